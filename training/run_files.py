"""Files every training workflow writes: JSON records written atomically, and the versions of
the libraries a run used (recorded beside its outputs for reproducibility)."""

from __future__ import annotations

import json
import os
import platform
from importlib import metadata
from pathlib import Path
from typing import Any

_LIBRARIES = ("torch", "transformers", "tokenizers", "datasets", "accelerate", "peft")


def write_json_atomic(path: Path, payload: dict[str, Any]) -> None:
    """Write to a temporary file in the same folder, then rename: readers (and a resumed run)
    see the old file or the new one, never half of one."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    os.replace(tmp, path)


def library_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in _LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions
