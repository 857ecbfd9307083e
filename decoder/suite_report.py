"""The benchmark suite's numbers, from run records alone (no models): what the tables, the JSON
and the plots show.

Metric names and definitions are those of ALGORITHMS.md section 13:
- tokens per step = new tokens / LLM verification passes (forward passes for plain and HF
  assisted generation), so the LLM's own token of every pass (the bonus token) counts: plain
  decoding has exactly 1.0;
- acceptance rate = accepted / proposed draft tokens, overall and per SSM; by position k: the share
  of verification steps whose match length (accepted drafted tokens, `DecodeStats.match_lengths`)
  is at least k;
- speedup = wall time of plain decoding / wall time of the method, side by side in one run. The
  methods run interleaved, so each repeat r is one paired measurement: the workload's tokens/s
  of the method over that of plain decoding in the same repeat (for identical greedy outputs,
  exactly the ratio of wall times). Reported as the median over repeats with the min and max;
  "vs best plain" divides by the fastest plain decoding transformers offers (`plain`, or
  `generate` with a static cache, eager or compiled), "vs HF assisted" by the fastest Hugging Face
  assisted generation;
- per-token latency (batch > 1; BASS, ALGORITHMS.md section 11) = a row's latency (seconds to its
  last token; plain batched generation returns every row at once, after the whole call) / its new
  tokens, of the row that finishes first, the one that finishes last, and the mean over the batch;
  each repeat's is the mean over its batches, reported as the median over repeats.
Greedy outputs must equal plain decoding's token for token: a method that differs is flagged and
gets no speedup and no rank. Sampled outputs cannot be compared token-wise; their speed and
acceptance are reported and ranked as they are.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from specboost.decoder.bench import RunRecord, _acceptance, _acceptance_per_ssm
from specboost.decoder.stats import per_token_latency

PLAIN = "plain"  # the reference method of every cell (runs first)
PLAIN_STATIC = "plain_static"  # llm.generate with a static cache
PLAIN_COMPILED = "plain_compiled"  # ... and a compiled forward
BEST_PLAIN = (PLAIN, PLAIN_STATIC, PLAIN_COMPILED)  # "vs best plain": the fastest of these
HF_ASSISTED = "hf_assisted"  # prefix of the Hugging Face assisted generation methods
PHASES = ("draft", "verify", "other")  # DecodeStats.time_<phase>; "other" is the decoder's bookkeeping
# Batch > 1: each row's latency (seconds from the start to its last token) and new tokens, in stats
ROW_LATENCIES, ROW_NEW_TOKENS = "row_latencies", "row_new_tokens"
LATENCY_POINTS = ("first", "last", "mean")  # stats.per_token_latency


@dataclass(frozen=True)
class Cell:
    """One workload cell: a category decoded one way at one batch size."""

    category: str
    decoding: str  # bench.Decoding.name: "greedy" or "sample(...)"
    greedy: bool
    batch_size: int


@dataclass
class CellRun:
    cell: Cell
    methods: dict[str, str]  # name -> description, in table order; PLAIN first
    records: list[RunRecord] = field(repr=False)
    warmup_seconds: dict[str, float] = field(default_factory=dict)  # untimed, compilation included


@dataclass(frozen=True)
class Spread:
    """Median over repeats, with the smallest and largest value."""

    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values: Iterable[float]) -> Spread:
        values = list(values)
        return cls(statistics.median(values), min(values), max(values))


@dataclass
class MethodRow:
    method: str
    description: str
    tokens_per_step: float  # new tokens / LLM passes (bonus token included)
    draft_tokens_per_step: float | None  # drafted tree nodes per LLM pass: the tree size
    acceptance_rate: float | None  # accepted / drafted tokens (None: the method reports no drafts)
    acceptance_rate_per_ssm: dict[int, float] | None
    accepted_at_least: list[float] | None  # [k - 1]: share of steps accepting >= k drafted tokens
    time_split: dict[str, float] | None  # share of the decoder's time per phase (PHASES)
    tokens_per_second: Spread
    speedup_vs_plain: Spread | None  # None: output differs (not ranked)
    speedup_vs_best_plain: Spread | None  # vs the fastest of BEST_PLAIN
    speedup_vs_hf_assisted: Spread | None  # vs the fastest HF assisted method; None without one
    identical_to_plain: bool | None  # None: sampled, not comparable token-wise
    per_token_latency: dict[str, float] | None  # LATENCY_POINTS -> seconds/token; None: batch 1
    decision_share: float | None = None  # a scheduler's decision time / the method's wall time
    draft_ms_per_token: float | None = None  # draft time per drafted token (ours)
    agreement_with_float32: float | None = None  # low precision: share of outputs = float32 plain's
    rank: int | None = None  # 1 = fastest; None: not ranked

    @property
    def ranked(self) -> bool:
        return self.identical_to_plain is not False


def summarise(records: Sequence[RunRecord], methods: dict[str, str], greedy: bool) -> list[MethodRow]:
    """One row per method over `records` (one or more cells of one decoding and batch size),
    ranked by median speedup vs plain. In low precision (records compared with float32 plain
    decoding) greedy outputs are not required to equal plain's: each row reports its agreement."""
    low_precision = any(r.identical_to_float32 is not None for r in records)
    greedy = greedy and not low_precision
    by_method: dict[str, list[RunRecord]] = defaultdict(list)
    for r in records:
        by_method[r.method].append(r)
    missing = [name for name in methods if not by_method[name]]
    if missing or PLAIN not in methods:
        raise ValueError(f"no records for {missing or [PLAIN]}: every method (and {PLAIN!r}) needs some")
    rates = {name: _rates_per_repeat(by_method[name]) for name in methods}
    identical = {
        name: all(r.identical_to_plain for r in by_method[name]) if greedy else None for name in methods
    }

    def fastest(names: Iterable[str]) -> str | None:
        usable = [n for n in names if identical[n] is not False]
        return max(usable, key=lambda n: statistics.median(rates[n].values()), default=None)

    best_hf = fastest(n for n in methods if n.startswith(HF_ASSISTED))
    best_plain = fastest(n for n in methods if n in BEST_PLAIN)
    rows = []
    for name, description in methods.items():
        rs, ok = by_method[name], identical[name] is not False
        rows.append(
            MethodRow(
                method=name,
                description=description,
                tokens_per_step=sum(r.new_tokens for r in rs) / max(1, sum(r.llm_steps for r in rs)),
                draft_tokens_per_step=_per_step(rs, "draft_tokens"),
                acceptance_rate=_acceptance(rs),
                acceptance_rate_per_ssm=_acceptance_per_ssm(rs) if _have(rs, "proposed_per_ssm") else None,
                accepted_at_least=accepted_at_least(rs),
                time_split=_time_split(rs),
                tokens_per_second=Spread.of(rates[name].values()),
                speedup_vs_plain=_ratio(rates[name], rates[PLAIN]) if ok else None,
                speedup_vs_best_plain=_ratio(rates[name], rates[best_plain]) if ok and best_plain else None,
                speedup_vs_hf_assisted=_ratio(rates[name], rates[best_hf]) if ok and best_hf else None,
                identical_to_plain=identical[name],
                per_token_latency=median_per_token_latency(rs),
                decision_share=decision_share(rs),
                draft_ms_per_token=draft_ms_per_token(rs),
                agreement_with_float32=(
                    sum(bool(r.identical_to_float32) for r in rs) / len(rs) if low_precision else None
                ),
            )
        )
    ranked = sorted((row for row in rows if row.ranked), key=lambda row: -row.speedup_vs_plain.median)
    for rank, row in enumerate(ranked, start=1):
        row.rank = rank
    return rows


