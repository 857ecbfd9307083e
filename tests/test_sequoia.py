"""Sequoia trees (ALGORITHMS.md section 8): the DP against brute force over every ordered tree,
acceptance vectors from hand-made logits, the hardware-aware choice on a fake cost model, and
`SequoiaSpeculator` inside the decoder (greedy = llm.generate; sampling keeps the LLM's
distribution, by the chi-square harness of test_sampling_lossless)."""

from __future__ import annotations

import functools
import itertools
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_greedy_equivalence import CASES, check_stats, llm_for, noisy_ssm, prompt_ids, reference
from test_sampling_lossless import check_decoder, models  # noqa: F401  (models: a fixture)
from transformers import AutoModelForCausalLM, GenerationConfig

from specboost.decoder import Rule, SpeculativeDecoder
from specboost.decoder.tiny_models import build_tiny_models
from specboost.speculator.sampling import LogitsToProbs, SamplingConfig
from specboost.speculator.sequoia import SequoiaSpeculator
from specboost.speculator.sequoia_acceptance import AcceptanceVector, load_acceptance_file
from specboost.speculator.sequoia_dp import chains_shape, expected_tokens, optimal_tree, shape_depth, solve
from specboost.speculator.sequoia_hardware import choose_tree_size, relative_costs
from specboost.speculator.shapes import TopologyShape
from specboost.training.sequoia_acceptance import (
    distilled_samples,
    estimate_acceptance,
    greedy_counts,
    without_replacement_counts,
)
from specboost.training.sequoia_trees import main

MAX_BRUTE_NODES = 8


# Brute force: every rooted ordered tree, as nested tuples of children --------------------------------
@functools.cache
def ordered_trees(nodes: int) -> tuple[tuple, ...]:
    """Every ordered tree of exactly `nodes` nodes (child order matters: child j weighs w_j): a
    root and an ordered forest of the other nodes."""
    return ordered_forests(nodes - 1)


@functools.cache
def ordered_forests(nodes: int) -> tuple[tuple, ...]:
    """Every ordered sequence of trees with `nodes` nodes in all."""
    if nodes == 0:
        return ((),)
    return tuple(
        (first, *rest)
        for size in range(1, nodes + 1)
        for first in ordered_trees(size)
        for rest in ordered_forests(nodes - size)
    )


def value(tree: tuple, weights: tuple[float, ...]) -> float:
    return 1.0 + sum(
        (weights[j] if j < len(weights) else 0.0) * value(child, weights) for j, child in enumerate(tree)
    )


def depth(tree: tuple) -> int:
    return 1 + max(map(depth, tree)) if tree else 0


def brute_force(weights: tuple[float, ...], nodes: int, max_depth: int | None) -> float:
    return max(
        value(tree, weights)
        for size in range(1, nodes + 1)
        for tree in ordered_trees(size)
        if max_depth is None or depth(tree) <= max_depth
    )


def test_tree_enumeration_counts_catalan() -> None:
    assert [len(ordered_trees(n)) for n in range(1, 9)] == [1, 1, 2, 5, 14, 42, 132, 429]


probabilities = st.floats(0.0, 1.0, allow_nan=False)
decreasing = st.lists(probabilities, min_size=1, max_size=4).map(lambda w: tuple(sorted(w, reverse=True)))
any_order = st.lists(probabilities, min_size=1, max_size=4).map(tuple)


def check_against_brute_force(weights: tuple[float, ...], nodes: int, max_depth: int | None) -> None:
    table = solve(weights, nodes, max_depth)
    best = table.value(nodes, max_depth)
    assert best == pytest.approx(brute_force(weights, nodes, max_depth), abs=1e-12)
    tree = table.tree(nodes, max_depth)
    assert tree.nodes <= nodes
    assert max_depth is None or tree.depth <= max_depth
    assert tree.expected_tokens == pytest.approx(best, abs=1e-12)  # F(T) recomputed from the topology


@settings(max_examples=40, deadline=None)
@given(weights=decreasing, nodes=st.integers(1, MAX_BRUTE_NODES), max_depth=st.none() | st.integers(0, 4))
def test_dp_equals_brute_force(weights, nodes, max_depth) -> None:
    check_against_brute_force(weights, nodes, max_depth)


@pytest.mark.parametrize("weights", [(0.9,), (0.6, 0.3), (0.5, 0.3, 0.1), (0.4, 0.35, 0.2, 0.05)])
def test_dp_equals_brute_force_on_the_whole_grid(weights) -> None:
    for nodes in range(1, MAX_BRUTE_NODES + 1):
        for max_depth in (None, 0, 1, 2, 3):
            check_against_brute_force(weights, nodes, max_depth)


