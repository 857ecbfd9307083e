"""The routed scheduler (ALGORITHMS.md section 5.3): per step and batch, plain decoding or one SSM's
argmax chain per row. Its rule against brute force, its online corrections, lossless decoding with
it (one sequence, batches, the engine, sampled), and the chain tables of the profile."""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Sequence

import numpy as np
import pytest
import torch
from conftest import VOCAB, noisy_copy, tiny_llama
from hypothesis import example, given, settings
from hypothesis import strategies as st
from test_scheduler import DEPTHS, FAVOURS_SSM_0, SPECULATE, VERIFY, WIDTHS, constant_predictor, cost_table

from specboost.decoder import SpeculativeDecoder, profiler
from specboost.decoder.batched import BatchedDecoder
from specboost.decoder.engine import Engine, EngineConfig
from specboost.decoder.profiler import ProfileConfig, profile
from specboost.decoder.strategies import StrategyOptions
from specboost.speculator import chain_router, routed_scheduler
from specboost.speculator.chain_router import NO_SSM, ChainPlan, ChainRouter, DecisionPacing, Stretches
from specboost.speculator.cost_model import CostModel, affine_in_depth
from specboost.speculator.oracle_router import OracleRouter
from specboost.speculator.padding import left_pad
from specboost.speculator.predictor import MatchLengthPredictor, PredictorConfig
from specboost.speculator.routed_scheduler import GREEDY, SAMPLED, SEEDED, RoutedScheduler


def chain_costs(verify: list[list[float]], draft: list[list[list[float]]]) -> CostModel:
    """A profile with only the chain tables: `verify` [batch 1, 8][plain, depth 1, depth 4] and
    `draft` [SSM][batch 1, 8][depth 1, depth 4] seconds."""
    return CostModel(
        "test|float64",
        [1],
        [verify[0][0]],
        [{} for _ in draft],
        [0.001] * len(draft),
        batch_sizes=[1, 8],
        chain_nodes=[1, *(1 + d for d in DEPTHS)],
        chain_verify_seconds=verify,
        chain_depths=list(DEPTHS),
        chain_seconds=draft,
    )


def objective(
    router: ChainRouter, f: np.ndarray, ssm: np.ndarray, depth: int, left: Sequence[float] = ()
) -> float:
    """Expected tokens per second of routing row b to SSM ssm[b] (NO_SSM: none) at grid depth
    `depth`, rows with `left` tokens still to draft (default 100 each), on the profile's numbers
    (the rule's objective, computed directly: half the mean row's gain, half the gain of the row
    with the most tokens left)."""
    rows = len(ssm)
    verify, draft, _ = router._costs(rows)
    drafting = [b for b in range(rows) if ssm[b] != NO_SSM]
    if not drafting:
        return rows / verify[0]
    left = list(left) or [100.0] * rows
    e = [f[b, ssm[b], depth] if ssm[b] != NO_SSM else 0.0 for b in range(rows)]
    slowest = 1 + max(left) - max(r - x for r, x in zip(left, e, strict=True))
    tokens = (rows + sum(e)) / 2 + rows * slowest / 2
    counts = np.bincount(ssm[drafting], minlength=router.num_ssms)
    seconds = verify[1 + depth] + sum(draft[i, n, depth] for i, n in enumerate(counts) if n)
    return tokens / seconds


def plan_objective(router: ChainRouter, f: np.ndarray) -> float:
    plan = router.choose(f, f, np.full(f.shape[0], 100.0))
    return objective(router, f, np.asarray(plan.ssm), max(plan.depth_index, 0))


costs = st.floats(1e-4, 1e-2)


@settings(max_examples=60, deadline=None)
@given(
    f=st.lists(st.floats(0, 4), min_size=4, max_size=4),
    verify=st.lists(costs, min_size=3, max_size=3),
    draft=st.lists(costs, min_size=4, max_size=4),
    factors=st.lists(st.floats(0.5, 2.0), min_size=3, max_size=3),
    overhead=st.sampled_from([0.0, 5e-4, 5e-3]),
)
@example(f=[0.0] * 4, verify=[1e-3, 1.1e-3, 1.2e-3], draft=[1e-4] * 4, factors=[1.0, 1.0, 2.0], overhead=0.0)
def test_one_row_takes_the_best_of_plain_and_every_ssm_and_length(f, verify, draft, factors, overhead):
    """At batch 1 the rule is the argmax over plain and every (SSM, length) of expected tokens per
    second (brute force over the 5 actions); its plain-Python form chooses what the batch rule's
    numpy form chooses at B = 1, under any corrections of the verify and the drafting costs and of
    plain steps' own verify, and any overhead per drafting step (the K = 0 pass once declined,
    where plain steps' factor was higher, a draft of no expected gain that the one-row rule takes)."""
    router = ChainRouter(
        constant_predictor([[[0.0, 0.0]] * 2] * 2),
        chain_costs([sorted(verify), sorted(verify)], [[draft[:2], draft[:2]], [draft[2:], draft[2:]]]),
    )
    f = np.minimum(np.asarray(f).reshape(1, 2, 2), DEPTHS)
    best = max(
        [objective(router, f, np.array([NO_SSM]), 0)]
        + [objective(router, f, np.array([i]), d) for i in range(2) for d in range(2)]
    )
    assert plan_objective(router, f) == pytest.approx(best)
    v, g, v_plain = factors
    router.costs.factors, router.plain_costs.factors = (v, g), (v_plain, 1.0)
    router.overhead.total, router.overhead.count = overhead, 0.0  # seconds = overhead: total over the prior
    verify_s, draft_s, _ = router._costs(1)
    one = router._choose_one(f[0].tolist(), f[0].tolist(), [100.0], None, False)  # plain Python
    verify_s = np.concatenate([[v_plain * verify_s[0]], v * verify_s[1:] + overhead])
    batch = router._route(f, verify_s, g * draft_s, np.zeros((1, 2)), np.full(1, 100.0))  # numpy, any B
    assert (one.depth_index < 0) == (batch is None)
    if batch is not None:
        assert (one.ssm, one.depth_index) == (batch[0].tolist(), batch[1])
        assert one.advantage == pytest.approx(batch[2]) and one.advantage > 1


