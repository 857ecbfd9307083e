"""`SpeculativeDecoder(strategy=...)` (decoder/strategies.py): every strategy name reproduces
`llm.generate` under greedy decoding, the pool's files feed them (voting weights, Sequoia
acceptance vectors), invalid combinations are refused with what to change, and `specboost
generate` exposes them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_greedy_equivalence import CASES, check_stats, llm_for, noisy_ssm, prompt_ids, reference
from test_scheduler import constant_predictor, cost_table

from specboost.decoder import BeamShape, ChainShape, SpeculativeDecoder, SSMPool, StrategyOptions
from specboost.decoder.cli import main as cli_main
from specboost.decoder.strategies import STRATEGIES
from specboost.decoder.tiny_models import build_tiny_models
from specboost.speculator.majority import MajorityConfig, MajoritySpeculator, PrunedPoolSpeculator
from specboost.speculator.sequoia_acceptance import AcceptanceVector, save_acceptance_file
from specboost.speculator.speculation import PoolSpeculator
from specboost.speculator.tree import DraftKind

WEAK = AcceptanceVector((0.3, 0.2), "greedy", 100)
STRONG = AcceptanceVector((0.8, 0.5, 0.2), "greedy", 100)
# verify(n) seconds for n = 1, 2, 4, 8, 16 and the learned scheduler's beam grid (1|2, 1|4).
COST = cost_table(2, [1.0, 1.1, 1.3, 2.0, 4.0], {"1,1": 0.2, "1,4": 0.8, "2,1": 0.3, "2,4": 1.2})

# name -> (SpeculativeDecoder keyword arguments, the report's strategy name)
STRATEGY_CASES = {
    "pool": (dict(shape=ChainShape(3)), "pool"),
    "pool-bass": (dict(shape=ChainShape(3), length_controller="bass"), "pool"),
    "pool-samples": (dict(shape=ChainShape(3, samples=3)), "pool"),  # greedy: one argmax chain each
    "learned": (
        dict(predictor=constant_predictor([[[0.5, 1.5], [1.0, 2.5]]] * 2), cost_model=COST),
        "learned",
    ),
    "learned-trees": (
        dict(
            predictor=constant_predictor([[[0.5, 1.5], [1.0, 2.5]]] * 2),
            cost_model=COST,
            strategy_options=StrategyOptions(actions="trees"),
        ),
        "learned",
    ),
    "majority": (
        dict(shape=ChainShape(3), strategy_options=StrategyOptions(majority=MajorityConfig())),
        "majority",
    ),
    "majority-minions": (dict(length_controller="minions"), "majority"),
    "pruned": (dict(shape=BeamShape(2, 3), strategy_options=StrategyOptions(budget=4)), "pruned"),
    "sequoia-nodes": (dict(strategy_options=StrategyOptions(nodes=8, acceptance=[WEAK, STRONG])), "sequoia"),
    "sequoia-hardware": (
        dict(cost_model=COST, strategy_options=StrategyOptions(acceptance=STRONG, ssm=1, depth=4)),
        "sequoia",
    ),
}


def strategy_of(case: str) -> str:
    return case.split("-")[0]


def test_every_strategy_name_is_covered() -> None:
    # "plain" drafts nothing and takes no SSMs: tests/test_plain_strategy.py
    assert {strategy_of(case) for case in STRATEGY_CASES} == set(STRATEGIES) - {"plain"}


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("case", sorted(STRATEGY_CASES))
def test_greedy_output_equals_generate(arch: str, case: str) -> None:
    kwargs, reported = STRATEGY_CASES[case]
    for llm_seed, prompt_seed, length, max_new in CASES[:2]:
        ssms = [noisy_ssm(arch, llm_seed, 0.1, 0), noisy_ssm(arch, llm_seed, 0.3, 1)]
        dec = SpeculativeDecoder(llm_for(arch, llm_seed), ssms, strategy=strategy_of(case), **kwargs)
        ids = prompt_ids(prompt_seed, length)
        out = dec.generate(ids, max_new_tokens=max_new, eos_token_id=None)
        assert torch.equal(out.sequences, reference(arch, llm_seed, ids, max_new))
        check_stats(out, length, num_ssms=2)
        assert out.stats.strategy["strategy"] == reported
        assert ("lengths" in out.stats.strategy) == ("length_controller" in kwargs)


def test_sequoia_picks_the_ssm_its_tree_promises_most_for() -> None:
    llm, ssms = llm_for("llama", 0), [noisy_ssm("llama", 0, s, i) for i, s in enumerate((0.1, 0.3))]
    dec = SpeculativeDecoder(
        llm, ssms, strategy="sequoia", strategy_options=StrategyOptions(nodes=6, acceptance=[WEAK, STRONG])
    )
    assert dec.speculator.index == 1 and dec.speculator.tree.nodes == 6
    chosen = SpeculativeDecoder(
        llm,
        ssms,
        strategy="sequoia",
        cost_model=COST,
        strategy_options=StrategyOptions(acceptance=[STRONG, WEAK]),
    )
    assert chosen.speculator.index == 0 and chosen.speculator.choice is not None
    single = SpeculativeDecoder(
        llm, ssms, strategy="sequoia", strategy_options=StrategyOptions(nodes=4, acceptance=WEAK)
    )
    assert single.speculator.index == 0  # one vector: SSM 0 unless StrategyOptions(ssm=)


def test_the_pool_supplies_weights_and_acceptance_vectors() -> None:
    llm, ssms = llm_for("gpt2", 0), [noisy_ssm("gpt2", 0, s, i) for i, s in enumerate((0.1, 0.3))]
    pool = SSMPool(ssms, None, {}, [0.25, 0.75], acceptance=[STRONG, WEAK])
    majority = SpeculativeDecoder(llm, pool, strategy="majority").speculator
    assert isinstance(majority, MajoritySpeculator) and majority.weights == [0.25, 0.75]
    sequoia = SpeculativeDecoder(llm, pool, strategy="sequoia", strategy_options=StrategyOptions(nodes=5))
    assert sequoia.speculator.index == 0 and sequoia.speculator.acceptance == STRONG
    with pytest.raises(ValueError, match="1 acceptance vectors for 2 SSMs"):
        SSMPool(ssms, None, {}, [0.5, 0.5], acceptance=[STRONG])


def test_pruning_several_chains_of_one_ssm_leaves_target_sampling() -> None:
    """Pruning compares one SSM's sampled chains by their probabilities, so the kept nodes are no
    longer independent draws: SELECTED (target sampling), as for a pool; one chain stays SAMPLED."""
    ssm = noisy_ssm("llama", 0, 0.1, 0)
    several = PrunedPoolSpeculator([ssm], ChainShape(3, samples=2), budget=4)
    assert several.tree_kind(True) is DraftKind.SELECTED and several.tree_kind(False) is DraftKind.GREEDY
    assert PrunedPoolSpeculator([ssm], ChainShape(3), budget=4).tree_kind(True) is DraftKind.SAMPLED


def test_length_controllers_drive_pool_chains() -> None:
    llm, ssm = llm_for("llama", 1), noisy_ssm("llama", 1, 0.1, 0)
    speculator = SpeculativeDecoder(llm, [ssm], length_controller="minions").speculator
    assert isinstance(speculator, PoolSpeculator) and speculator.length_controller.name == "minions"


ERRORS = {
    "unknown strategy": (dict(strategy="magic"), "strategy must be one of"),
    "option of another strategy": (
        dict(strategy="pool", strategy_options=StrategyOptions(budget=4)),
        r"StrategyOptions\(budget=...\) is for strategy='pruned'; strategy='pool' does not use it",
    ),
    "majority config for sequoia": (
        dict(strategy="sequoia", strategy_options=StrategyOptions(majority=MajorityConfig(), nodes=4)),
        "is for strategy='majority' or strategy='pruned'",
    ),
    "length controller with a beam": (
        dict(shape=BeamShape(2, 3), length_controller="bass"),
        "a length controller sets chain lengths; use ChainShape",
    ),
    "length controller for sequoia": (
        dict(strategy="sequoia", length_controller="bass"),
        "length_controller sets chain lengths for strategy 'pool', 'majority', 'pruned'",
    ),
    "length controller for learned": (
        dict(strategy="learned", length_controller="minions"),
        "does not draft chains",
    ),
    "actions for another strategy": (
        dict(strategy="pool", strategy_options=StrategyOptions(actions="trees")),
        r"StrategyOptions\(actions=...\) is for strategy='learned'",
    ),
    "unknown length controller": (dict(length_controller="magic"), "unknown length controller 'magic'"),
    "majority of beams": (
        dict(strategy="majority", shape=BeamShape(2, 2)),
        "votes on chains: use shape=ChainShape",
    ),
    "majority of several chains per SSM": (
        dict(strategy="majority", shape=ChainShape(3, samples=2)),
        r"does not apply: use shape=ChainShape\(3\)",
    ),
    "sequoia with a shape": (
        dict(strategy="sequoia", shape=ChainShape(3)),
        "drafts its own DP-optimal tree: drop shape=",
    ),
    "sequoia without acceptance": (
        dict(strategy="sequoia", strategy_options=StrategyOptions(nodes=8)),
        "needs an acceptance vector",
    ),
    "sequoia without a size": (
        dict(strategy="sequoia", strategy_options=StrategyOptions(acceptance=STRONG)),
        r"needs a tree size: StrategyOptions\(nodes=N\), or a hardware profile",
    ),
    "sequoia with too few vectors": (
        dict(strategy="sequoia", strategy_options=StrategyOptions(nodes=8, acceptance=[STRONG])),
        "1 acceptance vectors for 2 SSMs",
    ),
    "sequoia SSM out of range": (
        dict(strategy="sequoia", strategy_options=StrategyOptions(nodes=8, acceptance=STRONG, ssm=2)),
        r"StrategyOptions\(ssm=2\) names no SSM",
    ),
    "custom speculator and a strategy": (
        dict(speculator=object(), strategy="majority"),
        "speculator= replaces the built-in strategies",
    ),
}


@pytest.mark.parametrize("case", sorted(ERRORS))
def test_invalid_combinations_say_what_to_change(case: str) -> None:
    kwargs, message = ERRORS[case]
    llm, ssms = llm_for("llama", 0), [noisy_ssm("llama", 0, s, i) for i, s in enumerate((0.1, 0.3))]
    with pytest.raises(ValueError, match=message):
        SpeculativeDecoder(llm, ssms, **kwargs)


# Command line -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path]]:
    return build_tiny_models(tmp_path_factory.mktemp("tiny"))


def generate_json(tiny: tuple[Path, list[Path]], capsys: pytest.CaptureFixture[str], *options: str) -> dict:
    llm_dir, ssm_dirs = tiny
    argv = ["generate", "--llm", str(llm_dir), "--ssm", *map(str, ssm_dirs), "--prompt", "Once upon a time"]
    assert cli_main([*argv, "--max-new-tokens", "12", "--json", *options]) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_majority_with_a_length_controller(tiny, capsys: pytest.CaptureFixture[str]) -> None:
    result = generate_json(tiny, capsys, "--strategy", "majority", "--length-controller", "bass")
    report = result["stats"]["strategy"]
    assert report["strategy"] == "majority" and report["length_controller"]["name"] == "bass"
    assert report["lengths"][0] == 7  # BASS's l0


def test_cli_pruned_and_sequoia(tiny, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    pruned = generate_json(tiny, capsys, "--strategy", "pruned", "--shape", "beam", "--budget", "3")
    assert (
        pruned["stats"]["strategy"]["budget"] == 3
        and pruned["stats"]["draft_tokens"] <= 3 * pruned["stats"]["llm_steps"]
    )
    save_acceptance_file([WEAK, STRONG], tmp_path / "acceptance.json")
    sequoia = generate_json(
        tiny,
        capsys,
        "--strategy",
        "sequoia",
        "--acceptance",
        str(tmp_path / "acceptance.json"),
        "--nodes",
        "6",
    )
    assert sequoia["stats"]["strategy"]["ssm"] == 1 and sequoia["stats"]["strategy"]["nodes"] == 6


def test_cli_several_sampled_chains_per_ssm(tiny, capsys: pytest.CaptureFixture[str]) -> None:
    """--chain-samples K drafts K sampled chains per SSM (verified here by --rule k_sequential)."""
    options = ("--do-sample", "--temperature", "1.0", "--seed", "0", "--length", "2")
    one = generate_json(tiny, capsys, *options, "--rule", "k_sequential")
    three = generate_json(tiny, capsys, *options, "--rule", "k_sequential", "--chain-samples", "3")
    assert three["stats"]["strategy"]["shape"] == "ChainShape(length=2, samples=3)"
    per_step = [r["stats"]["draft_tokens"] / r["stats"]["llm_steps"] for r in (one, three)]
    assert per_step[1] > per_step[0]  # more chains, more drafted nodes


def test_cli_reports_invalid_strategy_settings(tiny, capsys: pytest.CaptureFixture[str]) -> None:
    llm_dir, ssm_dirs = tiny
    argv = ["generate", "--llm", str(llm_dir), "--ssm", str(ssm_dirs[0]), "--prompt", "Once"]
    assert cli_main([*argv, "--strategy", "sequoia", "--nodes", "4"]) == 2
    assert (
        "specboost generate: error: strategy='sequoia' needs an acceptance vector" in capsys.readouterr().err
    )
    assert cli_main([*argv, "--shape", "beam", "--length-controller", "minions"]) == 2
    assert "a length controller sets chain lengths" in capsys.readouterr().err
    assert cli_main([*argv, "--shape", "beam", "--chain-samples", "2"]) == 2
    assert "--chain-samples is for --shape chain, not --shape beam" in capsys.readouterr().err
