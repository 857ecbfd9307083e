"""Weighted-majority speculation (ALGORITHMS.md section 6): votes and pruning on hand-made merged
trees, the weight update, weights that learn which SSM is right, and lossless decoding (greedy:
identical to `llm.generate`; sampling: the chi-square harness of test_sampling_lossless)."""

from __future__ import annotations

import functools
import itertools

import pytest
from conftest import tiny_llama
from test_greedy_equivalence import (
    ARCHS,
    CASES,
    always_wrong_ssm,
    check_stats,
    llm_for,
    noisy_ssm,
    prompt_ids,
    reference,
)
from test_sampling_lossless import VOCAB, check_decoder, spread

from specboost.decoder import BeamShape, ChainShape, Rule, SpeculativeDecoder, TopologyShape
from specboost.speculator.cost_model import CostModel
from specboost.speculator.length_control import make_length_controller
from specboost.speculator.majority import (
    MajorityConfig,
    MajoritySpeculator,
    MajorityWeights,
    PrunedPoolSpeculator,
    best_first,
    induced_subtree,
    node_scores,
    node_weights,
    paying_budget,
    plot_weight_history,
    prune,
    voted_path,
)
from specboost.speculator.tree import DraftKind, TokenTree, merge_trees


# Hand-made merged trees --------------------------------------------------------------------------------
def merged(*chains: list[int]) -> TokenTree:
    """The SpecInfer merge of one greedy chain per SSM (SSM i drafted chains[i])."""
    trees = []
    for ssm, chain in enumerate(chains):
        tree = TokenTree.root_only(99)
        tree.add_sequence(chain, ssm)
        trees.append(tree)
    return merge_trees(trees)


def voted_tokens(tree: TokenTree, weights: list[float]) -> tuple[list[int], list[int]]:
    """The voted chain's tokens and the SSMs whose sequence it is."""
    path = voted_path(tree, weights)
    return [tree.tokens[u] for u in path], sorted(tree.ssms[path[-1]])


THREE = ([1, 2, 3], [1, 2, 4], [5, 6, 7])  # SSMs 0 and 1 agree on two tokens


def test_node_weights() -> None:
    tree = merged(*THREE)
    w = node_weights(tree, [1.0, 2.0, 4.0])
    by_prefix = {tuple(tree.tokens[v] for v in tree.path_to(u)): w[u] for u in range(len(tree))}
    assert by_prefix == {
        (): 7.0,
        (1,): 3.0,
        (1, 2): 3.0,
        (1, 2, 3): 1.0,
        (1, 2, 4): 2.0,
        (5,): 4.0,
        (5, 6): 4.0,
        (5, 6, 7): 4.0,
    }


@pytest.mark.parametrize(
    ("weights", "tokens", "voted"),
    [
        ([1.0, 1.0, 1.0], [1, 2, 3], [0]),  # 2 > 1 at the root; tie 1 = 1 below: lowest SSM
        ([1.0, 1.0, 2.5], [5, 6, 7], [2]),  # 2.5 > 2: the lone SSM outweighs the pair
        ([1.0, 1.5, 2.5], [1, 2, 4], [1]),  # 2.5 = 2.5 tie at the root -> SSM 0's side; then 1.5 > 1
        ([0.6, 2.0, 2.5], [1, 2, 4], [1]),  # 2.6 > 2.5: the heaviest SSM loses to a pair
        ([0.1, 0.1, 1.0], [5, 6, 7], [2]),
    ],
)
def test_voted_path(weights: list[float], tokens: list[int], voted: list[int]) -> None:
    assert voted_tokens(merged(*THREE), weights) == (tokens, voted)


