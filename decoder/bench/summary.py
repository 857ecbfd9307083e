"""Run records -> one row per method and cell group, with the metrics of ALGORITHMS.md section 13:
tokens per step (new tokens / LLM passes, the LLM's own token included: plain = 1.0); acceptance
(accepted / drafted tokens, overall, per SSM, and by position k: the share of steps accepting at
least k); speedup: the methods run interleaved, so each repeat is one paired measurement (the
method's tokens/s over the reference's: plain, the fastest plain decoding, the fastest HF assisted
generation or the fastest fixed row), reported as the median over repeats with the min and max; a
learned scheduler's choices: each action's share of its steps; per-token latency of several rows
(BASS section 11; Minions' normalized latency): a row's latency / its new tokens, of the first and
the last row to finish and the mean, per repeat the mean over its items, then the median over
repeats. Greedy outputs must equal the reference: a method that differs is flagged, gets no
speedup and no rank; sampled outputs are not compared, and in low precision each row reports its
agreement with float32 plain decoding.
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from specboost.decoder.bench.records import ROW_LATENCIES, ROW_NEW_TOKENS, CellRun, RunRecord, latest_gate
from specboost.decoder.stats import per_token_latency

PLAIN = "plain"  # the reference method of every cell (runs first)
BEST_PLAIN = (PLAIN, "plain_static", "plain_compiled")  # "vs best plain": the fastest of these
LOOP_PLAIN = "loop_plain+compiled"  # our loop's plain steps: the routed scheduler's "no draft" action
HF_ASSISTED = "hf_assisted"  # prefix of the Hugging Face assisted generation methods
LEARNED = "learned"  # prefix of the learned scheduler's rows ("learned+compiled", "learned+oracle")
ORACLE = "oracle"  # the scheduler evaluation's oracle row (its decision rule on the true match lengths)
PHASES = ("draft", "verify", "other")  # DecodeStats.time_<phase>; "other" is the decoder's bookkeeping
LATENCY_POINTS = ("first", "last", "mean")  # stats.per_token_latency


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
    draft_tokens_per_step: (
        float | None
    )  # drafted tree nodes per LLM pass: the tree size (None: drafts nothing)
    acceptance_rate: float | None  # accepted / drafted tokens (None: the method reports no drafts)
    acceptance_rate_per_ssm: dict[int, float] | None
    accepted_at_least: list[float] | None  # [k - 1]: share of steps accepting >= k drafted tokens
    time_split: dict[str, float] | None  # share of the decoder's time per phase (PHASES)
    draft_ms_per_token: float | None  # draft time per drafted token (ours)
    draft_ms_per_level: float | None  # draft time per tree level drafted (a stacked pool: one pass)
    tokens_per_second: Spread
    speedup_vs_plain: Spread | None  # None: output differs (not ranked)
    speedup_vs_best_plain: Spread | None  # vs the fastest of BEST_PLAIN
    speedup_vs_hf_assisted: Spread | None  # vs the fastest HF assisted method; None without one
    speedup_vs_best_fixed: Spread | None  # vs the fastest fixed row (`best_fixed`)
    identical_to_plain: bool | None  # None: sampled or low precision, not compared token-wise
    per_token_latency: dict[str, float] | None  # LATENCY_POINTS -> seconds/token; None: one row
    decision_share: float | None = None  # a scheduler's decision time / the method's wall time
    action_shares: dict[str, float] | None = None  # a scheduler's action -> share of steps, largest first
    action_steps: int = 0  # the steps `action_shares` are shares of
    gate: dict | None = None  # the speculation gate's report after the table's last call (`gate_report`)
    agreement_with_float32: float | None = None  # low precision: share of outputs = float32 plain's
    rank: int | None = None  # 1 = fastest; None: not ranked


def summarise(
    records: Sequence[RunRecord], methods: dict[str, str], greedy: bool, exact: bool = True
) -> list[MethodRow]:
    """One row per method over `records` (one or more cells of one decoding and batch size), ranked
    by median speedup vs plain. Without `exact` (low precision) greedy rows report agreement."""
    by_method: dict[str, list[RunRecord]] = defaultdict(list)
    for r in records:
        by_method[r.method].append(r)
    missing = [name for name in methods if not by_method[name]]
    if missing or PLAIN not in methods:
        raise ValueError(f"no records for {missing or [PLAIN]}: every method (and {PLAIN!r}) needs some")
    rates = {name: _rates_per_repeat(by_method[name]) for name in methods}
    identical = {
        name: all(r.identical for r in by_method[name]) if greedy and exact else None for name in methods
    }

    def fastest(names: Iterable[str]) -> dict[int, float] | None:
        usable = [n for n in names if identical[n] is not False]
        best = max(usable, key=lambda n: statistics.median(rates[n].values()), default=None)
        return None if best is None else rates[best]

    references = {"plain": rates[PLAIN], "best_plain": fastest(n for n in methods if n in BEST_PLAIN)}
    references["hf_assisted"] = fastest(n for n in methods if n.startswith(HF_ASSISTED))
    references["best_fixed"] = fastest(n for n in methods if fixed(n))
    rows = []
    for name, description in methods.items():
        rs, ok = by_method[name], identical[name] is not False
        speedups = {k: _ratio(rates[name], ref) if ok and ref else None for k, ref in references.items()}
        shares, steps = action_shares(rs)
        rows.append(
            MethodRow(
                name,
                description,
                sum(r.new_tokens for r in rs) / max(1, sum(r.llm_steps for r in rs)),
                *_drafting(rs),
                tokens_per_second=Spread.of(rates[name].values()),
                speedup_vs_plain=speedups["plain"],
                speedup_vs_best_plain=speedups["best_plain"],
                speedup_vs_hf_assisted=speedups["hf_assisted"],
                speedup_vs_best_fixed=speedups["best_fixed"],
                identical_to_plain=identical[name],
                per_token_latency=median_per_token_latency(rs),
                decision_share=decision_share(rs),
                action_shares=shares,
                action_steps=steps,
                gate=gate_report(rs),
                agreement_with_float32=sum(r.identical for r in rs) / len(rs)
                if greedy and not exact
                else None,
            )
        )
    ranked = sorted(
        (row for row in rows if row.identical_to_plain is not False), key=lambda r: -r.speedup_vs_plain.median
    )
    for rank, row in enumerate(ranked, start=1):
        row.rank = rank
    return rows


def fixed(method: str) -> bool:
    """A row of one fixed strategy and shape, plain and HF assisted included: any but the learned
    scheduler's and the oracle's, which choose among such shapes step by step."""
    return not method.startswith((LEARNED, ORACLE))


def best_fixed(rows: Iterable[MethodRow]) -> MethodRow | None:
    """The fixed row of highest median tokens/s whose output is not flagged (as `summarise` picks
    the reference of `speedup_vs_best_fixed`); None: no such row."""
    usable = [row for row in rows if fixed(row.method) and row.identical_to_plain is not False]
    return max(usable, key=lambda row: row.tokens_per_second.median, default=None)


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


def _have(records: Sequence[RunRecord], key: str) -> bool:
    """Whether every record's stats hold `key` (plain and HF assisted runs keep no DecodeStats; in
    a batch, plain keeps its rows' latencies alone)."""
    return all(r.stats is not None and key in r.stats for r in records)