@settings(max_examples=25, deadline=None)
@given(weights=any_order, nodes=st.integers(1, 7), max_depth=st.none() | st.integers(1, 3))
def test_dp_equals_brute_force_for_non_monotone_rates(weights, nodes, max_depth) -> None:
    """Measured vectors need not decrease; the DP stays exact (a child needs its elder siblings)."""
    check_against_brute_force(weights, nodes, max_depth)


@settings(max_examples=25, deadline=None)
@given(weights=decreasing, max_nodes=st.integers(1, 40))
def test_unbounded_equals_deep_bound_and_grows_with_size(weights, max_nodes) -> None:
    table = solve(weights, max_nodes)
    bounded = solve(weights, max_nodes, max_nodes)
    values = [table.value(n) for n in range(1, max_nodes + 1)]
    assert values == [bounded.value(n, max_nodes) for n in range(1, max_nodes + 1)]
    assert table.tree(max_nodes).shape == bounded.tree(max_nodes, max_nodes).shape
    assert all(a <= b for a, b in itertools.pairwise(values))  # non-decreasing in n
    by_depth = [table.value(max_nodes, d) for d in range(max_nodes)]
    assert all(a <= b for a, b in itertools.pairwise(by_depth))  # and in the depth bound


def test_tree_is_breadth_first_in_rank_order() -> None:
    """Levels come in order, so the drafter can fill the tree one level per SSM pass; the
    rank-1 child carries the largest subtree."""
    tree = optimal_tree((0.7, 0.15, 0.05), 40)
    parents = tree.shape.parents
    depths = [0] * len(parents)
    for u in range(1, len(parents)):
        depths[u] = depths[parents[u]] + 1
    assert depths == sorted(depths)
    assert list(parents[1:]) == sorted(parents[1:])  # breadth-first: parents in order
    root_children = tree.shape.children()[0]
    sizes = [subtree_size(tree.shape, c) for c in root_children]
    assert sizes == sorted(sizes, reverse=True)
    assert shape_depth(tree.shape) == tree.depth == max(depths)


def subtree_size(shape: TopologyShape, node: int) -> int:
    return 1 + sum(subtree_size(shape, c) for c in shape.children()[node])


def test_hand_computed_trees() -> None:
    # One rank: the best tree is a chain, F = 1 + w + w^2 + ...
    assert optimal_tree((0.5,), 4).shape.parents == (-1, 0, 1, 2)
    assert optimal_tree((0.5,), 4).expected_tokens == pytest.approx(1.875)
    # Depth 1: a star of the first ranks.
    star = optimal_tree((0.5, 0.3, 0.1), 10, depth=1)
    assert star.shape.parents == (-1, 0, 0, 0) and star.expected_tokens == pytest.approx(1.9)
    # 3 nodes, w = (0.5, 0.4): chain 1 + 0.5 + 0.25 = 1.75 < star 1 + 0.5 + 0.4 = 1.9.
    assert optimal_tree((0.5, 0.4), 3).shape.parents == (-1, 0, 0)


def test_chains_shape() -> None:
    assert chains_shape(7, 3).parents == (-1, 0, 0, 0, 1, 2, 3)
    assert chains_shape(6, 2).parents == (-1, 0, 0, 1, 2, 3)  # lengths 3 and 2
    assert chains_shape(3, 4).parents == (-1, 0, 0)  # more chains than drafts
    # k chains = 1 + (w_1 + ... + w_k)(1 + w_1 + ... + w_1^(L-1)) under the positional model
    w = (0.6, 0.2, 0.1)
    assert expected_tokens(chains_shape(7, 2), w) == pytest.approx(1 + 0.8 * (1 + 0.6 + 0.36))


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        solve((1.2,), 4)
    with pytest.raises(ValueError, match="tree size"):
        solve((0.5,), 4).tree(5)


