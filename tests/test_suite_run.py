"""The harness's configurations end to end on the tiny stand-in models (decoder/bench/): `specboost
bench --suite FILE --llm LLM --pool POOL` runs every method of every cell on a pool exported with a
predictor, a hardware profile of this machine and Sequoia vectors, and writes the report; the
options that make no sense with --suite are refused; `--suite batched` and `--suite scheduler`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_export_pool import make_boost
from transformers import AutoModelForCausalLM

from specboost.decoder.bench.methods import Models, generate_method
from specboost.decoder.bench.records import GREEDY
from specboost.decoder.bench.suite import SuiteConfig
from specboost.decoder.bench.workloads import Prompt, encode_batches
from specboost.decoder.cli import main
from specboost.decoder.profiler import ProfileConfig, profile
from specboost.decoder.tiny_models import build_tiny_models
from specboost.speculator.cost_model import PROFILE_FILE, save_cost_model
from specboost.speculator.predictor import MatchLengthPredictor, PredictorConfig
from specboost.speculator.sequoia_acceptance import ACCEPTANCE_FILE, AcceptanceVector, save_acceptance_file
from specboost.training import bench_fixture, export

MAX_NEW = 10


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(LLM folder, exported pool with a predictor, this machine's profile and Sequoia vectors)."""
    root = tmp_path_factory.mktemp("suite")
    llm_dir, ssm_dirs = build_tiny_models(root / "tiny")
    boost = make_boost(root, (llm_dir, ssm_dirs))
    llm = AutoModelForCausalLM.from_pretrained(llm_dir).eval()
    ssms = [AutoModelForCausalLM.from_pretrained(d).eval() for d in ssm_dirs]
    config = ProfileConfig(verify_sizes=(1, 8, 32), prefix_length=8, repeats=1)
    save_cost_model(profile(llm, ssms, config, show_progress=False), boost / PROFILE_FILE)
    torch.manual_seed(0)
    predictor = MatchLengthPredictor(PredictorConfig(input_size=llm.config.hidden_size, num_ssms=len(ssms)))
    predictor.save_pretrained(boost / "predictor")
    vectors = [AcceptanceVector((0.7, 0.2), "greedy", 10), AcceptanceVector((0.5, 0.3), "greedy", 10)]
    save_acceptance_file(vectors, boost / ACCEPTANCE_FILE)
    export.export_pool(boost, root / "pool")
    return llm_dir, root / "pool"