def test_vote_ties_go_to_the_lowest_ssm_whatever_the_insertion_order() -> None:
    tree = TokenTree.root_only(99)
    tree.add_sequence([7, 7], 2)  # inserted first: the root's first child
    tree.add_sequence([8, 8], 0)
    tree.add_sequence([7, 9], 1)
    # weights 1, 1, 2: node 7 (SSMs 1, 2) = 3 > node 8 = 1; then 7 (SSM 2) = 2 > 9 (SSM 1) = 1.
    assert voted_tokens(tree, [1.0, 1.0, 2.0]) == ([7, 7], [2])
    # weights 2, 1, 1: 7 = 2 = 8: tie -> SSM 0's node 8, although node 7 came first.
    assert voted_tokens(tree, [2.0, 1.0, 1.0]) == ([8, 8], [0])


def test_identical_chains_are_voted_together() -> None:
    tree = merged([3, 4], [3, 4], [5, 6])
    assert voted_tokens(tree, [1.0, 1.0, 1.5]) == ([3, 4], [0, 1])


def subtree_prefixes(tree: TokenTree) -> list[tuple[int, ...]]:
    return [tuple(tree.tokens[v] for v in tree.path_to(u)) for u in range(1, len(tree))]


@pytest.mark.parametrize("weights", [[1.0, 1.0, 1.0, 1.0], [0.3, 2.0, 1.0, 0.7], [5.0, 0.1, 0.2, 1.0]])
def test_prune_keeps_the_heaviest_nodes_with_their_parents(weights: list[float]) -> None:
    tree = merged([1, 2, 3, 4], [1, 2, 5, 6], [1, 7, 8, 9], [10, 11, 12, 13])
    all_weights = sorted(node_weights(tree, weights)[1:], reverse=True)
    original = set(subtree_prefixes(tree))
    for budget in range(1, len(tree) + 2):
        pruned = prune(tree, weights, budget)
        assert pruned.num_draft_tokens == min(budget, tree.num_draft_tokens)
        prefixes = subtree_prefixes(pruned)
        assert set(prefixes) <= original
        assert all(p[:-1] in prefixes or len(p) == 1 for p in prefixes)  # parents kept
        kept = sorted(node_weights(pruned, weights)[1:], reverse=True)
        assert kept == all_weights[: len(kept)]  # the heaviest ones (proposers are kept with a node)
        assert pruned.tokens[0] == 99 and pruned.kind is tree.kind


def test_prune_ties_prefer_shallow_nodes() -> None:
    tree = merged([1, 2], [3, 4])
    assert subtree_prefixes(prune(tree, [1.0, 1.0], 2)) == [(1,), (3,)]
    assert subtree_prefixes(prune(tree, [1.0, 1.5], 2)) == [(3,), (3, 4)]


def test_induced_subtree_needs_parents() -> None:
    tree = merged([1, 2])
    with pytest.raises(ValueError, match="without its parent"):
        induced_subtree(tree, [2])


# The weight update -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(reward_threshold=0.2, punish_threshold=0.5), "punish_threshold <= reward_threshold"),
        (dict(reward_threshold=1.5), "reward_threshold <= 1"),
        (dict(reward_factor=1.0), "reward_factor must be > 1"),
        (dict(punish_factor=1.2), r"punish_factor must be in \(0, 1\)"),
        (dict(update_every=0), "update_every must be >= 1"),
        (dict(weight_range=(2.0, 10.0)), "weight_range"),
    ],
)
def test_config_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        MajorityConfig(**kwargs)


def test_initial_weights_validation() -> None:
    with pytest.raises(ValueError, match="2 weights for 3 SSMs"):
        MajorityWeights(3, MajorityConfig(), [1.0, 1.0])
    with pytest.raises(ValueError, match="positive and finite"):
        MajorityWeights(2, MajorityConfig(), [1.0, 0.0])