# Acceptance vectors ---------------------------------------------------------------------------------
def test_greedy_counts_on_hand_made_logits() -> None:
    """SSM ranking per position vs the LLM's argmax: ranks 1, 2, 1, 3, beyond, 1."""
    ssm = torch.tensor([[4.0, 3, 2, 1]] * 6)  # ranks: token 0, 1, 2, 3
    llm_argmax = [0, 1, 0, 2, 3, 0]
    llm = torch.nn.functional.one_hot(torch.tensor(llm_argmax), 4).double()
    assert greedy_counts(llm, ssm, 3) == [3, 1, 1]
    acceptance = AcceptanceVector.from_counts([3, 1, 1], 6, rule="greedy", num_positions=6)
    assert acceptance.p == pytest.approx((3 / 6, 1 / 3, 1 / 2))
    assert acceptance.marginal == pytest.approx((3 / 6, 1 / 6, 1 / 6))
    assert AcceptanceVector.from_counts([2, 0], 2, rule="greedy", num_positions=2).p == (1.0, 0.0)


def test_without_replacement_counts_on_hand_made_distributions() -> None:
    """p = (0.6, 0.1, 0.3), q = (0.3, 0.3, 0.4), 3 children, worked by hand through Sequoia's rule:
    child 1 is accepted with sum min(p, q) = 0.7; after rejecting token 1 (prob 0.2) or token 2
    (prob 0.1) the residual is (1, 0, 0) and D is (3/7, 0, 4/7) or (1/2, 1/2, 0), so child 2 is
    accepted with 0.2 * 3/7 + 0.1 * 1/2; child 3 covers the rest (the cover property)."""
    p, q = torch.tensor([[0.6, 0.1, 0.3]]), torch.tensor([[0.3, 0.3, 0.4]])
    probs = LogitsToProbs(SamplingConfig(do_sample=True))
    trials = 6000
    counts = without_replacement_counts(
        p.log().double(), q.log().double(), 3, probs, trials, torch.Generator().manual_seed(0)
    )
    marginal = [0.7, 0.2 * 3 / 7 + 0.05, 0.2 * 4 / 7 + 0.05]
    assert sum(counts) == trials
    assert [c / trials for c in counts] == pytest.approx(marginal, abs=0.02)
    vector = AcceptanceVector.from_counts(counts, trials, rule="without_replacement", num_positions=1)
    assert vector.p == pytest.approx([0.7, (0.6 / 7 + 0.05) / 0.3, 1.0], abs=0.04)


def test_estimate_acceptance_of_the_llm_itself() -> None:
    """An SSM equal to the LLM: rank 1 always wins, greedy and without replacement alike."""
    llm = llm_for("llama", 0)
    samples = [([1, 2, 3], [4, 5, 6, 7]), ([], [9, 8, 7])]
    greedy = estimate_acceptance(llm, llm, samples, k=3)
    assert greedy.p == (1.0, 0.0, 0.0) and greedy.num_positions == 4 + 2 and greedy.rule == "greedy"
    sampled = estimate_acceptance(
        llm, llm, samples, k=2, sampling=SamplingConfig(do_sample=True, temperature=0.7), simulations=3
    )
    assert sampled.p == (1.0, 0.0) and sampled.rule == "without_replacement" and sampled.simulations == 3


def test_acceptance_vector_json_round_trip(tmp_path: Path) -> None:
    vector = AcceptanceVector((0.8, 0.4, 0.1), "without_replacement", 123, temperature=0.7, top_p=0.9)
    vector.save(tmp_path / "a.json")
    assert AcceptanceVector.load(tmp_path / "a.json") == vector
    (tmp_path / "old.json").write_text(json.dumps({"acceptance": [vector.to_dict()]}))
    with pytest.raises(ValueError, match="format_version"):
        load_acceptance_file(tmp_path / "old.json")
    with pytest.raises(ValueError, match="load_acceptance_file"):
        AcceptanceVector.load(tmp_path / "old.json")
    assert vector.sampling == SamplingConfig(do_sample=True, temperature=0.7, top_p=0.9)
    with pytest.raises(ValueError, match="rule"):
        AcceptanceVector((0.5,), "mss", 1)


# Hardware-aware choice -------------------------------------------------------------------------------
class FakeCostModel:
    """Seconds: verifying up to `flat` tokens costs one unit, then `slope` per extra token."""

    def __init__(self, flat: int, slope: float, ssm_step: float) -> None:
        self.flat, self.slope, self.ssm_step = flat, slope, ssm_step

    def verify_time(self, n_tokens: int) -> float:
        return 2.0 * (1.0 + self.slope * max(0, n_tokens - self.flat))

    def ssm_step_time(self, ssm: int) -> float:
        return 2.0 * self.ssm_step


