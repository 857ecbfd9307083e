"""Speculation on or off, chosen by measured throughput (ALGORITHMS.md section 5.4).

The routed rule (section 5.3) scores each step from the profile's costs and the predictor's
estimates, both corrected online, and each of its choices can look right while the mix loses to
plain decoding: what a step costs also depends on the steps before it. On a CPU a pass pays for
bringing its model's weights back into the caches after another model's passes (the tiny fixture's
LLM: a one-token pass 0.5 ms after plain steps, 1.0-1.4 ms right after drafting steps), so a rule
that moves between plain steps and drafting, or between SSMs, pays for every move, and the
profile's steady-state costs do not show it. The gate measures what the rule cannot model. It runs
the routed scheduler ("on") or plain decoding with nothing decided or drafted ("off") for windows
of `WINDOW_TOKENS` tokens per row (fewer in batches, whose steps take longer), keeps each regime's
sums of tokens and wall seconds over its windows, decayed by MOMENTUM per window of its own and by
IDLE_DECAY per window of the other (a regime's rate follows its last few windows, not its last one;
a trial after a long wait is still judged by what it measures now), and runs the regime with the
higher measured rate. Every switch is a trial: when the running regime's rate falls below the
other's, the other runs one window and keeps the lead only if it measures better then. Before,
every window decayed both regimes by 0.5 and the window in which the running regime fell behind was
charged as a lost trial: on t08-r29 (tiny fixture, T = 0.8) one slow window of the router (190
tokens/s against 280-400 in its others, plain decoding's last rate 219) turned it off for 3.3 s,
most of the table, where it ran 1.4x plain decoding. Exploring is paid for in time, not in windows:
a trial that lost cost what the better regime would have saved on its tokens, and the other regime
is tried again only after the better one has run for that loss / EXPLORE_SHARE seconds (at least
MIN_WAIT windows, at most MAX_WAIT), so exploring costs at most about EXPLORE_SHARE of the time
whatever a trial costs. The share shrinks as trials keep losing, EXPLORE_SHARE / n after the n-th
lost in a row (n at most MAX_STREAK), as a bandit explores less the more evidence it holds: where
speculation never pays, the trials had cost a steady 1.5% of `learned+compiled`'s time on the quick
fixture's greedy batch-1 prompts, 0.7-1.0% with the shrinking share. Trials after a count of
windows (2, 4, ... 32, doubling while they lost) had left `learned+compiled` at 0.89x our plain
loop on the quick suite's greedy batch-1 table (quick-r8): a trial of the router after a stretch of
plain steps first catches an SSM up on the stretch, eagerly, and its steps averaged 2.9-4.8 ms
against an off step's 0.6 ms.
A regime's rate stays what it last measured until it runs again, so one step timed while the
decoder set itself up (a compile, a cache's warm-up at a capacity it had not met, a growth: about
0.2 s against 2 ms steps at batch 8) would hold the gate in the wrong regime and charge its
window as a loss: such steps (`setup_count`) are not measured. Every other step is, from the end
of the step before it (the loop's own work included) to its verdicts, and a window closes after
WINDOW_TOKENS tokens per row, not after a count of steps, so that the regimes are measured alike:
each window holds about as many calls' starts (cold caches after whatever ran before the call,
the SSM catching up on the prompt) and ends (chains cut short by the tokens left) per token,
whichever regime ran it. Windows of 16 steps, with a call's first 4 steps left out (they reload
the caches), had judged the router by its calls' ends: on the quick fixture's greedy 48-token calls
the router took about 5 steps a call, and the gate measured 13 of its 59 steps, at 2.7 tokens a
step and 713 tokens/s, while its calls ran 1108 tokens/s at 9.8 tokens a step (our plain loop:
838); its plain windows, timed without the loop's own work, read 1300 tokens/s. On quick-r30 the
gate so kept the router off on 90% of the greedy batch-1 steps (0.95x the fastest fixed row).
After a switch the first window / SETTLE_SHARE tokens per row are not measured: each regime's
first steps after the other's pay for the switch (the router's SSMs catch up on the plain stretch,
and each model's weights come back into the CPU's caches: on the quick fixture the router's first
window after plain ones ran 8-13% below its next three), so a trial judged on its first window
judged the switch, not the regime, and lost where the two were near; what those steps cost still
counts in a lost trial's loss.
A trial ends once it has lost: when its window has taken LOST_AFTER times what the better regime
takes for a whole window (`_lost_already`), so that a trial's window costs about a window and a
half of the better regime at most, whatever it meets (its settling aside). And what is owed
prices exploring where nothing changes; a workload does change (texts the SSMs serve badly, then
texts they serve well): each call tells the gate the router's predicted advantage on its prompt
(`call_started`), and, off, a call CONTEXT_MARGIN times more promising than the one where the
router last lost is a trial at once.
Off, a greedy gate also checks the router in shadow (`shadowed`, speculator/hindsight_walk.py), on
a clock of its own (CHECK_SHARE of plain decoding's time, shrinking while checks fail in a row):
the SSM a hold drafts is caught up on the text decoded meanwhile, and its greedy chains walked
along it say how many tokens a held chain would bring now against where the router was measured;
a check that reads the router CHECK_MARGIN times faster than plain decoding starts a trial at once.
A trial measures the text at hand but costs a window and a half when it loses; the opening's
context did not tell the quick suite's categories apart; the walk reads the text itself.
A batch is judged whole: its rows drift apart while the router runs, and a static batch's call
lasts until its slowest row is done, so the rows left behind finish on the gate of the batch as it
was admitted, closing no window (`step`'s `tail`), and a step counts the mean of its tokens per
admitted row and of the slowest row's gain, so that a step that leaves rows behind pays for half
of it at once (`RoutedDrafting.observe`): read per running row, with the tail a smaller bucket's,
the router had looked faster than plain decoding on three of the quick suite's four categories at
batch 8, where it was slower on all.
One gate per batch-size bucket: what pays at batch 1 says nothing about batch 8; a new bucket's
gate starts where the nearest one stands (`RoutedScheduler.gate`). And one per learning regime
(greedy, sampled, seeded: `RoutedScheduler.router_for`): what pays for one says nothing of another.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

WINDOW_TOKENS = 32  # tokens per row in a measured window at batch 1; WINDOW_TOKENS // rows in batches
MIN_WINDOW_TOKENS = 8
SETTLE_SHARE = 4  # after a switch, window / SETTLE_SHARE tokens per row settle before a window is measured
MOMENTUM = 0.75  # per window of a regime, of its older windows' evidence
IDLE_DECAY = 0.9  # per window of the other regime, of an idle regime's evidence
EXPLORE_SHARE = 0.02  # what the windows run in the losing regime may cost, as a share of the winner's time
CHECK_SHARE = 0.02  # what shadow checks may cost, as a share of plain decoding's time while off
CHECK_MARGIN = 1.1  # a check passes where it reads the router this many times plain decoding's rate
MAX_STREAK = 8  # after the n-th trial lost in a row exploring may cost EXPLORE_SHARE / min(n, MAX_STREAK)
MIN_WAIT = 2  # windows of the better regime before the other is tried again, however cheap its trials
MAX_WAIT = 512  # windows of the better regime after which the other is tried whatever its last trial cost
LOST_AFTER = 1.5  # a trial ends once its window took this many times the better regime's for a window
CONTEXT_MARGIN = 1.25  # a call this many times more promising than where the router lost is tried at once


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

    def decay(self, factor: float) -> None:
        """One window passed: older evidence weighs less against the next."""
        self.tokens *= factor
        self.seconds *= factor


class SpeculationGate:
    """Whether the routed scheduler decides the next step (`on`) or the step is plain; `step`
    records each step's tokens and seconds. Starts on; measures off in its second window, or where
    `price_off` says what a plain step costs (seconds, per row a token), once the first trial of
    off, priced from it, is paid for like a lost one. A `pinned` gate stays in that regime and
    only measures it (the hold at batch 1: `RoutedScheduler.hold`)."""

    def __init__(
        self,
        rows: int = 1,
        like: SpeculationGate | None = None,
        price_off: Callable[[], float] | None = None,
        pinned: bool | None = None,
        shadows: bool = False,
    ) -> None:
        self.window = max(MIN_WINDOW_TOKENS, WINDOW_TOKENS // rows)  # a batch's steps take longer
        self.settle = self.window // SETTLE_SHARE  # tokens per row after a switch, not measured
        self.price_off = price_off  # read once, after the first window, if that was on's
        self.pinned = pinned
        self.on = True if like is None else like.on  # another batch size's gate: start in its regime
        if pinned is not None:
            self.on = pinned
        self.measured = {True: Throughput(), False: Throughput()}
        self.owed = 0.0 if like is None else like.owed  # seconds of the better regime before a trial
        self.streak = 0 if like is None else like.streak  # trials lost in a row
        self.since = 0  # windows of the current regime since it was chosen
        self.trial = False  # the current window tries the regime that lost last
        self.steps = {True: 0, False: 0}  # steps taken in each regime
        self.lost = 0.0  # seconds the trials that lost cost, summed
        self.trials = {True: 0, False: 0}  # trials of each regime started, and those it won
        self.won = {True: 0, False: 0}
        self._window = [0.0, 0.0]  # tokens, seconds of the window in progress
        self._switch = [0.0, 0.0]  # tokens, seconds of the settling since the last switch
        self._settling = 0.0  # tokens per row still to settle
        self.windows = 0  # windows measured
        # The router's advantage (`ChainPlan.advantage`) at the newest call's start, and at the one
        # where it last lost to plain decoding (None: it has not): `call_started`.
        self.context = 1.0 if like is None else like.context
        self.lost_context = None if like is None else like.lost_context
        self.context_trials = 0
        self._on_context = self.context  # the highest context met since the router last ran
        # Off, checks of the router along the text decoded meanwhile (`shadowed`), on a clock of
        # their own: the check asked for, the seconds of plain decoding before the next, the checks
        # run and passed.
        self.shadows = shadows
        self.shadow_due = False
        self.check_owed = 0.0 if like is None else like.check_owed
        self.checks = 0
        self.checks_passed = 0
        self.checks_failed = 0  # in a row

    def step(self, tokens: float, seconds: float, tail: bool = False) -> None:
        """One step of the current regime emitted `tokens` per row in `seconds` of wall time, as
        `RoutedDrafting.observe` counts them for the batch as it was admitted. A `tail` step runs the rows
        left after others finished: it adds to the window, which does not close in it, so that a
        tail's time is the regime's that ran up to it (ALGORITHMS.md 5.4, "A batch is judged
        whole"). The steps of the first `settle` tokens after a switch are the switch's, not the
        regime's: the router's first steps after plain ones catch its SSMs up and find their
        weights out of the CPU's caches, as plain steps after drafting find the LLM's; they count
        in what a lost trial cost, not in the regime's rate."""
        self.steps[self.on] += 1
        if self._settling > 0:
            self._settling -= tokens
            self._switch[0] += tokens
            self._switch[1] += seconds
            return
        window = self._window
        window[0] += tokens
        window[1] += seconds
        if tail or (window[0] < self.window and not self._lost_already()):
            return
        for regime, throughput in self.measured.items():
            throughput.decay(MOMENTUM if regime == self.on else IDLE_DECAY)
        self.measured[self.on].add(*window)
        self._window = [0.0, 0.0]
        self.windows += 1
        switch, self._switch = self._switch, [0.0, 0.0]
        running = self.on
        self._choose(window[0] + switch[0], window[1] + switch[1])
        if self.on != running:
            self._settling = self.settle
            if self.on:
                self._on_context = self.context

    def call_started(self, advantage: float) -> None:
        """New rows start (a call, or rows joining a batch): `advantage` is the router's rule's score
        of their first step over a plain step's (`ChainRouter.opening`), from the hidden states
        of their prompts, which every regime computes. Off (not on trial: then the router is the
        better regime, and runs after the trial), where the router last lost at a context of
        advantage A, a call of advantage CONTEXT_MARGIN x A or more is a trial of the router now,
        whatever is owed: what is owed prices exploring where nothing changes, and a workload that
        moves from texts the SSMs serve badly to texts they serve well is such a change. A context
        trial that loses is owed for like any other, and the highest context it met (a trial may
        span calls) is the new A, so that the next one needs a still more promising call."""
        self.context = advantage
        if self.on:
            self._on_context = max(self._on_context, advantage)
            return
        promising = self.lost_context is not None and advantage >= CONTEXT_MARGIN * self.lost_context
        if self.trial or not promising:
            return
        self._try_now()
        self.context_trials += 1

    def shadowed(self, factor: float | None, seconds: float) -> None:
        """The shadow check `shadow_due` asked for ran in `seconds`: along the text decoded since the
        router last ran, the SSM a held chain drafts would now bring `factor` x the tokens per step
        it brought where the router's rate was measured (None: nothing to check on). Where `factor`
        x that rate beats plain decoding's, a trial of the router starts now, judged and owed for
        like any other; otherwise the next check waits for `seconds` / CHECK_SHARE of plain
        decoding (ALGORITHMS.md 5.4, "Shadow checks")."""
        self.shadow_due = False
        if factor is None:
            self.check_owed = seconds / CHECK_SHARE
            return
        self.checks += 1
        rates = {regime: throughput.rate for regime, throughput in self.measured.items()}
        if factor * rates[True] >= CHECK_MARGIN * rates[False]:
            self.checks_passed += 1
            self.checks_failed = 0
            self._try_now()
            return
        self.checks_failed += 1
        self.check_owed = seconds * min(self.checks_failed, MAX_STREAK) / CHECK_SHARE

    def _lost_already(self) -> bool:
        """Whether the trial running has taken longer in its window than LOST_AFTER times what the
        regime it must beat takes for a whole window: then it ends now, judged on what it
        measured. The margin leaves room for the steps a window still had to come, which at batch
        sizes where a window is a few steps may each bring many tokens. Its settling (W / 4 tokens
        per row) is not cut. A trial that met a call its regime serves badly had run its whole
        window: on quick-r39 (greedy, batch 1) a held chain of 16 on an instructions prompt took
        0.65 s for the 48 tokens plain decoding took 0.18 s for, and the 0.47 s it lost owed 23 s
        of plain decoding, the rest of the table."""
        if not self.trial:  # most steps: nothing more to compute
            return False
        other = self.measured[not self.on].rate
        return other is not None and self._window[1] > LOST_AFTER * self.window / other

    def _choose(self, tokens: float, seconds: float) -> None:
        """After a window (with the settling before it, if the regime was just switched to) of
        `tokens` in `seconds`: run the better regime. A switch is a trial of the other regime; a
        trial that lost cost what the better regime would have saved on its tokens, and that cost,
        over the exploring share, is owed in seconds of the better regime before the other's next
        trial. The share is EXPLORE_SHARE over the trials lost in a row (at most MAX_STREAK of
        them). A pinned gate never switches."""
        if self.pinned is not None:
            return
        rates = {regime: throughput.rate for regime, throughput in self.measured.items()}
        other = not self.on
        if rates[other] is None and self.on and self.price_off is not None and rates[True]:
            self.owed = max(self.owed, self._first_trial_owed(rates[True]))
        if rates[other] is not None:
            best = self.on if rates[self.on] >= rates[other] else other
            if best != self.on and self.trial:  # a trial lost: back, owing what it cost
                loss = max(0.0, seconds - tokens / rates[best])
                self.streak += 1
                self.lost += loss
                self.owed += loss * min(self.streak, MAX_STREAK) / EXPLORE_SHARE
                self._lost_at(best)
                self.on, self.trial, self.since = best, False, 0
                return
            if best != self.on:  # the evidence turned: a trial of the other, judged on what it measures now
                self._lost_at(best)
                self._try(best)
                return
            if self.trial:  # the trial won: its regime takes over, owing nothing to the one it beat
                self._lost_at(best)
                self.won[best] += 1
                self.trial, self.since, self.streak, self.owed = False, 0, 0, 0.0
                return
        self.owed = max(0.0, self.owed - seconds)
        self.since += 1
        waited = self.since >= MIN_WAIT or rates[other] is None  # never measured: once nothing is owed
        if (self.owed == 0.0 and waited) or self.since >= MAX_WAIT:
            self._try(other)
            self.owed = 0.0
        elif not self.on and self.shadows and rates[True] is not None:
            self.check_owed = max(0.0, self.check_owed - seconds)
            self.shadow_due = self.check_owed == 0.0

    def _try(self, regime: bool) -> None:
        """A trial of `regime` starts."""
        self.on, self.trial, self.since = regime, True, 0
        self.trials[regime] += 1

    def _try_now(self) -> None:
        """A trial of the router starts between windows' ends (a call's context, a shadow check
        that passed): off's window so far is off's evidence, and the switch settles first."""
        self.measured[False].add(*self._window)
        self._window, self._switch = [0.0, 0.0], [0.0, 0.0]
        self.shadow_due = False
        self.on, self.trial, self.since = True, True, 0
        self.trials[True] += 1
        self._settling = self.settle
        self._on_context = self.context

    def _lost_at(self, best: bool) -> None:
        """Plain decoding measured better than the router (`best` False): remember the highest
        context the router met since it last ran, where it lost."""
        if not best:
            self.lost_context = self._on_context

    def _first_trial_owed(self, rate_on: float) -> float:
        """Seconds of the router owed before off's first window: that window's tokens at the
        priced plain step against the router's measured rate, over EXPLORE_SHARE, as a lost
        trial's (nothing where off is priced as fast). Read once: later trials are measured."""
        price, self.price_off = self.price_off(), None
        return max(0.0, self.window * (price - 1 / rate_on)) / EXPLORE_SHARE

    def report(self) -> dict:
        """Steps in each regime, each regime's measured rate (tokens per row per second: at batch 1
        tokens per second), the trials of each regime and those it won, the seconds the trials that
        lost cost, the trials a call's context started, the shadow checks run and passed, the
        newest call's context and the one where the router last lost, the regime now, and the
        seconds of it still owed before the next trial and the trials lost in a row that set them
        (what keeps a regime that lost off: 5.4)."""
        rates = {regime: throughput.rate for regime, throughput in self.measured.items()}
        return {
            "steps_on": self.steps[True],
            "steps_off": self.steps[False],
            "tokens_per_second_on": rates[True],
            "tokens_per_second_off": rates[False],
            "trials_on": self.trials[True],
            "trials_on_won": self.won[True],
            "trials_off": self.trials[False],
            "trials_off_won": self.won[False],
            "seconds_lost": self.lost,
            "context_trials": self.context_trials,
            "shadow_checks": self.checks,
            "shadow_checks_passed": self.checks_passed,
            "context": self.context,
            "lost_context": self.lost_context,
            "on": self.on,
            "seconds_owed": self.owed,
            "lost_in_a_row": self.streak,
        }