@settings(max_examples=40, deadline=None)
@given(
    f=st.lists(st.floats(0, 4), min_size=12, max_size=12),
    scale=st.floats(0.2, 5.0),
)
def test_a_batch_never_does_worse_than_plain_or_one_fixed_chain_for_all(f, scale) -> None:
    """Batch 3, 2 SSMs: the rule's routing is at least as good, on its own objective, as plain
    decoding and as every fixed choice of one SSM and one length for every row (the fixed rows of
    the benchmark); and no worse than its best subset routing before it turns rows off."""
    verify = [[1e-3, 1.3e-3, 2e-3], [2e-3, 2.8e-3, 5e-3]]
    draft = [[[0.2e-3 * scale, 0.7e-3 * scale], [0.3e-3 * scale, 1.1e-3 * scale]]] * 2
    router = ChainRouter(constant_predictor([[[0.0, 0.0]] * 2] * 2), chain_costs(verify, draft))
    f = np.minimum(np.asarray(f).reshape(3, 2, 2), DEPTHS)
    fixed = [objective(router, f, np.full(3, i), d) for i in range(2) for d in range(2)]
    got = plan_objective(router, f)
    assert got >= objective(router, f, np.full(3, NO_SSM), 0) * (1 - 1e-9)
    assert got >= max(fixed) * (1 - 1e-9)


def test_nothing_predicted_decodes_plainly_and_rows_turn_off_alone() -> None:
    verify = [[1e-3, 1.2e-3, 1.5e-3], [2e-3, 2.2e-3, 2.5e-3]]
    draft = [[[0.1e-3, 0.4e-3], [0.2e-3, 0.5e-3]]] * 2
    router = ChainRouter(constant_predictor([[[0.0, 0.0]] * 2] * 2), chain_costs(verify, draft))
    zero = np.zeros((2, 2, 2))
    plan = router.choose(zero, zero, np.full(2, 100.0))
    assert plan.lengths == [0, 0] and plan.depth_index == -1
    f = np.zeros((8, 2, 2))
    f[:7, 1] = [0.9, 3.5]  # seven rows where SSM 1 matches well, one where nothing does
    plan = router.choose(f, f, np.full(8, 100.0))
    assert plan.lengths == [4] * 7 + [0] and plan.ssm == [1] * 7 + [NO_SSM]
    assert [plan.action(b) for b in (0, 7)] == ["SSM 1 x4", "plain"]


def test_a_batch_is_judged_by_its_rows_with_the_most_tokens_left() -> None:
    """A static batch's call waits for its slowest row (ALGORITHMS.md 5.3, "A batch is judged
    whole"). Measured on the tiny fixture at batch 8 (quick-r52's qa prompts, router pinned on):
    a chain of 4 took 11-13 ms a step against a plain step's 4.5 ms, six rows accepting 4 tokens
    and two rows 0-1, and the call ran 0.68x plain decoding. Counted per mean row the step is
    worth 1.4x a plain one; counted whole it loses, and the router declines. The same estimates
    with the two poor rows 10 tokens ahead of the others: the rows left behind gain 3.8, and it
    drafts. And the row with the most tokens left keeps its draft where K = 0 per row would cut a
    mean row's (its gain is the call's)."""
    verify = [[1e-3, 1.3e-3, 2e-3], [4e-3, 6e-3, 9e-3]]
    draft = [[[0.2e-3, 0.7e-3], [0.5e-3, 2e-3]]] * 2
    router = ChainRouter(constant_predictor([[[0.0, 0.0]] * 2] * 2), chain_costs(verify, draft))
    f = np.zeros((8, 2, 2))
    f[:, 0] = [0.95, 3.8]
    f[6:, 0] = [0.3, 0.3]
    mean_rule = (8 + f[:, 0, 1].sum()) / (9e-3 + 2e-3)
    assert mean_rule > 8 / 4e-3  # what the rule chose before it judged the batch whole
    assert router.choose(f, f, np.full(8, 100.0)).depth_index == -1
    ahead = np.array([100.0] * 6 + [90.0] * 2)
    plan = router.choose(f, f, ahead)
    assert plan.depth_index == 1 and plan.lengths[:6] == [4] * 6
    assert objective(router, f, np.asarray(plan.ssm), 1, ahead) > 8 / 4e-3
    f[:7, 0] = [0.95, 3.9]
    f[7, 0] = [0.5, 0.5]  # the row with the most tokens left: K = 0 would cost the call its gain
    left = np.array([90.0] * 7 + [100.0])
    plan = router.choose(f, f, left)
    assert plan.depth_index == 1 and plan.ssm[7] == 0


def test_a_row_far_behind_pays_its_eager_catch_up() -> None:
    """On the compiled loop an SSM whose cache is further behind than a compiled catch-up pass
    takes (COMPILED_MAX_CHAIN) drafts after an eager pass: its extra cost (the eager table's
    one-token draft over the compiled one's) is charged, so the router keeps to the SSM that is up
    to date unless the other's estimate pays for it; rows behind by a few tokens cost nothing."""
    verify = [[1e-3, 1.2e-3, 1.5e-3], [2e-3, 2.2e-3, 2.5e-3]]
    compiled_draft = [[[0.1e-3, 0.4e-3], [0.2e-3, 0.5e-3]]] * 2
    eager_draft = [[[2.1e-3, 2.4e-3], [2.2e-3, 2.5e-3]]] * 2
    cost = chain_costs(verify, eager_draft)
    cost.compiled_chain_verify_seconds, cost.compiled_chain_seconds = verify, compiled_draft
    router = ChainRouter(constant_predictor([[[0.0, 0.0]] * 2] * 2), cost, None, None)
    router.costs_on_compiled_loop(True)
    assert router._costs(1)[2] == pytest.approx([2e-3, 2e-3])
    f = np.array([[[0.9, 3.0], [0.9, 3.2]]])  # SSM 1 a little better
    up_to_date = np.array([[1, 20]])  # SSM 1 sat out 19 steps
    assert router.choose(f, f, np.array([100.0]), np.array([[1, 2]])).ssm == [1]
    assert router.choose(f, f, np.array([100.0]), up_to_date).ssm == [0]
    much_better = np.array([[[0.2, 0.5], [0.9, 4.0]]])
    assert router.choose(much_better, much_better, np.array([100.0]), up_to_date).ssm == [1]
    batch = np.repeat(f, 3, 0)  # a batch: one late row makes SSM 1's one catch-up pass eager
    behind = np.array([[1, 1], [1, 1], [1, 20]])
    assert router.choose(batch, batch, np.full(3, 100.0), behind).ssm == [0, 0, 0]
    assert router.choose(batch, batch, np.full(3, 100.0), np.ones((3, 2))).ssm == [1, 1, 1]
    asked = []
    router.plan([torch.zeros(32)], [100], behind=lambda: asked.append(1) or np.array([[1, 20]]))
    router.costs_on_compiled_loop(False)  # eager: every catch-up costs alike, nothing to ask
    router.plan([torch.zeros(32)], [100], behind=lambda: asked.append(2) or np.array([[1, 20]]))
    assert asked == [1]


