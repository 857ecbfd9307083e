"""The harness's one timing protocol, written once. A configuration's `Plan` names its cells (a
category of prompts decoded one way at one batch size); in each cell every method runs on every
item (a left-padded batch) after untimed warm-up, the methods interleaved repeat after repeat in
shuffled orders.
Every timed run leaves a `RunRecord`; a configuration's run, a `Report`."""

from __future__ import annotations

import json
import os
import platform
import random
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import BatchEncoding

from specboost.decoder.bench.checkpoint import Checkpoint, Progress, fingerprint
from specboost.decoder.bench.records import (
    GREEDY,
    Cell,
    CellRun,
    Decoding,
    Method,
    MethodResult,
    MethodSet,
    RunRecord,
    TableRun,
)
from specboost.decoder.bench.summary import Table, tables
from specboost.speculator.loading import DTYPES

Log = Callable[[str], None]
PARTIAL_REPORT = "report.partial.md"  # the tables finished so far, while a run goes on
CHECKPOINT = "bench.checkpoint.json"  # the same as JSON, which a run started again resumes after
# A method's warm-up that takes this long (seconds) is logged: compiling its graphs takes minutes on
# a 2-core CPU (a batch-8 table's warm-ups took about 15 minutes a category on a slow host, the
# suite saying nothing meanwhile), and the log then shows where they go.
WARMUP_LOGGED = 1.0
# The methods of a cell run in an order shuffled for every item and repeat, from this seed. In a
# fixed order every method always ran right after the same one, and on a CPU a run's first steps
# pay for bringing its models back into the caches after its predecessor's: on the quick fixture
# the compiled plain loop's steps 1-4 took +0.42, +0.25, +0.12 and +0.08 ms (against 0.4 ms
# steps) after an eager pool's run, +0.08, +0.03, +0.02 and 0.0 ms after its own, so the rows
# listed after the eager pool rows (the learned scheduler's) ran 2-4% slower than alone.
ORDER_SEED = 0


@dataclass
class Plan:
    """What a configuration measures, once its models are loaded."""

    settings: list[tuple[Decoding, int]]  # (decoding, batch size): one group of cells each
    categories: list[str]
    items: Callable[[str, int], list[BatchEncoding] | str]  # a category's batches, or why it has none
    methods: Callable[[Decoding, int, BatchEncoding], MethodSet]  # per group, built on its first batch
    models: dict[str, Any]  # what the methods ran on: paths, parameter counts
    reference: Callable[[Decoding, list[BatchEncoding]], list | None] = lambda *_: None  # None: plain's
    warmup_item: BatchEncoding | None = None  # None: each cell's first item
    fixture: dict[str, Any] | None = None  # the fixture's build record (the suite on a fixture)
    results: Callable[[Report], dict[str, Any]] = lambda _: {}  # a comparison's own, from the records
    # What `results` needs of a finished table besides its records (JSON-able; the suite: plain
    # decoding's outputs), kept in the checkpoint, and its restore in a resumed run (a table that
    # runs again, the checkpoint being unreadable past it, replaces what was restored).
    table_state: Callable[[Decoding, int], Any] = lambda *_: None
    restore_table: Callable[[Decoding, int, Any], None] = lambda *_: None


