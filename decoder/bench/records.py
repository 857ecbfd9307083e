"""What the harness measures with and keeps: a `Method` and what one run of it decoded
(`MethodResult`), the `RunRecord` of every timed run, grouped by cell (`Cell`, `CellRun`) and by
table (`TableRun`). The kept ones come back from their JSON (`from_dict`): a resumed run reads
the tables an earlier one finished from its checkpoint."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from transformers import BatchEncoding

from specboost.decoder.stats import DecodeStats, merged_stats

# A run of several rows keeps each row's latency and new tokens in its stats (per-token latency).
ROW_LATENCIES, ROW_NEW_TOKENS = "row_latencies", "row_new_tokens"
# The stats keyed by SSM number (`DecodeStats.to_dict`): JSON keys them by strings, read back as ints.
PER_SSM = ("proposed_per_ssm", "accepted_per_ssm", "acceptance_rate_per_ssm")


@dataclass(frozen=True)
class Decoding:
    """How every method decodes: greedy, or sampling with one fixed seed (each repeat of a method
    then draws the same tokens)."""

    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0

    @property
    def name(self) -> str:
        return f"sample(T={self.temperature:g}, top_p={self.top_p:g})" if self.do_sample else "greedy"

    def options(self) -> dict:
        """The sampling options of `llm.generate` and `SpeculativeDecoder.generate`."""
        if not self.do_sample:
            return {"do_sample": False}
        return {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p}


GREEDY = Decoding()


def row_stats(latencies: Sequence[float], new_tokens: Sequence[int]) -> dict[str, list]:
    return {ROW_LATENCIES: list(latencies), ROW_NEW_TOKENS: list(new_tokens)}


def latest_gate(reports: Iterable[dict]) -> dict | None:
    """The latest of a decoder's speculation gate reports (`SpeculationGate.report`, ALGORITHMS.md
    5.4): a gate lives from the decoder's warm-up to its last call and counts every step in it, so
    the latest report is the one of most steps. None for none."""
    return max(reports, key=lambda gate: gate["steps_on"] + gate["steps_off"], default=None)


@dataclass
class MethodResult:
    """What one run of a method decoded: one item of one or more rows."""

    rows: list[list[int]]  # each row's new tokens, through its first EOS
    llm_steps: int  # LLM passes per row, summed over rows (forward passes for plain and HF assisted)
    latencies: list[float]  # per row: seconds from the run's start to its last token
    decoded: list[DecodeStats] | None = None  # ours: each row's statistics
    ssms: list[int] | None = None  # ours: the harness's number of the decoder's SSM i
    strategy: dict = field(default_factory=dict)  # ours, one row: the strategy's own record

    def stats(self) -> dict | None:
        """Ours: the rows' statistics merged; several rows: each row's latency and length."""
        out = None
        if self.decoded is not None:
            out = merged_stats(self.decoded, self.ssms).to_dict() | {"strategy": self.strategy}
        if len(self.rows) > 1:
            out = (out or {}) | row_stats(self.latencies, [len(row) for row in self.rows])
        return out


@dataclass
class Method:
    name: str
    description: str
    run: Callable[[BatchEncoding], MethodResult]  # one item: input_ids, attention_mask [B, L]
    compiled: bool = False  # runs torch.compile'd graphs: warmed up on every item before timing
    warm_every_item: bool = False  # prepares something per item in its first run (the oracle's outputs)


@dataclass
class MethodSet:
    methods: list[Method]  # the reference method (plain decoding) first
    skipped: dict[str, str] = field(default_factory=dict)  # method -> why it did not run


@dataclass
class RunRecord:
    """One timed run of one method on one item."""

    method: str
    item: int
    repeat: int
    new_tokens: int
    llm_steps: int
    seconds: float  # wall time of the run, less its untimed part (an oracle's lookahead)
    identical: bool  # its rows equal the cell's reference rows
    draft_tokens: int | None = None  # ours only: HF assisted does not report them
    accepted_tokens: int | None = None
    stats: dict | None = None  # MethodResult.stats
    compilations: int = 0  # graphs torch.compile built during this timed run (0 when warmed up)

    @classmethod
    def of(
        cls,
        method: str,
        item: int,
        repeat: int,
        result: MethodResult,
        seconds: float,
        identical: bool,
        built: int,
    ) -> RunRecord:
        """The record of a run that took `seconds` (its untimed part, an oracle's lookahead, left out)."""
        decoded = result.decoded or []
        counts = (
            [sum(s.draft_tokens for s in decoded), sum(s.accepted_tokens for s in decoded)]
            if decoded
            else [None, None]
        )
        seconds -= result.strategy.get("untimed_seconds", 0.0)
        new_tokens = sum(len(row) for row in result.rows)
        return cls(
            method,
            item,
            repeat,
            new_tokens,
            result.llm_steps,
            seconds,
            identical,
            *counts,
            result.stats(),
            built,
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunRecord:
        """The record of its JSON (`asdict`), its per-SSM stats keyed by SSM number again, as they
        were measured (the summary sorts SSMs by their keys)."""
        stats = data.get("stats")
        if stats is not None:
            stats = stats | {
                name: {int(i): v for i, v in stats[name].items()} for name in PER_SSM if name in stats
            }
        return cls(**data | {"stats": stats})


@dataclass(frozen=True)
class Cell:
    """One workload cell: a category decoded one way at one batch size."""

    category: str
    decoding: str  # Decoding.name
    greedy: bool
    batch_size: int
    exact: bool = True  # greedy rows must equal the reference; False (low precision): agreement shown


@dataclass
class CellRun:
    cell: Cell
    methods: dict[str, str]  # name -> description, in table order; the reference first
    records: list[RunRecord] = field(repr=False)
    warmup_seconds: dict[str, float] = field(default_factory=dict)  # untimed, compilation included

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CellRun:
        """The cell's run of its JSON (`asdict`)."""
        records = [RunRecord.from_dict(record) for record in data["records"]]
        return cls(Cell(**data["cell"]), data["methods"], records, data["warmup_seconds"])


@dataclass
class TableRun:
    """One finished table: every category decoded one way at one batch size, the methods that did
    not run there and why, and the plan's own state of it (`Plan.table_state`), JSON-able, which a
    resumed run hands back to its plan."""

    decoding: Decoding
    batch_size: int
    runs: list[CellRun] = field(repr=False)
    skipped: dict[str, str]  # method, or "category <name>" -> why it did not run
    state: Any = None

    @property
    def title(self) -> str:
        return f"{self.decoding.name}, batch {self.batch_size}"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TableRun:
        """The table of its JSON (`asdict`)."""
        runs = [CellRun.from_dict(run) for run in data["runs"]]
        return cls(Decoding(**data["decoding"]), data["batch_size"], runs, data["skipped"], data["state"])
