"""The named configurations of the harness that `specboost bench --suite NAME` runs (a JSON file of
`SuiteConfig` settings serves too), and the single-file bench's settings."""

from __future__ import annotations

from pathlib import Path

from specboost.decoder.bench.batched import BatchedConfig
from specboost.decoder.bench.protocol import GREEDY, Protocol
from specboost.decoder.bench.scheduler import SchedulerConfig
from specboost.decoder.bench.strategies import StrategiesConfig
from specboost.decoder.bench.suite import BENCH_METHODS, SuiteConfig

SUITES: dict[str, Protocol] = {
    "default": SuiteConfig(),  # make bench: the `small` fixture
    # make bench SUITE=quick: the tiny fixture, without `batched+compiled` (its stacked pool compiles
    # a graph per number of rows: 10 of the suite's 43 minutes in quick-r6, at 0.34-0.43x the fastest
    # row; the default suite keeps it)
    "quick": SuiteConfig(
        fixture="tiny",
        prompts_per_category=3,
        max_new_tokens=48,
        repeats=2,
        without=("batched+compiled",),
    ),
    # make demo: the single-file bench's rows plus Sequoia and the learned scheduler, greedy, batch
    # 1, on 8 held-out Gutenberg openings (a split no training step saw); on --llm with --pool (the
    # demo's export, which ships the predictor, profile and Sequoia vectors), else the tiny fixture.
    "demo": SuiteConfig(
        fixture="tiny",
        prompts="gutenberg_openings",
        prompts_per_category=8,
        decodings=(GREEDY,),
        batch_sizes=(1,),
        compiled=False,
        methods=(*BENCH_METHODS, "sequoia", "learned"),
    ),
    "batched": BatchedConfig(),  # make bench-batched
    "strategies": StrategiesConfig(),  # make strategy-compare
    "scheduler": SchedulerConfig(),  # make scheduler-eval
}
# `specboost bench --llm --ssm --prompts`: the suite's harness on one prompt file, greedy, batch 1.
FILE_BENCH = {
    "decodings": (GREEDY,),
    "batch_sizes": (1,),
    "compiled": False,
    "methods": BENCH_METHODS,
    "prompts_per_category": None,
    "threads": None,
}
FILE_BENCH_OPTIONS = (
    *("llm", "ssms", "tokenizer", "prompts", "max_prompts", "methods", "max_new_tokens", "repeats"),
    *(
        "warmup",
        "threads",
        "dtype",
        "device",
        "chain_length",
        "beam_width",
        "beam_depth",
        "topology_children",
    ),
)


def resolve_suite(name_or_path: str) -> Protocol:
    if name_or_path in SUITES:
        return SUITES[name_or_path]
    path = Path(name_or_path)
    if not path.is_file():
        raise FileNotFoundError(f"no suite {name_or_path!r}: give one of {sorted(SUITES)} or a JSON file")
    return SuiteConfig.from_json(path)
