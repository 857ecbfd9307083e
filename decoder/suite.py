"""The benchmark suite: every method against plain decoding and Hugging Face assisted generation
on bundled held-out workloads, with a JSON record, a Markdown report and plots.

    specboost bench --suite default                  # = make bench (the `small` fixture)
    specboost bench --suite quick                    # the `tiny` fixture, a few prompts: minutes
    specboost bench --suite my_suite.json --spec-bench question.jsonl --out DIR
    specboost bench --suite default --llm MY_LLM --pool MY_POOL_EXPORT   # your own models

1. The models: the fixture (`suite_fixture`: the reference LLM, distilled data, boosted pool,
   predictor, hardware profile and export, built once into ARTIFACTS/bench-fixture/<fixture>),
   or a given LLM and exported pool (`make export`; no fixture is built).
2. Workloads (`suite_workloads`): held-out prompts of the bundled sets by category, or a
   Spec-Bench question file by its categories; fixed max_new_tokens; greedy and one sampling
   setting with a fixed seed; batch sizes 1 and 8.
3. Methods (`suite_methods`), interleaved per prompt after warm-up, repeated (decoder bench's
   `measure`).
4. Report (`suite_report`, `suite_plots`): metrics of ALGORITHMS.md section 13, medians and
   min-max over repeats, identical-output check; OUT gets suite.json, report.md and the plots.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from specboost.decoder.bench import GREEDY, Decoding, machine_info, measure
from specboost.decoder.suite_fixture import FIXTURES, FixtureBuild, build_fixture
from specboost.decoder.suite_methods import Shapes, SuiteModels, build_methods, ssm_token_seconds
from specboost.decoder.suite_plots import (
    plot_acceptance_by_position,
    plot_speedup,
    plot_ssm_weights,
    plot_tokens_per_step,
    weight_histories,
)
from specboost.decoder.suite_report import Cell, CellRun, Table, draft_cost_line, markdown_table, tables
from specboost.decoder.suite_workloads import (
    CATEGORIES,
    Workload,
    bundled_workloads,
    encode_batches,
    load_spec_bench,
)

# The README's generated results go between these lines (in its "## Benchmark results" section).
README_MARKERS = ("<!-- bench-suite: begin -->", "<!-- bench-suite: end -->")


@dataclass(frozen=True)
class SuiteConfig:
    fixture: str = "small"  # suite_fixture.FIXTURES (unused when `llm` and `pool` are given)
    llm: str | None = None  # with `pool`: benchmark this LLM (folder or hub id) instead of the fixture's
    pool: str | None = None  # an exported pool for `llm` (folder or hub id; SSMPool.from_pretrained)
    categories: tuple[str, ...] = tuple(CATEGORIES)  # bundled categories (ignored with spec_bench)
    spec_bench: str | None = None  # a Spec-Bench question file: its categories are the workloads
    prompts_per_category: int = 4  # at batch size b: ceil(prompts_per_category / b) batches of b
    max_new_tokens: int = 64
    max_prompt_tokens: int = 128  # longer prompts keep their last tokens
    decodings: tuple[Decoding, ...] = (GREEDY, Decoding(do_sample=True, temperature=0.8))
    batch_sizes: tuple[int, ...] = (1, 8)
    repeats: int = 3  # timed runs per method and batch of prompts
    warmup: int = 1  # untimed runs per method on each cell's first batch
    threads: int = 1  # torch CPU threads (also those of the fixture's hardware profile)
    dtype: str = "float32"
    device: str = "cpu"
    shapes: Shapes = field(default_factory=Shapes)
    compiled: bool = True  # also the torch.compile'd rows (plain_compiled, chain[i]+compiled, ...)

    def __post_init__(self) -> None:
        if self.fixture not in FIXTURES:
            raise ValueError(f"unknown fixture {self.fixture!r}; choose one of {sorted(FIXTURES)}")
        if (
            min(self.prompts_per_category, self.max_new_tokens, self.repeats, self.threads, *self.batch_sizes)
            < 1
        ):
            raise ValueError(
                "prompts_per_category, max_new_tokens, repeats, threads and batch sizes must be >= 1"
            )
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if (self.llm is None) != (self.pool is None):
            raise ValueError(
                "give both llm and pool (a pool exported for that LLM by `make export`) to benchmark "
                "your own models, or neither to benchmark the fixture"
            )

    @property
    def name(self) -> str:
        """The report folder's name: the fixture's, or the given LLM's."""
        return self.fixture if self.llm is None else Path(self.llm).name

    @classmethod
    def from_json(cls, path: Path) -> SuiteConfig:
        """A JSON object of SuiteConfig fields (`decodings`: a list of Decoding fields, `shapes`:
        Shapes fields)."""
        data = json.loads(path.read_text())
        unknown = sorted(set(data) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"{path}: unknown suite settings {unknown}")
        if "decodings" in data:
            data["decodings"] = tuple(Decoding(**d) for d in data["decodings"])
        if "shapes" in data:
            data["shapes"] = Shapes(**data["shapes"])
        for name in ("categories", "batch_sizes"):
            if name in data:
                data[name] = tuple(data[name])
        return cls(**data)


