"""Boost-tuning under DeepSpeed ZeRO-2 and ZeRO-3: the documented check (training/check_deepspeed.py).

DeepSpeed is the optional `deepspeed` extra, absent from .venv and CI, where this test is skipped.
`make check-deepspeed` installs it into .venv-deepspeed and runs the check; there,
`.venv-deepspeed/bin/python -m pytest tests/test_deepspeed.py` runs this test (about a minute).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip(
    "deepspeed",
    reason="DeepSpeed (the optional `deepspeed` extra) is not installed here: "
    "`make check-deepspeed` installs it into .venv-deepspeed and runs this check",
)


def test_boost_runs_under_zero2_and_zero3(tmp_path: Path) -> None:
    env = {**os.environ, "HF_DATASETS_CACHE": str(tmp_path / "hf_cache")}
    check = [sys.executable, "-m", "specboost.training.check_deepspeed", "--out", str(tmp_path)]
    done = subprocess.run(check, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads((tmp_path / "check.json").read_text())
    assert record["ok"] and sorted(record["stages"]) == ["ZeRO-2", "ZeRO-3"]
    for stage in record["stages"].values():
        assert all(loss["after"] < loss["before"] for loss in stage["ssm_loss"])
