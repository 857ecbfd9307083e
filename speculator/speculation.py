"""Speculation strategies: who drafts what in a step (ALGORITHMS.md sections 1 and 3).

A strategy proposes one token tree per step and hears back what the LLM accepted. The decoder
loop only talks to this interface, so new strategies (weighted majority, Sequoia trees, the
learned scheduler) plug in without touching the loop.
"""

from __future__ import annotations

from typing import Protocol

import torch
from transformers import PreTrainedModel

from specboost.speculator.drafter import SSMDrafter
from specboost.speculator.sampling import LogitsToProbs
from specboost.speculator.shapes import ChainShape, DraftShape
from specboost.speculator.tree import DraftKind, TokenTree, merge_trees


class Speculator(Protocol):
    num_ssms: int

    def tree_kind(self, do_sample: bool) -> DraftKind:
        """The kind of tree `propose` returns, so the decoder can pick a lossless rule up front."""

    def reset(self, seed: int | None) -> None:
        """Forget all per-sequence state (caches); called at the start of every `generate`."""

    def propose(self, verified: list[int], max_depth: int, probs: LogitsToProbs) -> TokenTree:
        """Draft a tree after `verified`, at most `max_depth` deep."""

    def observe(self, tree: TokenTree, accepted: list[int]) -> None:
        """Feedback: the accepted nodes of the last proposed tree."""


class PoolSpeculator:
    """Every SSM drafts the same shape; their trees are merged into one (SpecInfer)."""

    def __init__(self, ssms: list[PreTrainedModel], shape: DraftShape | None = None) -> None:
        if not ssms:
            raise ValueError("speculative decoding needs at least one SSM")
        self.drafters = [SSMDrafter(model, i) for i, model in enumerate(ssms)]
        self.shape = shape or ChainShape()
        self.num_ssms = len(ssms)
        self._generators: list[torch.Generator | None] = [None] * len(ssms)

    def tree_kind(self, do_sample: bool) -> DraftKind:
        return self.shape.kind(do_sample)

    def reset(self, seed: int | None) -> None:
        for drafter in self.drafters:
            drafter.reset()
        self._generators = [
            None if seed is None else torch.Generator(d.model.device).manual_seed(seed + 7919 * (d.index + 1))
            for d in self.drafters
        ]

    def propose(self, verified: list[int], max_depth: int, probs: LogitsToProbs) -> TokenTree:
        trees = [
            drafter.draft(verified, self.shape, probs, max_depth, gen)
            for drafter, gen in zip(self.drafters, self._generators, strict=True)
        ]
        return trees[0] if len(trees) == 1 else merge_trees(trees)

    def observe(self, tree: TokenTree, accepted: list[int]) -> None:
        """The pool strategy keeps no state across steps beyond the SSM caches."""
