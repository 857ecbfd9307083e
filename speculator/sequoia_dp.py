"""Sequoia's optimal tree topologies by dynamic programming (ALGORITHMS.md section 8).

The positional acceptance model: at an accepted node, its j-th child (j = 1, 2, ..., in the
order the drafter fills them: the SSM's j-th ranked token, or the j-th token sampled without
replacement) is accepted with a probability `weights[j - 1]` that depends only on j. These are
*marginal* probabilities, P(children 1..j-1 rejected and child j accepted), so they sum to at
most 1; with conditional rates a_j = P(child j accepted | children 1..j-1 rejected) (what
ALGORITHMS.md calls p_j, `AcceptanceVector.p`) they are a_j * prod_{i<j} (1 - a_i). A node v
is then accepted with probability f(v) = product of the weights of the child ranks on the path
root -> v, and

    F(T) = sum over nodes v of f(v)   (f(root) = 1)

is the expected number of tokens one verification pass emits: the expected number of accepted
drafts (every non-root node) plus the LLM's own correction or bonus token (the root's 1).

The DP: c(n, d) = the largest F(T) over trees of at most n nodes and depth at most d (the root
has depth 0). c(n, 0) = 1 for n >= 1, c(0, d) = 0, and for d >= 1

    c(n, d) = 1 + max over a_1 + ... + a_k <= n - 1 of sum_j weights_j * c(a_j, d - 1),

where a_j is the size of child j's subtree and a child exists only if the previous one does
(a_j = 0 ends the children). That is a knapsack over the children, solved for every budget at
once: O(k n^2) per depth, O(d k n^2) in all. With decreasing weights the optimal a_j are
decreasing (rearrangement inequality, as Sequoia states), but the DP does not need it, so
non-monotone measured vectors are handled exactly too. "At most n nodes" equals "exactly n
nodes" without a depth bound (adding a leaf never lowers F) and is what a depth bound needs
(a tree of depth d and k children per node holds only so many nodes). Without a depth bound
the table stops growing once depth d + 1 gains nothing over depth d.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specboost.speculator.shapes import TopologyShape

Weights = tuple[float, ...]


@dataclass(frozen=True)
class OptimalTree:
    """A Sequoia tree: its topology (breadth-first, children in rank order) and F(T)."""

    shape: TopologyShape
    expected_tokens: float  # F(T): expected tokens per LLM verification pass

    @property
    def nodes(self) -> int:
        return len(self.shape.parents)

    @property
    def depth(self) -> int:
        return shape_depth(self.shape)


@dataclass(frozen=True, eq=False)
class TreeTable:
    """The DP tables for one weight vector, every size <= max_nodes and every depth."""

    weights: Weights
    max_nodes: int
    values: list[torch.Tensor]  # per depth d: [max_nodes + 1], values[d][n] = c(n, d)
    splits: list[torch.Tensor]  # per depth d: [k, max_nodes], splits[d][j, b] = a_j when
    #                             children j.. share a budget of b nodes (0: no child j)

    def _level(self, depth: int | None) -> int:
        last = len(self.values) - 1  # deeper levels equal the last one (converged or capped)
        return last if depth is None else min(depth, last)

    def value(self, nodes: int, depth: int | None = None) -> float:
        """c(nodes, depth): the best F(T) with |T| <= nodes and depth(T) <= depth (None: any)."""
        self._check(nodes)
        return float(self.values[self._level(depth)][nodes])

    def tree(self, nodes: int, depth: int | None = None) -> OptimalTree:
        """The optimal tree of `value(nodes, depth)`, in breadth-first order, so the drafter can
        fill it level by level; child j of a node is its j-th ranked (or sampled) token."""
        self._check(nodes)
        parents = [-1]
        queue = deque([(0, nodes, self._level(depth))])  # (node, its subtree budget, depth left)
        while queue:
            node, budget, level = queue.popleft()
            if level == 0:
                continue
            rest = budget - 1
            for j in range(len(self.weights)):
                size = int(self.splits[level][j, rest])
                if size == 0:
                    break
                queue.append((len(parents), size, level - 1))
                parents.append(node)
                rest -= size
        shape = TopologyShape(tuple(parents))
        return OptimalTree(shape, expected_tokens(shape, self.weights))

    def _check(self, nodes: int) -> None:
        if not 1 <= nodes <= self.max_nodes:
            raise ValueError(f"tree size must be in [1, {self.max_nodes}], got {nodes}")


@functools.cache
def solve(weights: Weights, max_nodes: int, max_depth: int | None = None) -> TreeTable:
    """The DP of the module docstring for all sizes <= max_nodes and depths <= max_depth (None:
    unbounded). Memoised: the speculator, the hardware-aware search and the CLI share tables."""
    _check_weights(weights)
    if max_nodes < 1:
        raise ValueError(f"max_nodes must be >= 1, got {max_nodes}")
    if max_depth is not None and max_depth < 0:
        raise ValueError(f"max_depth must be >= 0, got {max_depth}")
    depth_cap = max_nodes - 1 if max_depth is None else min(max_depth, max_nodes - 1)
    # Budgets b = 0..max_nodes-1 (rows) for the children of one node; child j takes a (columns).
    b = torch.arange(max_nodes)[:, None]
    a = torch.arange(max_nodes)[None, :]
    feasible = (a >= 1) & (a <= b)
    remainder = (b - a).clamp(min=0)
    values = [(torch.arange(max_nodes + 1) >= 1).double()]  # depth 0: the root alone
    splits = [torch.zeros(len(weights), max_nodes, dtype=torch.long)]
    for _ in range(depth_cap):
        level_values, level_splits = _deeper(values[-1], weights, feasible, remainder)
        if torch.equal(level_values, values[-1]):  # converged: deeper trees gain nothing
            break
        values.append(level_values)
        splits.append(level_splits)
    return TreeTable(weights, max_nodes, values, splits)


def _deeper(
    prev: torch.Tensor, weights: Weights, feasible: torch.Tensor, remainder: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """c(., d) from c(., d - 1): the knapsack over children k, k-1, ..., 1 for every budget."""
    budgets = feasible.shape[0]
    best = torch.zeros(budgets, dtype=torch.float64)  # children j.. with budget b; none left: 0
    choice = torch.zeros(len(weights), budgets, dtype=torch.long)
    for j in reversed(range(len(weights))):
        with_child = weights[j] * prev[:budgets][None, :] + best[remainder]
        candidates = torch.where(feasible, with_child, -torch.inf)
        candidates[:, 0] = 0.0  # no child j, hence no later child either
        best, choice[j] = candidates.max(dim=1)  # ties: the first, i.e. fewer nodes
    return torch.cat([torch.zeros(1, dtype=torch.float64), 1.0 + best]), choice


def optimal_tree(weights: Weights, nodes: int, depth: int | None = None) -> OptimalTree:
    """The best tree of at most `nodes` nodes and depth at most `depth` (None: any depth)."""
    return solve(weights, nodes, depth).tree(nodes, depth)


def expected_tokens(shape: TopologyShape, weights: Weights) -> float:
    """F(T) of a topology, computed from the topology itself: sum over nodes of the product of
    the weights of the child ranks on the path (a rank beyond the weight vector weighs 0)."""
    f = [1.0] * len(shape.parents)
    for children in shape.children():
        for rank, child in enumerate(children):
            f[child] = weights[rank] if rank < len(weights) else 0.0
    for u, parent in enumerate(shape.parents[1:], start=1):  # parents precede children
        f[u] *= f[parent]
    return sum(f)


def shape_depth(shape: TopologyShape) -> int:
    depths = [0] * len(shape.parents)
    for u, parent in enumerate(shape.parents[1:], start=1):
        depths[u] = depths[parent] + 1
    return max(depths)


def chains_shape(nodes: int, chains: int) -> TopologyShape:
    """`chains` chains that share the root and split nodes - 1 drafts as evenly as possible,
    breadth-first. Under the positional model, k independent chains are exactly this tree: their
    first tokens are the root's children 1..k, and below each the chain goes on with rank 1;
    only one chain can match, so 1 + E[max match] = F(T) (ALGORITHMS.md section 8)."""
    if nodes < 1 or chains < 1:
        raise ValueError(f"need nodes >= 1 and chains >= 1, got nodes={nodes}, chains={chains}")
    drafts = nodes - 1
    lengths = [drafts // chains + (i < drafts % chains) for i in range(min(chains, drafts))]
    parents, tips = [-1], [0] * len(lengths)
    for level in range(max(lengths, default=0)):
        for i, length in enumerate(lengths):
            if level < length:
                parents.append(tips[i])
                tips[i] = len(parents) - 1
    return TopologyShape(tuple(parents))


def tree_vs_chains(
    weights: Weights, sizes: Sequence[int], chains: Sequence[int], max_depth: int | None
) -> list[dict]:
    """Per size n: the Sequoia tree's predicted tokens per step (its depth and parents too) and
    those of k chains of n nodes (k = 1 and every k of `chains` below n), under `weights`."""
    rows = []
    for n in sizes:
        tree = optimal_tree(weights, n, max_depth)
        rows.append(
            {
                "nodes": n,
                "sequoia": tree.expected_tokens,
                "sequoia_depth": tree.depth,
                "chains": {k: expected_tokens(chains_shape(n, k), weights) for k in (1, *chains) if k < n},
                "parents": list(tree.shape.parents),
            }
        )
    return rows


def _check_weights(weights: Weights) -> None:
    if any(not 0.0 <= w <= 1.0 for w in weights):
        raise ValueError(f"acceptance weights must lie in [0, 1], got {weights}")