def test_weight_update_trace() -> None:
    """update_every=2: ACR over both steps. SSM 0: 5/6 > 0.6 reward; SSM 1: 1/4 < 0.3 punish;
    SSM 2: 2/4 in between, unchanged; SSM 3 not credited, unchanged. Then the clip at the range."""
    config = MajorityConfig(update_every=2, weight_range=(0.6, 1.5))
    weights = MajorityWeights(4, config)
    weights.record({0: 3, 1: 2}, {0: 3, 1: 1})
    assert weights.history == [[1.0] * 4]  # not yet
    weights.record({0: 3, 1: 2, 2: 4}, {0: 2, 2: 2})
    assert weights.weights == [1.25, 0.8, 1.0, 1.0]
    for _ in range(2):
        weights.record({0: 1, 1: 1}, {0: 1})
    assert weights.weights == pytest.approx([1.5, 0.64, 1.0, 1.0])  # 1.5625 clipped
    for _ in range(2):
        weights.record({1: 1}, {})
    assert weights.weights == [1.5, 0.6, 1.0, 1.0]  # 0.512 clipped
    assert len(weights.history) == 4
    weights.start_sequence()
    assert weights.history == [[1.5, 0.6, 1.0, 1.0]]


# Weights learn which SSM is right ------------------------------------------------------------------------
@functools.cache
def right_and_wrong(arch: str, prompt_seed: int, length: int, max_new: int):
    llm = llm_for(arch, 0)
    ids = prompt_ids(prompt_seed, length)
    expected = reference(arch, 0, ids, max_new)
    wrong = always_wrong_ssm(arch, set(expected[0, length:].tolist()))
    return llm, wrong, ids, expected


def test_majority_weights_find_the_right_ssm() -> None:
    """Two identical always-wrong SSMs outvote the LLM's copy at first (weight 2 against 1); each
    update punishes them (ACR 0) until 2 * 0.8^4 < 1, then the copy is voted and rewarded."""
    llm, wrong, ids, expected = right_and_wrong("llama", 12, 3, 40)
    config = MajorityConfig(update_every=1)
    speculator = MajoritySpeculator([wrong, wrong, llm], length=3, config=config)
    out = SpeculativeDecoder(llm, [wrong, wrong, llm], speculator=speculator).generate(ids, max_new_tokens=40)
    assert out.sequences.tolist() == expected.tolist()
    report = out.stats.strategy
    assert report["strategy"] == "majority"
    assert report["voted"][:5] == [[0, 1]] * 4 + [[2]]
    assert all(v == [2] for v in report["voted"][4:-1])
    assert out.stats.match_lengths[:4] == [0] * 4 and out.stats.match_lengths[4] == 3
    history = report["weights"]
    assert len(history) == out.stats.llm_steps + 1
    assert history[4] == pytest.approx([0.8**4, 0.8**4, 1.0])
    assert all(a[2] <= b[2] and a[0] >= b[0] for a, b in itertools.pairwise(history))
    assert history[-1][2] > 1.0 > history[-1][0] == history[-1][1]
    # The weights rate the SSMs, not the sequence: the next generate starts from them.
    again = SpeculativeDecoder(llm, [wrong, wrong, llm], speculator=speculator).generate(
        ids, max_new_tokens=40
    )
    assert again.stats.strategy["weights"][0] == history[-1]
    assert again.stats.strategy["voted"][0] == [2]


def test_pruned_pool_weights_find_the_right_ssm() -> None:
    """Budget 4 over chains of 4. The always-wrong SSM is sure of its tokens and the LLM's copy is
    not (a random model), so at equal weights the wrong SSM's chain fills the budget; each step
    punishes it (ACR 0) until its nodes score below the copy's, then the copy's tokens are kept,
    accepted, and the copy is rewarded."""
    llm, wrong, ids, expected = right_and_wrong("gpt2", 13, 5, 30)
    speculator = PrunedPoolSpeculator(
        [wrong, llm], ChainShape(4), budget=4, config=MajorityConfig(update_every=1)
    )
    out = SpeculativeDecoder(llm, [wrong, llm], speculator=speculator).generate(ids, max_new_tokens=30)
    assert out.sequences.tolist() == expected.tolist()
    history, lengths = out.stats.strategy["weights"], out.stats.match_lengths
    turn = next(step for step, accepted in enumerate(lengths) if accepted)
    assert history[: turn + 1] == [pytest.approx([0.8**step, 1.0]) for step in range(turn + 1)]
    assert history[-1][1] > 1.0 > history[-1][0]  # the copy rewarded, the wrong SSM punished
    assert out.stats.strategy["strategy"] == "pruned" and out.stats.strategy["budget"] == 4


