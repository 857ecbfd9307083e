"""Files written atomically: to a temporary file in the same folder, then renamed, so that readers
(and a resumed run) see the old file or the new one, never half of one."""

from __future__ import annotations

import os
from pathlib import Path


def write_text_atomic(path: Path, text: str) -> None:
    """`text` into `path` atomically (its folder made first)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