def _drafting(records: Sequence[RunRecord]) -> tuple:
    """Drafted tokens per step, acceptance (overall and per SSM), acceptance by position, the
    decoder's time split and drafting time per drafted token and per tree level; all None for a
    method that does not draft (plain and HF assisted generation, which report no drafts)."""
    if not _have(records, "time_draft"):
        return (None,) * 7
    drafted, accepted = sum(r.draft_tokens for r in records), sum(r.accepted_tokens for r in records)
    proposed, hits, seconds = Counter(), Counter(), Counter()
    for r in records:
        proposed.update(r.stats["proposed_per_ssm"])
        hits.update(r.stats["accepted_per_ssm"])
        seconds.update({phase: r.stats[f"time_{phase}"] for phase in PHASES})
    total, levels = sum(seconds.values()), sum(r.stats.get("draft_levels", 0) for r in records)
    return (
        drafted / max(1, sum(r.llm_steps for r in records)),
        accepted / drafted if drafted else 0.0,
        {i: hits[i] / n if n else 0.0 for i, n in sorted(proposed.items())},
        accepted_at_least(records),
        {phase: seconds[phase] / total if total else 0.0 for phase in PHASES},
        1e3 * seconds["draft"] / drafted if drafted else None,
        1e3 * seconds["draft"] / levels if levels else None,
    )