def test_a_catch_up_is_shared_by_the_stretch_it_starts() -> None:
    """The eager catch-up's charge is divided by the mean drafting stretch: after stretches of 5
    steps an SSM that sat out is charged a fifth of it (section 5.3, "Catching up")."""
    stretches = Stretches(2)
    for drafting in ([0], [0], [0], [0], [0], [], [1], []):  # SSM 0: 5 steps; SSM 1: 1 step
        stretches.observe(drafting)
    assert stretches.mean == pytest.approx((0.9 * (0.9 * 1 + 5) + 1) / (0.9 * (0.9 + 1) + 1))
    long = Stretches(1)
    for _ in range(40):
        for drafting in ([0],) * 5 + ([],):
            long.observe(drafting)
    assert long.mean == pytest.approx(5.0, rel=0.01)


def test_declining_lets_the_scales_recover() -> None:
    """Bad drafts pull an SSM's scale down and the router declines; plain steps age that evidence
    (IDLE_DECAY), so the scale drifts back to the prior and drafting is tried again, instead of a
    stretch of bad text turning speculation off for good."""
    router = ChainRouter(constant_predictor([[[0.9, 3.5]] * 2]), cost_table(1, VERIFY, SPECULATE), 0.9, None)
    hidden, wanted = [torch.zeros(32)], [1000]
    for _ in range(10):  # drafts of 4 that match nothing
        plan = router.plan(hidden, wanted)
        router.observe(plan, [0], 1e-3, 1e-3)
    assert plan.action(0) == "plain" and router.calibration.ssm_scales()[0] < 0.5
    actions = []
    for _ in range(80):
        plan = router.plan(hidden, wanted)
        actions.append(plan.action(0))
        router.observe(plan, [4 if plan.depth_index >= 0 else 0], 1e-3, 1e-3)
    assert actions[0] == "plain" and actions[-1] == "SSM 0 x4"


def _route_states(states: dict[str, tuple[list[float], float]], steps: int) -> dict[str, list[str]]:
    """Route one SSM over `states` in turn, each its predictor's estimates at depths 1 and 4 (fed as
    the pass head's output) and the tokens a depth-4 draft gets accepted there; the actions taken
    at each state."""
    router = ChainRouter(constant_predictor([[[0.0, 0.0]] * 2]), cost_table(1, VERIFY, SPECULATE), 0.9, None)
    actions: dict[str, list[str]] = {name: [] for name in states}
    for step in range(steps):
        name = list(states)[step % len(states)]
        estimates, accepted = states[name]
        plan = router.plan([torch.tensor(estimates)], [1000])
        actions[name].append(plan.action(0))
        router.observe(plan, [min(accepted, plan.lengths[0])], 1e-3, 1e-3)
    return actions


def test_states_the_predictor_cannot_tell_apart_are_scored_at_the_measured_mean() -> None:
    """A predictor whose estimates vary from state to state while the drafts accept alike (its
    hidden states unlike those it was trained on: section 5.1, "Slopes"): its low estimates are
    corrected to the measured mean, and the router drafts there too. Scaled only by the ratio
    accepted / predicted, the state it rates low (0.3 x 1.45) would decode plainly for good."""
    alike = {"low": ([0.1, 0.3], 4), "high": ([0.9, 3.5], 4), "middle": ([0.6, 2.0], 4)}
    actions = _route_states(alike, 60)
    assert actions["low"][0] == "plain" and set(actions["low"][1:]) == {"SSM 0 x4"}
    told_apart = {"low": ([0.1, 0.3], 0), "high": ([0.9, 3.5], 4), "middle": ([0.6, 2.0], 2)}
    actions = _route_states(told_apart, 60)
    assert set(actions["low"]) == {"plain"} and actions["high"][-1] == "SSM 0 x4"