def _rates_per_repeat(records: Sequence[RunRecord]) -> dict[int, float]:
    """Repeat -> tokens per second over the whole workload in that repeat."""
    tokens: dict[int, int] = defaultdict(int)
    seconds: dict[int, float] = defaultdict(float)
    for r in records:
        tokens[r.repeat] += r.new_tokens
        seconds[r.repeat] += r.seconds
    return {k: tokens[k] / seconds[k] if seconds[k] else 0.0 for k in sorted(tokens)}


def _ratio(method: dict[int, float], reference: dict[int, float]) -> Spread:
    """Per repeat (each a side-by-side measurement), method rate / reference rate."""
    return Spread.of(method[k] / reference[k] for k in method if reference.get(k))


def _per_step(records: Sequence[RunRecord], name: str) -> float | None:
    values = [getattr(r, name) for r in records]
    if any(v is None for v in values):
        return None
    return sum(values) / max(1, sum(r.llm_steps for r in records))


def _have(records: Sequence[RunRecord], key: str) -> bool:
    """Whether every record's stats hold `key` (plain and HF assisted runs keep no DecodeStats;
    at batch > 1 plain keeps its rows' latencies alone)."""
    return all(r.stats is not None and key in r.stats for r in records)


def row_stats(latencies: Sequence[float], new_tokens: Sequence[int]) -> dict[str, list]:
    """What a batch > 1 run keeps in its stats for the per-token latency: each row's latency
    (seconds to its last token) and new tokens."""
    return {ROW_LATENCIES: list(latencies), ROW_NEW_TOKENS: list(new_tokens)}


