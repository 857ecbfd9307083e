"""Who drafts for the sequences of a batch (ALGORITHMS.md sections 3, 7 and 11).

Every sequence keeps its own SSM caches. Two ways to draft for a batch (a `SequenceGroup`):

- `BatchedChainDrafting`: for the SpecInfer pool drafting chains (`PoolSpeculator` with
  `ChainShape`), each SSM drafts every sequence's chain at once over a ragged cache
  (`BatchedChainDrafter`): one SSM pass per chain position for the whole batch. The chains of
  one sequence are merged into its tree exactly as `PoolSpeculator` merges them.
- `PerSequenceDrafting`: any other strategy (beam or topology trees, weighted majority, Sequoia,
  the learned scheduler): every sequence gets its own copy of the decoder's speculator, sharing
  the models, and drafts alone.

Chain strategies draft one length per step for the whole batch, chosen by the batch's length
controller (BASS Algorithm 1 by default; section 7).
"""

from __future__ import annotations

import copy
import types
from collections.abc import Mapping
from typing import Protocol

import torch
from torch import nn

from specboost.decoder.compilation import ModelCalls
from specboost.decoder.sequence import SequenceState
from specboost.decoder.verify import Rule
from specboost.speculator.batched_drafter import BatchedChainDrafter
from specboost.speculator.length_control import LengthController, make_length_controller
from specboost.speculator.shapes import ChainShape
from specboost.speculator.speculation import DraftRequest, PoolSpeculator, Speculator, StepFeedback
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
        self, rows: list[SequenceState], depths: list[int], length: int | None
    ) -> list[TokenTree] | ChainDraft:
        """One tree per row, at most `depths[b]` deep (or one SSM's greedy chains, still on the
        device); `length` is the batch's chain length (None: the strategy's own shape)."""

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


def ssm_generator(seed: int | None, index: int, device: torch.device) -> torch.Generator | None:
    """SSM `index`'s random stream for a sequence seeded `seed`, apart from the LLM's (as in
    `PoolSpeculator.reset`)."""
    return None if seed is None else torch.Generator(device).manual_seed(seed + 7919 * (index + 1))


class BatchedChainDrafting:
    """The pool's chains, drafted for every row at once by each SSM (see the module doc)."""

    def __init__(self, speculator: PoolSpeculator, calls: ModelCalls) -> None:
        self.shape = speculator.shape
        self.drafters = [
            BatchedChainDrafter(d.model, d.index, calls.get(d.model)) for d in speculator.drafters
        ]
        self.generators: list[list[torch.Generator | None]] = [[] for _ in self.drafters]

    def add(self, rows: list[SequenceState]) -> None:
        for drafter, generators in zip(self.drafters, self.generators, strict=True):
            drafter.add_rows(len(rows))
            generators += [ssm_generator(row.seed, drafter.index, drafter.model.device) for row in rows]

    def retain(self, rows: list[SequenceState], keep: list[int]) -> None:
        for i, drafter in enumerate(self.drafters):
            drafter.select(keep)
            self.generators[i] = [self.generators[i][r] for r in keep]

    def propose(
        self, rows: list[SequenceState], depths: list[int], length: int | None
    ) -> list[TokenTree] | ChainDraft:
        length = self.shape.length if length is None else length
        lengths = [min(length, depth) for depth in depths]
        if len(self.drafters) == 1 and all(
            row.rule is Rule.GREEDY and not row.probs.processors for row in rows
        ):
            # One SSM's greedy chains stay on the device until the verifier reads them back.
            drafter = self.drafters[0]
            tokens, lengths = drafter.draft_greedy([row.tokens for row in rows], lengths)
            return ChainDraft([row.tokens[-1] for row in rows], tokens, lengths, drafter.index)
        trees = [
            TokenTree.root_only(row.tokens[-1], self.shape.kind(row.probs.config.do_sample)) for row in rows
        ]
        verified, probs = [row.tokens for row in rows], [row.probs for row in rows]
        for drafter, generators in zip(self.drafters, self.generators, strict=True):
            chains = drafter.draft(verified, lengths, probs, generators)
            for tree, chain in zip(trees, chains, strict=True):  # a trie insert = SpecInfer's merge
                tree.add_sequence([t for t, _ in chain], drafter.index, [q for _, q in chain])
        return trees

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

    def propose(self, rows: list[SequenceState], depths: list[int], length: int | None) -> list[TokenTree]:
        trees = []
        for row, depth, speculator in zip(rows, depths, self.speculators, strict=True):
            if length is not None:
                speculator.shape = ChainShape(length)
            trees.append(speculator.propose(DraftRequest(row.tokens, depth, row.probs, row.hidden)))
        return trees

    def observe(self, rows: list[SequenceState], accepted: list[list[int]], verify_seconds: float) -> None:
        for row, nodes, speculator in zip(rows, accepted, self.speculators, strict=True):
            speculator.observe(StepFeedback(row.tree, nodes, verify_seconds))

    def report(self, row: int) -> dict:
        return self.speculators[row].report()


def make_drafting(speculator: Speculator, batched: bool, calls: ModelCalls, rows: int) -> GroupDrafting:
    """`BatchedChainDrafting` for the pool's fixed-length chains (when `batched`), else
    `PerSequenceDrafting` (sharing the decoder's speculator for a group of one row)."""
    fixed_chains = type(speculator) is PoolSpeculator and isinstance(speculator.shape, ChainShape)
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
