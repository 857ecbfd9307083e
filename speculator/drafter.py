"""The SSMs of a pool drafting token trees over one verified prefix, one forward pass per tree
level for the whole pool (ALGORITHMS.md section 3).

SSMs that share an architecture run as one stacked model (`speculator/stacked_pool.py`), each on
its own row of one KV cache (a `TreeCache`); a pool that cannot be stacked drafts with one cache
per SSM, one pass per SSM and level. Every row keeps its cache synced to the verified prefix:
after a verification it commits the K/V of the drafted tokens the LLM accepted (they are pending
nodes of its cache, as in the LLM's) and feeds only the tokens it has not seen (at least the
LLM's correction or bonus token). Then every SSM's tree grows level by level as its plan says
(`speculator/draft_plans.py`), all SSMs' frontier nodes fed in one pass with tree attention.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from specboost.speculator.draft_plans import DraftPlan, make_plan
from specboost.speculator.kv_cache import CompiledPass, TreeCache, capacity_for
from specboost.speculator.model_info import context_length
from specboost.speculator.sampling import LogitsToProbs
from specboost.speculator.shapes import DraftShape
from specboost.speculator.stacked_pool import stack_pool, why_not_stackable
from specboost.speculator.tree import TokenTree

logger = logging.getLogger(__name__)

HEADROOM = 256  # positions a new cache holds beyond the text it starts with
Compiler = Callable[[PreTrainedModel], CompiledPass | None]  # a model's compiled tree pass (None: eager)


@dataclass
class _Row:
    """One SSM's row of a cache: what it holds and what it drafted last."""

    member: int  # position of the SSM in the pool
    cached: list[int] = field(default_factory=list)  # verified tokens committed to the cache, in order
    expansion: TokenTree = field(default_factory=lambda: TokenTree.root_only(-1))  # last step's nodes
    slots: dict[int, int] = field(default_factory=dict)  # expansion node -> its pending index


@dataclass
class _Unit:
    """SSMs drafting in one pass: a stacked model (one row per SSM) or one SSM alone."""

    model: PreTrainedModel
    rows: list[_Row]
    cache: TreeCache | None = None


