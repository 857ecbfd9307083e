"""Adaptive speculation length (ALGORITHMS.md section 7): the two update rules on hand-computed
traces, and greedy decoding with a controller choosing the chain length stays identical to
`llm.generate`."""

from __future__ import annotations

import pytest
from test_greedy_equivalence import ARCHS, CASES, check_stats, llm_for, noisy_ssm, prompt_ids, reference

from specboost.decoder import BeamShape, SpeculativeDecoder
from specboost.speculator.length_control import (
    BassLengthConfig,
    BassLengthController,
    MinionsLengthConfig,
    MinionsLengthController,
    fit_slope,
    make_length_controller,
)
from specboost.speculator.speculation import PoolSpeculator


def feed(controller, steps: list[tuple[list[int], float]]) -> list[int]:
    for accepted, seconds in steps:
        controller.update(accepted, seconds)
    return controller.history


# BASS Algorithm 1 -----------------------------------------------------------------------------------
def test_bass_trace_by_hand() -> None:
    """l0=7, l_incre=2, l_mod=10, l_limit=32. Each line: accepted counts -> (l, s) by the rule."""
    steps = [
        [7],  # max == l=7: l = min(7+2, 32) = 9, s = 0
        [3],  # miss: 9 - ceil(0.9)=1 - s=0 = 8; max(1, 3, 8) = 8, s = 1
        [2],  # miss: 8 - 1 - 1 = 6; max(1, 2, 6) = 6
        [6],  # hit: 8, s = 0
        [8],  # hit: 10
        [10],  # hit: 12
        [0],  # miss: 12 - ceil(1.2)=2 - 0 = 10; max(1, 0, 10) = 10, s = 1
        [0],  # miss: 10 - 1 - 1 = 8
        [1, 7, 3],  # a batch, max 7: 8 - 1 - 1 = 6, but never below max(x): 7
        [7, 0],  # hit (max == l): 9, s = 0
    ]
    controller = BassLengthController()
    assert feed(controller, [(x, 0.0) for x in steps]) == [7, 9, 8, 6, 8, 10, 12, 10, 8, 7, 9]


def test_bass_limits() -> None:
    controller = BassLengthController(BassLengthConfig(l0=30))
    assert feed(controller, [([30], 0.0), ([32], 0.0)]) == [30, 32, 32]  # capped at l_limit
    controller = BassLengthController(BassLengthConfig(l0=2))
    # 2 - 1 - 0 = 1; then 1 - 1 - 1 = -1 -> floor 1
    assert feed(controller, [([0], 0.0), ([0], 0.0), ([0], 0.0)]) == [2, 1, 1, 1]
    controller.reset()
    assert (controller.history, controller.s) == ([2], 0)


# Minions 3.3 ------------------------------------------------------------------------------------------
def test_fit_slope() -> None:
    assert fit_slope([1.0, 2.0, 3.0]) == pytest.approx(1.0)
    assert fit_slope([3.0, 2.0, 1.0]) == pytest.approx(-1.0)
    assert fit_slope([0.5, 0.5, 0.5, 0.5]) == 0.0
    assert fit_slope([0.0, 1.0, 0.0, 1.0]) == pytest.approx(0.2)  # covariance 1 / variance 5


def test_minions_trace_by_hand() -> None:
    """Records are t_LLM / (mean accepted + 1); a decision after 3 records since the last one."""
    controller = MinionsLengthController(MinionsLengthConfig(initial=4, decision_threshold=3))
    rising = [([0], 1.0), ([1], 4.0), ([0], 3.0)]  # costs 1, 2, 3: slope +1 -> s = 4 - 1
    falling = [([0], 3.0), ([1, 3], 6.0), ([2], 3.0)]  # costs 3, 2, 1: slope -1 -> s = 3 + 1
    flat = [([1], 2.0)] * 4  # costs 1, 1, 1, 1: slope 0 -> no decision, the window keeps growing
    history = feed(controller, rising + falling + flat)
    assert history == [4, 4, 4, 3, 3, 3, 4, 4, 4, 4, 4]
    assert controller.records == [1.0] * 4
    feed(controller, [([0], 2.0)])  # costs 1, 1, 1, 1, 2: slope 0.2 > 0 -> s = 3
    assert (controller.length(), controller.records) == (3, [])