def test_a_step_that_compiled_corrects_no_cost(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process's first steps compile graphs and measure seconds for milliseconds: a step during
    which torch.compile compiled corrects no cost (before, 20 s against 1.4 ms held v at its bound
    for about a hundred drafting steps, and the quick suite's router declined 98% of its steps)."""
    compiled = [0]
    monkeypatch.setattr(chain_router, "setup_count", lambda: compiled[0])
    router = ChainRouter(constant_predictor([[[0.9, 3.5]] * 2]), cost_table(1, VERIFY, SPECULATE), None, 0.9)
    hidden, wanted = [torch.zeros(32)], [1000]
    actions = []
    for step in range(10):
        plan = router.plan(hidden, wanted)
        actions.append(plan.action(0))
        compiled[0] += step == 0  # the first step compiles
        router.observe(plan, [4], *((20.0, 30.0) if step == 0 else plan.profiled))
    assert actions == ["SSM 0 x4"] * 10 and router.cost_factors == (1.0, 1.0, 1.0)


def test_plain_steps_correct_their_own_cost() -> None:
    """A plain step measured at half its profiled time moves only the plain factor, and drafting
    steps only (v, g): a verify pass after the SSMs' passes and one after a plain step cost
    differently on a CPU (section 5.2)."""
    router = ChainRouter(
        constant_predictor([[[0.3, 1.0]] * 2]), cost_table(1, [1e-3] * 5, SPECULATE), None, 0.9
    )
    plain = router.plain([60])
    for _ in range(60):
        router.observe(plain, [0], plain.profiled[0] / 2, 0.0)
    v, g, v_plain = router.cost_factors
    assert (v, g) == (1.0, 1.0) and 0.5 < v_plain < 0.6  # one pseudo-step of prior at 1
    drafting = router.choose(np.full((1, 1, 2), 4.0), np.full((1, 1, 2), 4.0), np.array([60.0]))
    router.observe(drafting, [4], 2 * drafting.profiled[0], drafting.profiled[1])
    assert router.cost_factors[0] > 1.0 and router.cost_factors[2] == v_plain


def test_a_cost_per_step_outside_the_passes_moves_the_choice_to_longer_chains() -> None:
    """Section 5.2, "The whole step": a step's time beyond its LLM pass and its drafting (host
    trees, sampling, the loop's work) is paid per step, so it favours fewer, longer steps, and the
    profile, which times the passes alone, does not show it. Timed by the whole step, plain steps
    and drafting steps both carry it; without `step_seconds` nothing changes."""
    overhead = 4e-3
    predictor = constant_predictor([[[0.9, 1.4]] * 2])
    router, blind = (ChainRouter(predictor, cost_table(1, VERIFY, SPECULATE), None, 0.9) for _ in range(2))
    hidden, wanted = [torch.zeros(32)], [1000]
    assert router.plan(hidden, wanted).action(0) == "SSM 0 x1"  # the passes alone: 1.41 against 1.0 tokens/ms
    for _ in range(20):
        for r in (router, blind):
            plan = r.plan(hidden, wanted)
            verify, drafting = plan.profiled
            r.observe(plan, [1], verify, drafting, None if r is blind else verify + drafting + overhead)
            plain, alone = r.plain(wanted), r.plain(wanted).profiled[0]
            r.observe(plain, [0], alone, 0.0, None if r is blind else alone + overhead)
    assert 0.8 * overhead < router.overhead.seconds < overhead and blind.overhead.seconds == 0.0
    assert router.plan(hidden, wanted).action(0) == "SSM 0 x4"  # 0.375 against 0.355 (x1), 0.25 (plain)
    assert blind.plan(hidden, wanted).action(0) == "SSM 0 x1"


def test_one_step_that_paid_for_something_else_does_not_stop_drafting_for_good() -> None:
    """A drafting step that also paid for other work (the oracle's lookahead generation: 0.3 s
    against steps of milliseconds) counts at most 4x its profiled seconds, and while the router
    declines the overhead fades, so it drafts again: unbounded and never fading, one such step had
    kept the quick suite's oracle on plain decoding for a whole table (quick-r36)."""
    router = ChainRouter(constant_predictor([[[0.9, 1.4]] * 2]), cost_table(1, VERIFY, SPECULATE), None, 0.9)
    hidden, wanted = [torch.zeros(32)], [1000]
    plan = router.plan(hidden, wanted)
    verify, drafting = plan.profiled
    router.observe(plan, [1], verify, drafting, verify + drafting + 0.3)
    assert router.overhead.seconds <= 4 * (verify + drafting) / 2  # clipped, one pseudo-step of prior
    actions = []
    for _ in range(60):
        plan = router.plan(hidden, wanted)
        actions.append(plan.action(0))
        if plan.action(0) != "plain":
            break
        router.observe(plan, [0], plan.profiled[0], 0.0, plan.profiled[0])
    assert actions[0] == "plain" and actions[-1] == "SSM 0 x1"


def test_a_plain_step_is_priced_by_the_lower_verify_factor() -> None:
    """The speculation gate's price of a plain step (section 5.4): the profile's one-token pass by
    v, which carries an eager profile over to a compiled loop (verify passes measured at a quarter
    of the profile), or by v_plain once plain steps measured cheaper still."""
    router = ChainRouter(
        constant_predictor([[[0.3, 1.0]] * 2]), cost_table(1, [1e-3] * 5, SPECULATE), None, 0.9
    )
    assert router.plain_step_seconds(1) == pytest.approx(1e-3)
    drafting = router.choose(np.full((1, 1, 2), 4.0), np.full((1, 1, 2), 4.0), np.array([60.0]))
    for _ in range(30):
        router.observe(drafting, [4], drafting.profiled[0] / 4, drafting.profiled[1])
    v, _, v_plain = router.cost_factors
    assert v < 0.4 and v_plain == 1.0 and router.plain_step_seconds(1) == pytest.approx(1e-3 * v)
    plain = router.plain([60])
    for _ in range(30):
        router.observe(plain, [0], plain.profiled[0] / 8, 0.0)
    v, _, v_plain = router.cost_factors
    assert v_plain < v and router.plain_step_seconds(1) == pytest.approx(1e-3 * v_plain)
    assert router.plain_step_seconds(8) == pytest.approx(2e-3 * v_plain)  # batch 8: twice the pass


def test_the_router_refuses_a_profile_without_chain_costs_and_a_grid_without_width_one() -> None:
    plain_profile = CostModel("test", [1], [1e-3], [{}], [1e-3])
    with pytest.raises(ValueError, match="profile again"):
        ChainRouter(constant_predictor([[[1.0, 1.0]] * 2]), plain_profile)
    wide = MatchLengthPredictor(PredictorConfig(input_size=32, num_ssms=1, widths=(2,), depths=DEPTHS))
    with pytest.raises(ValueError, match="width 1"):
        ChainRouter(wide, cost_table(1, VERIFY, SPECULATE))


def routed_decoder(llm, ssms, predictor=None, cost=None, gate=False, **kwargs) -> SpeculativeDecoder:
    """A decoder routed by the rule of 5.3 (its gate off unless `gate`: these tests check the rule)."""
    predictor = predictor or constant_predictor(FAVOURS_SSM_0)
    cost = cost or cost_table(len(ssms), VERIFY, SPECULATE)
    return SpeculativeDecoder(
        llm,
        ssms,
        strategy="learned",
        predictor=predictor,
        cost_model=cost,
        strategy_options=StrategyOptions(gate=gate),
        **kwargs,
    )


@pytest.mark.parametrize("gate", [False, True])
def test_routed_greedy_decoding_with_logits_processors_equals_generate(
    monkeypatch: pytest.MonkeyPatch, gate: bool
) -> None:
    """Greedy rows with logits processors (a repetition penalty, which reads each position's
    history, and `min_new_tokens`, which holds the end-of-sequence token back) route and draft
    the same argmax chains on the device as rows without; their plain steps (the gate off, or
    the rule declining) and their chains are verified on the processed scores: the output is
    `generate`'s with the same options, in one sequence and in a batch."""
    llm = tiny_llama(layers=2, seed=0)
    llm.generation_config.eos_token_id = 7
    ssms = [tiny_llama(layers=1, seed=1), tiny_llama(layers=1, seed=2)]
    decoder = routed_decoder(llm, ssms, gate=gate)

    def on_the_host(*args: object) -> None:
        raise AssertionError("greedy rows drafted host trees")

    monkeypatch.setattr(routed_scheduler.RoutedChains, "draft_trees", on_the_host)
    prompts = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(8))
    options = dict(max_new_tokens=30, repetition_penalty=1.5, min_new_tokens=20)
    expected = [llm.generate(prompts[b : b + 1], do_sample=False, **options)[0] for b in range(2)]
    plain = llm.generate(prompts[:1], do_sample=False, max_new_tokens=30)[0]
    assert not torch.equal(expected[0], plain)  # the processors change the output
    out = decoder.generate(prompts[:1], **options)
    assert torch.equal(out.sequences[0], expected[0])
    assert any(choice.startswith("SSM") for choice in out.stats.strategy["choices"])
    batch = BatchedDecoder(decoder).generate(prompts, **options)
    for b in range(2):
        assert torch.equal(batch.sequences[b, : len(expected[b])], expected[b])


@pytest.mark.parametrize("prompt_length", [1, 6])
def test_routed_decoding_reproduces_greedy_decoding(prompt_length: int) -> None:
    """Chains of both SSMs and lengths, plain steps: the output is the LLM's greedy output."""
    llm = tiny_llama(layers=2, seed=0)
    ssms = [tiny_llama(layers=1, seed=1), tiny_llama(layers=1, seed=2)]
    torch.manual_seed(0)
    decoder = routed_decoder(llm, ssms)
    assert isinstance(decoder.speculator, RoutedScheduler)
    prompt = torch.randint(0, VOCAB, (1, prompt_length), generator=torch.Generator().manual_seed(3))
    out = decoder.generate(prompt, max_new_tokens=30)
    assert torch.equal(out.sequences, llm.generate(prompt, max_new_tokens=30, do_sample=False))
    report = out.stats.strategy
    assert sum(report["actions"].values()) == out.stats.llm_steps == len(report["choices"])
    assert any(a.startswith("SSM") for a in report["actions"]) and 0 <= report["overhead_fraction"] < 1


def test_a_bad_favourite_is_found_out_and_the_other_ssm_drafts() -> None:
    """Issue 28's test for the routed scheduler: SSM 0, predicted best, is a random model; SSM 1 is
    a copy of the LLM. After SSM 0's first draft the router moves to SSM 1 and stays there."""
    llm = tiny_llama(layers=2, seed=0)
    ssms = [tiny_llama(layers=2, seed=7), copy.deepcopy(llm)]
    decoder = routed_decoder(llm, ssms)
    decoder.speculator.router.costs = None  # a made-up profile: keep its costs (5.2)
    prompt = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(3))
    out = decoder.generate(prompt, max_new_tokens=40)
    assert torch.equal(out.sequences, llm.generate(prompt, max_new_tokens=40, do_sample=False))
    choices = out.stats.strategy["choices"]
    assert choices[0] == "SSM 0 x4" and choices[1].startswith("SSM 1")
    assert not any(c.startswith("SSM 0") for c in choices[1:])
    scales = decoder.speculator.router.calibration.ssm_scales()
    assert scales[0] < 0.5 < 1.0 < scales[1]


