"""Decoding statistics, with the metric names of ALGORITHMS.md section 13."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, fields

import torch


@dataclass
class DecodeStats:
    llm_steps: int = 0  # LLM verification passes
    new_tokens: int = 0  # tokens emitted (accepted drafts + one LLM token per step, after stopping)
    draft_tokens: int = 0  # drafted tree nodes sent to the LLM
    draft_levels: int = 0  # tree levels the SSMs drafted (a stacked pool drafts each in one pass)
    accepted_tokens: int = 0  # drafted tokens the LLM accepted
    proposed_per_ssm: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    accepted_per_ssm: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    match_lengths: list[int] = field(default_factory=list)  # accepted drafted tokens per step
    time_draft: float = 0.0  # seconds
    time_verify: float = 0.0
    time_other: float = 0.0
    time_total: float = 0.0
    strategy: dict = field(default_factory=dict)  # the speculation strategy's own record (Speculator.report)

    @property
    def tokens_per_step(self) -> float:
        """New tokens per LLM verification pass (mean accepted length, bonus token included)."""
        return self.new_tokens / self.llm_steps if self.llm_steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def acceptance_rate_per_ssm(self) -> dict[int, float]:
        return {
            i: self.accepted_per_ssm[i] / n if n else 0.0 for i, n in sorted(self.proposed_per_ssm.items())
        }

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.time_total if self.time_total else 0.0

    def to_dict(self) -> dict:
        """Plain JSON-ready data, derived metrics included. (Built field by field: `asdict` cannot
        copy defaultdict fields before Python 3.12.)"""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["proposed_per_ssm"] = dict(self.proposed_per_ssm)
        out["accepted_per_ssm"] = dict(self.accepted_per_ssm)
        out["match_lengths"] = list(self.match_lengths)
        for name in ("tokens_per_step", "acceptance_rate", "acceptance_rate_per_ssm", "tokens_per_second"):
            out[name] = getattr(self, name)
        return out


def merged_stats(rows: Sequence[DecodeStats], numbers: Sequence[int] | None = None) -> DecodeStats:
    """Several sequences' statistics as one: counts and phase times summed (the rows of a batch
    each carry the batch's wall time, so the shares stay the batch's), every row's match lengths;
    SSM i counted as SSM `numbers[i]` when given."""
    total = DecodeStats()
    for s in rows:
        for name in ("llm_steps", "new_tokens", "draft_tokens", "draft_levels", "accepted_tokens"):
            setattr(total, name, getattr(total, name) + getattr(s, name))
        for name in ("time_draft", "time_verify", "time_other", "time_total"):
            setattr(total, name, getattr(total, name) + getattr(s, name))
        for counts, merged in (
            (s.proposed_per_ssm, total.proposed_per_ssm),
            (s.accepted_per_ssm, total.accepted_per_ssm),
        ):
            for i, n in counts.items():
                merged[numbers[i] if numbers else i] += n
        total.match_lengths += s.match_lengths
    return total


def per_token_latency(latencies: Sequence[float], new_tokens: Sequence[int]) -> dict[str, float]:
    """BASS's per-token latency of a batch (ALGORITHMS.md section 11): each sequence's latency
    (seconds to its last token) / its new tokens, for the sequence that finishes first, the one
    that finishes last (ties: the lower, the higher per-token latency), and the batch mean."""
    per_token = [t / max(1, n) for t, n in zip(latencies, new_tokens, strict=True)]
    order = sorted(zip(latencies, per_token, strict=True))
    return {"first": order[0][1], "last": order[-1][1], "mean": sum(per_token) / len(per_token)}


class PhaseTimer:
    """Time per phase of the decode loop. On CUDA each phase is timed by a pair of CUDA events and
    read only when asked for, so that timing adds no host-device synchronisation to a step; elsewhere
    by the host clock. `mark()` / `seconds_since(mark)` give the phases of the steps since a row
    joined the loop; `forget_before(mark)` drops what no row needs any more."""

    def __init__(self, device: torch.device) -> None:
        self.events = device.type == "cuda"
        self._records: list[tuple[str, object, object]] = []  # (phase, start, end): times or events
        self._offset = 0  # marks of the records dropped by `forget_before`

    def _now(self) -> object:
        if not self.events:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = self._now()
        try:
            yield
        finally:
            self._records.append((name, start, self._now()))

    def mark(self) -> int:
        """The position of the next phase record."""
        return self._offset + len(self._records)

    def seconds_since(self, mark: int = 0) -> dict[str, float]:
        """Seconds per phase over the records from `mark` on (waits for their CUDA events)."""
        out: dict[str, float] = defaultdict(float)
        for name, start, end in self._records[max(0, mark - self._offset) :]:
            if self.events:
                end.synchronize()
                out[name] += start.elapsed_time(end) / 1000
            else:
                out[name] += end - start
        return out

    @property
    def seconds(self) -> dict[str, float]:
        return self.seconds_since(self._offset)

    def forget_before(self, mark: int) -> None:
        drop = max(0, mark - self._offset)
        del self._records[:drop]
        self._offset += drop