def median_per_token_latency(records: Sequence[RunRecord]) -> dict[str, float] | None:
    """Seconds per token of the first and last row to finish and the batch mean: per repeat the
    mean over its batches, then the median over repeats. None: the records keep no row latencies."""
    if not _have(records, ROW_LATENCIES):
        return None
    by_repeat: dict[int, list[dict[str, float]]] = defaultdict(list)
    for r in records:
        by_repeat[r.repeat].append(per_token_latency(r.stats[ROW_LATENCIES], r.stats[ROW_NEW_TOKENS]))
    return {
        point: statistics.median(
            statistics.fmean(b[point] for b in batches) for batches in by_repeat.values()
        )
        for point in LATENCY_POINTS
    }


def accepted_at_least(records: Sequence[RunRecord]) -> list[float] | None:
    """[k - 1] = share of verification steps whose match length is >= k, for k = 1 .. the longest."""
    if not _have(records, "match_lengths"):
        return None
    lengths = [m for r in records for m in r.stats["match_lengths"]]
    if not lengths:
        return []
    return [sum(m >= k for m in lengths) / len(lengths) for k in range(1, max(lengths) + 1)]


def decision_share(records: Sequence[RunRecord]) -> float | None:
    """The share of the method's wall time its scheduler spent deciding the speculation shape
    (the learned scheduler's `decision_seconds`, ALGORITHMS.md section 5); None without one."""
    if not records or not all(r.stats and "decision_seconds" in r.stats.get("strategy", {}) for r in records):
        return None
    seconds = sum(r.seconds for r in records)
    return sum(r.stats["strategy"]["decision_seconds"] for r in records) / seconds if seconds else 0.0


def draft_ms_per_token(records: Sequence[RunRecord]) -> float | None:
    """Milliseconds of drafting per drafted token; None for methods that draft nothing."""
    if not _have(records, "time_draft") or any(r.draft_tokens is None for r in records):
        return None
    drafted = sum(r.draft_tokens for r in records)
    return 1e3 * sum(r.stats["time_draft"] for r in records) / drafted if drafted else None


def _time_split(records: Sequence[RunRecord]) -> dict[str, float] | None:
    if not _have(records, "time_draft"):
        return None
    seconds = {phase: sum(r.stats[f"time_{phase}"] for r in records) for phase in PHASES}
    total = sum(seconds.values())
    return {phase: s / total if total else 0.0 for phase, s in seconds.items()}


# Tables -------------------------------------------------------------------------------------------
@dataclass
class Table:
    """Methods of one decoding and batch size over all categories, plus each category alone."""

    decoding: str
    batch_size: int
    rows: list[MethodRow]
    per_category: dict[str, list[MethodRow]]
    compiled_warmup: dict[str, float] = field(default_factory=dict)  # method -> warm-up seconds
    timed_compilations: int = 0  # graphs built inside timed runs (should be 0)

    @property
    def title(self) -> str:
        return f"{self.decoding}, batch {self.batch_size}"


def tables(runs: Sequence[CellRun]) -> list[Table]:
    """One table per (decoding, batch size), in the order the cells ran."""
    groups: dict[tuple[str, int], list[CellRun]] = {}
    for run in runs:
        groups.setdefault((run.cell.decoding, run.cell.batch_size), []).append(run)
    out = []
    for (decoding, batch_size), group in groups.items():
        methods, greedy = group[0].methods, group[0].cell.greedy
        records = [r for run in group for r in run.records]
        per_category = {run.cell.category: summarise(run.records, methods, greedy) for run in group}
        warmup: dict[str, float] = defaultdict(float)
        for run in group:
            for name, seconds in run.warmup_seconds.items():
                if name.endswith("compiled"):
                    warmup[name] += seconds
        table = Table(decoding, batch_size, summarise(records, methods, greedy), per_category, dict(warmup))
        table.timed_compilations = sum(r.compilations for r in records)
        out.append(table)
    return out


