"""The strategy comparison (`specboost bench --suite strategies`, decoder/bench/strategies.py) end to
end on the tiny stand-in models: an exported pool with a hardware profile and acceptance vectors,
a few sizes and lengths."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_export_pool import make_boost

from specboost.decoder.bench.strategies import StrategiesConfig
from specboost.decoder.cli import main
from specboost.decoder.tiny_models import build_tiny_models
from specboost.speculator.cost_model import PROFILE_FILE, CostModel, device_key, save_cost_model
from specboost.speculator.sequoia_acceptance import ACCEPTANCE_FILE, AcceptanceVector, save_acceptance_file
from specboost.training import export


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(LLM folder, exported pool folder with this machine's profile and acceptance vectors)."""
    root = tmp_path_factory.mktemp("compare")
    tiny = build_tiny_models(root / "tiny")
    boost = make_boost(root, tiny)
    key = device_key("cpu", torch.float32)
    cost = CostModel(key, [1, 2, 4, 8, 16], [1e-3, 1.1e-3, 1.3e-3, 2e-3, 4e-3], [{}, {}], [2e-4, 3e-4])
    save_cost_model(cost, boost / PROFILE_FILE)
    vectors = [AcceptanceVector((0.6, 0.2), "greedy", 10), AcceptanceVector((0.4, 0.3), "greedy", 10)]
    save_acceptance_file(vectors, boost / ACCEPTANCE_FILE)
    export.export_pool(boost, root / "pool")
    return tiny[0], root / "pool"


def test_compare_writes_json_markdown_and_plots(pool: tuple[Path, Path], tmp_path: Path) -> None:
    llm, folder = pool
    config = StrategiesConfig(
        llm=str(llm), pool=str(folder), max_prompts=1, max_new_tokens=10, repeats=1, warmup=0,
        sizes=(4, 8), chains=(2, 4), chain_length=3, lengths=(2, 3),
    )  # fmt: skip
    report = config.run(log=lambda _: None)
    config.write(report, tmp_path)
    h = report.results["headline"]
    assert h["all_identical"] and h["ssm"] == 0  # the hardware-aware choice: SSM 0's vector promises more
    assert set(h["trees"]) == {4, 8}
    assert h["trees"][4]["best_k_chains"] == "2-chains@4"  # 4 chains need more than 4 nodes
    assert set(h["adaptive"]) == {"minions", "bass"} and h["best_fixed_length"] in (
        "chain[0,2]",
        "chain[0,3]",
    )
    methods = list(report.runs[0].methods)
    assert methods[0] == "plain" and len(methods) == len(set(methods))
    assert {"sequoia@4", "sequoia@8", "chain[0,3]", "chain[0,7]", "4-chains@8", "sequoia@auto"} <= set(
        methods
    )
    assert {"chain[1,3]", "pool_chain", "pruned", "majority", "minions", "bass"} <= set(methods)
    written = json.loads((tmp_path / "strategy_compare.json").read_text())
    assert written["headline"]["ssm"] == 0 and written["predicted"][0]["nodes"] == 4
    markdown = (tmp_path / "strategy_compare.md").read_text()
    assert "| nodes | sequoia | 1 chain | 2 chains | 4 chains |" in markdown and "| bass |" in markdown
    for plot in ("strategy_trees.png", "strategy_majority.png", "strategy_lengths.png"):
        assert (tmp_path / plot).read_bytes()[:4] == b"\x89PNG"


def test_the_strategies_run_from_the_command_line_with_their_ssm(
    pool: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    llm, folder = pool
    argv = ["bench", "--suite", "strategies", "--llm", str(llm), "--pool", str(folder), "--ssm", "1"]
    argv += ["--max-prompts", "1", "--max-new-tokens", "6", "--repeats", "1", "--warmup", "0"]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    assert "## (a) Tokens per step by tree size (SSM 1;" in capsys.readouterr().out
    assert json.loads((tmp_path / "strategy_compare.json").read_text())["headline"]["ssm"] == 1