@pytest.mark.parametrize("temperature", [0.8, 1.3])
def test_seeded_rows_draft_what_the_target_rule_will_draw(temperature: float) -> None:
    """A seeded row's chains are coupled to the target rule's draws (ALGORITHMS.md 5.3, "Seeded
    rows"): drafted by a copy of the LLM, every token is accepted, and the text is what plain
    decoding samples with that seed. The argmax chains drafted before had none of these accepted."""
    llm = tiny_llama(layers=2, seed=0)
    decoder = routed_decoder(llm, [copy.deepcopy(llm), noisy_copy(llm, 0.3, seed=2)])
    plain = SpeculativeDecoder(llm, [], strategy="plain")
    prompt = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(3))
    options = dict(max_new_tokens=24, do_sample=True, temperature=temperature)
    for seed in (0, 1):
        out = decoder.generate(prompt, seed=seed, **options)
        assert torch.equal(out.sequences, plain.generate(prompt, seed=seed, **options).sequences)
        stats = out.stats
        assert stats.proposed_per_ssm[0] >= 12 and stats.accepted_per_ssm[0] == stats.proposed_per_ssm[0]


def test_greedy_sampled_and_seeded_requests_learn_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """What one regime accepts says nothing of another's (greedy verification of argmax chains, MSS
    of sampled chains, the target rule of a seeded row's coupled chains): each routes with a router
    and gates of its own, on the same loop's costs (results r40: shared, the regime where drafting
    lost turned speculation off for the requests of the others decoded between its own). The
    router learns from the steps it decides: at batch 1, where every speculating step holds
    (ALGORITHMS.md 5.4, "Holding at batch 1"), with that bound lowered."""
    monkeypatch.setattr(routed_scheduler, "ALWAYS_HELD_ROWS", 0)
    llm = tiny_llama(layers=2, seed=0)
    ssms = [noisy_copy(llm, 0.1, seed=1), noisy_copy(llm, 0.3, seed=2)]
    decoder = routed_decoder(llm, ssms, gate=True)
    scheduler = decoder.speculator
    routers = {regime: scheduler.router_for(regime) for regime in (GREEDY, SAMPLED, SEEDED)}
    assert routers[GREEDY] is scheduler.router and len({id(r) for r in routers.values()}) == 3
    assert all(r.compiled == scheduler.router.compiled for r in routers.values())
    prompt = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(3))
    calls = {
        SEEDED: [dict(do_sample=True, temperature=0.8, seed=s) for s in (0, 1, 0)],
        SAMPLED: [dict(do_sample=True, temperature=0.8)],
        GREEDY: [dict()],
    }
    texts = []
    for regime, options in calls.items():
        evidence = {r: copy.deepcopy(router.calibration.predicted) for r, router in routers.items()}
        for option in options:
            texts.append(decoder.generate(prompt, max_new_tokens=16, **option).sequences[0].tolist())
        learnt = {r for r, router in routers.items() if router.calibration.predicted != evidence[r]}
        assert learnt == {regime}
        assert (1, regime) in scheduler.gates
    assert texts[0] == texts[2]  # the seed alone fixes the text, whatever the router learnt between
    assert set(scheduler.gates) == {(1, regime) for regime in calls}
    scheduler.forget()
    assert scheduler.router_for(SEEDED) is not routers[SEEDED] and not scheduler.gates


def test_drafting_much_slower_than_profiled_turns_speculation_off() -> None:
    """The profile says drafting is nearly free; here a draft takes 10x its profiled time and the
    verification as profiled. After the first draft's measured time the corrected router (5.2)
    decodes plainly; without the correction it keeps drafting."""
    predictor = constant_predictor([[[0.3, 1.0], [0.35, 1.1]]])
    hidden, wanted = [torch.zeros(32)], [60]
    for corrected in (True, False):
        router = ChainRouter(
            predictor, cost_table(1, [1e-3] * 5, SPECULATE), None, 0.9 if corrected else None
        )
        actions = []
        for _ in range(6):
            plan = router.plan(hidden, wanted)
            actions.append(plan.action(0))
            router.observe(plan, [1], plan.profiled[0], 10 * plan.profiled[1])
        assert actions == ["SSM 0 x4"] + (["plain"] * 5 if corrected else ["SSM 0 x4"] * 5)
    assert router.cost_factors == (1.0, 1.0, 1.0)  # the uncorrected one


