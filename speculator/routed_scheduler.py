"""The routed scheduler (ALGORITHMS.md section 5.3): per step, plain decoding or ONE SSM's argmax
chain, the SSM and its length chosen by `ChainRouter` from the LLM's hidden state and the chain
costs of the hardware profile. The learned scheduler's default action space (`strategy="learned"`).

Drafting is the fast chain drafter's (`BatchedChainDrafter`, one per SSM, each SSM on its own
cache): a chain costs what a fixed chain of that SSM costs, and an SSM that sat steps out catches
up in one pass when it is chosen again. Greedy decoding drafts argmax chains. Under sampling a
chain is sampled from the SSM and verified by MSS, which accepts far more of it than the target
rule accepts of an argmax chain (section 5.3, "Sampling"); except for a seeded sequence: which
SSM drafts how far follows measured step times, which a seed does not fix, so it is verified by
the target rule, whose one draw per emitted token leaves the text a function of the seed alone,
and its chains are coupled to those draws: each token the SSM's choice under the very noise the
rule's draw will use (section 5.3, "Seeded rows"; `batched_drafter.coupled_choice`).

A batch (`decoder/routed_drafting.py`) routes its rows together; this class is the strategy of
one sequence (`propose`) and holds what the batches share: the models, and a router and gates per
learning regime (greedy, sampled, seeded: `router_for`), whose online corrections persist across
calls.
"""

from __future__ import annotations

import functools
import time
from collections import Counter
from collections.abc import Callable

import torch
from transformers import PreTrainedModel

from specboost.speculator.batched_drafter import BatchedChainDrafter
from specboost.speculator.chain_router import NO_SSM, ChainPlan, ChainRouter, DecisionPacing, PreferredAction
from specboost.speculator.cost_model import CostModel
from specboost.speculator.kv_cache import COMPILED_MAX_NODES, CompiledPass, bucket
from specboost.speculator.predictor import MatchLengthPredictor
from specboost.speculator.sampling import LogitsToProbs
from specboost.speculator.scheduler import check_pool_size
from specboost.speculator.speculation import DraftRequest, StepFeedback
from specboost.speculator.speculation_gate import SpeculationGate
from specboost.speculator.tree import ChainDraft, DraftKind, TokenTree

GREEDY, SAMPLED, SEEDED = "greedy", "sampled", "seeded"  # learning regimes: `learning_regime`
ALWAYS_HELD_ROWS = 1  # batch sizes whose speculating steps all hold (ALGORITHMS.md 5.4, "Holding at batch 1")


def learning_regime(do_sample: bool, seeded: bool) -> str:
    """Which of the routed scheduler's routers learns from a sequence's steps (`router_for`):
    greedy decoding, unseeded sampling (sampled chains, MSS) or seeded sampling (chains coupled
    to the target rule's draws), as `RoutedScheduler.tree_kind` drafts for them."""
    if not do_sample:
        return GREEDY
    return SEEDED if seeded else SAMPLED