def test_minions_bounds_and_step_sizes() -> None:
    config = MinionsLengthConfig(
        initial=3, decision_threshold=2, s_reward=2, s_punish=2, min_length=2, max_length=6
    )
    controller = MinionsLengthController(config)
    rising, falling = [([0], 1.0), ([0], 2.0)], [([0], 2.0), ([0], 1.0)]
    # 3 - 2 -> clamped to 2; a decision at the bound still starts a new window; then 2+2, 4+2, 6 (max).
    assert feed(controller, rising + falling * 3) == [3, 3, 2, 2, 4, 4, 6, 6, 6]


# Configs and factory ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: BassLengthConfig(l0=0), "l0 must be >= 1"),
        (lambda: BassLengthConfig(l_mod=0), "l_mod must be >= 1"),
        (lambda: BassLengthConfig(l0=8, l_limit=4), "l_limit must be >= l0"),
        (lambda: MinionsLengthConfig(decision_threshold=1), "decision_threshold must be >= 2"),
        (lambda: MinionsLengthConfig(initial=20), "min_length <= initial <= max_length"),
        (lambda: MinionsLengthConfig(s_punish=0), "s_punish must be >= 1"),
        (lambda: make_length_controller("linear"), "unknown length controller 'linear'"),
        (lambda: make_length_controller(None, l0=3), "without a length controller"),
        (lambda: BassLengthController().update([], 0.1), "at least one sequence"),
    ],
)
def test_invalid_settings(make, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make()


def test_factory() -> None:
    assert make_length_controller(None) is None
    bass = make_length_controller("bass", l0=5, l_limit=9)
    assert isinstance(bass, BassLengthController) and bass.length() == 5
    assert bass.describe() == {"name": "bass", "l0": 5, "l_incre": 2, "l_mod": 10, "l_limit": 9}
    minions = make_length_controller("minions", initial=6)
    assert isinstance(minions, MinionsLengthController) and minions.length() == 6


def test_controller_needs_chains() -> None:
    ssm = noisy_ssm("llama", 0, 0.1, 0)
    with pytest.raises(ValueError, match="use ChainShape"):
        PoolSpeculator([ssm], BeamShape(2, 3), length_controller=make_length_controller("bass"))


# End to end: greedy decoding with the length chosen per step ----------------------------------------------
@pytest.mark.parametrize("kind", ["bass", "minions"])
@pytest.mark.parametrize("arch", ARCHS)
def test_pool_with_controller_greedy_identical_to_generate(arch: str, kind: str) -> None:
    settings = {"bass": dict(l0=3, l_limit=8), "minions": dict(initial=3, decision_threshold=2)}[kind]
    for llm_seed, prompt_seed, length, max_new in CASES:
        ssms = [noisy_ssm(arch, llm_seed, 0.05, 0), noisy_ssm(arch, llm_seed, 0.3, 1)]
        speculator = PoolSpeculator(ssms, length_controller=make_length_controller(kind, **settings))
        ids = prompt_ids(prompt_seed, length)
        out = SpeculativeDecoder(llm_for(arch, llm_seed), ssms, speculator=speculator).generate(
            ids, max_new_tokens=max_new
        )
        assert out.sequences.tolist() == reference(arch, llm_seed, ids, max_new).tolist()
        check_stats(out, length, len(ssms))
        lengths = out.stats.strategy["lengths"]
        assert len(lengths) == out.stats.llm_steps
        assert all(m <= n for m, n in zip(out.stats.match_lengths, lengths, strict=True))
        assert out.stats.strategy["length_controller"]["name"] == kind


def test_bass_grows_while_everything_is_accepted() -> None:
    """An SSM equal to the LLM: every draft is accepted, so l grows by l_incre per step (up to the
    end, where the drafts are cut to the tokens still wanted)."""
    llm = llm_for("llama", 1)
    speculator = PoolSpeculator([llm], length_controller=make_length_controller("bass", l0=2))
    ids = prompt_ids(8, 4)
    out = SpeculativeDecoder(llm, [llm], speculator=speculator).generate(ids, max_new_tokens=30)
    assert out.sequences.tolist() == reference("llama", 1, ids, 30).tolist()
    assert out.stats.strategy["lengths"] == [2, 4, 6, 8, 10]
    assert out.stats.match_lengths == [2, 4, 6, 8, 5]  # 3 + 5 + 7 + 9 = 24 tokens, 6 still wanted