def draft_cost_line(table: Table, ssm_seconds: dict[str, list[float]]) -> str:
    """Per single-SSM chain row: its time per drafted token (catch-up passes included) against a
    plain static-cache decoding step of that SSM alone (eager rows against eager, compiled against
    compiled)."""
    parts = []
    for row in table.rows:
        if not row.method.startswith("chain[") or row.draft_ms_per_token is None:
            continue
        index = int(row.method[len("chain[") : row.method.index("]")])
        kind = "compiled" if row.method.endswith("+compiled") else "static"
        plain_ms = ssm_seconds[kind][index] * 1e3
        parts.append(
            f"`{row.method}` {row.draft_ms_per_token:.2f} ms = {row.draft_ms_per_token / plain_ms:.2f}x "
            f"SSM {index}'s {plain_ms:.2f} ms"
        )
    lead = "Drafting cost per drafted token vs one plain static-cache step of the same SSM"
    return f"{lead} (eager vs eager, compiled vs compiled): " + "; ".join(parts) + "."


def _number(value: float | None, fmt: str = ".2f") -> str:
    return "-" if value is None else format(value, fmt)


def _spread(value: Spread | None) -> str:
    if value is None:
        return "-"
    return f"{value.median:.2f}x ({value.low:.2f}-{value.high:.2f})"


def _output(row: MethodRow) -> str:
    if row.agreement_with_float32 is not None:
        return f"{row.agreement_with_float32:.0%} = float32 plain"
    return {True: "same", False: "**DIFFERS**", None: "sampled"}[row.identical_to_plain]


def _latency(row: MethodRow) -> str:
    if row.per_token_latency is None:
        return "-"
    return " / ".join(f"{row.per_token_latency[p] * 1e3:.2f}" for p in LATENCY_POINTS)


def markdown_table(table: Table) -> str:
    """The headline table (categories together) and the speedup of every category; at batch > 1
    with the per-token latency."""
    batched = table.batch_size > 1
    latency_header = " | ms/token first / last / mean" if batched else ""
    header = (
        "| rank | method | tokens/step | drafted/step | acceptance | per SSM | draft/verify/other "
        f"| tokens/s{latency_header} | vs plain | vs best plain | vs HF assisted | output |"
    )
    lines = [header, "|" + "---|" * header.count(" | ") + "---|"]
    for row in sorted(table.rows, key=lambda r: (r.rank is None, r.rank or 0)):
        per_ssm = " ".join(f"{i}:{a:.2f}" for i, a in (row.acceptance_rate_per_ssm or {}).items()) or "-"
        split = "/".join(f"{row.time_split[p]:.0%}" for p in PHASES) if row.time_split else "-"
        cells = (
            _number(row.rank, "d"),
            f"`{row.method}`",
            f"{row.tokens_per_step:.2f}",
            _number(row.draft_tokens_per_step, ".1f"),
            _number(row.acceptance_rate),
            per_ssm,
            split,
            f"{row.tokens_per_second.median:.1f}",
            *([_latency(row)] if batched else []),
            _spread(row.speedup_vs_plain),
            _spread(row.speedup_vs_best_plain),
            _spread(row.speedup_vs_hf_assisted),
            _output(row),
        )
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        f"\n`{row.method}`: its scheduler's decisions took {row.decision_share:.1%} of its wall time."
        for row in table.rows
        if row.decision_share is not None
    ]
    if table.compiled_warmup:
        lines.append(
            "\nCompiled methods: untimed warm-up on every prompt (graph compilation included), seconds: "
            + ", ".join(f"`{name}` {s:.0f}" for name, s in table.compiled_warmup.items())
            + f"; graphs compiled during timed runs: {table.timed_compilations}."
        )
    categories = list(table.per_category)
    lines += ["", "Speedup vs plain per category (median over repeats):", ""]
    lines.append("| method | " + " | ".join(categories) + " |")
    lines.append("|---|" + "---|" * len(categories))
    for row in table.rows:
        by_category = [
            next(r for r in table.per_category[c] if r.method == row.method).speedup_vs_plain
            for c in categories
        ]
        lines.append(
            f"| `{row.method}` | " + " | ".join(_number(s.median if s else None) for s in by_category) + " |"
        )
    return "\n".join(lines)
