"""Speculation on or off, chosen by measured throughput (ALGORITHMS.md section 5.4).

The routed rule (section 5.3) scores each step from the profile's costs and the predictor's
estimates, both corrected online, and each of its choices can look right while the mix loses to
plain decoding: what a step costs also depends on the steps before it. On a CPU a pass pays for
bringing its model's weights back into the caches after another model's passes (the tiny
fixture's LLM: a one-token pass 0.5 ms after plain steps, 1.0-1.4 ms right after drafting steps),
so a rule that moves between plain steps and drafting, or between SSMs, pays for every move, and
the profile's steady-state costs do not show it. The gate measures what the rule cannot model. It
runs the routed scheduler ("on") or plain decoding with nothing decided or drafted ("off") for
windows of `WINDOW` steps (fewer in batches, whose steps carry more tokens), keeps each regime's
sums of tokens and wall seconds over its windows, all decayed by MOMENTUM per window of either (a
regime's rate stays what it last measured, and a trial after a long wait is judged by what it
measures now), and runs the regime with the higher measured rate. The other regime is tried again
for one window after `wait` windows; `wait` doubles each time that trial loses (FIRST_WAIT,
2 FIRST_WAIT, ... MAX_WAIT windows) and halves when it wins: where speculation never pays, the
trials cost a few percent and then less, and a trial that wins on one window's lucky text (the
router's rate follows the text, plain decoding's hardly) does not bring back frequent trials.
A regime's rate stays what it last measured until it runs again, so one step timed while the
decoder set itself up (a compile, a cache's warm-up at a capacity it had not met, a growth: about
0.2 s against 2 ms steps at batch 8) would hold the gate in the other regime for up to MAX_WAIT
windows: such steps (`setup_count`) are not measured.
One gate per batch-size bucket: what pays at batch 1 says nothing about batch 8.
"""

from __future__ import annotations

from dataclasses import dataclass

WINDOW = 16  # steps per measured window at batch 1; WINDOW // rows at larger batches (at least MIN_WINDOW)
MIN_WINDOW = 4
MOMENTUM = 0.5  # per window (of either regime), of the older windows' evidence
FIRST_WAIT = 2  # windows of the better regime before the other is tried again
MAX_WAIT = 32  # the longest wait, in windows


@dataclass
class Throughput:
    """Decayed sums of one regime's tokens and seconds over its windows."""

    tokens: float = 0.0
    seconds: float = 0.0

    @property
    def rate(self) -> float | None:
        """Tokens per second; None before the regime's first window."""
        return self.tokens / self.seconds if self.seconds > 0 else None

    def add(self, tokens: float, seconds: float) -> None:
        self.tokens += tokens
        self.seconds += seconds

    def decay(self) -> None:
        """One window passed (of either regime): older evidence weighs less against the next."""
        self.tokens *= MOMENTUM
        self.seconds *= MOMENTUM


class SpeculationGate:
    """Whether the routed scheduler decides the next step (`on`) or the step is plain; `step`
    records each step's tokens and seconds. Starts on, then measures off in its second window."""

    def __init__(self, rows: int = 1) -> None:
        self.window = max(MIN_WINDOW, WINDOW // rows)  # steps per window: a batch's steps weigh more
        self.on = True
        self.measured = {True: Throughput(), False: Throughput()}
        self.wait = FIRST_WAIT  # windows of the better regime before the other's next trial
        self.since = 0  # windows of the current regime since it was chosen
        self.trial = False  # the current window tries the regime that lost last
        self.steps = {True: 0, False: 0}  # steps taken in each regime
        self._window = [0, 0.0, 0]  # tokens, seconds, steps of the window in progress

    def step(self, tokens: int, seconds: float) -> None:
        """One step of the current regime emitted `tokens` (all rows) in `seconds` of wall time."""
        self.steps[self.on] += 1
        window = self._window
        window[0] += tokens
        window[1] += seconds
        window[2] += 1
        if window[2] < self.window:
            return
        for throughput in self.measured.values():
            throughput.decay()
        self.measured[self.on].add(window[0], window[1])
        self._window = [0, 0.0, 0]
        self._choose()

    def _choose(self) -> None:
        """After a window: keep the better regime, try the other after `wait` windows."""
        rates = {regime: throughput.rate for regime, throughput in self.measured.items()}
        other = not self.on
        if rates[other] is None:  # never measured: measure it now
            self.on, self.trial, self.since = other, True, 0
            return
        best = self.on if rates[self.on] >= rates[other] else other
        if self.trial:  # the window tried the regime that had lost: keep it if it won now
            self.wait = max(FIRST_WAIT, self.wait // 2) if best == self.on else min(2 * self.wait, MAX_WAIT)
            self.trial, self.on, self.since = False, best, 0
            return
        if best != self.on:  # measured evidence turned: follow it
            self.on, self.since = best, 0
            return
        self.since += 1
        if self.since >= self.wait:
            self.on, self.trial, self.since = other, True, 0

    def report(self) -> dict:
        rates = {regime: throughput.rate for regime, throughput in self.measured.items()}
        return {
            "steps_on": self.steps[True],
            "steps_off": self.steps[False],
            "tokens_per_second_on": rates[True],
            "tokens_per_second_off": rates[False],
        }
