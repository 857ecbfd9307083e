"""Who drafts for the sequences of a batch (ALGORITHMS.md sections 3, 7 and 11).

Every sequence keeps its own SSM caches. Two ways to draft for a batch (a `SequenceGroup`):

- `BatchedChainDrafting`: for the SpecInfer pool drafting one chain per SSM (`PoolSpeculator`
  with `ChainShape`), the pool drafts every sequence's chains at once over a ragged cache
  (`BatchedChainDrafter`): one pass per chain position for the whole batch and, when the SSMs
  are stacked into one model, for the whole pool. The chains of one sequence are merged into
  its tree exactly as `PoolSpeculator` merges them.
- `PerSequenceDrafting`: any other strategy (beam or topology trees, several sampled chains per
  SSM, weighted majority, Sequoia, the learned scheduler): every sequence gets its own copy of
  the decoder's speculator, sharing the models, and drafts alone.

Chain strategies draft one length per step for the whole batch, chosen by the batch's length
controller (BASS Algorithm 1 by default; section 7).
"""

from __future__ import annotations

import copy
import types
from collections.abc import Mapping
from dataclasses import replace
from typing import Protocol

import torch
from torch import nn

from specboost.decoder.compilation import ModelCalls
from specboost.decoder.routed_drafting import RoutedDrafting
from specboost.decoder.sequence import SequenceState
from specboost.decoder.verify import Rule
from specboost.speculator.batched_drafter import BatchedChainDrafter
from specboost.speculator.length_control import LengthController, make_length_controller
from specboost.speculator.routed_scheduler import RoutedScheduler
from specboost.speculator.shapes import ChainShape
from specboost.speculator.speculation import (
    DraftRequest,
    PoolSpeculator,
    Speculator,
    StepFeedback,
    pool_drafters,
    ssm_generator,
)
from specboost.speculator.tree import ChainDraft, TokenTree

_NOT_WALKED = (type, types.ModuleType, types.FunctionType, types.MethodType)
# The setting that holds the initial length, per length controller.
_INITIAL_LENGTH = {"bass": "l0", "minions": "initial"}


class GroupDrafting(Protocol):
    """Drafting state of the rows of one batch, in row order."""

    def add(self, rows: list[SequenceState]) -> None:
        """New rows, appended after the current ones."""

    def retain(self, rows: list[SequenceState], keep: list[int]) -> None:
        """Keep only rows `keep` (indices into `rows`, the rows before the call)."""

    def propose(
        self, rows: list[SequenceState], depths: list[int], lengths: list[int | None]
    ) -> list[TokenTree] | ChainDraft:
        """One tree per row, at most `depths[b]` deep (or one SSM's greedy chains, still on the
        device); `lengths[b]` is row b's chain length (None: the strategy's own shape)."""

    one_chain: bool
    """Every row's draft is one chain, never deeper than the row's `max_depth`: its nodes fit in
    the text's own positions, and the group's LLM cache needs no headroom (`CAPACITY_HEADROOM`)."""

    def wants_hidden(self) -> bool:
        """Whether the step's verification should return the LLM's hidden states (when the
        speculator reads them at all): the routed scheduler's gate may say the next step needs none."""

    def levels(self, row: int) -> int:
        """Tree levels drafted for row `row` in the last `propose` (for a stacked pool one pass each,
        the catch-up pass included; one pass per SSM and level otherwise)."""

    def observe(self, rows: list[SequenceState], accepted: list[list[int]], verify_seconds: float) -> None:
        """What the LLM accepted of each row's tree."""

    def report(self, row: int) -> dict:
        """The strategy's record of row `row`'s sequence, for `DecodeStats.strategy`."""


def drafts_chains(speculator: Speculator) -> bool:
    """Whether the speculator drafts chains whose length a batch controller may set."""
    return isinstance(speculator, PoolSpeculator) and isinstance(speculator.shape, ChainShape)


def batch_length_controller(
    speculator: Speculator, kind: str | None, settings: Mapping[str, int] | None
) -> LengthController | None:
    """The batch's length controller for a chain strategy: a copy of the speculator's own, else
    `kind` ("bass", "minions" or None for a fixed length) starting at the speculator's chain
    length unless `settings` say otherwise. None for strategies that do not draft chains."""
    if not drafts_chains(speculator):
        return None
    if speculator.length_controller is not None:
        controller = copy.deepcopy(speculator.length_controller)
        controller.reset()
        return controller
    if kind is not None and settings is None:
        settings = {_INITIAL_LENGTH[kind]: speculator.shape.length}
    return make_length_controller(kind, **(settings or {}))