def test_routed_batches_and_the_engine_equal_each_row_alone() -> None:
    """Batches of rows of different lengths, some drafting and some not in a step (SSM 0 is random,
    SSM 1 a copy of the LLM): every row is the LLM's own greedy output, in a batch and in the
    serving engine's groups."""
    llm = tiny_llama(layers=2, seed=0)
    ssms = [tiny_llama(layers=1, seed=1), copy.deepcopy(llm)]
    decoder = routed_decoder(llm, ssms)
    decoder.speculator.router.costs = None  # a made-up profile: keep its costs (5.2)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (3, 7, 5, 2)]
    ids, mask = left_pad(prompts, pad_id=0)
    out = BatchedDecoder(decoder).generate(ids, mask, max_new_tokens=20, do_sample=False)
    expected = [
        llm.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False)[0, len(p) :] for p in prompts
    ]
    for b in range(len(prompts)):
        assert out.sequences[b, ids.shape[1] :].tolist() == expected[b].tolist()
    actions = Counter()
    for stats in out.stats.sequences:
        actions.update(stats.strategy["actions"])
    assert any(a.startswith("SSM 1") for a in actions)
    with Engine(decoder, EngineConfig(batch_size=2, num_groups=2)) as engine:
        results = engine.run(prompts, timeout=60, max_new_tokens=20, do_sample=False)
    for result, tokens in zip(results, expected, strict=True):
        assert result.new_tokens == tokens.tolist()


def test_profile_measures_chain_tables_at_every_batch_size() -> None:
    llm, ssms = tiny_llama(layers=2, seed=0), [tiny_llama(layers=1, seed=1)] * 2
    config = ProfileConfig(WIDTHS, DEPTHS, (1, 4), prefix_length=4, repeats=1, batch_sizes=(1, 3))
    cost = profile(llm, ssms, ProfileConfig(**{**config.__dict__, "sampled": True}), False)
    assert cost.has_chain_costs and cost.batch_sizes == [1, 3] and cost.chain_nodes == [1, 2, 5]
    assert np.asarray(cost.chain_verify_seconds).shape == (2, 3)
    assert np.asarray(cost.chain_seconds).shape == (2, 2, 2)
    assert min(np.asarray(cost.chain_seconds).flat) > 0
    assert cost.chain_draft_table(4).shape == (2, 5, 2) and (cost.chain_draft_table(4)[:, 0] == 0).all()
    sampled = np.asarray(cost.sampled_chain_seconds)
    assert sampled.shape == (2, 2, 2) and sampled.min() > 0
    monotone = np.minimum.accumulate(sampled[..., ::-1], -1)[..., ::-1]  # `nondecreasing` in depth
    assert cost.chain_draft_table(3, sampled=True)[:, [1, 3]] == pytest.approx(monotone)
    greedy_only = profile(llm, ssms, config, False)  # the default: no sampled table
    assert not greedy_only.sampled_chain_seconds
    assert greedy_only.chain_draft_table(3, sampled=True) == pytest.approx(greedy_only.chain_draft_table(3))


def test_sampled_drafting_is_priced_by_its_own_table() -> None:
    """Rows that draft host trees (sampled chains, a draw and its q per position) cost what the
    profile's sampled table says: where those chains cost three times the greedy ones, a step
    that drafts a chain of 4 under greedy decoding drafts a chain of 1 under sampling; a profile
    without the sampled table prices them as greedy chains."""
    verify = [[1e-3, 1.2e-3, 1.5e-3], [2e-3, 2.2e-3, 2.5e-3]]
    draft = [[[0.2e-3, 0.8e-3], [0.3e-3, 1.0e-3]]] * 2
    cost = chain_costs(verify, draft)
    router = ChainRouter(constant_predictor([[[0.0, 0.0]] * 2] * 2), cost, None, None)
    f = np.array([[[0.9, 2.5], [0.5, 1.0]]])  # greedy: x4 3.5 / 2.3 ms beats x1 1.9 / 1.4 ms
    unpriced = router.choose(f, f, np.array([100.0]), sampled=True)
    assert router.choose(f, f, np.array([100.0])).lengths == unpriced.lengths == [4]
    cost.sampled_chain_seconds = [[[3 * t for t in row] for row in ssm] for ssm in draft]
    router.costs_on_compiled_loop(False)
    assert router.choose(f, f, np.array([100.0])).lengths == [4]
    sampled = router.choose(f, f, np.array([100.0]), sampled=True)  # x1 1.9 / 1.8 ms, x4 3.5 / 3.9 ms
    assert sampled.lengths == [1] and sampled.profiled[1] == pytest.approx(0.6e-3)


def test_the_profile_times_each_part_of_a_run_after_it_settles() -> None:
    """Every run is called `settle` times untimed, then once timed; a run that times its own parts
    (a drafting step: the SSM's chains, then the LLM's pass over them) gives each part's median,
    a part several runs time pooling their samples (the verify pass of a chain length, every SSM's)."""
    calls: Counter = Counter()

    def run(name: str, parts: dict[str, float]):
        def segments() -> dict[str, float]:
            calls[name] += 1
            return parts

        return segments

    runs = [
        run("a", {"draft 0": 1.0, "verify": 3.0}),
        run("b", {"draft 1": 2.0, "verify": 5.0}),
        profiler.timed(lambda: calls.update(["c"]), "plain", torch.device("cpu")),
    ]
    seconds = profiler._interleaved_medians(runs, repeats=3, settle=4, show_progress=False)
    assert calls == {"a": 15, "b": 15, "c": 15}
    assert seconds["draft 0"] == 1.0 and seconds["draft 1"] == 2.0 and seconds["verify"] == 4.0
    assert 0 <= seconds["plain"] < 0.1


def test_a_smaller_pass_never_costs_more_than_a_larger_one() -> None:
    """A profile whose one-node pass measured slower than its longer chains (noise, or a shape
    slower alone than in the loop) prices the plain step and every shorter chain at most as the
    longer ones: the tables are made nondecreasing in size before interpolating."""
    verify = [[3.9e-3, 1.4e-3, 1.8e-3], [4e-3, 3.7e-3, 4.2e-3]]
    draft = [[[1.0e-3, 0.9e-3], [1.2e-3, 2e-3]]]
    cost = chain_costs(verify, draft)
    assert cost.chain_verify_time(1, np.array([1, 2, 5])) == pytest.approx([1.4e-3, 1.4e-3, 1.8e-3])
    assert cost.chain_verify_time(8, np.array([1, 2, 5])) == pytest.approx([3.7e-3, 3.7e-3, 4.2e-3])
    assert cost.chain_draft_table(1)[0, 1] == pytest.approx([0.9e-3, 0.9e-3])