class RoutedChains:
    """The chain drafters of one group of sequences: one `BatchedChainDrafter` per SSM over the
    group's rows, drafting the rows a `ChainPlan` routes to it."""

    def __init__(
        self,
        ssms: list[PreTrainedModel],
        compiled: Callable[[PreTrainedModel], CompiledPass | None] | None = None,
    ) -> None:
        self.drafters = [BatchedChainDrafter(m, compiled(m) if compiled else None) for m in ssms]
        self._empty: dict[int, torch.Tensor] = {}  # per row count: chains of no token

    def add(self, count: int) -> None:
        for drafter in self.drafters:
            drafter.add_sequences(count)

    def select(self, keep: list[int]) -> None:
        for drafter in self.drafters:
            drafter.select(keep)

    def warm(self, final_length: int) -> None:
        """Every compiled drafter sized for rows of up to `final_length` tokens (text and tokens
        still wanted) and its passes compiled at its rows and that capacity, whether or not it ever
        drafts (`TreeCache.warm_for`): its shapes then follow the rows' lengths, as the LLM's cache's
        do, not the steps it happens to draft, so a warm-up on these prompts compiles all a timed
        run can meet, however differently it routes. Called when the rows change."""
        positions = final_length + COMPILED_MAX_NODES  # a pass's nodes, padded
        for drafter in self.drafters:
            drafter.cache.warm_for(positions)

    def expect_sampling(self, probs: list[LogitsToProbs]) -> None:
        """Every drafter's sampled blocks for rows sampled under `probs`, before they warm
        (`BatchedChainDrafter.expect_sampling`)."""
        for drafter in self.drafters:
            drafter.expect_sampling(probs)

    def behind(self, verified: list[list[int]]) -> list[tuple[int, ...]]:
        """[B][S] the tokens each SSM must catch each row up on before drafting it (at least 1)."""
        return list(zip(*(drafter.behind(verified) for drafter in self.drafters), strict=True))

    def nothing(self, verified: list[list[int]]) -> ChainDraft:
        """Chains of no token for every row (a plain step)."""
        rows = len(verified)
        if rows not in self._empty:
            self._empty[rows] = torch.zeros(rows, 0, dtype=torch.long, device=self.drafters[0].model.device)
        return ChainDraft([v[-1] for v in verified], self._empty[rows], [0] * rows, 0)

    def draft_trees(
        self,
        verified: list[list[int]],
        plan: ChainPlan,
        probs: list[LogitsToProbs],
        sample: list[bool],
        coupled: list[torch.Generator | None] | None = None,
    ) -> list[TokenTree]:
        """Every row's chain as a host tree: sampled, with its q (for MSS), where `sample[b]`, else
        coupled to the target rule's draws from `coupled[b]` where given (a seeded row), else the
        argmax of the row's processed scores."""
        kinds = [DraftKind.SAMPLED if s else DraftKind.GREEDY for s in sample]
        trees = [TokenTree.root_only(v[-1], kind) for v, kind in zip(verified, kinds, strict=True)]
        streams: list[torch.Generator | None] = [None] * len(verified)  # unseeded rows sample
        for i, mine in plan.routes():
            lengths = [n if on else 0 for n, on in zip(plan.lengths, mine, strict=True)]
            chains = self.drafters[i].draft(verified, lengths, probs, streams, sample, coupled)
            for b in (b for b, on in enumerate(mine) if on):
                trees[b].add_sequence([t for t, _ in chains[b]], i, [q for _, q in chains[b]])
        return trees

    def draft(self, verified: list[list[int]], plan: ChainPlan) -> ChainDraft:
        """Every row's chain, on the device (rows drafting nothing: length 0)."""
        roots = [v[-1] for v in verified]
        first = plan.ssm[0]
        if first != NO_SSM and all(i == first for i in plan.ssm):  # one SSM drafts every row (batch 1)
            chains, drafted = self.drafters[first].draft_greedy(verified, list(plan.lengths))
            return ChainDraft(roots, chains, drafted, first)
        width = max(plan.lengths, default=0)  # 0: a plain step, chains of no token
        tokens = torch.zeros(len(verified), width, dtype=torch.long, device=self.drafters[0].model.device)
        lengths = list(plan.lengths)
        for i, mine in plan.routes():
            chains, drafted = self.drafters[i].draft_greedy(
                verified, [n if on else 0 for n, on in zip(plan.lengths, mine, strict=True)]
            )
            for b in (b for b, on in enumerate(mine) if on):
                lengths[b] = drafted[b]  # fewer past the SSM's context
            rows = torch.as_tensor(mine, device=tokens.device)[:, None]
            tokens[:, : chains.shape[1]] = torch.where(rows, chains, tokens[:, : chains.shape[1]])
        return ChainDraft(roots, tokens, lengths, [max(i, 0) for i in plan.ssm])