SUITES: dict[str, SuiteConfig] = {
    "default": SuiteConfig(),
    "quick": SuiteConfig(
        fixture="tiny", prompts_per_category=3, max_new_tokens=48, repeats=2, compiled=False
    ),
}


def resolve_suite(name_or_path: str) -> SuiteConfig:
    if name_or_path in SUITES:
        return SUITES[name_or_path]
    path = Path(name_or_path)
    if not path.is_file():
        raise FileNotFoundError(f"no suite {name_or_path!r}: give one of {sorted(SUITES)} or a JSON file")
    return SuiteConfig.from_json(path)


@dataclass
class SuiteReport:
    config: SuiteConfig
    machine: dict[str, Any]
    models: dict[str, Any]  # paths and parameter counts
    fixture: FixtureBuild | None  # None: the config's own llm and pool
    runs: list[CellRun] = field(repr=False)
    skipped: dict[str, dict[str, str]]  # "<decoding>, batch <b>" -> method -> why it did not run
    seconds: float = 0.0  # wall time of the whole suite, fixture included

    def tables(self) -> list[Table]:
        return tables(self.runs)

    def to_json(self) -> dict[str, Any]:
        return {
            "config": asdict(self.config),
            "machine": self.machine,
            "models": self.models,
            "fixture": None if self.fixture is None else asdict(self.fixture),
            "seconds": self.seconds,
            "skipped": self.skipped,
            "tables": [asdict(t) for t in self.tables()],
            "runs": [asdict(run) for run in self.runs],
        }


# Running ------------------------------------------------------------------------------------------
def workloads_of(config: SuiteConfig) -> list[Workload]:
    if config.spec_bench is not None:
        return load_spec_bench(config.spec_bench)
    need = max(math.ceil(config.prompts_per_category / b) * b for b in config.batch_sizes)
    return bundled_workloads(config.categories, need)


def run_suite(
    config: SuiteConfig, artifacts: Path = Path("artifacts"), log: Callable[[str], None] = print
) -> SuiteReport:
    """Build (or reuse) the fixture unless the config names its own models, then run every cell:
    batch size x decoding x category."""
    start = time.perf_counter()
    if config.llm is not None:
        build, llm, pool = None, config.llm, config.pool
    else:
        build = build_fixture(config.fixture, artifacts, config.threads, log=log)
        llm, pool = build.paths.llm, build.paths.export
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(config.threads)
    try:
        models = SuiteModels.load(llm, pool, config.dtype, config.device)
        workloads = workloads_of(config)
        machine = machine_info(config) | {"load_average": os.getloadavg()[0]}  # under the suite's threads
        runs, skipped = [], {}
        for batch_size in config.batch_sizes:
            for decoding in config.decodings:
                key = f"{decoding.name}, batch {batch_size}"
                runs += _run_cells(
                    config, models, workloads, decoding, batch_size, skipped.setdefault(key, {}), log
                )
        probe = encode_batches(workloads[0].prompts[:1], models.tokenizer, 1, config.max_prompt_tokens)[0]
        ssm_seconds = ssm_token_seconds(models.pool, probe.input_ids.to(config.device), config.repeats)
    finally:
        torch.set_num_threads(previous_threads)
    model_info = {"llm": str(llm), "pool": str(pool), "parameters": models.parameters()}
    model_info["ssm_token_seconds"] = ssm_seconds
    report = SuiteReport(config, machine, model_info, build, runs, skipped)
    report.seconds = time.perf_counter() - start
    return report