def accepted_at_least(records: Sequence[RunRecord]) -> list[float] | None:
    """[k - 1] = share of verification steps whose match length is >= k, for k = 1 .. the longest."""
    if not _have(records, "match_lengths"):
        return None
    lengths = [m for r in records for m in r.stats["match_lengths"]]
    return [sum(m >= k for m in lengths) / len(lengths) for k in range(1, max(lengths, default=0) + 1)]


def median_per_token_latency(records: Sequence[RunRecord]) -> dict[str, float] | None:
    """Seconds per token of the first and last row to finish and the batch mean: per repeat the
    mean over its items, then the median over repeats. None: the records keep no row latencies."""
    if not _have(records, ROW_LATENCIES):
        return None
    by_repeat: dict[int, list[dict[str, float]]] = defaultdict(list)
    for r in records:
        by_repeat[r.repeat].append(per_token_latency(r.stats[ROW_LATENCIES], r.stats[ROW_NEW_TOKENS]))
    means = [
        {p: statistics.fmean(item[p] for item in items) for p in LATENCY_POINTS}
        for items in by_repeat.values()
    ]
    return {p: statistics.median(mean[p] for mean in means) for p in LATENCY_POINTS}


def decision_share(records: Sequence[RunRecord]) -> float | None:
    """The share of the method's wall time its scheduler spent deciding the speculation shape
    (the learned scheduler's `decision_seconds`, ALGORITHMS.md section 5); None without one."""
    if not records or not all(r.stats and "decision_seconds" in r.stats.get("strategy", {}) for r in records):
        return None
    seconds = sum(r.seconds for r in records)
    return sum(r.stats["strategy"]["decision_seconds"] for r in records) / seconds if seconds else 0.0


def action_shares(records: Sequence[RunRecord]) -> tuple[dict[str, float] | None, int]:
    """Each action's share of the scheduler's steps (largest first, then by name) and the steps,
    from the records' `stats["strategy"]["actions"]` (action -> steps) summed over repeats and
    items; (None, 0) when a record has none (a fixed strategy, or a report older than them)."""
    if not records or not all(r.stats and "actions" in r.stats.get("strategy", {}) for r in records):
        return None, 0
    counts: Counter[str] = Counter()
    for r in records:
        counts.update(r.stats["strategy"]["actions"])
    steps = sum(counts.values())
    ordered = sorted(((name, n) for name, n in counts.items() if n), key=lambda item: (-item[1], item[0]))
    return ({name: n / steps for name, n in ordered} if steps else None), steps


def gate_report(records: Sequence[RunRecord]) -> dict | None:
    """The speculation gate's report after the last of the records' calls (`latest_gate`: it counts
    every call before it, warm-up calls included). None where no record reports a gate (a fixed
    strategy, an ungated scheduler) or where the reports predate the trial counts (records a
    resumed run reads from an older checkpoint)."""
    strategies = [r.stats.get("strategy", {}) for r in records if r.stats]
    gates = [strategy["gate"] for strategy in strategies if "gate" in strategy]
    return latest_gate(gate for gate in gates if "trials_on" in gate)


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

    def row(self, method: str) -> MethodRow:
        return next(r for r in self.rows if r.method == method)


def tables(runs: Sequence[CellRun]) -> list[Table]:
    """One table per (decoding, batch size), in the order the cells ran."""
    groups: dict[tuple[str, int], list[CellRun]] = {}
    for run in runs:
        groups.setdefault((run.cell.decoding, run.cell.batch_size), []).append(run)
    out = []
    for (decoding, batch_size), group in groups.items():
        methods, cell = group[0].methods, group[0].cell
        records = [r for run in group for r in run.records]
        per_category = {
            run.cell.category: summarise(run.records, methods, cell.greedy, cell.exact) for run in group
        }
        warmup: Counter[str] = Counter()
        for run in group:
            warmup.update({name: s for name, s in run.warmup_seconds.items() if name.endswith("compiled")})
        rows = summarise(records, methods, cell.greedy, cell.exact)
        out.append(
            Table(
                decoding, batch_size, rows, per_category, dict(warmup), sum(r.compilations for r in records)
            )
        )
    return out