def test_a_noisy_drafting_table_is_read_as_a_line_in_depth() -> None:
    """The tiny fixture's sampled profile (SSM 0, batch 1) measured a chain of 8 at 1.35x a chain
    of 4 where the loop takes 1.70x; read one depth at a time, a chain of 8 looked as good as one
    of 4 at acceptance 0.78 and the router chose it. As the line closest to the five depths
    (`cost_model.affine_in_depth`) it costs 1.62x, and the router drafts 4."""
    depths, ms = [1, 2, 4, 8, 16], 1e-3
    drafting = [2.21 * ms, 3.73 * ms, 4.77 * ms, 6.44 * ms, 13.86 * ms]
    verify = [3.45 * ms, 4.37 * ms, 5.09 * ms, 4.70 * ms, 5.45 * ms, 6.70 * ms]  # 1, 2, 3, 5, 9, 17 nodes
    cost = CostModel(
        "test|float64",
        [1],
        [verify[0]],
        [{}],
        [0.001],
        batch_sizes=[1, 8],
        chain_nodes=[1, *(1 + d for d in depths)],
        chain_verify_seconds=[verify, verify],
        chain_depths=depths,
        chain_seconds=[[drafting, drafting]],
    )
    table = cost.chain_draft_table(1)[0, 1]
    assert np.diff(table) / np.diff(depths) == pytest.approx([(table[-1] - table[0]) / 15] * 4)
    assert 1.55 < table[3] / table[2] < 1.7
    config = PredictorConfig(input_size=32, num_ssms=1, widths=(1,), depths=tuple(depths))
    router = ChainRouter(MatchLengthPredictor(config).eval(), cost, None, None)
    f = np.array([[[0.78 * (1 - 0.78**d) / 0.22 for d in depths]]])  # geometric acceptance, 0.78
    score = {d: (1 + f[0, 0, k]) / (verify[k + 1] + drafting[k]) for k, d in enumerate(depths)}
    assert max(score, key=score.get) == 8  # the measured depths, one at a time
    assert router.choose(f, f, np.array([100.0])).lengths == [4]


@settings(max_examples=60, deadline=None)
@given(
    st.floats(0, 1e-2),
    st.floats(0, 1e-3),
    st.lists(st.integers(1, 64), min_size=3, max_size=8, unique=True),
    st.lists(st.floats(0.5, 2.0), min_size=8, max_size=8),
)
def test_a_drafting_table_fit_is_a_nondecreasing_line(
    a: float, b: float, depths: list[int], noise: list[float]
) -> None:
    """A table that is a line a + b d is kept as it is; any positive table becomes a line that
    never falls with depth."""
    d = np.sort(np.asarray(depths, float))
    if a + b * d[0] > 1e-6:
        assert affine_in_depth(d.tolist(), a + b * d) == pytest.approx(a + b * d, rel=1e-6)
    noisy = affine_in_depth(d.tolist(), (a + b * d + 1e-4) * np.asarray(noise[: len(d)]))
    assert (noisy > 0).all() and (np.diff(noisy) >= -1e-15).all()
    assert np.diff(noisy) / np.diff(d) == pytest.approx(
        [(noisy[-1] - noisy[0]) / (d[-1] - d[0])] * (len(d) - 1)
    )


def test_unknown_actions_are_refused() -> None:
    with pytest.raises(ValueError, match="actions must be one of 'chains', 'trees'"):
        StrategyOptions(actions="forest")


def plan_of(ssm: list[int], lengths: list[int]) -> ChainPlan:
    """A plan routing row b to SSM ssm[b] for lengths[b] tokens (all 0: a plain step)."""
    rows = len(ssm)
    depth = 0 if any(lengths) else -1
    return ChainPlan(ssm, lengths, depth, [[1.0, 1.0]] * rows, [60.0] * rows, (1e-3, 1e-3))


def decision_steps(pacing: DecisionPacing, plan: ChainPlan, steps: int, max_hold: int = 4) -> list[int]:
    """The steps of `steps` at which `pacing` decides, when every decision is `plan`."""
    decided = []
    for step in range(steps):
        if pacing.due():
            decided.append(step)
            pacing.decided(plan, max_hold)
    return decided


def test_pacing_spaces_out_decisions_while_they_decline() -> None:
    """After plain decisions the next decisions come 1, 2, 4 then 8 plain steps later; a drafting
    decision (or a restart: new rows) brings deciding back to every step."""
    pacing = DecisionPacing()
    assert decision_steps(pacing, plan_of([NO_SSM], [0]), 40) == [0, 2, 5, 10, 19, 28, 37]
    pacing.decided(plan_of([0], [4]), 4)
    assert pacing.due() and pacing.due() and pacing.held is None
    pacing.decided(plan_of([NO_SSM], [0]), 4)
    pacing.restart()
    assert pacing.due()


def test_pacing_holds_a_drafting_decision_while_it_repeats() -> None:
    """A drafting decision that repeats the last one is held for the next 1, 2, then at most
    `max_hold` steps; another decision (another SSM, length or plain) brings deciding back to
    every step, and a plain decision after a held one spaces out its plain steps from 1 again."""
    chain, pacing = plan_of([0], [4]), DecisionPacing()
    assert decision_steps(pacing, chain, 20) == [0, 1, 3, 6, 11, 16]
    assert pacing.held is chain
    assert decision_steps(DecisionPacing(), chain, 20, max_hold=0) == list(range(20))
    for other in (plan_of([1], [4]), plan_of([0], [2])):
        pacing.wait = 0
        pacing.decided(other, 4)
        assert pacing.held is None and pacing.due()
    pacing.decided(plan_of([NO_SSM], [0]), 4)
    assert pacing.held is None and not pacing.due() and pacing.due()  # one plain step, then decide


def test_a_draft_that_matched_nothing_ends_the_hold() -> None:
    """A held decision whose drafts all matched nothing is decided again at the next step, and a
    repeat is then held from one step again; where any drafting row matched, or the step drafted
    nothing, the hold goes on."""
    chain, pacing = plan_of([0], [16]), DecisionPacing()
    assert decision_steps(pacing, chain, 7) == [0, 1, 3, 6]  # held for 4 steps after step 6
    pacing.due()
    pacing.observe(chain, [5])
    assert pacing.held is chain and not pacing.due()
    pacing.observe(chain, [0])
    assert pacing.held is None and pacing.due()
    pacing.decided(chain, 4)
    assert pacing.held is chain and not pacing.due() and pacing.due()  # held one step
    batch = plan_of([0, NO_SSM, 1], [4, 0, 4])
    pacing.decided(batch, 4)
    pacing.decided(batch, 4)
    for accepted, ends in (([0, 0, 2], False), ([0, 0, 0], True)):
        pacing.wait = 1
        pacing.observe(batch, accepted)
        assert pacing.due() == ends
    pacing.decided(plan_of([NO_SSM], [0]), 4)
    pacing.observe(plan_of([NO_SSM], [0]), [0])
    assert not pacing.due()  # a plain step's pacing is its own


