"""Speculation strategies: who drafts what in a step (ALGORITHMS.md sections 1 and 3).

A strategy proposes one token tree per step and hears back what the LLM accepted. The decoder
loop only talks to this interface, so new strategies (weighted majority, Sequoia trees, the
learned scheduler) plug in without touching the loop.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

import torch
from transformers import PreTrainedModel

from specboost.speculator.drafter import PoolDrafter
from specboost.speculator.length_control import LengthController
from specboost.speculator.sampling import LogitsToProbs
from specboost.speculator.shapes import ChainShape, DraftShape
from specboost.speculator.tree import DraftKind, TokenTree, merge_trees


@dataclass
class DraftRequest:
    """What the decoder asks for in one step."""

    verified: list[int]  # prompt + every verified token; the last one is the tree's root
    max_depth: int  # deeper drafts are wasted: tokens still wanted, context left
    probs: LogitsToProbs  # logits -> the sampling distribution (q for the SSMs)
    # The LLM's last-layer hidden state [H] at the token before the root (the state that chose
    # the root; free, as the last verify pass computed it). Only for strategies with wants_hidden,
    # and None when no such state exists yet (a one-token prompt).
    hidden: torch.Tensor | None = None
    # The random stream the target rule will draw this step's tokens from, for a sequence verified
    # by it with a stream of its own (a seeded one): drafters may read ahead on a copy of it
    # (`batched_drafter.coupled_choice`), never advance it. None otherwise.
    generator: torch.Generator | None = None


@dataclass
class StepFeedback:
    """What the LLM made of the last proposed tree."""

    tree: TokenTree
    accepted: list[int]  # accepted node indices, root excluded, in path order
    verify_seconds: float  # wall time of the LLM verification pass


class Speculator(Protocol):
    num_ssms: int
    wants_hidden: bool  # whether `propose` needs `DraftRequest.hidden`

    def tree_kind(self, do_sample: bool, seeded: bool = False) -> DraftKind:
        """The kind of tree `propose` returns, so the decoder can pick a lossless rule up front.
        `seeded`: the sequence has a seed, so its text must follow from the seed alone (drafts whose
        randomness the seed does not fix, such as ones chosen by measured step times, must then be
        verified by a rule whose draws do not depend on the draft)."""

    def reset(self, seed: int | None) -> None:
        """Forget all per-sequence state (caches); called at the start of every `generate`."""

    def propose(self, request: DraftRequest) -> TokenTree:
        """Draft a tree after `request.verified`, at most `request.max_depth` deep."""

    def observe(self, feedback: StepFeedback) -> None:
        """Feedback on the last proposed tree."""

    def report(self) -> dict:
        """Strategy-specific statistics of the last `generate` (JSON-ready), for `DecodeStats.strategy`."""


def pool_drafters(speculator: object) -> list[PoolDrafter]:
    """The `PoolDrafter` a built-in speculator drafts with (none for a custom one)."""
    drafter = getattr(speculator, "drafter", None)
    return [drafter] if isinstance(drafter, PoolDrafter) else []


class PoolSpeculator:
    """Every SSM drafts the same shape; their trees are merged into one (SpecInfer).

    With a `length_controller` (ALGORITHMS.md section 7) the SSMs draft chains whose length the
    controller picks before every step from the LLM's feedback (t_LLM = `verify_seconds`); the
    length depends only on past steps, so every rule that is lossless for chains stays lossless.
    """

    def __init__(
        self,
        ssms: list[PreTrainedModel],
        shape: DraftShape | None = None,
        length_controller: LengthController | None = None,
    ) -> None:
        if not ssms:
            raise ValueError("speculative decoding needs at least one SSM")
        self.drafter = PoolDrafter(ssms)
        self.shape = shape or ChainShape()
        if length_controller is not None and not isinstance(self.shape, ChainShape):
            raise ValueError(f"a length controller sets chain lengths; use ChainShape, not {self.shape!r}")
        self.length_controller = length_controller
        self.num_ssms = len(ssms)
        self.wants_hidden = False
        self._generators: list[torch.Generator | None] = [None] * len(ssms)

    def tree_kind(self, do_sample: bool, seeded: bool = False) -> DraftKind:
        return self.shape.kind(do_sample)

    def reset(self, seed: int | None) -> None:
        self.drafter.reset()
        self._generators = ssm_generators(seed, self.drafter.models)
        if self.length_controller is not None:
            self.length_controller.reset()

    def step_shape(self) -> DraftShape:
        """What every SSM drafts in the next step."""
        if self.length_controller is None:
            return self.shape
        return replace(self.shape, length=self.length_controller.length())

    def draft_merged(self, request: DraftRequest, probs: LogitsToProbs) -> TokenTree:
        """Every SSM drafts `step_shape()` with `probs` (greedy or sampled); the trees merged."""
        shapes = [self.step_shape()] * self.num_ssms
        trees = self.drafter.draft(request.verified, shapes, probs, request.max_depth, self._generators)
        return trees[0] if len(trees) == 1 else merge_trees(trees)

    def propose(self, request: DraftRequest) -> TokenTree:
        return self.draft_merged(request, request.probs)

    def observe(self, feedback: StepFeedback) -> None:
        """Only a length controller learns from feedback; the SSM caches sync on the next draft."""
        if self.length_controller is not None:
            self.length_controller.update([len(feedback.accepted)], feedback.verify_seconds)

    def report(self) -> dict:
        report: dict = {"strategy": "pool", "shape": repr(self.shape)}
        if self.length_controller is not None:
            report["length_controller"] = self.length_controller.describe()
            report["lengths"] = self.length_controller.history[:-1]  # per step, like match_lengths
        return report


def ssm_generator(seed: int | None, index: int, device: torch.device) -> torch.Generator | None:
    """SSM `index`'s random stream for a sequence seeded `seed`, apart from the LLM's (which the
    decoder seeds with `seed` itself)."""
    return None if seed is None else torch.Generator(device).manual_seed(seed + 7919 * (index + 1))


def ssm_generators(seed: int | None, ssms: list[PreTrainedModel]) -> list[torch.Generator | None]:
    """Every SSM's stream (`ssm_generator`), SSM i of `ssms` being pool index i."""
    return [ssm_generator(seed, i, ssm.device) for i, ssm in enumerate(ssms)]