def test_node_scores_weigh_each_ssms_own_probability() -> None:
    """c_v = sum over v's proposers of w_i p_i(v) / the weight through v's parent; path products."""
    tree = TokenTree.root_only(99)
    tree.add_sequence([1, 2], ssm=0, ps=[0.5, 0.8])
    tree.add_sequence([1, 3], ssm=1, ps=[0.9, 0.6])
    tree.add_sequence([4], ssm=2)  # probability not recorded: 1
    weights = [1.0, 2.0, 1.0]
    score = node_scores(tree, weights)
    one = (1.0 * 0.5 + 2.0 * 0.9) / 4.0
    assert score == pytest.approx([1.0, one, one * 0.8 * 1 / 3, one * 0.6 * 2 / 3, 1 / 4])
    assert best_first(tree, score) == [1, 4, 3, 2]


def test_paying_budget_keeps_the_nodes_worth_their_verification() -> None:
    """A chain whose scores fall fast: each node pays while its score exceeds the step's marginal cost."""
    tree = TokenTree.root_only(99)
    tree.add_sequence([1, 2, 3, 4], ssm=0, ps=[0.9, 0.9, 0.2, 0.9])  # scores 0.9, 0.81, 0.162, 0.146
    assert paying_budget(tree, [1.0], lambda n: 1.0) == 4  # verification free: keep everything
    assert paying_budget(tree, [1.0], lambda n: 1.0 + 0.1 * n) == 2  # rates 1, 1.73, 2.26, 2.21, 2.16
    assert paying_budget(tree, [1.0], lambda n: 1.0 + 2.0 * n) == 0  # nothing pays: verify none


def test_pruned_pool_with_a_cost_model_is_lossless_and_keeps_what_pays() -> None:
    """No budget: each step keeps the number of best nodes the cost model says pays; greedy output
    still equals generate."""
    llm_seed, prompt_seed, length, max_new = CASES[0]
    ssms = [noisy_ssm("llama", llm_seed, 0.1, 0), noisy_ssm("llama", llm_seed, 0.3, 1)]
    cost = CostModel("test", [1, 64], [1.0, 64.0], [{}, {}], [0.1, 0.1])  # every node costs a token
    speculator = PrunedPoolSpeculator(ssms, BeamShape(2, 3), budget=None, cost_model=cost)
    ids = prompt_ids(prompt_seed, length)
    out = SpeculativeDecoder(llm_for("llama", llm_seed), ssms, speculator=speculator).generate(
        ids, max_new_tokens=max_new
    )
    assert out.sequences.tolist() == reference("llama", llm_seed, ids, max_new).tolist()
    kept = out.stats.strategy["kept"]
    assert out.stats.strategy["budget"] == "profile" and len(kept) == out.stats.llm_steps
    assert max(kept) < 12  # a node costs as much as an LLM token: only sure ones pay
    with pytest.raises(ValueError, match=r"budget .* or a cost model"):
        PrunedPoolSpeculator(ssms, BeamShape(2, 3), budget=None)


# Greedy: identical to llm.generate -------------------------------------------------------------------------
MAJORITY_CONFIGS = {  # SSMs, length controller and its settings
    "2-ssms": (2, None, {}),
    "3-ssms": (3, None, {}),
    "3-ssms-bass": (3, "bass", dict(l0=3, l_limit=8)),
    "2-ssms-minions": (2, "minions", dict(initial=3, decision_threshold=2)),
}


