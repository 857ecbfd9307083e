"""The harness's configurations end to end on the tiny stand-in models (decoder/bench/): `specboost
bench --suite FILE --llm LLM --pool POOL` runs every method of every cell on a pool exported with a
predictor, a hardware profile of this machine and Sequoia vectors, and writes the report; the
options that make no sense with --suite are refused; `--suite batched` and `--suite scheduler`."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from test_export_pool import add_predictor_and_profile, make_boost

from specboost.decoder.bench.diversity import greedy_outputs, pool_diversity
from specboost.decoder.bench.methods import Models, generate_method
from specboost.decoder.bench.protocol import compiled_graphs
from specboost.decoder.bench.records import GREEDY, Decoding
from specboost.decoder.bench.suite import SuiteConfig, measured_tv, oracle_decoder, oracle_method
from specboost.decoder.bench.workloads import Prompt, encode_batches
from specboost.decoder.cli import main
from specboost.decoder.tiny_models import build_tiny_models
from specboost.speculator.oracle_router import OracleRouter
from specboost.speculator.sequoia_acceptance import ACCEPTANCE_FILE, AcceptanceVector, save_acceptance_file
from specboost.training import bench_fixture, export

MAX_NEW = 10


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(LLM folder, exported pool with a predictor, this machine's profile and Sequoia vectors)."""
    root = tmp_path_factory.mktemp("suite")
    llm_dir, ssm_dirs = build_tiny_models(root / "tiny")
    boost = make_boost(root, (llm_dir, ssm_dirs))
    add_predictor_and_profile(boost, (llm_dir, ssm_dirs))
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
    graphs = compiled_graphs()
    assert main([*argv, "--max-new-tokens", str(MAX_NEW), "--chain-length", "3"]) == 0
    assert "Models given: LLM" in capsys.readouterr().out
    assert compiled_graphs() == graphs  # "compiled": False holds for every row, the engine's too

    record = json.loads((out / "suite.json").read_text())
    config = record["config"]
    assert (config["llm"], config["pool"], record["fixture"]) == (str(llm), str(pool), None)
    assert config["max_new_tokens"] == MAX_NEW and config["shapes"]["chain_length"] == 3  # overrides
    assert config["categories"] == ["qa", "math"]  # the file's settings
    titles = [t["decoding"] + f", batch {t['batch_size']}" for t in record["tables"]]
    sampled = ["sample(T=0.8, top_p=1)", "sample(T=1, top_p=1)"]
    assert titles == [f"{d}, batch {b}" for b in (1, 2) for d in ("greedy", *sampled)]
    greedy_1 = {row["method"]: row for row in record["tables"][0]["rows"]}
    assert set(greedy_1) == {
        "plain", "plain_static", "hf_assisted[0]", "hf_assisted[1]", "chain[0]", "chain[1]", "stairs[0]",
        "pool_chain", "pool_beam", "majority", "majority+adaptive", "pruned", "sequoia", "learned",
        "learned+oracle",
    }  # fmt: skip
    sampled_1 = {row["method"] for row in record["tables"][1]["rows"]}
    assert sampled_1 == set(greedy_1) - {"stairs[0]", "learned+oracle"} | {
        "pool_chain+kseq",
        "chain[0]x3",
        "chain[0]x3+kseq",
    }
    assert {row["method"] for row in record["tables"][3]["rows"]} == {
        "plain",
        "plain_static",
        "batched",
        "engine",
        "learned+engine",
    }
    for table in record["tables"]:
        assert set(table["per_category"]) == {"qa", "math"}
        for row in table["rows"]:
            assert row["identical_to_plain"] is (True if table["decoding"] == "greedy" else None), row
            assert row["rank"] is not None
    assert greedy_1["learned"]["decision_share"] is not None  # it ran with the pool's predictor
    assert greedy_1["learned"]["action_shares"] and greedy_1["learned+oracle"]["action_shares"]
    batch_2 = {row["method"]: row for row in record["tables"][3]["rows"]}
    assert batch_2["learned+engine"]["action_shares"]  # the rows' choices, counted per row and step
    assert greedy_1["chain[0]"]["draft_tokens_per_step"] <= 3  # --chain-length 3
    assert greedy_1["plain"]["tokens_per_step"] == 1.0
    runs = [r for cell in record["runs"] for r in cell["records"]]
    assert runs and all(0 < r["new_tokens"] <= MAX_NEW * 2 for r in runs)  # batch 2: two rows
    for decoding in sampled:
        assert record["skipped"][f"{decoding}, batch 1"] == {
            "stairs[0]": "ValueError: verification='stairs' is a greedy baseline; use do_sample=False"
        }
        for size in (1, 2):  # one pool: each SSM's TV to the LLM in every sampled cell group
            tv = record["ssm_tv"][f"{decoding}, batch {size}"]
            assert tv["positions"] > 0 and len(tv["tv"]["pool"]) == 2
    assert record["models"]["notes"] == []  # a greedy CE pool has no target temperature
    diversity = record["diversity"]["pool"]  # untimed, on plain decoding's greedy outputs at batch 1
    assert diversity["chain_length"] == 3 and list(diversity["positions"]) == ["qa", "math", "all"]
    assert diversity["prompts"]["all"] == 4 and len(diversity["mean_match"]["all"]) == 2
    assert all(0 <= m <= 3 for column in diversity["mean_match"].values() for m in column)
    # The walk with one SSM takes exactly the LLM steps of greedy chain decoding with it.
    alone = diversity["tokens_per_step"]["all"]
    assert alone == [pytest.approx(greedy_1[f"chain[{i}]"]["tokens_per_step"]) for i in (0, 1)]
    assert diversity["union_tokens_per_step"]["all"] == pytest.approx(
        diversity["union_gain"]["all"] * max(alone)
    )
    assert max(alone) <= diversity["union_tokens_per_step"]["all"] <= 4
    report = (out / "report.md").read_text()
    assert report.count("Measured TV(p, q_j)") == 4 and "sampled rows on" not in report
    assert report.index("## greedy, batch 1") < report.index("## Pool diversity (greedy)")
    assert "**pool** (L = 3; 4 outputs" in report and "| union / best single |" in report
    assert report.count("Per category, the fastest single-SSM chain") == 3  # batch 1 tables only
    assert (
        report.index("**Machine:**") < report.index("Models given: LLM") < report.index("## greedy, batch 1")
    )
    for plot in ("speedup.png", "tokens_per_step_vs_tree_size.png", "acceptance_by_position.png"):
        assert (out / plot).stat().st_size > 0
    assert (out / "ssm_weights.png").is_file()  # majority ran: its weights over time


