"""Shadow checks (ALGORITHMS.md 5.4, "Shadow checks"): what the held chain would bring now, read
off the text plain decoding produced while the speculation gate was off.

A gate that is off knows plain decoding's rate now and the router's as it was when it last ran,
on other text: the quick suite's batch-8 calls, one category each, ran speculation at 0.84-1.14x
our plain loop by category, and a prompt's opening did not tell them apart. A trial of the router
measures the text at hand, but costs a window and a half of the slower regime when it loses. A
shadow check asks the same question for the price of the pass that catches the preferred SSM up
on that text, which a trial would pay first anyway: that pass's logits at every position give the
SSM's argmax after each token, teacher-forced, and so the greedy chains it would have drafted and
how many of their tokens the LLM's own output matched.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class Walk:
    """Greedy chains walked in hindsight along text: tokens accepted, chains a mismatch cut, steps."""

    accepted: int = 0
    stops: int = 0
    steps: int = 0

    @property
    def rate(self) -> float | None:
        """The probability that a drafted token is accepted once the ones before it were, as
        `PreferredAction.rate` measures it on drafted chains; None where nothing was walked."""
        return self.accepted / (self.accepted + self.stops) if self.accepted + self.stops else None


def walk(agreements: Sequence[Sequence[bool]], length: int) -> Walk:
    """Chain decoding with chains of `length` along each row's text, where `agreements[b][j]` says
    whether the SSM's argmax after the row's j-th token is the next one: a step's chain accepts
    the run of agreements from its position (at most `length`; a mismatch cuts it), then the LLM's
    own token; the next step starts after it. A chain the text's end cuts is not a stop."""
    total = Walk()
    for agrees in agreements:
        j = 0
        while j < len(agrees):
            run = 0
            while run < length and j + run < len(agrees) and agrees[j + run]:
                run += 1
            total.accepted += run
            total.stops += run < length and j + run < len(agrees)
            total.steps += 1
            j += run + 1
    return total
