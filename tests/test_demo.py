"""`make demo`'s wiring: the Makefile chain (read with `make -n`, nothing runs) ships a pool with
the predictor, the hardware profile and the Sequoia vectors, keeps every output under ARTIFACTS,
and ends with `specboost bench --suite demo` on that export (learned and sequoia rows included)."""

from __future__ import annotations

import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from specboost.decoder.bench.configurations import SUITES
from specboost.decoder.bench.records import GREEDY
from specboost.decoder.bench.suite import BENCH_METHODS
from specboost.decoder.bench.workloads import held_out
from specboost.decoder.cli import bench_config, bench_usage_error, build_parser

ROOT = Path(__file__).resolve().parents[1]


def demo_commands(artifacts: Path) -> list[list[str]]:
    """The commands `make demo ARTIFACTS=artifacts` would run, in order (recursive makes expanded)."""
    done = subprocess.run(
        ["make", "--no-print-directory", "-n", "demo", f"ARTIFACTS={artifacts}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    text = done.stdout.replace("\\\n", " ")
    return [shlex.split(line) for line in text.splitlines() if "specboost" in line and "make " not in line]


def option(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_the_demo_exports_the_scheduler_and_sequoia_files_and_benches_them(tmp_path: Path) -> None:
    commands = demo_commands(tmp_path)
    steps = [argv[2] if argv[1] == "-m" else argv[1] for argv in commands]
    assert steps == [
        "specboost.training.reference_llm",
        "specboost.training.distill",  # the pool's prompts
        "specboost.training.boost",
        "specboost.training.distill",  # the predictor's prompts, never boosted on
        "specboost.training.predictor_data",
        "specboost.training.train_predictor",
        "profile",
        "specboost.training.sequoia_trees",
        "specboost.training.export",
        "bench",
    ]
    by_step = dict(zip(steps, commands, strict=True))
    pool = Path(option(by_step["specboost.training.boost"], "--out"))
    assert Path(option(by_step["specboost.training.export"], "--boost")) == pool
    assert Path(option(by_step["specboost.training.train_predictor"], "--out")).parent == pool
    assert Path(option(by_step["profile"], "--out")).parent == pool
    assert Path(option(by_step["specboost.training.sequoia_trees"], "--out")).parent == pool
    for argv in commands:  # every output under ARTIFACTS (the repo's artifacts/ untouched)
        assert tmp_path in Path(option(argv, "--out")).parents

    bench = by_step["bench"]
    args = build_parser().parse_args(bench[1:])
    assert bench_usage_error(args) is None
    assert args.pool == option(by_step["specboost.training.export"], "--out")
    config = bench_config(args)
    assert config.methods is not None and {"sequoia", "learned"} <= set(config.methods)


def test_the_demo_suite_is_the_file_bench_plus_sequoia_and_the_learned_scheduler() -> None:
    demo = SUITES["demo"]
    assert demo.decodings == (GREEDY,) and demo.batch_sizes == (1,) and not demo.compiled
    assert demo.methods == (*BENCH_METHODS, "sequoia", "learned")
    assert all(demo.wanted(name) for name in ("plain", "hf_assisted[2]", "stairs[1]", "sequoia", "learned"))
    (workload,) = demo.workloads()  # held-out prompts: the predictor's labels come from the train split
    assert workload.prompts == tuple(held_out("gutenberg_openings")[:8])
