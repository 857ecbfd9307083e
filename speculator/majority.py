"""Weighted-majority speculation (ALGORITHMS.md section 6; Minions 3.2).

Every SSM i has a weight w_i (initially equal). The SSMs' drafts are merged into one tree; the
weight of a node is the sum of w_i over the SSMs whose sequence passes through it. Two uses:

- `MajoritySpeculator` ("majority"): from the root, step to the heaviest child until a leaf;
  that path is one SSM's chain (the voted SSM's) and the only thing the LLM verifies, so a step
  costs the LLM no more than single-SSM speculation.
- `PrunedPoolSpeculator` ("pruned"): the merged tree of any draft shape cut to its best nodes
  (by weight and the SSMs' own probabilities), as many as a fixed budget or the hardware
  profile says pay.

After every `update_every` verification steps, the acceptance rate ACR_i = accepted / proposed of
the tokens each SSM was credited with moves its weight: ACR_i > reward_threshold multiplies w_i by
reward_factor (> 1), ACR_i < punish_threshold by punish_factor (< 1) (the weighted majority
algorithm, Littlestone & Warmuth 1994). The weights rate the SSMs, not a sequence, so they carry
over from one `generate` to the next; the report holds their history during the last one.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from transformers import PreTrainedModel

from specboost.speculator.cost_model import CostModel
from specboost.speculator.length_control import LengthController
from specboost.speculator.shapes import ChainShape, DraftShape
from specboost.speculator.speculation import DraftRequest, PoolSpeculator, StepFeedback
from specboost.speculator.tree import DraftKind, TokenTree


@dataclass(frozen=True)
class MajorityConfig:
    """Settings of the weight update (ALGORITHMS.md section 6). Minions gives no values; ours:
    a greedy chain that keeps more than 60% of its tokens earns its SSM x1.25, one that keeps
    less than 30% costs x0.8 (= 1/1.25, so a reward and a punishment cancel), judged over
    batches of 4 steps (one step alone is a noisy rate). Weights are clipped to `weight_range`
    so that long runs neither underflow nor overflow."""

    reward_threshold: float = 0.6
    punish_threshold: float = 0.3
    reward_factor: float = 1.25
    punish_factor: float = 0.8
    update_every: int = 4  # verification steps per weight update
    weight_range: tuple[float, float] = (1e-6, 1e6)

    def __post_init__(self) -> None:
        if not 0 <= self.punish_threshold <= self.reward_threshold <= 1:
            raise ValueError(
                "need 0 <= punish_threshold <= reward_threshold <= 1, got "
                f"punish_threshold={self.punish_threshold}, reward_threshold={self.reward_threshold}"
            )
        if not self.reward_factor > 1:
            raise ValueError(f"reward_factor must be > 1, got {self.reward_factor}")
        if not 0 < self.punish_factor < 1:
            raise ValueError(f"punish_factor must be in (0, 1), got {self.punish_factor}")
        if self.update_every < 1:
            raise ValueError(f"update_every must be >= 1 step, got {self.update_every}")
        low, high = self.weight_range
        if not 0 < low <= 1 <= high < math.inf:
            raise ValueError(f"weight_range must satisfy 0 < low <= 1 <= high < inf, got {self.weight_range}")


# Votes and pruning on a merged tree -----------------------------------------------------------------
def node_weights(tree: TokenTree, weights: Sequence[float]) -> list[float]:
    """Per node: the sum of w_i over the SSMs whose sequence passes through it (`tree.ssms`)."""
    return [sum(weights[i] for i in ssms) for ssms in tree.ssms]


def voted_path(tree: TokenTree, weights: Sequence[float]) -> list[int]:
    """From the root, step to the heaviest child until a leaf; returns the nodes (root excluded).

    Ties go to the child proposed by the lowest-numbered SSM, so the vote is deterministic."""
    weight, path, node = node_weights(tree, weights), [], 0
    while tree.children[node]:
        node = max(tree.children[node], key=lambda child: (weight[child], -min(tree.ssms[child])))
        path.append(node)
    return path


def induced_subtree(tree: TokenTree, nodes: Iterable[int]) -> TokenTree:
    """The tree restricted to the root and `nodes` (which must include every node's parent), with
    each node's proposing SSMs and proposals."""
    out = TokenTree.root_only(tree.tokens[0], tree.kind)
    out.ssms[0] = set(tree.ssms[0])
    index = {0: 0}
    for u in sorted(nodes):  # index order is topological
        if tree.parents[u] not in index:
            raise ValueError(f"node {u} is kept without its parent {tree.parents[u]}")
        v = out.insert(index[tree.parents[u]], tree.tokens[u])
        out.ssms[v] = set(tree.ssms[u])
        out.proposals[v] = list(tree.proposals[u])
        index[u] = v
    return out


def node_scores(tree: TokenTree, weights: Sequence[float]) -> list[float]:
    """Per node, how likely the LLM is to accept the path root -> u, as the pool sees it (root: 1):
    the product along the path of c_v = (sum over the SSMs proposing v of w_i p_i(v)) / (sum of
    w_i over the SSMs whose sequences pass through v's parent), p_i(v) being SSM i's own
    probability of v's token (1 where not recorded). With equal probabilities this orders nodes by
    weight (ALGORITHMS.md section 6); with one SSM it is the SSM's own path probability. Scores
    never grow downwards."""
    score = [1.0] * len(tree)
    for u in range(1, len(tree)):
        parent = tree.parents[u]
        through = sum(weights[i] for i in tree.ssms[parent])
        own: dict[int, float] = {}  # an SSM's beams may reach a node more than once
        for proposal in tree.proposals[u]:
            own[proposal.ssm] = max(own.get(proposal.ssm, 0.0), 1.0 if proposal.p is None else proposal.p)
        mass = sum(weights[i] * p for i, p in own.items())
        score[u] = score[parent] * (mass / through if through else 0.0)
    return score


def best_first(tree: TokenTree, score: Sequence[float]) -> list[int]:
    """The drafted nodes by decreasing score, never a node before its parent (ties: shallower, then
    lower index): since scores never grow downwards, its first n are the n best nodes."""

    def key(u: int) -> tuple[float, int, int]:
        return -score[u], tree.depths[u], u

    frontier = [key(child) for child in tree.children[0]]
    heapq.heapify(frontier)
    order: list[int] = []
    while frontier:
        u = heapq.heappop(frontier)[-1]
        order.append(u)
        for child in tree.children[u]:
            heapq.heappush(frontier, key(child))
    return order


def prune(tree: TokenTree, weights: Sequence[float], budget: int) -> TokenTree:
    """Keep the `budget` drafted nodes of highest score (`node_scores`), with their parents."""
    return induced_subtree(tree, best_first(tree, node_scores(tree, weights))[:budget])


def paying_budget(tree: TokenTree, weights: Sequence[float], step_seconds: Callable[[int], float]) -> int:
    """The number n of best nodes to verify that maximises expected new tokens per second: (1 +
    the sum of their scores) / step_seconds(n), step_seconds(n) being a step's time when n drafted
    nodes are verified (the hardware profile's L_verify(n + 1) plus the drafting)."""
    score = node_scores(tree, weights)
    expected, best, best_rate = 1.0, 0, 1.0 / step_seconds(0)
    for n, u in enumerate(best_first(tree, score), start=1):
        expected += score[u]
        rate = expected / step_seconds(n)
        if rate > best_rate:
            best, best_rate = n, rate
    return best


# The weights and their update ------------------------------------------------------------------------
class MajorityWeights:
    """The SSM weights w_i and the reward/punish update (ALGORITHMS.md section 6)."""

    def __init__(self, num_ssms: int, config: MajorityConfig, initial: Sequence[float] | None = None) -> None:
        self.config = config
        self.weights = [1.0] * num_ssms if initial is None else [float(w) for w in initial]
        if len(self.weights) != num_ssms:
            raise ValueError(f"got {len(self.weights)} weights for {num_ssms} SSMs")
        if not all(0 < w < math.inf for w in self.weights):
            raise ValueError(f"weights must be positive and finite, got {self.weights}")
        self.start_sequence()

    def start_sequence(self) -> None:
        """A new `generate`: the history restarts from the current weights; a partial batch is
        dropped."""
        self.history = [list(self.weights)]  # the weights after each update, the current ones first
        self._steps = 0
        self._proposed: Counter[int] = Counter()
        self._accepted: Counter[int] = Counter()

    def record(self, proposed: Mapping[int, int], accepted: Mapping[int, int]) -> None:
        """One verification step: tokens credited to each SSM, and how many of them the LLM kept."""
        self._proposed.update(proposed)
        self._accepted.update(accepted)
        self._steps += 1
        if self._steps % self.config.update_every == 0:
            self._update()

    def _update(self) -> None:
        c = self.config
        low, high = c.weight_range
        for i, proposed in self._proposed.items():
            if proposed == 0:
                continue
            rate = self._accepted[i] / proposed  # ACR_i
            if rate > c.reward_threshold:
                self.weights[i] = min(self.weights[i] * c.reward_factor, high)
            elif rate < c.punish_threshold:
                self.weights[i] = max(self.weights[i] * c.punish_factor, low)
        self.history.append(list(self.weights))
        self._proposed.clear()
        self._accepted.clear()

    def report(self) -> dict:
        return {"weights": [list(w) for w in self.history], "majority": asdict(self.config)}


def count_per_ssm(tree: TokenTree, nodes: Iterable[int]) -> Counter[int]:
    """How many of `nodes` each SSM proposed."""
    return Counter(i for u in nodes for i in tree.ssms[u])


# Speculators ------------------------------------------------------------------------------------------
class WeightedPoolSpeculator(PoolSpeculator):
    """A pool with SSM weights (the base of the two strategies below)."""

    def __init__(
        self,
        ssms: list[PreTrainedModel],
        shape: DraftShape | None = None,
        length_controller: LengthController | None = None,
        config: MajorityConfig | None = None,
        weights: Sequence[float] | None = None,
    ) -> None:
        super().__init__(ssms, shape, length_controller)
        self.voting = MajorityWeights(self.num_ssms, config or MajorityConfig(), weights)

    @property
    def weights(self) -> list[float]:
        return self.voting.weights

    def reset(self, seed: int | None) -> None:
        super().reset(seed)
        self.voting.start_sequence()

    def report(self) -> dict:
        return {**super().report(), **self.voting.report()}


class MajoritySpeculator(WeightedPoolSpeculator):
    """Weighted majority (Minions 3.2): every SSM drafts a greedy chain of `length` tokens (with a
    `length_controller`, of the length it picks at every step); only the voted chain goes to the
    LLM. `config` sets the weight update, `weights` the initial weights (default: all 1).

    The voted SSMs (those whose chain is the voted path) are credited with the chain: ACR_i is
    accepted / proposed over the chains for which SSM i was voted.

    Sampling (do_sample=True): the voted chain is SELECTED by looking at every SSM's draft, so it
    is not a sample from the voted SSM's q, and multi-step speculative sampling, which assumes it
    is, would not be lossless. The SSMs therefore draft argmax chains under sampling too, and
    `tree_kind` says GREEDY, whose default sampling rule is target sampling: sample y ~ p, accept
    the child equal to y. That is lossless for any tree fixed before the LLM's random draws
    (ALGORITHMS.md section 2), and the vote depends only on the drafts and on past steps.
    """

    def __init__(
        self,
        ssms: list[PreTrainedModel],
        length: int = 4,
        length_controller: LengthController | None = None,
        config: MajorityConfig | None = None,
        weights: Sequence[float] | None = None,
    ) -> None:
        super().__init__(ssms, ChainShape(length), length_controller, config, weights)
        self.voted: list[list[int]] = []  # per step of the last generate: the voted SSMs

    def tree_kind(self, do_sample: bool, seeded: bool = False) -> DraftKind:
        return DraftKind.GREEDY

    def reset(self, seed: int | None) -> None:
        super().reset(seed)
        self.voted = []

    def propose(self, request: DraftRequest) -> TokenTree:
        merged = self.draft_merged(request, request.probs.greedy())  # argmax chains, also when sampling
        path = voted_path(merged, self.weights)
        self.voted.append(sorted(merged.ssms[path[-1]]) if path else [])
        return induced_subtree(merged, path)

    def observe(self, feedback: StepFeedback) -> None:
        super().observe(feedback)
        proposed, accepted = feedback.tree.num_draft_tokens, len(feedback.accepted)
        voted = self.voted[-1]
        self.voting.record(dict.fromkeys(voted, proposed), dict.fromkeys(voted, accepted))

    def report(self) -> dict:
        return {**super().report(), "strategy": "majority", "voted": [list(v) for v in self.voted]}


class PrunedPoolSpeculator(WeightedPoolSpeculator):
    """The pool's merged tree (any `shape`) cut to its best drafted nodes: those the pool is most
    confident in, by the SSMs' own probabilities and weights (`node_scores`; ALGORITHMS.md section
    6, last line). `budget` fixes how many; without one, every step keeps the number that the
    hardware profile `cost_model` says pays best (`paying_budget`: expected tokens per second of
    the step, L_verify from the profile, the drafting as measured). `config` and `weights` as for
    MajoritySpeculator. Each SSM is credited with the kept nodes it proposed, so ACR_i is its
    acceptance rate within the verified trees.

    Pruning looks at which SSMs agree, so a pool's pruned sampled chains (or one SSM's several
    chains, `ChainShape(samples=k)`, kept by their probabilities) are no longer children sampled
    independently from their q: multi-step speculative sampling is not lossless on them, and
    `tree_kind` says SELECTED, whose only sampling rule is target sampling (lossless on any
    tree fixed before the LLM's draws, ALGORITHMS.md section 2). Beam and topology trees are
    verified by target sampling too (or, for one SSM, by sampling without replacement: with one
    SSM every weight is equal and pruning keeps a breadth-first prefix, i.e. each node's
    first-drawn children), and one SSM's pruned chain is a prefix of its sampled chain (MSS).
    """

    def __init__(
        self,
        ssms: list[PreTrainedModel],
        shape: DraftShape | None = None,
        budget: int | None = 8,
        length_controller: LengthController | None = None,
        config: MajorityConfig | None = None,
        weights: Sequence[float] | None = None,
        cost_model: CostModel | None = None,
    ) -> None:
        if budget is None and cost_model is None:
            raise ValueError("give the pruned tree's budget (drafted nodes) or a cost model to choose it")
        if budget is not None and budget < 1:
            raise ValueError(f"budget must be >= 1 drafted node, got {budget}")
        super().__init__(ssms, shape, length_controller, config, weights)
        self.budget = budget
        self.cost_model = cost_model
        self.kept: list[int] = []  # drafted nodes kept per step of the last generate

    def tree_kind(self, do_sample: bool, seeded: bool = False) -> DraftKind:
        kind = super().tree_kind(do_sample)
        several = self.num_ssms > 1 or getattr(self.shape, "samples", 1) > 1  # chains compared
        return DraftKind.SELECTED if kind is DraftKind.SAMPLED and several else kind

    def reset(self, seed: int | None) -> None:
        super().reset(seed)
        self.kept = []

    def propose(self, request: DraftRequest) -> TokenTree:
        start = time.perf_counter()
        merged = super().propose(request)
        budget = self.budget
        if budget is None:
            draft_seconds = time.perf_counter() - start
            verify = self.cost_model.verify_time
            budget = paying_budget(merged, self.weights, lambda n: verify(n + 1) + draft_seconds)
        tree = prune(merged, self.weights, budget)
        tree.kind = self.tree_kind(request.probs.config.do_sample)
        self.kept.append(tree.num_draft_tokens)
        return tree

    def observe(self, feedback: StepFeedback) -> None:
        super().observe(feedback)
        tree = feedback.tree
        self.voting.record(count_per_ssm(tree, range(1, len(tree))), count_per_ssm(tree, feedback.accepted))

    def report(self) -> dict:
        budget = "profile" if self.budget is None else self.budget
        return {**super().report(), "strategy": "pruned", "budget": budget, "kept": list(self.kept)}


# Plot -------------------------------------------------------------------------------------------------
def plot_weight_history(stats: Mapping[str, Any], path: str | Path) -> None:
    """Plot each SSM's weight over the verification steps of one `generate` into `path` (PNG).

    `stats`: `out.stats.to_dict()`, `out.stats.strategy`, or a speculator's `report()`."""
    strategy = stats if "weights" in stats else stats.get("strategy", {})
    if "weights" not in strategy:
        raise ValueError("no weight history here: decode with MajoritySpeculator or PrunedPoolSpeculator")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    history, every = strategy["weights"], strategy["majority"]["update_every"]
    steps = [k * every for k in range(len(history))]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for i, series in enumerate(zip(*history, strict=True)):
        ax.plot(steps, series, marker=".", label=f"SSM {i}")
    ax.set(xlabel="LLM verification steps", ylabel="weight $w_i$", yscale="log", title=strategy["strategy"])
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