def _run_cells(
    config: SuiteConfig,
    models: SuiteModels,
    workloads: list[Workload],
    decoding: Decoding,
    batch_size: int,
    skipped: dict[str, str],
    log: Callable[[str], None],
) -> list[CellRun]:
    """Every category at one decoding and batch size, with one set of methods (so the weights of a
    weighted-majority method carry over from category to category, as they would in serving)."""
    n = math.ceil(config.prompts_per_category / batch_size) * batch_size
    method_set, runs = None, []
    for workload in workloads:
        if len(workload.prompts) < n:
            skipped[f"category {workload.category}"] = f"{len(workload.prompts)} prompts, {n} needed"
            continue
        encoded = [
            e.to(config.device)
            for e in encode_batches(
                workload.prompts[:n], models.tokenizer, batch_size, config.max_prompt_tokens
            )
        ]
        if method_set is None:
            method_set = build_methods(
                models,
                decoding,
                batch_size,
                config.max_new_tokens,
                config.shapes,
                encoded[0],
                config.compiled,
            )
            skipped.update(method_set.skipped)
            if len(method_set.methods) == 1:  # plain alone: nothing to compare
                skipped["all methods"] = "nothing but plain decoding runs at this batch size"
                return []
        cell = Cell(workload.category, decoding.name, not decoding.do_sample, batch_size)
        log(f"[suite] {workload.category}, {decoding.name}, batch {batch_size}:")
        warmups: dict[str, float] = {}
        low_precision = config.dtype in ("bfloat16", "float16") and not decoding.do_sample
        reference = models.float32_outputs(encoded, config.max_new_tokens) if low_precision else None
        records = measure(method_set.methods, encoded, config.repeats, config.warmup, log, warmups, reference)
        runs.append(CellRun(cell, {m.name: m.description for m in method_set.methods}, records, warmups))
    return runs


# Writing ------------------------------------------------------------------------------------------
def machine_line(machine: dict[str, Any]) -> str:
    gpu = f"GPU {machine['gpu']}" if "gpu" in machine else "no GPU"
    load = f"load average {machine['load_average']:.1f} when the suite started"
    return (
        f"{machine['cpu']} ({machine['cpu_count']} cores, {load}), {gpu}; "
        f"torch threads {machine['torch_threads']}, "
        f"{machine['dtype']} on {machine['device']}; "
        f"torch {machine['torch']}, transformers {machine['transformers']}"
    )


def fixture_line(build: FixtureBuild | None) -> str:
    if build is None:
        return "no fixture: the models were given"
    first_build = sum(step.seconds for step in build.steps) / 60
    if all(step.cached for step in build.steps):
        return f"fixture cached (its first build took {first_build:.1f} min)"
    return f"fixture built in this run: {build.seconds / 60:.1f} min (all steps: {first_build:.1f} min)"


