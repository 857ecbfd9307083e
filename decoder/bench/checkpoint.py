"""A run's checkpoint: the tables finished so far, written atomically after each one, so that a
run killed midway (the quick suite takes 75 minutes on 2 cores) goes on after its last finished
table instead of starting over. A checkpoint is resumed only by a run that measures the same
thing: its fingerprint (the configuration, the models and fixture, the machine) must match, for
tables measured elsewhere would mix into one report; one that does not match, or cannot be read,
is ignored with a line saying why, and overwritten after the first table."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specboost.decoder.bench.records import Decoding, TableRun
from specboost.speculator.atomic_files import write_text_atomic

FORMAT = 1  # the file's layout: a checkpoint of another is unreadable
# What a checkpoint that cannot be read raises: its JSON, its layout, its values, the plan's restore.
UNREADABLE = (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError)


@dataclass
class Progress:
    """What an earlier run finished: its tables and the wall seconds it had taken by the last."""

    tables: list[TableRun] = field(default_factory=list)
    seconds: float = 0.0


def fingerprint(config: Any, models: Any, fixture: Any, machine: dict[str, Any]) -> dict[str, str]:
    """What a run measures, by part, each its canonical JSON's SHA-256 (by part, so that a
    mismatch says which differs). The machine's load average is left out: it changes by the
    minute, and the run's own load is part of it."""
    parts = {
        "configuration": asdict(config),
        "models": {"models": models, "fixture": fixture},
        "machine": {name: value for name, value in machine.items() if name != "load_average"},
    }
    return {name: _digest(part) for name, part in parts.items()}


def _digest(data: Any) -> str:
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class Checkpoint:
    """The checkpoint file of a run whose fingerprint is `key`."""

    path: Path
    key: dict[str, str]

    def save(self, tables: list[TableRun], seconds: float) -> None:
        """The finished `tables` and the run's wall `seconds` so far, atomically (a kill while
        writing leaves the previous checkpoint)."""
        data = {"format": FORMAT, "fingerprint": self.key, "seconds": seconds}
        text = json.dumps(data | {"tables": [asdict(table) for table in tables]}, default=str)
        write_text_atomic(self.path, text + "\n")

    def resume(
        self,
        tables: int,
        restore: Callable[[Decoding, int, Any], None],
        log: Callable[[str], None],
    ) -> Progress:
        """The tables an earlier run finished (of `tables` in the run), their state handed back by
        `restore` (the plan's `restore_table`), where the file holds a checkpoint of this
        fingerprint; else nothing, with a line saying why (none for a missing file)."""
        if not self.path.exists():
            return Progress()
        try:
            data = json.loads(self.path.read_text())
            if data["format"] != FORMAT:
                raise ValueError(f"format {data['format']}, this version reads {FORMAT}")
            differing = [part for part, digest in self.key.items() if data["fingerprint"].get(part) != digest]
            why = f"written for a different run (what differs: {', '.join(differing)})" if differing else None
            progress = Progress() if differing else _restored(data, restore)
        except UNREADABLE as error:
            why, progress = f"unreadable ({type(error).__name__}: {error})", Progress()
        if why is not None:
            log(f"[bench] ignoring the checkpoint {self.path}: {why}; starting over")
        else:
            log(
                f"[bench] resuming: {len(progress.tables)} of {tables} tables finished by an "
                f"earlier run ({self.path}); delete it to start over"
            )
        return progress


def _restored(data: dict[str, Any], restore: Callable[[Decoding, int, Any], None]) -> Progress:
    """The checkpoint's tables, every one read before `restore` gets any one's state (a table run
    again replaces what its restore left)."""
    progress = Progress([TableRun.from_dict(table) for table in data["tables"]], float(data["seconds"]))
    for table in progress.tables:
        restore(table.decoding, table.batch_size, table.state)
    return progress
