"""Greedy chains walked in hindsight along a text: an SSM's teacher-forced argmax agreements with
the text, their runs, and the steps chain decoding would take along it. Shared by the oracle
(`oracle_router.agreement_runs`), the suite's pool diversity (decoder/bench/diversity.py) and the
speculation gate's shadow checks (ALGORITHMS.md 5.4, "Shadow checks").

A gate that is off knows plain decoding's rate now and the router's as it was when it last ran,
on other text: the quick suite's batch-8 calls, one category each, ran speculation at 0.84-1.14x
our plain loop by category, and a prompt's opening did not tell them apart. A trial of the router
measures the text at hand, but costs a window and a half of the slower regime when it loses. A
shadow check asks the same question for the price of the pass that catches the preferred SSM up
on that text, which a trial would pay first anyway: that pass's logits at every position give the
SSM's argmax after each token, and so the greedy chains it would have drafted and how many of
their tokens the LLM's own output matched.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


def run_lengths(agrees: Sequence[bool]) -> np.ndarray:
    """[n]: per position p of `agrees` [n] (whether the SSM's argmax after the text's token p is
    token p + 1), the agreements in a row from p on: the match of an uncapped argmax chain drafted
    there, cut by a mismatch or the text's end."""
    runs = np.zeros(len(agrees) + 1, dtype=np.int64)
    for p in range(len(agrees) - 1, -1, -1):
        runs[p] = runs[p + 1] + 1 if agrees[p] else 0
    return runs[:-1]


def walk_positions(matches: Sequence[int]) -> list[int]:
    """Where the steps of chain decoding along one text start, a step at position j accepting
    matches[j] drafted tokens and then the LLM's own: it moves 1 + matches[j] on."""
    positions, position = [], 0
    while position < len(matches):
        positions.append(position)
        position += 1 + int(matches[position])
    return positions


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
    """Chain decoding with chains of `length` along each row's text, `agreements[b]` its
    `run_lengths` flags: each step accepts the run from its position, at most `length`, then the
    LLM's own token. A chain the text's end cuts is not a stop."""
    total = Walk()
    for agrees in agreements:
        runs = run_lengths(agrees)
        positions = walk_positions(np.minimum(runs, length))
        total.steps += len(positions)
        for p in positions:
            run = int(runs[p])
            total.accepted += min(run, length)
            total.stops += run < length and p + run < len(agrees)
    return total
