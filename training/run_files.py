"""Files every training workflow writes: JSON records written atomically, and the versions of
the libraries a run used (recorded beside its outputs for reproducibility)."""

from __future__ import annotations

import json
import platform
from importlib import metadata
from pathlib import Path
from typing import Any

from specboost.speculator.atomic_files import write_text_atomic

_LIBRARIES = ("torch", "transformers", "tokenizers", "datasets", "accelerate", "peft")


def write_json_atomic(path: Path, payload: dict[str, Any]) -> None:
    """`payload` as indented JSON, written atomically (`write_text_atomic`)."""
    write_text_atomic(path, json.dumps(payload, indent=2) + "\n")


def library_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in _LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions
