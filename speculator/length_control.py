"""Adaptive speculation length (ALGORITHMS.md section 7).

A `LengthController` picks the chain length of the next step from what the LLM made of the
previous ones: the accepted drafted tokens of every sequence of the step (one for now; a list
so that batches (BASS) fit the same interface) and the LLM's step time t_LLM. Two rules:

- `MinionsLengthController` (Minions 3.3): watches t_LLM / verified length and moves the length
  against the trend of that cost;
- `BassLengthController` (BASS Algorithm 1): grows the length while every draft is accepted and
  shrinks it otherwise.

`PoolSpeculator(..., length_controller=...)` (chains) and `MajoritySpeculator` use them.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any


class LengthController(ABC):
    """Picks the draft length of every step; `history[k]` is the length of step k since the last
    `reset` (the last entry is the length of the next step)."""

    name: str  # what `make_length_controller` calls it
    config: Any  # the controller's settings, a dataclass

    def __init__(self, initial: int) -> None:
        self._initial = initial
        self.reset()

    def length(self) -> int:
        """The length to draft in the next step."""
        return self.history[-1]

    def reset(self) -> None:
        """Back to the initial length, forgetting every observation (a new sequence)."""
        self.history: list[int] = [self._initial]
        self._reset_state()

    def update(self, accepted_counts: Sequence[int], step_seconds: float) -> None:
        """Feedback on the last step: accepted drafted tokens per sequence, and t_LLM in seconds."""
        if not accepted_counts:
            raise ValueError("update needs the accepted count of at least one sequence")
        self.history.append(self._next_length(list(accepted_counts), step_seconds))

    def describe(self) -> dict:
        """The controller and its settings, JSON-ready (for reports)."""
        return {"name": self.name, **asdict(self.config)}

    @abstractmethod
    def _reset_state(self) -> None: ...

    @abstractmethod
    def _next_length(self, accepted_counts: list[int], step_seconds: float) -> int: ...


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


# Minions 3.3 ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MinionsLengthConfig:
    """Minions' online length monitor. Defaults are ours (the paper tunes them per deployment):
    start at 4 tokens, decide after 8 steps at one length, move by one token, stay in [1, 16]."""

    initial: int = 4
    decision_threshold: int = 8  # records since the last decision needed for a line fit (>= 2)
    s_reward: int = 1  # added when the cost per verified token falls
    s_punish: int = 1  # subtracted when it rises
    min_length: int = 1
    max_length: int = 16

    def __post_init__(self) -> None:
        _check_positive(s_reward=self.s_reward, s_punish=self.s_punish, min_length=self.min_length)
        if self.decision_threshold < 2:
            raise ValueError(
                f"decision_threshold must be >= 2 (a line needs 2 points), got {self.decision_threshold}"
            )
        if not self.min_length <= self.initial <= self.max_length:
            raise ValueError(
                f"need min_length <= initial <= max_length, got {self.min_length}, {self.initial}, "
                f"{self.max_length}"
            )


def fit_slope(values: Sequence[float]) -> float:
    """Least-squares slope of `values` against their index 0, 1, 2, ..."""
    n = len(values)
    x_mean, y_mean = (n - 1) / 2, sum(values) / n
    covariance = sum((x - x_mean) * (y - y_mean) for x, y in enumerate(values))
    return covariance / sum((x - x_mean) ** 2 for x in range(n))


class MinionsLengthController(LengthController):
    """Minions 3.3: the best length s minimises t_LLM / vl, the LLM step time over the verified
    length vl (accepted drafts + the LLM's own token, averaged over the batch). Every step adds
    one record t_LLM / vl. Once `decision_threshold` records exist since the last decision, a line
    is fitted to them over time (the length is constant in that window, so the trend is the
    signal): slope > 0 means the cost per token rises, s overshot, s -= s_punish; slope < 0
    means s can grow, s += s_reward; the result is clamped to [min_length, max_length]. Every
    decision starts a new window (also one that a bound left without effect), so stale records
    of another length are never fitted; a slope of exactly 0 decides nothing and the window grows.
    """

    name = "minions"

    def __init__(self, config: MinionsLengthConfig | None = None) -> None:
        self.config = config or MinionsLengthConfig()
        super().__init__(self.config.initial)

    def _reset_state(self) -> None:
        self.records: list[float] = []  # t_LLM / vl since the last decision

    def _next_length(self, accepted_counts: list[int], step_seconds: float) -> int:
        c, s = self.config, self.length()
        verified_length = sum(accepted_counts) / len(accepted_counts) + 1
        self.records.append(step_seconds / verified_length)
        if len(self.records) < c.decision_threshold:
            return s
        slope = fit_slope(self.records)
        if slope == 0:
            return s
        self.records = []
        s = s - c.s_punish if slope > 0 else s + c.s_reward
        return min(max(s, c.min_length), c.max_length)


# BASS Algorithm 1 ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class BassLengthConfig:
    """BASS Algorithm 1 with the paper's values."""

    l0: int = 7  # initial length
    l_incre: int = 2  # growth after a step whose longest acceptance was the whole draft
    l_mod: int = 10  # a miss shrinks l by ceil(l / l_mod) (plus 1 after another miss)
    l_limit: int = 32  # the largest length

    def __post_init__(self) -> None:
        _check_positive(l0=self.l0, l_incre=self.l_incre, l_mod=self.l_mod)
        if self.l_limit < self.l0:
            raise ValueError(f"l_limit must be >= l0, got l_limit={self.l_limit}, l0={self.l0}")


class BassLengthController(LengthController):
    """BASS Algorithm 1, one length for the whole batch: after a step with accepted counts x,
    if max(x) == l then l <- min(l + l_incre, l_limit) and s <- 0; else
    l <- max(1, max(x), l - ceil(l / l_mod) - s) and s <- 1 (s makes consecutive misses shrink
    faster)."""

    name = "bass"

    def __init__(self, config: BassLengthConfig | None = None) -> None:
        self.config = config or BassLengthConfig()
        super().__init__(self.config.l0)

    def _reset_state(self) -> None:
        self.s = 0

    def _next_length(self, accepted_counts: list[int], step_seconds: float) -> int:
        c, length, longest = self.config, self.length(), max(accepted_counts)
        if longest == length:
            self.s = 0
            return min(length + c.l_incre, c.l_limit)
        shrunk = length - math.ceil(length / c.l_mod) - self.s
        self.s = 1
        return max(1, longest, shrunk)


CONTROLLERS = {
    MinionsLengthController.name: (MinionsLengthController, MinionsLengthConfig),
    BassLengthController.name: (BassLengthController, BassLengthConfig),
}


def make_length_controller(kind: str | None, **settings: int) -> LengthController | None:
    """ "minions" or "bass" with their config fields as keyword arguments; None: a fixed length."""
    if kind is None:
        if settings:
            raise ValueError(f"settings {sorted(settings)} given without a length controller")
        return None
    if kind not in CONTROLLERS:
        raise ValueError(f"unknown length controller {kind!r}; choose one of {sorted(CONTROLLERS)} or None")
    controller, config = CONTROLLERS[kind]
    return controller(config(**settings))
