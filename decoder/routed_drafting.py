"""The routed scheduler drafting for the rows of a batch (ALGORITHMS.md sections 5.3 and 11).

One `ChainRouter` decision per step for the whole group (spaced out while it declines or repeats
itself: `DecisionPacing`) (the rows' hidden states through the predictor in one call, then the
batch rule: the length, the SSMs that draft, K = 0 per row or for the whole batch), then each
chosen SSM drafts the chains of its rows in one `BatchedChainDrafter` pass per chain position.
Greedy rows' chains stay on the device until the verifier reads them back with its verdicts; a
group with sampled rows (or logits processors) gets host trees, verified by the rows' own rules:
chains sampled from the SSM for rows verified by MSS (or k-sequential selection), chains coupled to
the target rule's draws for seeded rows (`batched_drafter.coupled_choice`), argmax chains for the
rest.
"""

from __future__ import annotations

import functools
import time
from collections import Counter

from specboost.decoder.compilation import ModelCalls
from specboost.decoder.sequence import SequenceState
from specboost.decoder.verify import Rule
from specboost.speculator.chain_router import ChainPlan, DecisionPacing, PreferredAction, held_run
from specboost.speculator.hindsight_walk import walk
from specboost.speculator.kv_cache import setup_count
from specboost.speculator.routed_scheduler import (
    GREEDY,
    ActionRecord,
    RoutedChains,
    RoutedScheduler,
    learning_regime,
)
from specboost.speculator.speculation_gate import SpeculationGate
from specboost.speculator.tree import ChainDraft, DraftKind, TokenTree

SAMPLED_DRAFT_RULES = frozenset({Rule.MSS, Rule.K_SEQUENTIAL})  # rules that read the drafts' q