def test_hardware_choice_deep_chain() -> None:
    """One rank (w = 0.8): chains only. Speedup(d+1, d) = (1 - 0.8^(d+1)) / 0.2 / (t(d+1) + 0.1 d):
    d=1 1.636, d=2 2.033, d=3 2.271, d=4 (t(5) = 1.5) 1.769: (4, 3)."""
    choice = choose_tree_size((0.8,), *relative_costs(FakeCostModel(4, 0.5, 0.1)), 16, 8)
    assert (choice.nodes, choice.depth) == (4, 3)
    assert choice.speedup == pytest.approx(2.952 / 1.3)


def test_hardware_choice_wide_tree() -> None:
    """w = (0.6, 0.3), verification flat up to 8 tokens, an SSM step costs half an LLM step:
    depth 1 (3 nodes) 1.9 / 1.5 = 1.267; depth 2 (full binary, 7 nodes) 2.71 / 2 = 1.355;
    depth 3 (8 nodes) 2.926 / 2.5 = 1.170; larger trees pay 1 per token: (7, 2)."""
    cost = FakeCostModel(8, 1.0, 0.5)
    choice = choose_tree_size((0.6, 0.3), *relative_costs(cost), 32, 6)
    assert (choice.nodes, choice.depth) == (7, 2)
    assert choice.speedup == pytest.approx(2.71 / 2.0)
    table = {n: cost.verify_time(n) / cost.verify_time(1) for n in (1, 3, 7, 8, 16)}  # measured sizes
    assert choose_tree_size((0.6, 0.3), table, 0.5, 32, 6) == choice


# The speculator in the decoder ------------------------------------------------------------------------
ACCEPTANCE = AcceptanceVector((0.6, 0.5, 0.3), "greedy", 100)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize(("llm_seed", "prompt_seed", "prompt_length", "max_new"), CASES[:3])
def test_greedy_output_equals_generate(arch, llm_seed, prompt_seed, prompt_length, max_new) -> None:
    ssm = noisy_ssm(arch, llm_seed, 0.1, 0)
    speculator = SequoiaSpeculator(ssm, ACCEPTANCE, nodes=12)
    dec = SpeculativeDecoder(llm_for(arch, llm_seed), [ssm], speculator=speculator)
    ids = prompt_ids(prompt_seed, prompt_length)
    out = dec.generate(ids, max_new_tokens=max_new, eos_token_id=None)
    assert torch.equal(out.sequences, reference(arch, llm_seed, ids, max_new))
    check_stats(out, prompt_length, num_ssms=1)
    assert out.stats.accepted_tokens > 0
    report = out.stats.strategy
    assert report["strategy"] == "sequoia" and report["nodes"] == 12
    assert report["expected_tokens_per_step"] == pytest.approx(solve(ACCEPTANCE.marginal, 12).value(12))


def test_speculator_with_cost_model_and_pool_index() -> None:
    """The hardware-aware size; SSM number 2 of a pool records itself as the proposer."""
    ssm = noisy_ssm("llama", 0, 0.1, 0)
    speculator = SequoiaSpeculator(ssm, ACCEPTANCE, cost_model=FakeCostModel(6, 1.0, 0.2), index=2)
    choice = speculator.choice
    assert (speculator.tree.nodes, speculator.tree.depth) == (choice.nodes, choice.depth)
    assert speculator.tree.nodes <= 6
    dec = SpeculativeDecoder(llm_for("llama", 0), [ssm], speculator=speculator)
    ids = prompt_ids(0, 4)
    out = dec.generate(ids, max_new_tokens=16, eos_token_id=None)
    assert torch.equal(out.sequences, reference("llama", 0, ids, 16))
    assert set(out.stats.proposed_per_ssm) == {2}
    assert out.stats.strategy["predicted_speedup"] == pytest.approx(choice.speedup)
    with pytest.raises(ValueError, match="tree size"):
        SequoiaSpeculator(ssm, ACCEPTANCE)


def test_sampling_without_replacement_is_lossless(models) -> None:  # noqa: F811
    """The decoder's default rule for one SSM filling a topology by sampling is Sequoia's; the
    output must have the LLM's joint distribution (T=0.8, top_p=0.95)."""
    acceptance = AcceptanceVector((0.5, 0.4, 0.3), "without_replacement", 100, temperature=0.8)
    speculator = SequoiaSpeculator(models["ssm_a"], acceptance, nodes=7)
    assert speculator.tree.depth >= 2 and len(speculator.tree.shape.children()[0]) >= 2
    dec = SpeculativeDecoder(models["llm"], [models["ssm_a"]], speculator=speculator)
    check_decoder(dec, 3, seed0=70_000, min_accepted=0.5, temperature=0.8, top_p=0.95)
    assert dec.verifier.check(speculator.tree_kind(True), True, 1) is Rule.WITHOUT_REPLACEMENT