@pytest.fixture(scope="module")
def sampling_pool(models: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A pool exported from a sampled boost run at T = 0.8: three SSMs, the greedy pool's SSM 1,
    SSM 0 and SSM 1 again (no predictor, no profile)."""
    llm, pool = models
    root = tmp_path_factory.mktemp("sampling")
    boost = make_boost(root, (llm, [pool / "ssm-1", pool / "ssm-0", pool / "ssm-1"]))
    record = json.loads((boost / export.RECORD_FILE).read_text())
    third = record["rounds"][1] | {"ssm": 2, "path": "ssm-2"}
    sampled = {"boost_mode": "sampled", "loss": "kl", "target_temperature": 0.8}
    (boost / export.RECORD_FILE).write_text(
        json.dumps(record | sampled | {"rounds": [*record["rounds"], third]})
    )
    export.export_pool(boost, root / "pool")
    return root / "pool"


def test_sampled_rows_run_on_the_sampling_pool(
    models: tuple[Path, Path], sampling_pool: Path, tmp_path: Path
) -> None:
    """--sampled-pool: greedy rows on the pool, sampled rows on the sampling pool (its third SSM
    drafts only there), with the k-sequential rows, each SSM's measured TV to the LLM and a
    warning for a temperature the sampling pool was not trained at."""
    llm, pool = models
    settings = {
        "categories": ["qa"],
        "prompts_per_category": 1,
        "batch_sizes": [1],
        "decodings": [{}, {"do_sample": True, "temperature": 1.0}],
        "methods": ["chain", "pool_chain", "pool_chain+kseq", "chainx3", "chainx3+kseq", "learned"],
        "repeats": 1,
        "warmup": 0,
        "compiled": False,
    }
    suite_file = tmp_path / "suite.json"
    suite_file.write_text(json.dumps(settings))
    argv = ["bench", "--suite", str(suite_file), "--llm", str(llm), "--pool", str(pool)]
    argv += ["--sampled-pool", str(sampling_pool), "--max-new-tokens", str(MAX_NEW), "--out", str(tmp_path)]
    assert main(argv) == 0

    record = json.loads((tmp_path / "suite.json").read_text())
    assert record["config"]["sampled_pool"] == str(sampling_pool)
    assert record["models"]["sampled"]["pool"] == str(sampling_pool)
    greedy, sampled = ({row["method"]: row for row in table["rows"]} for table in record["tables"])
    assert set(greedy) == {"plain", "chain[0]", "chain[1]", "pool_chain", "learned"}
    assert set(sampled) == {
        *("plain", "chain[0]", "chain[1]", "chain[2]", "pool_chain", "pool_chain+kseq"),
        *("chain[0]x3", "chain[0]x3+kseq"),
    }
    assert set(greedy["pool_chain"]["acceptance_rate_per_ssm"]) == {"0", "1"}
    assert set(sampled["pool_chain+kseq"]["acceptance_rate_per_ssm"]) == {"0", "1", "2"}
    for name in ("chain[0]x3", "chain[0]x3+kseq", "pool_chain+kseq"):
        assert 0 < sampled[name]["draft_tokens_per_step"] <= 3 * 4  # three chains of 4
        assert sampled[name]["accepted_at_least"] is not None  # acceptance by position
    assert "no match-length predictor" in record["skipped"]["sample(T=1, top_p=1), batch 1"]["learned"]

    measured = record["ssm_tv"]["sample(T=1, top_p=1), batch 1"]
    tv = measured["tv"]
    assert measured["positions"] > 0 and list(tv) == ["sampling pool", "greedy pool"]
    assert all(0 < t < 1 for t in (*tv["sampling pool"], *tv["greedy pool"]))
    # The sampling pool's SSMs are the greedy pool's 1, 0, 1: the same TVs, measured once per pool.
    assert tv["sampling pool"] == pytest.approx([tv["greedy pool"][i] for i in (1, 0, 1)])
    note = "sample(T=1, top_p=1) rows ran on a pool trained at target_temperature 0.8, not at T=1"
    assert record["models"]["notes"] == [note]
    report = (tmp_path / "report.md").read_text()
    assert (
        f"sampled rows on the pool `{sampling_pool}` (3 SSMs" in report and f"**Warning:** {note}." in report
    )
    assert report.count("Measured TV(p, q_j)") == 1 and "sampling pool: SSM 0" in report
    # Each pool's diversity on the same greedy outputs: the sampling pool's SSMs are 1, 0, 1.
    match = {name: pool["mean_match"]["all"] for name, pool in record["diversity"].items()}
    assert match["sampling pool"] == [match["greedy pool"][i] for i in (1, 0, 1)]
    assert "**sampling pool** (L = 4" in report and "**greedy pool** (L = 4" in report


@pytest.fixture(scope="module")
def generalist(models: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A pool of one SSM exported from a greedy boost run, as the fixture's generalist: the greedy
    pool's SSM 1 (so its chain decodes as `chain[1]`)."""
    llm, pool = models
    root = tmp_path_factory.mktemp("generalist")
    boost = make_boost(root, (llm, [pool / "ssm-1"]))
    record = json.loads((boost / export.RECORD_FILE).read_text())
    (boost / export.RECORD_FILE).write_text(json.dumps(record | {"rounds": record["rounds"][:1]}))
    export.export_pool(boost, root / "pool")
    return root / "pool"


def test_the_generalist_rows_run_on_the_fixtures_generalist(
    models: tuple[Path, Path], generalist: Path, tmp_path: Path
) -> None:
    """The fixture's build record names the generalist's export: its chain runs as `generalist`
    at the pool's chain length, greedy only, and stands in the per-category table; a record from
    before the generalist step still runs, its generalist rows listed as not run."""
    llm, pool = models
    settings = {
        "fixture": "tiny",
        "categories": ["qa"],
        "prompts_per_category": 1,
        "batch_sizes": [1],
        "decodings": [{}, {"do_sample": True}],
        "methods": ["chain", "generalist"],
        "repeats": 1,
        "warmup": 0,
        "compiled": False,
    }
    suite_file = tmp_path / "suite.json"
    suite_file.write_text(json.dumps(settings))
    cache = tmp_path / "bench-fixture" / "tiny"
    cache.mkdir(parents=True)

    def run(paths: dict[str, str], out: Path) -> dict:
        """The suite on a fixture whose build record holds `paths` (no steps: nothing to build)."""
        build = {"name": "tiny", "paths": paths, "steps": [], "seconds": 0.0}
        (cache / "fixture.json").write_text(json.dumps(build))
        argv = ["bench", "--suite", str(suite_file), "--artifacts", str(tmp_path), "--out", str(out)]
        assert main([*argv, "--max-new-tokens", str(MAX_NEW), "--chain-length", "3"]) == 0
        return json.loads((out / "suite.json").read_text())

    paths = {"llm": str(llm), "export": str(pool)}
    record = run(paths | {"generalist_export": str(generalist)}, tmp_path / "report")
    assert record["models"]["generalist"]["pool"] == str(generalist)
    assert len(record["models"]["generalist"]["parameters"]["ssms"]) == 1
    greedy, sampled = ({row["method"]: row for row in table["rows"]} for table in record["tables"])
    assert set(greedy) == {"plain", "chain[0]", "chain[1]", "generalist"}
    assert set(sampled) == {"plain", "chain[0]", "chain[1]"}  # trained greedily: no sampled rows
    row = greedy["generalist"]
    assert row["identical_to_plain"] and set(row["acceptance_rate_per_ssm"]) == {"0"}
    assert 0 < row["draft_tokens_per_step"] <= 3  # the chain length of the chain[i] rows
    assert row["tokens_per_step"] == pytest.approx(greedy["chain[1]"]["tokens_per_step"])  # the same SSM
    report = (tmp_path / "report" / "report.md").read_text()
    assert f"generalist `{generalist}` (" in report
    assert "| category | fastest single chain | `generalist` |" in report

    old = run(paths, tmp_path / "old")  # built before the generalist step
    assert "generalist" not in old["models"]
    assert all(row["method"] != "generalist" for table in old["tables"] for row in table["rows"])
    assert "no generalist SSM" in old["skipped"]["greedy, batch 1"]["generalist"]

    with pytest.raises(ValueError, match="must be a pool of one SSM, not 2"):
        SuiteConfig(llm=str(llm), pool=str(pool), generalist=str(pool)).plan(tmp_path, print)


def test_an_ssm_that_is_the_llm_matches_as_far_as_a_chain_can(models: tuple[Path, Path]) -> None:
    """The LLM as a member: its chain of L matches the LLM's greedy output min(L, tokens left) at
    every position, so its walk takes ceil(n / (L + 1)) steps per output of n tokens, and the
    union with any other member is itself."""
    llm, pool = models
    loaded = Models.load(str(llm), str(pool))
    prompts = [Prompt(text, "test", i) for i, text in enumerate(("Once upon a time", "What is 2 + 3?"))]
    batches = encode_batches(prompts, loaded.tokenizer, 1, 16)
    kept = {}
    for batch in batches:
        new = loaded.llm.generate(**batch, max_new_tokens=MAX_NEW, do_sample=False)
        kept[id(batch)] = (batch, loaded.rows(new[:, batch.input_ids.shape[1] :]))
    outputs = greedy_outputs(kept.values(), {"stories": batches[:1], "qa": batches[1:], "math": []})
    chain = 3
    diversity = pool_diversity([loaded.ssms[0], loaded.llm], outputs, chain, [chain, 5], loaded.llm)
    lengths = {category: len(pairs[0][1]) for category, pairs in outputs.items() if pairs}
    assert list(diversity.positions) == ["stories", "qa", "all"]
    for category, n in lengths.items():
        assert diversity.positions[category] == n
        assert diversity.mean_match[category][1] == pytest.approx(
            sum(min(chain, n - j) for j in range(n)) / n
        )
        assert diversity.tokens_per_step[category][1] == pytest.approx(n / math.ceil(n / (chain + 1)))
        assert diversity.mean_match[category][0] <= diversity.mean_match[category][1]
    for column in diversity.positions:
        assert diversity.union_tokens_per_step[column] == diversity.tokens_per_step[column][1]
        assert diversity.union_gain[column] == 1.0
    for length, walks in diversity.by_length.items():  # the LLM is the best member and the reference
        steps = sum(math.ceil(n / (length + 1)) for n in lengths.values())
        assert (
            walks["best"]
            == walks["union"]
            == walks["reference"]
            == pytest.approx(sum(lengths.values()) / steps)
        )
        assert walks["best_member"] == 1 and set(walks["gain"].values()) == {1.0}
    assert list(diversity.by_length) == [chain, 5]


@pytest.mark.parametrize("compiled", [False, True])
def test_the_oracle_rows_route_on_true_lengths_on_their_own_loop(
    models: tuple[Path, Path], compiled: bool
) -> None:
    """`learned+oracle` and `learned+oracle+compiled`: the learned decoder of that loop without its
    gate, its router the oracle priced on that loop's costs (the compiled row's margin over
    `learned+compiled` is what better estimates could win there). Not run here: compiling takes
    minutes."""
    llm, pool = models
    loaded = Models.load(str(llm), str(pool))
    decoder = oracle_decoder(loaded, [0, 1], compiled)
    router = decoder.speculator.router
    assert isinstance(router, OracleRouter) and decoder.calls.enabled is compiled
    assert decoder.speculator.gate(1) is None and router._compiled_loop is compiled
    method = oracle_method(loaded, [0, 1], MAX_NEW, Decoding(), compiled)
    assert method.name == ("learned+oracle+compiled" if compiled else "learned+oracle")
    assert method.warm_every_item


def test_the_llm_is_at_no_distance_from_itself(models: tuple[Path, Path]) -> None:
    llm, pool = models
    loaded = Models.load(str(llm), str(pool))
    batch = encode_batches([Prompt("Once upon a time", "test", 0)], loaded.tokenizer, 1, 16)[0]
    decoding = Decoding(do_sample=True, temperature=0.7)
    torch.manual_seed(0)
    new = loaded.llm.generate(**batch, max_new_tokens=8, **decoding.options())
    rows = loaded.rows(new[:, batch.input_ids.shape[1] :])
    measured = measured_tv(loaded.llm, {"llm": [loaded.llm], "ssms": loaded.ssms}, decoding, [(batch, rows)])
    assert measured["positions"] == len(rows[0]) and measured["tv"]["llm"] == [pytest.approx(0, abs=1e-6)]
    assert all(0 < t < 1 for t in measured["tv"]["ssms"])


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
    with pytest.raises(ValueError, match="serves the sampled rows beside llm and pool"):
        SuiteConfig(sampled_pool="p")


def test_a_dry_run_with_given_models_builds_no_fixture(
    models: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    llm, pool = models
    argv = ["bench", "--suite", "quick", "--llm", str(llm), "--pool", str(pool), "--artifacts", str(tmp_path)]
    assert main([*argv, "--dry-run"]) == 0
    assert "no fixture to build" in capsys.readouterr().out and not (tmp_path / "bench-fixture").exists()


def test_methods_a_bare_pool_cannot_run_are_skipped_with_the_reason(tmp_path: Path) -> None:
    """A pool without predictor, profile or Sequoia vectors: `learned` would silently run the fixed
    shape under its name (a bug: it was measured as `learned`), so it is not run; neither is Sequoia,
    nor, without a generalist, its row."""
    llm_dir, ssm_dirs = build_tiny_models(tmp_path / "tiny")
    export.export_pool(make_boost(tmp_path, (llm_dir, ssm_dirs)), tmp_path / "pool")
    models = Models.load(llm_dir, tmp_path / "pool")
    probe = encode_batches([Prompt("Once upon a time", "test", 0)], models.tokenizer, 1, 16)[0]
    method_set = SuiteConfig(max_new_tokens=4, compiled=False).method_set(models, GREEDY, 1, probe)
    assert set(method_set.skipped) == {"learned", "learned+oracle", "sequoia", "generalist"}
    assert "no generalist SSM" in method_set.skipped["generalist"]
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