class RoutedDrafting:
    """`GroupDrafting` of the routed scheduler: per row an `ActionRecord`, per group the drafters;
    the speculation gate of the group's size says whether the group speculates, and its hold gate
    whether the router decides the step or its preferred action is held (5.4, "Holding")."""

    one_chain = True  # a row drafts one SSM's chain or nothing

    def __init__(self, scheduler: RoutedScheduler, calls: ModelCalls) -> None:
        self.scheduler = scheduler
        self.router = scheduler.router  # the step's: `RoutedScheduler.router_for`
        self.chains = RoutedChains(scheduler.models, calls.get)
        self.records: list[ActionRecord] = []
        self.regimes: list[str] = []  # each row's learning regime (`RoutedScheduler.router_for`)
        self.regime = GREEDY  # the group's: its rows' most common (set when the rows change)
        self.pacing = DecisionPacing()
        self._plan: ChainPlan | None = None
        self._gate: SpeculationGate | None = None  # the step's
        self._hold: SpeculationGate | None = None  # deciding or holding (5.4, "Holding"): the last used
        self._speculated = False  # the step was the router's or a hold's (the gate on), not plain decoding's
        self._holding = False  # the step drafted the preferred action, decided on nothing
        self._drafting = 0.0
        self._span: tuple[float, int] | None = None  # the gate's step began: when, at which `setup_count()`
        self._joining: list[SequenceState] = []  # rows joined since the last step: the gate's context (5.4)
        self._admitted = 0  # rows in the group after the latest rows joined: whose batch the gate judges
        self._progress: list[int] = []  # per row, the tokens it gained since it joined
        self._slowest = 0  # the least of them when the gate last counted a step

    def add(self, rows: list[SequenceState]) -> None:
        """Rows join the group. The gate's next step begins where its drafting does: reading the new
        rows' prompts is the same work whichever regime runs (5.4)."""
        self._span = None
        self._joining += rows
        self.chains.add(len(rows))
        self.records += [ActionRecord() for _ in rows]
        self._admitted = len(self.records)
        self._progress += [0] * len(rows)
        self._slowest = min(self._progress)
        joining = [learning_regime(row.probs.config.do_sample, row.seed is not None) for row in rows]
        self._regroup(self.regimes + joining)
        self.pacing.restart()  # decide for the new rows at once
        self.chains.expect_sampling([row.probs for row in rows if row.rule in SAMPLED_DRAFT_RULES])
        self._warm(rows)

    def retain(self, rows: list[SequenceState], keep: list[int]) -> None:
        self.chains.select(keep)
        self.pacing.select(keep)
        self.records = [self.records[i] for i in keep]
        self._progress = [self._progress[i] for i in keep]  # the slowest row gone: no gain of the rest
        self._slowest = min(self._progress, default=0)
        self._regroup([self.regimes[i] for i in keep])
        self._warm([rows[i] for i in keep])

    def _regroup(self, regimes: list[str]) -> None:
        """The rows' regimes, and the group's: its rows', or where they differ (a serving engine's
        group), the most common one's. Set when the rows change, not per step."""
        self.regimes = regimes
        if regimes:
            self.regime = Counter(regimes).most_common(1)[0][0]

    def _warm(self, rows: list[SequenceState]) -> None:
        """Size the drafters for the rows' final lengths (`RoutedChains.warm`)."""
        if rows:
            self.chains.warm(max(row.final_length for row in rows))

    def wants_hidden(self) -> bool:
        """Whether this step's verification must return the hidden states: only while the gate is on,
        and not for a held chain (5.4, "Holding") or the plain steps `DecisionPacing` spaces out:
        none of them reads a state. The first step after the gate turns on, or after a held step
        where the router decides, then has no state to route on, and is a plain step that decides
        nothing (`_switched_on`): computing the states at every window's end had cost 10% of an off
        stretch's time (a pass with another graph, and on the CPU its own frozen copy of the weights,
        once every 16 steps). Held chains' passes returned the states until 2026-12-06, to keep the
        graphs fewer (a chain's pass without them is another graph per chain length: on the tiny
        fixture 4 more of 6, warm-up 94 s against 79 s with a warm compile cache); the pass with them
        took 1.08 ms against 0.97-0.99 (the predictor's head is 5% of the tiny LLM's compute). The
        steps that draft a held decision of the router's pacing still return them: the router decides
        again after them. Rows that join a group while its decisions are spaced out (`add` restarts
        the pacing) route the next step with the states they read; the rows already there have none
        and draft nothing for that step."""
        paced_plain = self.pacing.wait and self.pacing.held is None
        return (self._gate is None or self._gate.on) and not paced_plain and not self._holding

    def propose(
        self, rows: list[SequenceState], depths: list[int], lengths: list[int | None]
    ) -> list[TokenTree] | ChainDraft:
        """The routed chains of every row; `lengths` (a batch length controller's) do not apply:
        the router chooses the length. A plain step for every row where the gate is off; the
        preferred action, decided on nothing, where the hold gate holds."""
        texts = [row.tokens for row in rows]
        start = time.perf_counter()
        if self._span is None:
            self._span = (start, setup_count())
        self.router = self.scheduler.router_for(self.regime)
        gate = self._gate = self.scheduler.gate(max(self._admitted, len(rows)), self.regime)
        greedy = all(row.rule is Rule.GREEDY for row in rows)  # argmax chains, processors or not
        self._holding = self._speculated = False
        if gate is not None and self._joining:
            self._context(gate, rows, depths, greedy)
        if gate is not None and gate.shadow_due:
            self._shadow(gate, rows, greedy)
        if gate is not None and not gate.on:  # nothing decided, drafted or timed: a plain step
            self._plan = None
            self.pacing.restart()  # the router decides at once when the gate turns it on
            for record in self.records:
                record.decided("off", 0.0)
            return self._plain_step(rows, greedy)
        self._speculated, self._hold = True, self.scheduler.hold(len(rows), self.regime)
        preferred = self.scheduler.preferred_action(self.regime)
        if self._hold is not None and not self._hold.on and preferred.action is not None:
            held = self._held(rows, depths, preferred, greedy)
            if held is not None:
                return held
        hidden = [row.hidden for row in rows]
        if gate is not None and all(state is None for state in hidden) and not self.pacing.wait:
            return self._switched_on(rows, greedy)
        behind = functools.partial(self.chains.behind, texts)
        plan = self._plan = self.router.plan(hidden, depths, self.pacing, texts, behind, not greedy)
        preferred.observe(plan)
        seconds = time.perf_counter() - start  # every row waited for the whole group's decision
        for b, record in enumerate(self.records):
            record.decided(plan.action(b), seconds)
        return self._draft(rows, plan, greedy)

    def _context(
        self, gate: SpeculationGate, rows: list[SequenceState], depths: list[int], greedy: bool
    ) -> None:
        """Rows joined: the router's plan on their prompts' hidden states alone (the LLM's pass
        over the prompts returns them in every regime; the rows already decoding have none while
        the gate is off) gives the gate its new context, its advantage (5.4, "A new context is
        tried"), which may start a trial of the router, and the hold its preferred action
        (`PreferredAction.seed`, 5.4 "Holding")."""
        joined = {id(row) for row in self._joining}
        self._joining = []
        new = [b for b, row in enumerate(rows) if id(row) in joined and row.hidden is not None]
        if new:
            hidden, texts = [rows[b].hidden for b in new], [rows[b].tokens for b in new]
            opening = self.router.opening(hidden, [depths[b] for b in new], texts, not greedy)
            gate.call_started(opening.advantage)
            self.scheduler.preferred_action(self.regime).seed(opening)

    def _shadow(self, gate: SpeculationGate, rows: list[SequenceState], greedy: bool) -> None:
        """The shadow check the gate, off, asked for (ALGORITHMS.md 5.4, "Shadow checks"): the SSM
        the hold drafts caught up on the rows' texts, its greedy chains of the preferred length walked
        along what the LLM decoded (not the prompts), and their measured acceptance rate against
        the one its drafted chains last measured (`PreferredAction.rate`) gives the factor by which
        the router's measured rate would change now. Sampled rows (their chains are not the
        argmax's), nothing held yet or nothing decoded: nothing checked (`SpeculationGate.shadowed`
        with None). A check that passes starts a trial and counts its walk as drafted steps, so
        that the hold's first length is priced on this text."""
        start = time.perf_counter()
        preferred = self.scheduler.preferred_action(self.regime)
        factor, walked = None, None
        if greedy and preferred.action is not None:
            ssm, depth_index = preferred.action
            then = preferred.rate(ssm)
            texts, starts = [row.tokens for row in rows], [row.prompt_length for row in rows]
            agreements = self.chains.drafters[ssm].agreement(texts, starts)
            length = int(self.router.depths[depth_index])
            walked = None if agreements is None else walk(agreements, length)
            now = None if walked is None else walked.rate
            if then is not None and now is not None:
                factor = (1 + held_run(now, length)) / (1 + held_run(then, length))
        gate.shadowed(factor, time.perf_counter() - start)
        if gate.on and factor is not None:
            preferred.walked(ssm, walked.accepted, walked.stops, walked.steps / len(rows))

    def _held(
        self, rows: list[SequenceState], depths: list[int], preferred: PreferredAction, greedy: bool
    ) -> list[TokenTree] | ChainDraft | None:
        """A step of the hold regime: the preferred SSM's chain drafted, at the length its measured
        acceptance pays for (`ChainRouter.held_depth`, timed as the step's decision), nothing else
        decided (5.4, "Holding"); None where, at that acceptance, a plain step pays more than any
        length: the router decides the step (after a plain step that returns the state, where the
        step before was held: held passes return none, `wants_hidden`), and its steps correct what
        the hold drafts next (the preference, the SSMs' acceptance). The pacing restarts, so that
        the router decides at once when it runs again."""
        start = time.perf_counter()
        ssm, depth_index = preferred.action
        rate = preferred.rate(ssm)
        if rate is not None:
            depth_index = self.router.held_depth(ssm, rate, len(rows), not greedy)
            if depth_index is None:
                return None
        self._holding = True
        self.pacing.restart()
        plan = self._plan = self.router.held(ssm, depth_index, depths, not greedy)
        seconds = time.perf_counter() - start  # choosing the length is deciding, if little
        for b, record in enumerate(self.records):  # a row with no token left to draft: a plain step
            record.decided(f"held {plan.action(b)}" if plan.lengths[b] else plan.action(b), seconds)
        return self._draft(rows, plan, greedy)

    def _draft(
        self, rows: list[SequenceState], plan: ChainPlan, greedy: bool
    ) -> list[TokenTree] | ChainDraft:
        """Every row's chain of `plan` (a plain step where no row drafts: no drafter runs, nor is
        timed)."""
        texts = [row.tokens for row in rows]
        if not any(plan.lengths):
            self._drafting = 0.0
            return self._plain_step(rows, greedy)
        start = time.perf_counter()
        drafted: list[TokenTree] | ChainDraft
        if greedy:
            drafted = self.chains.draft(texts, plan)
        else:
            sample = [row.rule in SAMPLED_DRAFT_RULES for row in rows]
            coupled = [row.generator if row.rule is Rule.TARGET else None for row in rows]
            drafted = self.chains.draft_trees(texts, plan, [row.probs for row in rows], sample, coupled)
        self._drafting = time.perf_counter() - start
        return drafted

    def _switched_on(self, rows: list[SequenceState], greedy: bool) -> list[TokenTree] | ChainDraft:
        """The gate turned the router on after plain steps, which compute no hidden state: a plain
        step that decides nothing, its pass returning the states, so that the next step decides on
        them. Not after the plain steps the pacing spaces out (they read no state either, and the
        router's plan takes them without deciding): taken for a switch, each had restarted the
        pacing, so that a plain decision was followed by one paced step and this one, at most.
        Deciding here, on no state, had been a plain decision, which `DecisionPacing` spaced out by
        1 to MAX_SKIP steps more (doubling on the plain decision the router had taken before the
        gate turned it off), their passes returning no state either: a trial of the router started
        with up to 9 plain steps, charged to the router (ALGORITHMS.md 5.4); an off step now
        restarts the pacing."""
        self._plan = None
        self.pacing.restart()
        for record in self.records:
            record.decided("plain", 0.0)
        return self._plain_step(rows, greedy)

    def _plain_step(self, rows: list[SequenceState], greedy: bool) -> list[TokenTree] | ChainDraft:
        """Every row's root alone: chains of no token on the device for greedy rows (the verifier's
        plain step), host trees for the rest (their rules sample from p)."""
        if greedy:
            return self.chains.nothing([row.tokens for row in rows])
        return [TokenTree.root_only(row.tokens[-1], DraftKind.GREEDY) for row in rows]

    def levels(self, row: int) -> int:
        return self._plan.lengths[row] if self._plan is not None else 0

    def observe(self, rows: list[SequenceState], accepted: list[list[int]], verify_seconds: float) -> None:
        """The step's whole time (from the end of the step before: the loop's work is its too; not
        timed where the decoder set itself up) goes to the gate and to the router's costs (5.2,
        "The whole step"; 5.4). The speculation gate is the one of the batch as it was admitted; it
        counts the mean of the step's tokens per admitted row and of the slowest row's gain, so
        that a step that leaves rows behind pays for half of it at once and the rows left behind
        finish on the time of the regime that ran before them (5.4, "A batch is judged whole")."""
        now, setups = time.perf_counter(), setup_count()
        step = now - self._span[0] if setups == self._span[1] else None
        self._span = (now, setups)
        gained = [len(nodes) + 1 for nodes in accepted]  # each row: its own token too
        self._progress = [done + gain for done, gain in zip(self._progress, gained, strict=True)]
        slowest, self._slowest = self._slowest, min(self._progress)
        if step is not None:
            emitted = sum(gained)
            admitted = max(self._admitted, len(accepted))
            if self._gate is not None:
                tokens = (emitted / admitted + self._slowest - slowest) / 2
                self._gate.step(tokens, step, tail=len(accepted) < admitted)
            if self._hold is not None and self._speculated:
                self._hold.step(emitted / len(accepted), step)
        if self._plan is None:
            return
        matched = [len(nodes) for nodes in accepted]
        if self._hold is not None:  # a hold's length is priced on it; ungated, nothing holds
            self.scheduler.preferred_action(self.regime).outcome(self._plan, matched)
        start = time.perf_counter()
        if self._holding:  # a held step's estimates are nobody's: its seconds correct the costs only
            self.router.observe_costs(self._plan, verify_seconds, self._drafting, step)
        else:
            self.router.observe(self._plan, matched, verify_seconds, self._drafting, step)
            self.pacing.observe(self._plan, matched)
        seconds = time.perf_counter() - start
        for record in self.records:
            record.decision_seconds += seconds

    def report(self, row: int) -> dict:
        gate = {} if self._gate is None else {"gate": self._gate.report()}
        if self._hold is not None:
            gate["hold"] = self._hold.report()
        return self.records[row].report() | {"cost_factors": list(self.router.cost_factors)} | gate
