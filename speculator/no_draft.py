"""Speculation off: a strategy that drafts nothing (`SpeculativeDecoder(llm, [], strategy="plain")`).

Every tree is the root alone, so each verification pass is one plain decoding step of the LLM:
greedy takes its argmax, sampling draws from p (the "target" rule on a tree without children,
ALGORITHMS.md section 2). It runs through the same decode loop, batches and serving engine as
the speculative strategies, which makes it the honest "speculation off" baseline for them: same
cache, same scheduling, no drafting.
"""

from __future__ import annotations

from specboost.speculator.speculation import DraftRequest, StepFeedback
from specboost.speculator.tree import DraftKind, TokenTree


class NoDraftSpeculator:
    num_ssms = 0
    wants_hidden = False

    def tree_kind(self, do_sample: bool, seeded: bool = False) -> DraftKind:
        return DraftKind.GREEDY  # no children: every lossless rule reduces to plain decoding

    def reset(self, seed: int | None) -> None:
        """No state."""

    def propose(self, request: DraftRequest) -> TokenTree:
        return TokenTree.root_only(request.verified[-1])

    def observe(self, feedback: StepFeedback) -> None:
        """Nothing to learn."""

    def report(self) -> dict:
        return {"strategy": "plain"}