# Command line -------------------------------------------------------------------------------------------
def cli_setup(tmp_path: Path) -> tuple[Path, list[Path], list[str]]:
    """Tiny models, a distilled run of 3 samples (2 held out) and the CLI's arguments for them."""
    llm_dir, ssm_dirs = build_tiny_models(tmp_path / "models")
    distilled = tmp_path / "distilled"
    distilled.mkdir()
    rows = [
        {"id": i, "prompt_ids": [1, 40 + i, 50], "output_ids": list(range(60 + i, 70 + i)), "filter": ""}
        for i in range(3)
    ]
    pq.write_table(pa.Table.from_pylist(rows), distilled / "data.parquet")
    (tmp_path / "record.json").write_text(json.dumps({"held_out_ids": [0, 2]}))
    argv = ["--llm", str(llm_dir), "--ssm", *map(str, ssm_dirs), "--distilled", str(distilled)]
    argv += ["--held-out-from", str(tmp_path / "record.json"), "--max-nodes", "8", "--width", "3"]
    return llm_dir, ssm_dirs, argv


def test_cli_writes_tables_and_the_pool_acceptance_file(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    _, ssm_dirs, argv = cli_setup(tmp_path)
    out = tmp_path / "sequoia_acceptance.json"
    assert main([*argv, "--chains", "2", "--decode", "1", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "sequoia" in printed and "2 chains" in printed and "measured" in printed
    result = json.loads(out.read_text())
    assert result["samples"] == 2 and result["ssms"] == [str(d) for d in ssm_dirs]
    vectors = load_acceptance_file(out)
    assert len(vectors) == len(result["tables"]) == len(ssm_dirs) == 2
    assert all(v.num_positions == 2 * 10 and v.rule == "greedy" for v in vectors)
    for acceptance, table in zip(vectors, result["tables"], strict=True):
        assert [row["nodes"] for row in table] == [2, 4, 8]
        for row in table:
            assert row["sequoia"] == pytest.approx(
                solve(acceptance.marginal, row["nodes"]).value(row["nodes"])
            )
            assert row["sequoia"] >= max(row["chains"].values()) - 1e-12  # a chain is one of the trees


def test_cli_measures_sampled_vectors_as_requests_are_sampled(tmp_path: Path) -> None:
    """`--rule without_replacement` measures at the sampling a request at that temperature gets:
    the LLM's generation config (here top_k=3), else transformers' defaults, flags over both. A
    vector measured at the temperature alone (no cut) differs: the SSM's draws and p both change."""
    llm_dir, ssm_dirs, argv = cli_setup(tmp_path)
    GenerationConfig(do_sample=True, top_k=3).save_pretrained(llm_dir)
    argv += ["--ssm", str(ssm_dirs[0]), "--rule", "without_replacement", "--temperature", "0.7"]
    llm, ssm = (AutoModelForCausalLM.from_pretrained(d).eval() for d in (llm_dir, ssm_dirs[0]))
    samples = distilled_samples(tmp_path / "distilled", tmp_path / "record.json", None)

    def measured(flags: list[str], sampling: SamplingConfig) -> AcceptanceVector:
        assert main([*argv, *flags, "--out", str(tmp_path / "out.json")]) == 0
        (vector,) = load_acceptance_file(tmp_path / "out.json")
        assert vector == estimate_acceptance(llm, ssm, samples, k=3, sampling=sampling)
        return vector

    cut = measured([], SamplingConfig(True, 0.7, top_k=3))
    assert (cut.top_k, cut.top_p, cut.temperature) == (3, 1.0, 0.7)
    uncut = measured(["--top-k", "0"], SamplingConfig(True, 0.7))
    assert uncut.top_k == 0 and uncut.p != cut.p
    assert measured(["--top-p", "0.9"], SamplingConfig(True, 0.7, top_k=3, top_p=0.9)).top_p == 0.9
    assert main([*argv, "--temperature", "0", "--out", str(tmp_path / "bad.json")]) == 2
    greedy = [a if a != "without_replacement" else "greedy" for a in argv]
    assert main([*greedy, "--top-k", "5", "--out", str(tmp_path / "bad.json")]) == 2
    assert not (tmp_path / "bad.json").exists()