def test_a_held_plan_drafts_no_row_past_its_tokens_wanted_and_follows_the_rows() -> None:
    """The held plan of a batch: each row drafts at most the tokens it still wants (none left: a
    row drafts nothing; no row left: a plain step), and rows that leave take their routes along."""
    router = ChainRouter(constant_predictor(FAVOURS_SSM_0), cost_table(2, VERIFY, SPECULATE), None, None)
    pacing = DecisionPacing()
    pacing.decided(plan_of([0, 1, 0], [4, 4, 4]), 4)
    pacing.decided(plan_of([0, 1, 0], [4, 4, 4]), 4)  # repeated: held for one step
    pacing.select([1, 2])
    held = router.plan([None, None], [60, 2], pacing)
    assert (held.ssm, held.lengths) == ([1, 0], [4, 2])
    pacing.wait = 1
    assert router.plan([None, None], [0, 0], pacing).action(0) == "plain"


def decide_and_verify(
    monkeypatch: pytest.MonkeyPatch, llm: torch.nn.Module, decoder: SpeculativeDecoder, new_tokens: int
) -> tuple[list[str], int, list[bool]]:
    """Decode a prompt with `decoder`, checking the output is the LLM's greedy one; returns the
    actions, how many times the router ran its predictor, and per LLM verify pass whether it
    returned hidden states."""
    decoder.speculator.router.costs = None  # a made-up profile: keep its costs (5.2)
    calls, states = [], []
    predict = ChainRouter._predict_one
    monkeypatch.setattr(
        ChainRouter, "_predict_one", lambda self, *args: calls.append(1) or predict(self, *args)
    )
    verifier = type(decoder.verifier)
    verify = verifier.verify
    monkeypatch.setattr(
        verifier,
        "verify",
        lambda self, cache, rows, keep, *args: states.append(keep) or verify(self, cache, rows, keep, *args),
    )
    prompt = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(3))
    out = decoder.generate(prompt, max_new_tokens=new_tokens)
    assert torch.equal(out.sequences, llm.generate(prompt, max_new_tokens=new_tokens, do_sample=False))
    return out.stats.strategy["choices"], len(calls), states


def test_a_router_that_declines_decides_rarely(monkeypatch: pytest.MonkeyPatch) -> None:
    """A predictor that expects nothing: every step is plain, and the predictor runs in about one
    step of nine, and the LLM's pass returns its hidden states only before those steps (the output
    is still the LLM's)."""
    llm = tiny_llama(layers=2, seed=0)
    decoder = routed_decoder(llm, [tiny_llama(layers=1, seed=1)], constant_predictor([[[0.0, 0.0]] * 2]))
    choices, calls, states = decide_and_verify(monkeypatch, llm, decoder, 60)
    assert choices == ["plain"] * 60 and calls == 9  # steps 0, 2, 5, 10, 19, 28, ..., 55
    assert len(states) == 60 and [i for i, keep in enumerate(states) if keep] == [1, 4, 9, 18, 27, 36, 45, 54]


def test_a_router_that_keeps_its_choice_decides_rarely(monkeypatch: pytest.MonkeyPatch) -> None:
    """SSM 0, predicted best, is a copy of the LLM: every decision is its chain of 4, so decisions
    are held 1, 2, then 4 steps, the predictor running only at the steps the router decides (the
    LLM's passes still return the states: no other graphs); the last held step, with 3 tokens
    wanted, drafts 2. The output is still the LLM's."""
    llm = tiny_llama(layers=2, seed=0)
    decoder = routed_decoder(llm, [copy.deepcopy(llm), tiny_llama(layers=1, seed=1)])
    choices, calls, states = decide_and_verify(monkeypatch, llm, decoder, 73)
    assert choices == ["SSM 0 x4"] * 14 + ["SSM 0 x2"]
    assert calls == 5  # steps 0, 1, 3, 6, 11
    assert states == [True] * 15


def test_the_oracle_predicts_exactly_what_greedy_verification_accepts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The oracle router (5.3's rule on the true match lengths): at every drafting step the
    accepted length equals its estimate for the chosen SSM and length, and the output is still the
    LLM's own greedy output."""
    llm = tiny_llama(layers=2, seed=0)
    ssms = [noisy_copy(llm, 0.3, seed=1), noisy_copy(llm, 0.1, seed=2)]
    decoder = routed_decoder(llm, ssms)
    scheduler = decoder.speculator
    scheduler.router = OracleRouter(scheduler.router, llm, ssms)
    scheduler.router.costs = None  # a made-up profile: keep its costs
    steps = []
    observe = ChainRouter.observe

    def check(self, plan, accepted, *seconds):
        for b, length in enumerate(plan.lengths):
            if length:
                steps.append((plan.predicted[b][plan.depth_index], accepted[b]))
        return observe(self, plan, accepted, *seconds)

    monkeypatch.setattr(ChainRouter, "observe", check)
    prompt = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(3))
    out = decoder.generate(prompt, max_new_tokens=40)
    assert torch.equal(out.sequences, llm.generate(prompt, max_new_tokens=40, do_sample=False))
    assert len(steps) > 3 and all(predicted == accepted for predicted, accepted in steps)
    assert len(scheduler.router.known) == 1  # one prompt: one greedy output generated


def test_a_compiled_decoder_takes_the_compiled_chain_costs() -> None:
    """A profile measured with --compile holds the chain tables of both loops; the router takes
    the compiled ones when told the loop is compiled, else (or without them) the eager ones."""
    verify = [[1e-3, 1.3e-3, 2e-3], [2e-3, 2.8e-3, 5e-3]]
    draft = [[[0.2e-3, 0.7e-3], [0.3e-3, 1.1e-3]]]
    cost = chain_costs(verify, draft)
    router = ChainRouter(constant_predictor([[[0.0, 0.0]] * 2]), cost)
    router.costs_on_compiled_loop(True)
    assert not router.compiled  # no compiled tables: the eager ones
    faster = copy.deepcopy(cost)
    faster.compiled_chain_verify_seconds = [[t / 2 for t in row] for row in verify]
    faster.compiled_chain_seconds = [[[t / 4 for t in row] for row in ssm] for ssm in draft]
    router = ChainRouter(constant_predictor([[[0.0, 0.0]] * 2]), faster)
    eager = router._costs(1)
    router.costs_on_compiled_loop(True)
    compiled = router._costs(1)
    assert router.compiled
    np.testing.assert_allclose(compiled[0], eager[0] / 2)
    np.testing.assert_allclose(compiled[1], eager[1] / 4)