@dataclass
class Report:
    """One run of a configuration of the harness."""

    config: Any  # the configuration (a dataclass)
    machine: dict[str, Any]
    models: dict[str, Any]
    runs: list[CellRun] = field(repr=False)
    skipped: dict[str, dict[str, str]]  # "<decoding>, batch <b>" -> method -> why it did not run
    seconds: float = 0.0  # wall time of the run
    fixture: dict[str, Any] | None = None
    results: dict[str, Any] = field(default_factory=dict)  # a comparison's own: headline, groups, ...

    def tables(self) -> list[Table]:
        return tables(self.runs)

    def differing(self) -> list[str]:
        """Methods whose greedy output differs from plain decoding's somewhere."""
        return sorted({r.method for t in self.tables() for r in t.rows if r.identical_to_plain is False})

    def to_json(self) -> dict[str, Any]:
        data = {name: getattr(self, name) for name in ("machine", "models", "fixture", "seconds", "skipped")}
        tables = [asdict(t) for t in self.tables()]
        runs = [asdict(run) for run in self.runs]
        return {"config": asdict(self.config), **data, **self.results, "tables": tables, "runs": runs}

    def write_json(self, path: Path) -> None:
        """The JSON record (its folder made first: every configuration writes it before the rest)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=2, default=str) + "\n")


@dataclass(frozen=True, kw_only=True)
class Protocol:
    """The settings every configuration has, and its run: `plan`, then every cell."""

    max_new_tokens: int = 64
    max_prompt_tokens: int = 128  # longer prompts keep their last tokens
    repeats: int = 3  # timed runs per method and item
    warmup: int = 1  # untimed runs per method on a cell's first item (compiled methods: every item)
    threads: int | None = 1  # torch CPU threads; None keeps torch's default
    dtype: str = "float32"
    device: str = "cpu"

    def __post_init__(self) -> None:
        if min(self.max_new_tokens, self.max_prompt_tokens, self.repeats, self.threads or 1) < 1:
            raise ValueError("max_new_tokens, max_prompt_tokens, repeats and threads must be >= 1")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")

    def with_options(self, **given: Any) -> Protocol:
        """The configuration with command-line options over its settings."""
        return replace(self, **given)

    def plan(self, artifacts: Path, log: Log) -> Plan:
        raise NotImplementedError

    def write_partial(self, report: Report, out: Path) -> Path | None:
        """The tables finished so far (`run`'s `on_table`) into `out` as PARTIAL_REPORT; returns
        the file, or None where the configuration writes none (its report is of its own making)."""
        return None

    def run(
        self,
        log: Log = print,
        artifacts: Path = Path("artifacts"),
        on_table: Callable[[Report], None] | None = None,
        checkpoint: Path | None = None,
    ) -> Report:
        """Plan, then run every cell. `on_table` gets the report of the tables finished so far after
        each table, so that a run stopped midway keeps them (`specboost bench` writes it as
        report.partial.md: the quick suite from a cold compile cache had been stopped after 106
        minutes with three tables finished and none written). With `checkpoint`, they are also
        saved there after each table, and a run started on the checkpoint of a run of the same
        configuration, models and machine does not run its tables again (`Checkpoint`): a killed
        quick suite had started over from nothing."""
        start = time.perf_counter()
        with torch_threads(self.threads):  # before anything loads: a pool's profile is per thread count
            plan = self.plan(artifacts, log)
            machine = machine_info(self.dtype, self.device)
            key = fingerprint(self, plan.models, plan.fixture, machine)
            saving = None if checkpoint is None else Checkpoint(checkpoint, key)
            earlier = (
                Progress() if saving is None else saving.resume(len(plan.settings), plan.restore_table, log)
            )

            def finished(so_far: list[TableRun]) -> None:
                seconds = earlier.seconds + time.perf_counter() - start
                if saving is not None:
                    saving.save(so_far, seconds)
                runs, skipped = cells_of(so_far)
                if on_table is not None and runs:
                    on_table(Report(self, machine, plan.models, runs, skipped, seconds, plan.fixture))

            done = run_cells(plan, self, log, finished, earlier.tables)
            report = Report(self, machine, plan.models, *cells_of(done), fixture=plan.fixture)
            report.results = plan.results(report)
        report.seconds = earlier.seconds + time.perf_counter() - start
        return report


def build_methods(
    candidates: dict[str, Callable[[], Method]], probe: BatchEncoding, required: bool = False
) -> MethodSet:
    """Each candidate built and run once on `probe` (an untimed first warm-up run); one that raises
    a ValueError or NotImplementedError is skipped with the error as its reason (with `required`,
    or for the first, the reference, the error is raised)."""
    out = MethodSet([])
    for index, (name, make) in enumerate(candidates.items()):
        try:
            method = make()
            with torch.inference_mode():
                method.run(probe)
        except (ValueError, NotImplementedError) as error:
            if required or index == 0:
                raise
            out.skipped[name] = f"{type(error).__name__}: {error}"
            continue
        out.methods.append(method)
    return out


def one_cell(
    category: str,
    items: list[BatchEncoding],
    candidates: dict[str, Callable[[], Method]],
    models: dict[str, Any],
    results: Callable[[Report], dict[str, Any]],
) -> Plan:
    """A plan of one greedy cell at batch size 1 in which every candidate must run (a comparison)."""
    methods = lambda *args: build_methods(candidates, args[-1], required=True)  # noqa: E731
    return Plan([(GREEDY, 1)], [category], lambda *_: items, methods, models, results=results)


def run_cells(
    plan: Plan,
    protocol: Protocol,
    log: Log,
    finished: Callable[[list[TableRun]], None] = lambda _: None,
    restored: Sequence[TableRun] = (),
) -> list[TableRun]:
    """Every table (a decoding and batch size) in the plan's order, but those `restored` (an
    earlier run's, from its checkpoint), which stand in their place without running again; after
    each table that ran, `finished` gets the tables so far."""
    done = {(table.decoding, table.batch_size): table for table in restored}
    tables: list[TableRun] = []
    for decoding, batch_size in plan.settings:
        if (decoding, batch_size) in done:
            tables.append(done[decoding, batch_size])
            continue
        tables.append(run_table(plan, protocol, log, decoding, batch_size))
        finished(tables)
    runs, skipped = cells_of(tables)
    if not runs:  # a report needs a table: say why there is none rather than write an empty one
        reasons = "; ".join(f"{where}: {why}" for where, notes in skipped.items() for why in notes.values())
        raise ValueError(f"nothing was measured, every cell was skipped ({reasons})")
    return tables


def run_table(plan: Plan, protocol: Protocol, log: Log, decoding: Decoding, batch_size: int) -> TableRun:
    """Every category with one method set (so a method's state, a weighted majority's weights,
    carries over from category to category as in serving), and the plan's state of the table."""
    runs: list[CellRun] = []
    notes: dict[str, str] = {}
    exact = protocol.dtype not in ("bfloat16", "float16")  # low precision: agreement with float32
    method_set = None
    for category in plan.categories:
        batches = plan.items(category, batch_size)
        if isinstance(batches, str):
            notes[f"category {category}"] = batches
            continue
        if method_set is None:
            method_set = plan.methods(decoding, batch_size, batches[0])
            notes.update(method_set.skipped)
            if len(method_set.methods) == 1:
                notes["all methods"] = "nothing but plain decoding runs at this batch size"
                break
        log(f"[bench] {category}, {decoding.name}, batch {batch_size}:")
        cell = Cell(category, decoding.name, not decoding.do_sample, batch_size, exact)
        records, warmups = measure(
            method_set.methods,
            batches,
            protocol,
            log,
            plan.reference(decoding, batches),
            plan.warmup_item,
        )
        runs.append(CellRun(cell, {m.name: m.description for m in method_set.methods}, records, warmups))
    return TableRun(decoding, batch_size, runs, notes, plan.table_state(decoding, batch_size))


def cells_of(tables: Sequence[TableRun]) -> tuple[list[CellRun], dict[str, dict[str, str]]]:
    """The tables' cells, in order, and their methods not run by table ("<decoding>, batch <b>")."""
    skipped: dict[str, dict[str, str]] = {}
    for table in tables:
        skipped.setdefault(table.title, {}).update(table.skipped)
    return [run for table in tables for run in table.runs], skipped


def measure(
    methods: Sequence[Method],
    items: Sequence[BatchEncoding],
    protocol: Protocol,
    log: Log,
    reference: Sequence[list[list[int]]] | None = None,
    warmup_item: BatchEncoding | None = None,
) -> tuple[list[RunRecord], dict[str, float]]:
    """Every method on every item, interleaved (drifts in machine speed hit every method alike) in
    an order shuffled for every item and repeat (`ORDER_SEED`), after `protocol.warmup` untimed
    rounds on `warmup_item` (default: the first item; a compiled method warms up on every item,
    building its graphs untimed, as does one that prepares something per item,
    `Method.warm_every_item`). A run is identical when its rows equal `reference`'s for its item
    (default: methods[0]'s first run's). Returns the records, in method order, and each method's
    warm-up seconds."""
    log(f"{len(methods)} methods, {len(items)} items, {protocol.repeats} repeats, {protocol.warmup} warm-up")
    records: list[RunRecord] = []
    warmups: dict[str, float] = {}
    with torch.inference_mode():
        for _ in range(protocol.warmup):
            for method in methods:
                start, graphs = time.perf_counter(), compiled_graphs()
                for item in items if method.compiled or method.warm_every_item else [warmup_item or items[0]]:
                    method.run(item)
                seconds = time.perf_counter() - start
                warmups[method.name] = warmups.get(method.name, 0.0) + seconds
                if seconds >= WARMUP_LOGGED:
                    built = compiled_graphs() - graphs
                    log(f"warm-up {method.name}: {seconds:.0f} s, {built} graphs compiled")
        order = random.Random(ORDER_SEED)
        for index, item in enumerate(items):
            runs: dict[tuple[int, int], tuple[MethodResult, float, int]] = {}
            for repeat in range(protocol.repeats):
                for m in order.sample(range(len(methods)), len(methods)):
                    graphs = compiled_graphs()
                    result, seconds = _timed(methods[m], item)
                    runs[repeat, m] = result, seconds, compiled_graphs() - graphs
            expected = runs[0, 0][0].rows if reference is None else reference[index]
            for (repeat, m), (result, seconds, built) in sorted(runs.items()):
                same = result.rows == expected
                records.append(RunRecord.of(methods[m].name, index, repeat, result, seconds, same, built))
            log(f"item {index + 1}/{len(items)} done")
    return records, warmups


def _timed(method: Method, item: BatchEncoding) -> tuple[MethodResult, float]:
    """The run and its wall time (CUDA synchronised around it)."""
    device = item.input_ids.device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    result = method.run(item)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return result, time.perf_counter() - start


def compiled_graphs() -> int:
    """Graphs torch.compile has built in this process so far."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


@contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """torch's CPU threads set to `threads` (None: unchanged) for the block."""
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def machine_info(dtype: str, device: str) -> dict[str, Any]:
    info = {
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "load_average": os.getloadavg()[0],
        "torch_threads": torch.get_num_threads(),
        "dtype": dtype,
        "device": device,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "platform": platform.platform(),
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