def markdown_report(report: SuiteReport, level: int = 1) -> str:
    """The report: machine first, then one table per decoding and batch size, then what was skipped."""
    c, h = report.config, "#" * level
    params = report.models["parameters"]
    ssm_params = ", ".join(f"{p / 1e6:.2f}M" for p in params["ssms"])
    all_tables = report.tables()
    categories = ", ".join(all_tables[0].per_category)
    source = "held-out" if c.spec_bench is None else f"Spec-Bench (`{c.spec_bench}`)"
    lines = [
        f"{h} specboost benchmark suite",
        "",
        f"**Machine:** {machine_line(report.machine)}.",
        "",
        f"{'Models given' if report.fixture is None else f'Fixture `{c.fixture}`'}: "
        f"LLM `{report.models['llm']}` ({params['llm'] / 1e6:.1f}M parameters), "
        f"pool `{report.models['pool']}` ({len(params['ssms'])} SSMs: {ssm_params}). "
        f"Workloads: {categories}; {c.prompts_per_category} {source} prompts per category, "
        f"{c.max_new_tokens} new tokens; {c.repeats} repeats after {c.warmup} warm-up, methods interleaved. "
        f"Suite wall time {report.seconds / 60:.1f} min; {fixture_line(report.fixture)}.",
        "",
        "tokens/step = new tokens / LLM passes (the LLM's own token included: plain = 1.00); drafted/step = "
        "tree size; acceptance = accepted / drafted tokens; draft/verify/other = shares of the decoder's "
        "time; speedup = tokens/s over plain's (or the fastest HF assisted's) in the same repeat: median "
        "(min-max) over repeats ([ALGORITHMS.md](docs/ALGORITHMS.md) section 13); ms/token (batch > 1, BASS) "
        "= a row's latency "
        "/ its new tokens, of the first and the last row to finish and the batch mean: median over repeats "
        "(plain batched generation returns every row after the whole call). Greedy outputs must equal "
        "plain decoding's: a method that differs is flagged and not ranked.",
    ]
    for table in all_tables:
        lines += ["", f"{h}# {table.title}", "", markdown_table(table)]
        if table.batch_size == 1 and "ssm_token_seconds" in report.models:
            lines += ["", draft_cost_line(table, report.models["ssm_token_seconds"])]
    notes = [
        f"- {group}: `{name}`: {why}"
        for group, items in report.skipped.items()
        for name, why in items.items()
    ]
    if notes:
        lines += ["", f"{h}# Not run", "", *notes]
    return "\n".join(lines) + "\n"


def write_report(report: SuiteReport, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "suite.json").write_text(json.dumps(report.to_json(), indent=2, default=str) + "\n")
    (out / "report.md").write_text(markdown_report(report))
    all_tables = report.tables()
    first = all_tables[0]  # greedy, batch 1 with the default settings
    plot_speedup(first, out / "speedup.png")
    plot_tokens_per_step(all_tables, out / "tokens_per_step_vs_tree_size.png")
    plot_acceptance_by_position(first, out / "acceptance_by_position.png")
    histories = weight_histories(report.runs)
    if histories:
        plot_ssm_weights(histories, out / "ssm_weights.png")


def update_readme(readme: Path, report: SuiteReport, out: Path) -> None:
    """Replace what stands between the README's two `README_MARKERS` with the report."""
    text = readme.read_text()
    begin, end = README_MARKERS
    if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
        raise ValueError(f"{readme} needs the lines {begin} and {end}, once each, to put the results between")
    head, rest = text.split(begin)
    tail = rest.split(end)[1]
    body = markdown_report(report, level=2).split("\n", 2)[2]  # without its title
    source = (
        f"Generated by `specboost bench --suite` from `{out}/report.md` (plots and suite.json beside it).\n"
    )
    readme.write_text(f"{head}{begin}\n{source}\n{body}{end}{tail}")


def run_and_write(
    config: SuiteConfig,
    out: Path,
    artifacts: Path = Path("artifacts"),
    readme: Path | None = None,
    log: Callable[[str], None] = print,
) -> SuiteReport:
    """`run_suite`, then the report into `out` (and into the README's results section)."""
    report = run_suite(config, artifacts, log)
    write_report(report, out)
    if readme is not None:
        update_readme(readme, report, out)
    return report
