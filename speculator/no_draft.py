"""Speculation off: a strategy that drafts nothing (`SpeculativeDecoder(llm, [], strategy="plain")`).

Every tree is the root alone, so each verification pass is one plain decoding step of the LLM:
greedy takes its argmax, sampling draws from p (ALGORITHMS.md section 2: every lossless rule on a
tree without children). Unseeded rows draw under MSS (`sampling.draw`, 0.02 ms a draw), seeded ones
under the target rule (`torch.multinomial`, as `generate` draws, so that a seeded request
reproduces seeded plain decoding token for token): drawn by `torch.multinomial`, our plain loop's
sampled step had cost about 0.15 ms more than the routed decoder's plain step on the quick fixture
(620 against 678 tokens/s at T = 1.0, a throwaway side-by-side run of 1152 tokens each). It runs
through the same decode loop, batches and serving engine as the speculative strategies, which makes
it the honest "speculation off" baseline for them: same cache, same scheduling, no drafting.
"""

from __future__ import annotations

from specboost.speculator.speculation import DraftRequest, StepFeedback
from specboost.speculator.tree import DraftKind, TokenTree


class NoDraftSpeculator:
    num_ssms = 0
    wants_hidden = False

    def tree_kind(self, do_sample: bool, seeded: bool = False) -> DraftKind:
        """No children: every lossless rule reduces to plain decoding; the kind picks the draw."""
        return DraftKind.SAMPLED if do_sample and not seeded else DraftKind.GREEDY

    def reset(self, seed: int | None) -> None:
        """No state."""

    def propose(self, request: DraftRequest) -> TokenTree:
        return TokenTree.root_only(request.verified[-1])

    def observe(self, feedback: StepFeedback) -> None:
        """Nothing to learn."""

    def report(self) -> dict:
        return {"strategy": "plain"}