class BatchedChainDrafting:
    """The pool's chains, drafted for every row at once (see the module doc): one
    `BatchedChainDrafter` per unit of the speculator's `PoolDrafter` (the stacked pool, or each SSM)."""

    def __init__(self, speculator: PoolSpeculator, calls: ModelCalls) -> None:
        self.shape = speculator.shape
        pool = speculator.drafter
        self.units = [
            (
                BatchedChainDrafter(unit.model, calls.get(unit.model), len(unit.rows)),
                [pool.indices[row.member] for row in unit.rows],  # the SSM index of each member
            )
            for unit in pool.units
        ]
        self.one_chain = sum(drafter.members for drafter, _ in self.units) == 1
        self.generators: list[list[torch.Generator | None]] = [[] for _ in self.units]  # per unit row
        self._levels = 0  # of the last `propose`: one pass per chain position

    def add(self, rows: list[SequenceState]) -> None:
        for (drafter, indices), generators in zip(self.units, self.generators, strict=True):
            old = drafter.sequences
            drafter.add_sequences(len(rows))
            drafter.expect_sampling([row.probs for row in rows if row.seed is None])
            device = drafter.model.device
            fresh = [[ssm_generator(row.seed, index, device) for row in rows] for index in indices]
            generators[:] = [
                g for p, index in enumerate(indices) for g in generators[p * old : (p + 1) * old] + fresh[p]
            ]

    def retain(self, rows: list[SequenceState], keep: list[int]) -> None:
        for i, (drafter, _) in enumerate(self.units):
            total = drafter.sequences
            self.generators[i] = [
                self.generators[i][p * total + b] for p in range(drafter.members) for b in keep
            ]
            drafter.select(keep)

    def propose(
        self, rows: list[SequenceState], depths: list[int], lengths: list[int | None]
    ) -> list[TokenTree] | ChainDraft:
        own = self.shape.length
        lengths = [min(own if n is None else n, depth) for n, depth in zip(lengths, depths, strict=True)]
        self._levels = max(lengths, default=0)
        verified = [row.tokens for row in rows]
        greedy = all(row.rule is Rule.GREEDY for row in rows)  # argmax chains, processors or not
        if greedy and len(self.units) == 1 and self.units[0][0].members == 1:
            # One SSM's greedy chains stay on the device until the verifier reads them back.
            ((drafter, (index,)),) = self.units
            tokens, lengths = drafter.draft_greedy(verified, lengths)
            return ChainDraft([row.tokens[-1] for row in rows], tokens, lengths, index)
        trees = [
            TokenTree.root_only(row.tokens[-1], self.shape.kind(row.probs.config.do_sample)) for row in rows
        ]
        for (drafter, indices), generators in zip(self.units, self.generators, strict=True):
            members = len(indices)
            if greedy:  # argmax chains on the device, read back once
                tokens, counts = drafter.draft_greedy(verified * members, lengths * members)
                chains = [
                    [(t, None) for t in row[:n]] for row, n in zip(tokens.tolist(), counts, strict=True)
                ]
            else:
                probs = [row.probs for row in rows] * members
                chains = drafter.draft(verified * members, lengths * members, probs, generators)
            for r, chain in enumerate(chains):  # a trie insert = SpecInfer's merge
                tree, index = trees[r % len(rows)], indices[r // len(rows)]
                tree.add_sequence([t for t, _ in chain], index, [q for _, q in chain])
        return trees

    def wants_hidden(self) -> bool:
        return True

    def levels(self, row: int) -> int:
        return self._levels

    def observe(self, rows: list[SequenceState], accepted: list[list[int]], verify_seconds: float) -> None:
        """Nothing to learn: the SSM caches catch up on the next draft."""

    def report(self, row: int) -> dict:
        return {"strategy": "pool", "shape": repr(self.shape), "drafting": "batched"}


class PerSequenceDrafting:
    """A copy of the decoder's speculator per row (models shared), each drafting alone; with
    `shared`, the single row drafts with the decoder's speculator itself (so that what it learns,
    such as majority weights, carries over to the next `generate`)."""

    def __init__(self, speculator: Speculator, shared: bool = False) -> None:
        self.prototype = speculator
        self.shared = shared
        self.chains = drafts_chains(speculator)
        self.one_chain = speculator.num_ssms == 0 or (
            self.chains and speculator.num_ssms == 1 and speculator.shape.samples == 1
        )
        self._spare: list[Speculator] = []  # copies of rows that left, for reuse
        self.speculators: list[Speculator] = []  # per row

    def _copy(self) -> Speculator:
        if self.shared and not self.speculators:
            return self.prototype
        if self._spare:
            return self._spare.pop()
        clone = share_modules_deepcopy(self.prototype)
        if self.chains:
            clone.length_controller = None  # the batch's controller sets the length
        return clone

    def add(self, rows: list[SequenceState]) -> None:
        for row in rows:
            speculator = self._copy()
            speculator.reset(row.seed)
            self.speculators.append(speculator)

    def retain(self, rows: list[SequenceState], keep: list[int]) -> None:
        kept = set(keep)
        self._spare += [s for i, s in enumerate(self.speculators) if i not in kept]
        self.speculators = [self.speculators[i] for i in keep]

    def propose(
        self, rows: list[SequenceState], depths: list[int], lengths: list[int | None]
    ) -> list[TokenTree]:
        trees = []
        for row, depth, length, speculator in zip(rows, depths, lengths, self.speculators, strict=True):
            if self.chains and speculator is not self.prototype:  # a copy, maybe last used by another row
                own = self.prototype.shape.length
                speculator.shape = replace(speculator.shape, length=own if length is None else length)
            stream = row.generator if row.rule is Rule.TARGET else None
            trees.append(speculator.propose(DraftRequest(row.tokens, depth, row.probs, row.hidden, stream)))
        return trees

    def wants_hidden(self) -> bool:
        return True

    def levels(self, row: int) -> int:
        return sum(drafter.levels for drafter in pool_drafters(self.speculators[row]))

    def observe(self, rows: list[SequenceState], accepted: list[list[int]], verify_seconds: float) -> None:
        for row, nodes, speculator in zip(rows, accepted, self.speculators, strict=True):
            speculator.observe(StepFeedback(row.tree, nodes, verify_seconds))

    def report(self, row: int) -> dict:
        return self.speculators[row].report()


def make_drafting(speculator: Speculator, batched: bool, calls: ModelCalls, rows: int) -> GroupDrafting:
    """`RoutedDrafting` for the routed scheduler (its batch rule decides for the group, section
    5.3); `BatchedChainDrafting` for the pool's fixed-length chains, one per SSM (when `batched`),
    else `PerSequenceDrafting` (sharing the decoder's speculator for a group of one row; also
    for several sampled chains per SSM, `ChainShape(samples=k)`, which its tree plans draft)."""
    if isinstance(speculator, RoutedScheduler):
        return RoutedDrafting(speculator, calls)
    fixed_chains = (
        type(speculator) is PoolSpeculator
        and isinstance(speculator.shape, ChainShape)
        and speculator.shape.samples == 1
    )
    if batched and fixed_chains and (rows > 1 or speculator.length_controller is None):
        return BatchedChainDrafting(speculator, calls)
    return PerSequenceDrafting(speculator, shared=rows == 1)


def share_modules_deepcopy(obj: object) -> object:
    """A deep copy of `obj` that shares every `nn.Module` it references (models are read-only
    while decoding, and copying them would copy their weights)."""
    memo: dict[int, object] = {}
    stack, seen = [obj], set()
    while stack:
        item = stack.pop()
        if id(item) in seen or isinstance(item, torch.Tensor):
            continue
        seen.add(id(item))
        if isinstance(item, nn.Module):
            memo[id(item)] = item
        elif isinstance(item, dict):
            stack += [*item.keys(), *item.values()]
        elif isinstance(item, list | tuple | set | frozenset):
            stack += list(item)
        elif hasattr(item, "__dict__") and not isinstance(item, _NOT_WALKED):
            stack += list(vars(item).values())
    return copy.deepcopy(obj, memo)