class RoutedScheduler:
    """A Speculator: per step plain decoding or one SSM's chain (section 5.3)."""

    wants_hidden = True

    def __init__(
        self,
        ssms: list[PreTrainedModel],
        predictor: MatchLengthPredictor,
        cost_model: CostModel,
        calibration: float | None = 0.9,
        cost_correction: float | None = 0.9,
        gated: bool = True,
    ) -> None:
        check_pool_size(predictor, cost_model, len(ssms))
        self.gated = gated  # measure speculation against plain decoding (section 5.4)
        self.models = list(ssms)
        self.num_ssms = len(ssms)
        self.router = ChainRouter(predictor.to(ssms[0].device), cost_model, calibration, cost_correction)
        self._routers: dict[str, ChainRouter] = {}  # the other regimes': `router_for`
        self.gates: dict[tuple[int, str], SpeculationGate] = {}  # per batch-size bucket and regime (5.4)
        self.holds: dict[tuple[int, str], SpeculationGate] = {}  # the same, deciding or holding (5.4)
        self.preferred: dict[str, PreferredAction] = {}  # per regime: what a hold drafts
        self.compiler: Callable[[PreTrainedModel], CompiledPass | None] | None = None  # set by the decoder
        self.reset(None)

    def forget(self) -> None:
        """Start the online corrections and the gates afresh (a warm-up taught nothing about the
        workload)."""
        self.router.forget()
        self._routers = {}
        self.gates.clear()
        self.holds.clear()
        self.preferred.clear()

    def router_for(self, regime: str) -> ChainRouter:
        """The router of a group of rows of one `regime` (`learning_regime`): each regime learns
        apart, in a router and gates of its own, on the same predictor and profile. What a regime
        accepts says nothing of another's: greedy verification of argmax chains, MSS of sampled
        chains, the target rule of a seeded row's coupled chains. Shared, the regime where
        drafting lost turned speculation off for the other requests decoded between its own
        (results r40): seeded requests (then drafting argmax chains) for unseeded ones, and
        sampled requests on a greedy pool for greedy ones. `router` is the
        greedy regime's (the oracle's and the compiled passes' too)."""
        if regime == GREEDY:
            return self.router
        if regime not in self._routers:
            self._routers[regime] = self.router.sibling()
        return self._routers[regime]

    def gate(self, rows: int, regime: str = GREEDY) -> SpeculationGate | None:
        """The speculation gate of groups of `rows` rows in `regime` (one per power-of-two bucket
        and regime: `router_for`); None when not `gated`: the router decides every step. A
        bucket's first gate starts where the regime's nearest bucket's stands (the larger at a
        tie): a batch whose rows finish one by one meets every smaller bucket, and a gate started
        afresh would run its first window in the router. Its first trial of plain decoding is
        priced by the regime's router (`ChainRouter.plain_step_seconds`, section 5.4)."""
        if not self.gated:
            return None
        size = bucket(rows)
        made = self.gates.get((size, regime))
        if made is not None:
            return made
        price = functools.partial(self.router_for(regime).plain_step_seconds, size)
        return _bucket_gate(self.gates, size, regime, price, shadows=regime == GREEDY)

    def hold(self, rows: int, regime: str = GREEDY) -> SpeculationGate | None:
        """The gate that, while `gate` speculates, chooses between the router deciding every step
        ("on") and its preferred action held without deciding ("off": `preferred_action`), for
        groups of `rows` rows in `regime`; bucketed and started like `gate`, its first trial of
        holding measured (ALGORITHMS.md 5.4, "Holding"). At batch size ALWAYS_HELD_ROWS or below
        it is pinned off: every speculating step holds, and the router decides only where nothing
        is preferred yet or the held chain pays less than a plain step (`ChainRouter.held_depth`).
        None when not `gated`."""
        if not self.gated:
            return None
        size = bucket(rows)
        return _bucket_gate(self.holds, size, regime, None, False if size <= ALWAYS_HELD_ROWS else None)

    def preferred_action(self, regime: str) -> PreferredAction:
        """The drafting action `regime`'s router has drafted most, which a hold drafts."""
        if regime not in self.preferred:
            self.preferred[regime] = PreferredAction()
        return self.preferred[regime]

    def tree_kind(self, do_sample: bool, seeded: bool = False) -> DraftKind:
        return DraftKind.SAMPLED if do_sample and not seeded else DraftKind.GREEDY

    def reset(self, seed: int | None) -> None:
        self._seeded = seed is not None
        self.chains = RoutedChains(self.models, self.compiler)
        self.chains.add(1)
        self.record = ActionRecord()
        self.pacing = DecisionPacing()
        self._plan: ChainPlan | None = None
        self._router = self.router  # the step's (`router_for`)
        self._drafting = 0.0

    def propose(self, request: DraftRequest) -> TokenTree:
        self.chains.warm(len(request.verified) + request.max_depth)
        start = time.perf_counter()
        texts = [request.verified]
        behind = functools.partial(self.chains.behind, texts)
        probs = request.probs
        trees = probs.config.do_sample  # else argmax chains on the device (the verifier processes)
        self._router = self.router_for(learning_regime(probs.config.do_sample, self._seeded))
        self._plan = self._router.plan(
            [request.hidden], [request.max_depth], self.pacing, texts, behind, trees
        )
        self.record.decided(self._plan.action(0), time.perf_counter() - start)
        start = time.perf_counter()
        if trees:
            sample = probs.config.do_sample and not self._seeded
            coupled = [request.generator]
            tree = self.chains.draft_trees([request.verified], self._plan, [probs], [sample], coupled)[0]
        else:
            drafted = self.chains.draft([request.verified], self._plan)
            tree = drafted.trees(drafted.tokens.tolist())[0]
        self._drafting = time.perf_counter() - start
        return tree

    def observe(self, feedback: StepFeedback) -> None:
        if self._plan is not None:
            start = time.perf_counter()
            accepted = [len(feedback.accepted)]
            self._router.observe(self._plan, accepted, feedback.verify_seconds, self._drafting)
            self.pacing.observe(self._plan, accepted)
            self.record.decision_seconds += time.perf_counter() - start

    def report(self) -> dict:
        return self.record.report()