class PoolDrafter:
    """Drafts with the SSMs `models`; `indices` are what tree nodes record as proposers (default
    0..n-1). `stack=False` keeps one pass per SSM even when they could be stacked."""

    def __init__(
        self, models: Sequence[PreTrainedModel], indices: Sequence[int] | None = None, stack: bool = True
    ) -> None:
        self.models = list(models)
        self.indices = list(range(len(models)) if indices is None else indices)
        self.compiler: Compiler | None = None  # set by the decoder: compiled passes per model
        self.stacked = stack and why_not_stackable(self.models) is None
        if self.stacked:
            try:
                self.units = [_Unit(stack_pool(self.models), [_Row(m) for m in range(len(models))])]
            except ValueError as error:  # a layer the stacked model does not reproduce
                self.stacked = False
                logger.warning("SSMs draft one after another: %s", error)
        elif stack and len(models) > 1:
            logger.warning("SSMs draft one after another: %s", why_not_stackable(self.models))
        if not self.stacked:
            self.units = [_Unit(model, [_Row(m)]) for m, model in enumerate(self.models)]
        self.max_positions = context_length(self.models[0])
        self.levels = 0  # tree levels of the last `draft` (passes of its busiest unit, catch-up included)

    def reset(self) -> None:
        """Forget every cache (a new sequence)."""
        for unit in self.units:
            unit.cache = None
            unit.rows = [_Row(row.member) for row in unit.rows]

    def draft_one(
        self,
        verified: list[int],
        shape: DraftShape,
        probs: LogitsToProbs,
        max_depth: int,
        generator: torch.Generator | None = None,
    ) -> TokenTree:
        """The tree of a pool of one SSM (`draft` with one shape)."""
        assert len(self.models) == 1, "draft_one is for a pool of one SSM"
        return self.draft(verified, [shape], probs, max_depth, [generator])[0]

    @torch.no_grad()
    def draft(
        self,
        verified: list[int],
        shapes: Sequence[DraftShape | None],
        probs: LogitsToProbs,
        max_depth: int,
        generators: Sequence[torch.Generator | None] | None = None,
    ) -> list[TokenTree | None]:
        """Per SSM, a tree of `shapes[i]` (None: the SSM sits this step out) after `verified`
        (prompt + accepted), no deeper than `max_depth`; past the SSMs' context, root-only trees."""
        generators = generators or [None] * len(self.models)
        if self.max_positions is not None:
            max_depth = min(max_depth, self.max_positions - len(verified))
        trees: list[TokenTree | None] = [None] * len(self.models)
        self.levels = 0
        for unit in self.units:
            if all(shapes[row.member] is None for row in unit.rows):
                continue
            if max_depth < 1:
                for row in unit.rows:
                    shape = shapes[row.member]
                    if shape is not None:
                        trees[row.member] = TokenTree.root_only(
                            verified[-1], shape.kind(probs.config.do_sample)
                        )
                continue
            plans = self._grow(unit, verified, shapes, probs, max_depth, generators)
            for member, plan in plans.items():
                trees[member] = plan.result()
        return trees

    def _grow(
        self,
        unit: _Unit,
        verified: list[int],
        shapes: Sequence[DraftShape | None],
        probs: LogitsToProbs,
        max_depth: int,
        generators: Sequence[torch.Generator | None],
    ) -> dict[int, DraftPlan]:
        """Sync the unit's rows, then grow every plan level by level, one pass per level."""
        logits = self._sync(unit, verified)  # [rows, V] after each row's last verified token
        plans: dict[int, DraftPlan] = {}
        for r, row in enumerate(unit.rows):
            shape = shapes[row.member]
            if shape is not None:
                index = self.indices[row.member]
                plans[r] = make_plan(shape, verified[-1], index, probs, max_depth, generators[row.member])
                row.expansion = plans[r].tree
        level, passes = {r: logits[r : r + 1] for r in plans}, 1
        while True:
            for r, plan in plans.items():
                if plan.frontier:
                    plan.grow(plan.probs.tree_scores(level[r], plan.tree, verified, plan.frontier))
            feeding = {r: plan.frontier for r, plan in plans.items() if plan.frontier}
            if not feeding:
                self.levels = max(self.levels, passes)
                return {unit.rows[r].member: plan for r, plan in plans.items()}
            level, passes = self._expand(unit, verified, feeding), passes + 1

    # Cache sync ----------------------------------------------------------------------------------------
    def _sync(self, unit: _Unit, verified: list[int]) -> torch.Tensor:
        """Bring every row's cache to exactly `verified`; the logits [rows, V] after it."""
        if unit.cache is None:
            compiled = self.compiler(unit.model) if self.compiler is not None else None
            capacity = capacity_for(len(verified) + HEADROOM)
            unit.cache = TreeCache(unit.model, len(unit.rows), capacity, compiled)
        keep, feeds = [], []
        for row in unit.rows:
            kept, common = _kept_nodes(row, verified)
            keep.append(kept if common == len(row.cached) else [])
            feeds.append(common)
        unit.cache.commit(keep)
        chains = []
        for r, (row, common) in enumerate(zip(unit.rows, feeds, strict=True)):
            if common < len(row.cached):
                unit.cache.truncate(r, common)
            seen = unit.cache.lengths[r]
            if seen == len(verified):  # the row has seen everything: recompute the last position
                unit.cache.truncate(r, seen - 1)
                seen -= 1
            row.cached, row.slots = list(verified), {}
            chains.append(verified[seen:])
        return unit.cache.feed_chains(chains).logits

    # Tree levels ----------------------------------------------------------------------------------------
    def _expand(
        self, unit: _Unit, verified: list[int], feeding: dict[int, list[int]]
    ) -> dict[int, torch.Tensor]:
        """Feed each row's frontier nodes (one level, after every node it fed this step) in ONE pass;
        rows with fewer nodes are padded (a padding node sees only itself). Returns each feeding
        row's logits [nodes, V]."""
        cache = unit.cache
        width, pending = max(map(len, feeding.values())), cache.pending
        root = len(verified) - 1
        tokens, positions, visible = [], [], []
        for r, row in enumerate(unit.rows):
            nodes = feeding.get(r, [])
            tree = row.expansion
            fed = {u: slot for u, slot in row.slots.items()}
            tokens.append([tree.tokens[u] for u in nodes] + [0] * (width - len(nodes)))
            positions.append([root + tree.depths[u] for u in nodes] + [root] * (width - len(nodes)))
            grid = []
            for i in range(width):
                seen = [False] * (pending + width)
                if i < len(nodes):
                    ancestors = tree.ancestors(nodes[i])
                    for u in ancestors:
                        if u in fed:
                            seen[fed[u]] = True
                    for j, v in enumerate(nodes):
                        seen[pending + j] = v in ancestors
                else:
                    seen[pending + i] = True
                grid.append(seen)
            visible.append(grid)
        device = cache.device
        out = cache.feed(
            torch.tensor(tokens, device=device),
            torch.tensor(positions, device=device),
            torch.tensor(visible, device=device),
        )
        for r, nodes in feeding.items():
            unit.rows[r].slots.update({u: pending + i for i, u in enumerate(nodes)})
        return {r: out.logits[r, : len(nodes)] for r, nodes in feeding.items()}


def _kept_nodes(row: _Row, verified: list[int]) -> tuple[list[int], int]:
    """The pending slots of the drafted nodes that `verified` accepted after the row's cached text,
    and the length of the common prefix of the two texts."""
    n = len(row.cached)
    if verified[:n] != row.cached:
        common = 0
        while common < min(n, len(verified)) and verified[common] == row.cached[common]:
            common += 1
        return [], common
    kept, node = [], 0
    for token in verified[n:]:
        child = row.expansion.child_with_token(node, token)
        if child is None or child not in row.slots:
            break
        kept.append(row.slots[child])
        node = child
    return kept, n