@pytest.mark.parametrize("config", sorted(MAJORITY_CONFIGS))
@pytest.mark.parametrize("arch", ARCHS)
def test_majority_greedy_identical_to_generate(arch: str, config: str) -> None:
    num_ssms, controller, settings = MAJORITY_CONFIGS[config]
    scales = [0.05, 0.3, 0.15][:num_ssms]
    for llm_seed, prompt_seed, length, max_new in CASES:
        ssms = [noisy_ssm(arch, llm_seed, scale, i) for i, scale in enumerate(scales)]
        speculator = MajoritySpeculator(
            ssms,
            length=3,
            length_controller=make_length_controller(controller, **settings),
            config=MajorityConfig(update_every=2),
        )
        ids = prompt_ids(prompt_seed, length)
        out = SpeculativeDecoder(llm_for(arch, llm_seed), ssms, speculator=speculator).generate(
            ids, max_new_tokens=max_new
        )
        assert out.sequences.tolist() == reference(arch, llm_seed, ids, max_new).tolist()
        check_stats(out, length, num_ssms)
        report = out.stats.strategy
        assert len(report["voted"]) == out.stats.llm_steps
        assert ("lengths" in report) == (controller is not None)


@pytest.mark.parametrize(
    "shape", [ChainShape(3), BeamShape(2, 3), TopologyShape.from_children_counts([[2], [2, 1]])]
)
def test_pruned_pool_greedy_identical_to_generate(shape) -> None:
    for llm_seed, prompt_seed, length, max_new in CASES[:2]:
        ssms = [noisy_ssm("opt", llm_seed, 0.1, 0), noisy_ssm("opt", llm_seed, 0.3, 1)]
        speculator = PrunedPoolSpeculator(ssms, shape, budget=3)
        ids = prompt_ids(prompt_seed, length)
        out = SpeculativeDecoder(llm_for("opt", llm_seed), ssms, speculator=speculator).generate(
            ids, max_new_tokens=max_new
        )
        assert out.sequences.tolist() == reference("opt", llm_seed, ids, max_new).tolist()
        assert out.stats.draft_tokens <= 3 * out.stats.llm_steps
        check_stats(out, length, 2)


# Sampling ---------------------------------------------------------------------------------------------------
def test_tree_kinds_under_sampling() -> None:
    ssms = [tiny_llama(layers=1, seed=s) for s in (1, 2)]
    assert MajoritySpeculator(ssms).tree_kind(True) is DraftKind.GREEDY
    assert PrunedPoolSpeculator(ssms, BeamShape(2, 2)).tree_kind(True) is DraftKind.BEAM
    assert PrunedPoolSpeculator(ssms[:1], ChainShape(3)).tree_kind(True) is DraftKind.SAMPLED
    assert PrunedPoolSpeculator(ssms, ChainShape(3)).tree_kind(True) is DraftKind.SELECTED
    assert PrunedPoolSpeculator(ssms, ChainShape(3)).tree_kind(False) is DraftKind.GREEDY
    with pytest.raises(ValueError, match="budget must be >= 1"):
        PrunedPoolSpeculator(ssms, budget=0)


@pytest.mark.parametrize("rule", ["mss", "without_replacement"])
def test_selected_trees_refuse_rules_that_need_q(rule: str) -> None:
    """A pool's pruned sampled chains are SELECTED: the default rule is target sampling, and the
    rules that trust the recorded q are refused before anything is drafted."""
    llm, ssms = llm_for("llama", 0), [noisy_ssm("llama", 0, s, i) for i, s in enumerate((0.1, 0.3))]
    verifier = SpeculativeDecoder(llm, ssms, speculator=PrunedPoolSpeculator(ssms, ChainShape(3))).verifier
    assert verifier.check(DraftKind.SELECTED, True, 2) is Rule.TARGET
    assert verifier.check(DraftKind.SELECTED, False, 2) is Rule.GREEDY
    dec = SpeculativeDecoder(llm, ssms, speculator=PrunedPoolSpeculator(ssms, ChainShape(3)), rule=rule)
    with pytest.raises(ValueError, match=rf"rule='{rule}' is only lossless on trees drafted as .*'selected'"):
        dec.generate(prompt_ids(0, 3), max_new_tokens=4, do_sample=True)