def _bucket_gate(
    gates: dict[tuple[int, str], SpeculationGate],
    size: int,
    regime: str,
    price: Callable[[], float] | None,
    pinned: bool | None = None,
    shadows: bool = False,
) -> SpeculationGate:
    """The gate of bucket `size` and `regime` in `gates`, made where missing in the regime's nearest
    bucket's state (`RoutedScheduler.gate`), `pinned` to a regime where given, checking the
    router in shadow while off where `shadows` (greedy rows: `SpeculationGate.shadowed`)."""
    key = (size, regime)
    if key not in gates:
        nearest = min(
            (k for k, r in gates if r == regime),
            key=lambda k: (abs(k.bit_length() - size.bit_length()), -k),
            default=None,
        )
        like = None if nearest is None else gates[nearest, regime]
        gates[key] = SpeculationGate(size, like, price, pinned, shadows)
    return gates[key]


class ActionRecord:
    """What a sequence's scheduler chose, step by step, and the time it took to choose."""

    def __init__(self) -> None:
        self.actions: Counter[str] = Counter()
        self.choices: list[str] = []
        self.decision_seconds = 0.0
        self.step_seconds = 0.0
        self._last_step: float | None = None

    def decided(self, action: str, seconds: float) -> None:
        now = time.perf_counter()
        if self._last_step is not None:
            self.step_seconds += now - self._last_step
        self._last_step = now
        self.actions[action] += 1
        self.choices.append(action)
        self.decision_seconds += seconds

    def report(self) -> dict:
        return {
            "strategy": "learned",
            "actions": dict(self.actions),
            "choices": self.choices,
            "decision_seconds": self.decision_seconds,
            # Time between the first and the last decision: all steps but the last.
            "overhead_fraction": self.decision_seconds / self.step_seconds if self.step_seconds else 0.0,
        }
