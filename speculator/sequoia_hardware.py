"""Hardware-aware choice of Sequoia's tree size n and depth d (ALGORITHMS.md section 8).

    Speedup(n, d) = G(n, d) / (t(n) + d * c)

G(n, d) = the best expected tokens per step of a tree with at most n nodes and depth at most d
(`sequoia_dp`); t(n) = time of one LLM pass verifying n tokens / time of a pass over 1 token
(plain decoding); c = time of one SSM step / that same 1-token LLM pass. A tree of depth d costs
d SSM steps, as the drafter expands one level per SSM forward pass. Plain decoding scores
1 / t(1) = 1. The grid search prefers the smaller n, then the smaller d, on ties, so the chosen
tree never carries nodes or levels that add nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from specboost.speculator.sequoia_dp import Weights, solve

VerifyCost = Callable[[int], float] | Mapping[int, float]  # n -> t(n), or a measured table of t(n)


class CostModelLike(Protocol):
    """Measured seconds on this machine: what `speculator.cost_model.CostModel` (written by the
    profiler) provides; any object with these two methods will do."""

    def verify_time(self, n_tokens: int) -> float:
        """Seconds of one LLM tree pass over n_tokens tokens."""

    def ssm_step_time(self, ssm: int) -> float:
        """Seconds of one forward step of SSM number `ssm`."""


@dataclass(frozen=True)
class TreeChoice:
    nodes: int
    depth: int
    expected_tokens: float  # G(n, d)
    relative_time: float  # t(n) + d * c, in 1-token LLM passes

    @property
    def speedup(self) -> float:
        return self.expected_tokens / self.relative_time


def relative_costs(cost_model: CostModelLike, ssm: int = 0) -> tuple[Callable[[int], float], float]:
    """(t, c) of the speedup model from measured seconds."""
    one = cost_model.verify_time(1)
    return (lambda n: cost_model.verify_time(n) / one), cost_model.ssm_step_time(ssm) / one


def choose_tree_size(
    weights: Weights, verify_cost: VerifyCost, ssm_cost: float, max_nodes: int, max_depth: int
) -> TreeChoice:
    """argmax over 2 <= n <= max_nodes (only the sizes of a measured table) and 1 <= d <= max_depth
    of Speedup(n, d)."""
    if isinstance(verify_cost, Mapping):
        sizes = sorted(n for n in verify_cost if 2 <= n <= max_nodes)
        t = verify_cost.__getitem__
    else:
        sizes, t = list(range(2, max_nodes + 1)), verify_cost
    if not sizes or max_depth < 1:
        raise ValueError(f"no tree to choose: sizes {sizes}, max_depth {max_depth}")
    table = solve(weights, sizes[-1], max_depth)
    best: TreeChoice | None = None
    for n in sizes:
        for d in range(1, min(max_depth, n - 1) + 1):
            choice = TreeChoice(n, d, table.value(n, d), t(n) + d * ssm_cost)
            if best is None or choice.speedup > best.speedup:
                best = choice
    return best