class AlwaysSelected(PrunedPoolSpeculator):
    """A pruned pool that calls its trees SELECTED also under greedy decoding."""

    def tree_kind(self, do_sample: bool, seeded: bool = False) -> DraftKind:
        return DraftKind.SELECTED


def test_selected_trees_greedy_identical_to_generate() -> None:
    for llm_seed, prompt_seed, length, max_new in CASES[:2]:
        ssms = [noisy_ssm("llama", llm_seed, 0.1, 0), noisy_ssm("llama", llm_seed, 0.3, 1)]
        dec = SpeculativeDecoder(llm_for("llama", llm_seed), ssms, speculator=AlwaysSelected(ssms, budget=5))
        ids = prompt_ids(prompt_seed, length)
        out = dec.generate(ids, max_new_tokens=max_new)
        assert out.sequences.tolist() == reference("llama", llm_seed, ids, max_new).tolist()
        assert out.stats.accepted_tokens > 0
        check_stats(out, length, 2)


def test_majority_sampling_is_lossless() -> None:
    """Three SSMs vote on greedy chains (the vote depends on every SSM's draft), verified by target
    sampling; T=0.8, top_k=5. Weights update every step and carry over between the calls."""
    llm = spread(tiny_llama(layers=2, seed=1, vocab=VOCAB))
    ssms = [spread(tiny_llama(layers=1, seed=s, vocab=VOCAB)) for s in (2, 3, 4)]
    speculator = MajoritySpeculator(ssms, length=2, config=MajorityConfig(update_every=1))
    dec = SpeculativeDecoder(llm, ssms, speculator=speculator)
    check_decoder(dec, 3, seed0=70_000, min_accepted=0.15, temperature=0.8, top_k=5)
    assert len(set(speculator.weights)) > 1  # the vote was weighted, not a plain count


def test_pruned_pool_of_sampled_chains_is_lossless() -> None:
    """Two SSMs draft sampled chains of 3, cut to the 3 heaviest nodes (SELECTED trees), verified
    by target sampling; T=0.9, top_p=0.95. Weights update every step and carry over."""
    llm = spread(tiny_llama(layers=2, seed=1, vocab=VOCAB))
    ssms = [spread(tiny_llama(layers=1, seed=s, vocab=VOCAB)) for s in (2, 3)]
    speculator = PrunedPoolSpeculator(ssms, ChainShape(3), budget=3, config=MajorityConfig(update_every=1))
    dec = SpeculativeDecoder(llm, ssms, speculator=speculator)
    check_decoder(dec, 3, seed0=80_000, min_accepted=0.15, temperature=0.9, top_p=0.95)
    assert dec.verifier.check(speculator.tree_kind(True), True, 2) is Rule.TARGET


# Plot -------------------------------------------------------------------------------------------------------
def test_plot_weight_history(tmp_path) -> None:
    report = {"strategy": "majority", "weights": [[1.0, 1.0], [1.25, 0.8]], "majority": {"update_every": 4}}
    plot_weight_history(report, tmp_path / "a.png")
    plot_weight_history({"new_tokens": 3, "strategy": report}, tmp_path / "b.png")  # DecodeStats.to_dict()
    assert (tmp_path / "a.png").read_bytes()[:4] == b"\x89PNG" and (tmp_path / "b.png").stat().st_size > 0
    with pytest.raises(ValueError, match="no weight history"):
        plot_weight_history({"strategy": {"strategy": "pool"}}, tmp_path / "c.png")