def test_the_suite_runs_every_method_on_given_models(
    models: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    llm, pool = models
    settings = {
        "categories": ["qa", "math"],
        "prompts_per_category": 2,
        "max_prompt_tokens": 24,
        "batch_sizes": [1, 2],
        "repeats": 1,
        "warmup": 0,
        "compiled": False,  # compiling takes minutes: tests/test_compiled.py checks compiled decoding
    }
    suite_file = tmp_path / "suite.json"
    suite_file.write_text(json.dumps(settings))
    out = tmp_path / "report"
    argv = ["bench", "--suite", str(suite_file), "--llm", str(llm), "--pool", str(pool), "--out", str(out)]
    assert main([*argv, "--max-new-tokens", str(MAX_NEW), "--chain-length", "3"]) == 0
    assert "Models given: LLM" in capsys.readouterr().out

    record = json.loads((out / "suite.json").read_text())
    config = record["config"]
    assert (config["llm"], config["pool"], record["fixture"]) == (str(llm), str(pool), None)
    assert config["max_new_tokens"] == MAX_NEW and config["shapes"]["chain_length"] == 3  # overrides
    assert config["categories"] == ["qa", "math"]  # the file's settings
    titles = [t["decoding"] + f", batch {t['batch_size']}" for t in record["tables"]]
    assert titles == [
        "greedy, batch 1",
        "sample(T=0.8, top_p=1), batch 1",
        "greedy, batch 2",
        "sample(T=0.8, top_p=1), batch 2",
    ]
    greedy_1 = {row["method"]: row for row in record["tables"][0]["rows"]}
    assert set(greedy_1) == {
        "plain", "plain_static", "hf_assisted[0]", "hf_assisted[1]", "chain[0]", "chain[1]", "stairs[0]",
        "pool_chain", "pool_beam", "majority", "majority+adaptive", "pruned", "sequoia", "learned",
    }  # fmt: skip
    assert {row["method"] for row in record["tables"][2]["rows"]} == {
        "plain",
        "plain_static",
        "batched",
        "engine",
    }
    for table in record["tables"]:
        assert set(table["per_category"]) == {"qa", "math"}
        for row in table["rows"]:
            assert row["identical_to_plain"] is (True if table["decoding"] == "greedy" else None), row
            assert row["rank"] is not None
    assert greedy_1["learned"]["decision_share"] is not None  # it ran with the pool's predictor
    assert greedy_1["chain[0]"]["draft_tokens_per_step"] <= 3  # --chain-length 3
    assert greedy_1["plain"]["tokens_per_step"] == 1.0
    runs = [r for cell in record["runs"] for r in cell["records"]]
    assert runs and all(0 < r["new_tokens"] <= MAX_NEW * 2 for r in runs)  # batch 2: two rows
    assert record["skipped"]["sample(T=0.8, top_p=1), batch 1"] == {
        "stairs[0]": "ValueError: verification='stairs' is a greedy baseline; use do_sample=False"
    }
    report = (out / "report.md").read_text()
    assert (
        report.index("**Machine:**") < report.index("Models given: LLM") < report.index("## greedy, batch 1")
    )
    for plot in ("speedup.png", "tokens_per_step_vs_tree_size.png", "acceptance_by_position.png"):
        assert (out / plot).stat().st_size > 0
    assert (out / "ssm_weights.png").is_file()  # majority ran: its weights over time


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--suite", "quick", "--prompts", "p.txt"], "--prompts cannot be used with --suite"),
        (["--suite", "quick", "--ssm", "a", "--methods", "chain"], "--ssm, --methods cannot be used with"),
        (["--suite", "quick", "--llm", "x"], "needs both --llm and --pool"),
        (["--suite", "quick", "--pool", "x"], "needs both --llm and --pool"),
        (["--suite", "quick", "--llm", "x", "--pool", "y", "--fixture", "tiny"], "give one of them"),
        (["--llm", "x", "--ssm", "y", "--prompts", "p", "--out", "o", "--pool", "z"], "add --suite"),
    ],
)
def test_options_that_do_not_fit_the_suite_are_refused(
    options: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", *options])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_suite_names_its_models_both_or_neither() -> None:
    assert SuiteConfig().name == "small" and SuiteConfig(llm="models/my-llm", pool="p").name == "my-llm"
    with pytest.raises(ValueError, match="give both llm and pool"):
        SuiteConfig(llm="models/my-llm")


def test_a_dry_run_with_given_models_builds_no_fixture(
    models: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    llm, pool = models
    argv = ["bench", "--suite", "quick", "--llm", str(llm), "--pool", str(pool), "--artifacts", str(tmp_path)]
    assert main([*argv, "--dry-run"]) == 0
    assert "no fixture to build" in capsys.readouterr().out and not (tmp_path / "bench-fixture").exists()


def test_methods_a_bare_pool_cannot_run_are_skipped_with_the_reason(tmp_path: Path) -> None:
    """A pool without predictor, profile or Sequoia vectors: `learned` would silently run the fixed
    shape under its name (a bug: it was measured as `learned`), so it is not run; neither is Sequoia."""
    llm_dir, ssm_dirs = build_tiny_models(tmp_path / "tiny")
    export.export_pool(make_boost(tmp_path, (llm_dir, ssm_dirs)), tmp_path / "pool")
    models = Models.load(llm_dir, tmp_path / "pool")
    probe = encode_batches([Prompt("Once upon a time", "test", 0)], models.tokenizer, 1, 16)[0]
    method_set = SuiteConfig(max_new_tokens=4, compiled=False).method_set(models, GREEDY, 1, probe)
    assert set(method_set.skipped) == {"learned", "sequoia"}
    assert "no match-length predictor" in method_set.skipped["learned"]
    assert "pool_chain" in {m.name for m in method_set.methods}


def test_counting_plain_passes_leaves_no_hook_on_the_llm(tmp_path: Path) -> None:
    """Plain `generate` runs count the LLM's passes through a forward hook that is there only while
    they run: a hook left on the LLM would be traced into our compiled passes, which would then
    guard on its count and recompile at every call (compiled rows measured ~2x too slow)."""
    llm_dir, ssm_dirs = build_tiny_models(tmp_path / "tiny")
    models = Models.load(str(llm_dir), ssms=tuple(map(str, ssm_dirs)))
    probe = encode_batches([Prompt("Once upon a time", "test", 0)], models.tokenizer, 1, 16)[0]
    plain = generate_method("plain", "llm.generate", models, 5, GREEDY)
    result = plain.run(probe)
    assert result.llm_steps == 5 and not models.llm._forward_hooks


def test_the_batched_configuration_compares_static_batches_and_the_engine(
    models: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`make bench-batched`: plain, batched, the sequential and the pipelined engine at each batch
    size on one workload, every output checked against per-sequence greedy `llm.generate`."""
    llm, pool = models
    argv = [
        "bench",
        "--suite",
        "batched",
        "--llm",
        str(llm),
        "--ssm",
        str(pool / "ssm-0"),
        "--num-prompts",
        "4",
    ]
    argv += ["--batch-sizes", "1", "2", "--max-new-tokens", "6", "--repeats", "1", "--threads", "1"]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    assert "| B | plain tok/s | batched (x plain) |" in capsys.readouterr().out
    record = json.loads((tmp_path / "batch_bench.json").read_text())
    assert [row["batch_size"] for row in record["by_batch_size"]] == [1, 2]
    for row in record["by_batch_size"]:
        assert set(row["methods"]) == {"plain", "batched", "engine_sequential", "engine_pipelined"}
        assert all(m["identical"] and m["normalized_latency"] > 0 for m in row["methods"].values())
        assert row["pipelining_gain"] > 0
    runs = [r for cell in record["runs"] for r in cell["records"]]
    assert all(len(r["stats"]["row_latencies"]) == 4 for r in runs)  # all four requests in every run
    assert (tmp_path / "batch_bench.md").is_file() and (tmp_path / "batch_bench.png").stat().st_size > 0


def test_the_scheduler_configuration_compares_learned_fixed_and_oracle(
    models: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`make scheduler-eval`: the learned scheduler against every fixed beam shape and the oracle."""
    llm, pool = models
    argv = ["bench", "--suite", "scheduler", "--llm", str(llm), "--pool", str(pool), "--max-prompts", "1"]
    assert (
        main([*argv, "--max-new-tokens", "6", "--repeats", "1", "--warmup", "0", "--out", str(tmp_path)]) == 0
    )
    assert "the best fixed shape" in capsys.readouterr().out
    record = json.loads((tmp_path / "scheduler_eval.json").read_text())
    h = record["headline"]
    assert h["all_identical"] and h["best_fixed"].startswith("fixed[") and h["regret"] < 1
    methods = {row["method"] for row in record["tables"][0]["rows"]}
    assert {"plain", "learned", "oracle", "fixed[1,1]"} <= methods
    assert (tmp_path / "scheduler_eval.md").is_file() and (tmp_path / "scheduler_eval.png").stat().st_size > 0


def test_make_bench_runs_the_suite_through_the_training_side(
    models: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`make bench` runs `python -m specboost.training.bench_fixture --suite ...`: with models given
    it builds no fixture and hands every option but --build-threads to `specboost bench`."""
    llm, pool = models
    settings = {"categories": ["qa"], "prompts_per_category": 1, "batch_sizes": [1], "decodings": [{}]}
    suite_file = tmp_path / "suite.json"
    suite_file.write_text(json.dumps(settings | {"repeats": 1, "warmup": 0, "compiled": False}))
    argv = ["--suite", str(suite_file), "--llm", str(llm), "--pool", str(pool), "--artifacts", str(tmp_path)]
    argv += ["--build-threads", "2", "--max-new-tokens", "4", "--out", str(tmp_path / "report")]
    assert bench_fixture.main(argv) == 0
    assert "## greedy, batch 1" in capsys.readouterr().out
    assert (tmp_path / "report" / "suite.json").is_file() and not (tmp_path / "bench-fixture").exists()
