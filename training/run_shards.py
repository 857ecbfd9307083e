"""A resumable run's folder: `run.json`, the settings its shards belong to, and `shards/`, Parquet
files each written atomically and read back on resume (distill.py and predictor_data.py)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from specboost.training.run_files import write_json_atomic
from specboost.training.target_distributions import COLUMNS, PositionTargets, distribution_columns

logger = logging.getLogger(__name__)

RUN_FILE, SHARDS_DIR = "run.json", "shards"


def claim_run_folder(out: Path, identity: dict[str, Any], absent: dict[str, Any] | None = None) -> None:
    """Refuse shards that belong to other settings; drop temporary files of killed writers.
    `absent`: the value a setting left out of an identity stands for (in the message only)."""
    (out / SHARDS_DIR).mkdir(parents=True, exist_ok=True)
    run = out / RUN_FILE
    if run.is_file():
        previous = json.loads(run.read_text())
        if previous != identity:
            absent = absent or {}
            diff = {
                k: (previous.get(k, absent.get(k)), identity.get(k, absent.get(k)))
                for k in identity.keys() | previous.keys()
            }
            diff = {k: v for k, v in diff.items() if v[0] != v[1]}
            changes = ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in sorted(diff.items()))
            raise ValueError(
                f"{out} holds a run made with other settings ({changes}): "
                "rerun with the same settings to resume, or use a new --out"
            )
    write_json_atomic(run, identity)
    for stray in (out / SHARDS_DIR).glob(".*.tmp-*"):
        stray.unlink(missing_ok=True)


def shard_tables(out: Path, columns: list[str] | None = None) -> list[pa.Table]:
    """Every complete shard (a file that cannot be read is skipped with a warning)."""
    tables: list[pa.Table] = []
    for path in sorted((out / SHARDS_DIR).glob("shard-*.parquet")):
        try:
            tables.append(pq.read_table(path, columns=columns))
        except (OSError, pa.ArrowInvalid) as error:
            logger.warning(
                "skipping unreadable shard %s (%s); its prompts will be generated again", path, error
            )
    return tables


def read_shards(out: Path, columns: list[str] | None = None) -> list[dict[str, Any]]:
    """Rows of every complete shard (`columns`: only these)."""
    return [row for table in shard_tables(out, columns) for row in table.to_pylist()]


def write_shard(out: Path, rows: list[dict[str, Any]]) -> Path:
    """One shard, named by its first row id (ids are disjoint between shards), written atomically.
    Rows may carry stored distributions (COLUMNS, numpy arrays): written with their compact types."""
    path = out / SHARDS_DIR / f"shard-{rows[0]['id']:09d}-{len(rows):05d}.parquet"
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    table = pa.Table.from_pylist([{k: v for k, v in r.items() if k not in COLUMNS} for r in rows])
    if COLUMNS[0] in rows[0]:
        targets = [PositionTargets(*(r[name] for name in COLUMNS)) for r in rows]
        for name, column in distribution_columns(targets).items():
            table = table.append_column(name, column)
    pq.write_table(table, tmp)
    os.replace(tmp, path)
    return path
