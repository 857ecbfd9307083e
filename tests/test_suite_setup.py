"""The benchmark suite's set-up: fixture steps, their done-markers and the build record
(training/bench_fixture.py), suite settings (decoder/bench/suite.py, configurations.py) and
`specboost bench`'s modes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import tiny_llama

from specboost.decoder.bench.configurations import SUITES, resolve_suite
from specboost.decoder.bench.markdown import speculative
from specboost.decoder.bench.methods import Models
from specboost.decoder.bench.records import GREEDY, Decoding
from specboost.decoder.bench.suite import candidates, read_fixture
from specboost.decoder.bench.workloads import CATEGORIES
from specboost.decoder.cli import main
from specboost.decoder.profiler import SAMPLED_TEMPERATURE
from specboost.speculator.prompt_sets import BUNDLED_PROMPT_SETS
from specboost.training import bench_fixture
from specboost.training.bench_fixture import (
    Step,
    build_fixture,
    cached_outcome,
    fixture_steps,
    readers,
    reads,
)
from specboost.training.distill import parse_prompt_sets


def test_the_fixture_runs_the_training_pipeline_in_order(tmp_path: Path) -> None:
    steps = fixture_steps("small", tmp_path, threads=2)
    assert [s.name for s in steps] == [
        "reference-llm",
        "distill-tinystories_train_openings+self_instruct_seed+eagle_qa+gsm8k",
        "trunk",
        "boost",
        "distill-gutenberg_openings+eagle_alpaca+eagle_gsm8k",
        "predictor-data",
        "predictor",
        "profile",
        "sequoia-acceptance",
        "export",
        "generalist",
        "export-generalist",
        # the pool for sampling, last
        "distill-sampled-tinystories_train_openings+self_instruct_seed+eagle_qa+gsm8k",
        "boost-sampled",
        "distill-sampled-gutenberg_openings+eagle_alpaca+eagle_gsm8k",
        "predictor-data-sampled",
        "predictor-sampled",
        "profile-sampled",
        "export-sampled",
    ]
    reference = steps[0]
    assert reference.argv[:2] == ("-m", "specboost.training.reference_llm")
    assert str(tmp_path / "reference-llm" / "small") in reference.argv  # shared with make reference-llm
    cache = tmp_path / "bench-fixture" / "small"
    assert all(cache in s.output.parents for s in steps[1:])
    profile = next(s for s in steps if s.name == "profile")
    # under the suite's threads, both loops, the sampled chains too
    assert profile.argv[-4:] == ("--threads", "2", "--compile", "--sampled")
    rebuilt = fixture_steps("small", tmp_path, threads=2, build_threads=3)
    for before, after in zip(steps, rebuilt, strict=True):
        assert before.argv == after.argv  # training threads change speed only: same identity
        trained = (
            "reference-llm",
            "trunk",
            "boost",
            "predictor-data",
            "sequoia-acceptance",
            "generalist",
            "boost-sampled",
        )
        if before.name in trained:
            assert "--threads" not in after.argv and after.speed_args == ("--threads", "3")


@pytest.mark.parametrize("fixture", ["tiny", "small"])
def test_a_trunk_takes_its_steps_from_the_pool_and_every_specialist_starts_from_it(
    tmp_path: Path, fixture: str
) -> None:
    """Each fixture's specialists branch from a trunk trained on all the pool's data
    (ALGORITHMS.md 4.1): trunk and members together train the generalist's steps."""
    steps = {s.name: s for s in fixture_steps(fixture, tmp_path, threads=1)}
    names = list(steps)
    assert names.index("trunk") == names.index("boost") - 1
    trunk, pool, generalist = steps["trunk"].argv, steps["boost"].argv, steps["generalist"].argv

    def value(argv: tuple[str, ...], flag: str) -> str:
        return argv[argv.index(flag) + 1]

    assert value(trunk, "--num-ssms") == "1" and value(trunk, "--distilled") == value(pool, "--distilled")
    members = int(value(pool, "--num-ssms"))
    assert int(value(trunk, "--max-steps")) + members * int(value(pool, "--max-steps")) == int(
        value(generalist, "--max-steps")
    )
    assert value(pool, "--ssm-base") == str(Path(value(trunk, "--out")) / "ssm-0")
    assert "--ssm-base" not in generalist


def test_without_a_trunk_the_specialists_start_from_scratch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(
        bench_fixture.FIXTURES, "tiny", bench_fixture.FixtureSpec(preset="tiny", trunk_steps=0)
    )
    steps = {s.name: s for s in fixture_steps("tiny", tmp_path, threads=1)}
    assert "trunk" not in steps and "--ssm-base" not in steps["boost"].argv
    assert steps["boost"].argv[steps["boost"].argv.index("--max-steps") + 1] == "400"


@pytest.mark.parametrize("trunk_steps", [-1, 1198])
def test_a_trunk_that_leaves_a_member_no_steps_is_refused(trunk_steps: int) -> None:
    with pytest.raises(ValueError, match=r"trunk_steps must leave each of the 3 SSMs .* got"):
        bench_fixture.FixtureSpec(preset="tiny", trunk_steps=trunk_steps)


def test_the_sampling_pool_takes_the_greedy_pools_profile(tmp_path: Path) -> None:
    """The sampling pool's hardware profile lies beside its own SSMs, so that the export ships it,
    with the sampled chains' tables (the suite's sampled rows run on it); its SSMs have the greedy
    pool's size, so it takes the figures of the greedy pool's profile (`--like`), which measures
    those tables too, rather than compiling and timing the same passes again."""
    steps = {s.name: s for s in fixture_steps("tiny", tmp_path, threads=1)}
    sampled = tmp_path / "bench-fixture" / "tiny" / "pool-sampled"
    argv = steps["profile-sampled"].argv
    assert argv[:4] == ("-m", "specboost.decoder.cli", "profile", "--llm")
    assert [a for a in argv if a.startswith(str(sampled / "ssm-"))] == [
        str(sampled / f"ssm-{i}") for i in range(3)
    ]
    assert steps["profile-sampled"].output == sampled / "hardware_profile.json"
    assert "--sampled" in argv and "--sampled" in steps["profile"].argv
    assert argv[-2:] == ("--like", str(steps["profile"].output))


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_a_pool_of_specialists_learns_a_mix_and_a_generalist_the_same_data(tmp_path: Path, name: str) -> None:
    """The pool distils one train set of each suite category (wrong math answers kept: the tiny
    LLM gets every one wrong) and splits it among specialists; the predictor's labels come from
    other sets of those categories; the generalist is one greedily boosted SSM on the pool's own
    data for the pool's total steps, exported as a pool of one SSM. Folders are named as distill
    names them, never by the raw list with its caps."""
    spec = bench_fixture.fixture_spec(name)
    steps = {s.name: s for s in fixture_steps(name, tmp_path, threads=1)}
    cache = tmp_path / "bench-fixture" / name
    pool_sets = [entry.name for entry in parse_prompt_sets(spec.pool_prompts)]
    predictor_sets = [entry.name for entry in parse_prompt_sets(spec.predictor_prompts)]
    assert "openings" in pool_sets[0] and {"self_instruct_seed", "eagle_qa", "gsm8k"} <= set(pool_sets)
    assert predictor_sets == ["gutenberg_openings", "eagle_alpaca", "eagle_gsm8k"]
    assert set(pool_sets + predictor_sets) <= set(BUNDLED_PROMPT_SETS)
    # every suite category has a set in the mixes (qa only eagle_qa, the pool's: it has no other)
    assert {c for c, sets in CATEGORIES.items() if set(sets) & set(pool_sets + predictor_sets)} == set(
        CATEGORIES
    )
    pool_data = cache / "distill" / "+".join(pool_sets)
    for step in steps.values():
        assert not any(c in str(step.output) for c in ":,") and not any(c in step.name for c in ":,")
        if step.argv[1] == "specboost.training.distill":
            assert "--keep-wrong-answers" in step.argv and step.output.parent.name in step.name
    assert steps[f"distill-{pool_data.name}"].output == pool_data / "data.parquet"

    def option(step: str, flag: str) -> str:
        argv = steps[step].argv
        return argv[argv.index(flag) + 1]

    assert steps["boost"].argv[-6:] == ("--boost-mode", "specialists", "--em-rounds", "4", "--em-span", "8")
    members = (spec.num_ssms * spec.max_steps - spec.trunk_steps) // spec.num_ssms
    assert option("boost", "--num-ssms") == "3" and option("boost", "--max-steps") == str(members)
    generalist = steps["generalist"].argv
    assert option("generalist", "--distilled") == option("boost", "--distilled") == str(pool_data)
    assert generalist[-4:] == ("--num-ssms", "1", "--max-steps", str(spec.num_ssms * spec.max_steps))
    assert "--boost-mode" not in generalist  # greedy: one SSM on every sample
    assert option("generalist", "--out") == str(cache / "generalist")
    assert option("export-generalist", "--boost") == str(cache / "generalist")
    assert steps["export-generalist"].output == cache / "generalist-export" / "specboost_pool.json"
    assert option("boost-sampled", "--distilled") == str(cache / "distill-sampled" / pool_data.name)
    assert option(f"distill-sampled-{pool_data.name}", "--prompts") == spec.pool_prompts
    # The sampled pool's predictor learns along the predictor prompts' text sampled at the profile's
    # temperature (on-policy, ALGORITHMS.md 5), sampled chains alone; the greedy pool's, along greedy text.
    predictor_text = cache / "distill-sampled" / "+".join(predictor_sets)
    sampled_text = steps[f"distill-sampled-{predictor_text.name}"].argv
    assert option(f"distill-sampled-{predictor_text.name}", "--prompts") == spec.predictor_prompts
    assert sampled_text[-3:] == ("--do-sample", "--temperature", str(SAMPLED_TEMPERATURE))
    assert option("predictor-data-sampled", "--distilled") == str(predictor_text)
    assert steps["predictor-data-sampled"].argv[-4:] == (
        "--temperature",
        str(SAMPLED_TEMPERATURE),
        "--widths",
        "1",
    )
    assert option("predictor-data", "--distilled") == str(cache / "distill" / predictor_text.name)


def fake_steps(tmp_path: Path) -> list[Step]:
    """Steps that each write their output file (and count their runs in runs.txt): a, then b,
    whose command names a's output (it reads it), then c, which reads nothing."""
    script = "import sys, pathlib; p = pathlib.Path(sys.argv[1]); p.write_text('x'); " + (
        "r = p.parent / 'runs.txt'; r.write_text(r.read_text() + p.name if r.exists() else p.name)"
    )
    inputs = {"a": (), "b": (str(tmp_path / "a"),), "c": ()}
    return [
        Step(name, ("-c", script, str(tmp_path / name), *read), tmp_path / name)
        for name, read in inputs.items()
    ]


def runs(tmp_path: Path) -> str:
    return (tmp_path / "runs.txt").read_text()


def test_a_built_step_is_cached_until_its_command_or_output_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    steps = fake_steps(tmp_path)
    monkeypatch.setattr(bench_fixture, "fixture_steps", lambda *_: steps)
    first = build_fixture("tiny", tmp_path, log=lambda _: None)
    assert [(o.name, o.cached) for o in first.steps] == [("a", False), ("b", False), ("c", False)]
    assert runs(tmp_path) == "abc"
    marker = json.loads((tmp_path / "bench-fixture" / "tiny" / "done" / "a.json").read_text())
    assert marker["argv"] == list(steps[0].argv) and marker["seconds"] > 0

    second = build_fixture("tiny", tmp_path, log=lambda _: None)
    assert [o.cached for o in second.steps] == [True, True, True]
    assert second.steps[0].seconds == first.steps[0].seconds  # the original build time
    assert runs(tmp_path) == "abc"

    (tmp_path / "b").unlink()  # output gone: b runs again, a and c stay cached
    build_fixture("tiny", tmp_path, log=lambda _: None)
    assert runs(tmp_path) == "abcb"

    # A changed command runs that step, and every step that reads what it wrote: b, not c.
    steps[0] = Step("a", (*steps[0].argv, "--new-setting"), steps[0].output)
    assert cached_outcome(tmp_path / "bench-fixture" / "tiny", steps[0]) is None
    third = build_fixture("tiny", tmp_path, log=lambda _: None)
    assert runs(tmp_path) == "abcbab"
    assert [o.cached for o in third.steps] == [False, False, True]


def test_a_new_greedy_pool_rebuilds_what_reads_it_and_leaves_the_sampling_pool(tmp_path: Path) -> None:
    """The quick fixture's steps, read for what each reads: a greedy boost run rebuilt reaches its
    labels, predictor, profile, Sequoia vectors and export, and the sampling pool only through the
    profile its own takes (`--like`); its distillation, training and labels stay cached."""
    steps = fixture_steps("tiny", tmp_path, threads=1)
    boost = [s.name for s in steps].index("boost")
    assert [s.name for s in readers(steps[boost], steps[boost + 1 :])] == [
        "predictor-data",
        "predictor",
        "profile",
        "sequoia-acceptance",
        "export",
        "profile-sampled",
        "export-sampled",
    ]
    trunk = steps[boost - 1]
    assert trunk.name == "trunk" and reads(steps[boost], trunk) and not reads(trunk, steps[boost])


def test_a_build_killed_after_a_step_still_rebuilds_what_reads_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The markers of the steps that read a step go before it runs: a build killed after it
    finished, before they ran, leaves them to the next build, which would otherwise find their
    old markers with the same commands and keep outputs made from the older inputs."""
    steps = fake_steps(tmp_path)
    monkeypatch.setattr(bench_fixture, "fixture_steps", lambda *_: steps)
    build_fixture("tiny", tmp_path, log=lambda _: None)
    steps[0] = Step("a", (*steps[0].argv, "--new-setting"), steps[0].output)

    def killed_before_b(line: str) -> None:
        if "] b: python" in line:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        build_fixture("tiny", tmp_path, log=killed_before_b)
    assert runs(tmp_path) == "abca"
    resumed = build_fixture("tiny", tmp_path, log=lambda _: None)
    assert runs(tmp_path) == "abcab"
    assert [o.cached for o in resumed.steps] == [True, False, True]


def test_a_step_run_afresh_starts_from_an_empty_out_but_an_interrupted_one_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A recipe changed (or an upstream step rebuilt): the step's `--out` inside the fixture cache
    is removed before it runs, since a boost run refuses another run's folder and a labelling run
    would resume from labels of SSMs since retrained. A step killed mid-run (its "started" marker
    names the same command) resumes from what it left; an `--out` outside the cache (the reference
    LLM's, shared with `make reference-llm`) is never removed. A step that reads one that ran in
    the same build starts afresh even from its own interrupted run: that run read older inputs."""
    cache = tmp_path / "bench-fixture" / "tiny"
    out, shared = cache / "pool", tmp_path / "reference-llm"
    script = (
        "import sys, pathlib; o = pathlib.Path(sys.argv[sys.argv.index('--out') + 1]); "
        "o.mkdir(parents=True, exist_ok=True); seen = sorted(p.name for p in o.iterdir()); "
        "(o / 'seen.txt').write_text(' '.join(seen)); (o / 'record.json').write_text('{}')"
    )

    def step(*settings: str, where: Path = out) -> Step:
        return Step("boost", ("-c", script, "--out", str(where), *settings), where / "record.json")

    steps = [step("--old")]
    monkeypatch.setattr(bench_fixture, "fixture_steps", lambda *_: steps)
    build_fixture("tiny", tmp_path, log=lambda _: None)
    (out / "stale.bin").write_text("from the old recipe")
    steps[0] = step("--new")
    build_fixture("tiny", tmp_path, log=lambda _: None)
    assert (out / "seen.txt").read_text() == "" and not (out / "stale.bin").exists()
    assert not (cache / "done" / "boost.started.json").exists()

    (out / "record.json").unlink()  # as if killed mid-run: started, not done
    (out / "checkpoint").write_text("partial")
    (cache / "done" / "boost.started.json").write_text(json.dumps({"argv": list(steps[0].argv)}))
    build_fixture("tiny", tmp_path, log=lambda _: None)
    assert "checkpoint" in (out / "seen.txt").read_text().split()

    # A step it reads runs again in this build: an interrupted run of it is stale too.
    upstream = Step(
        "trunk", ("-c", script, "--out", str(cache / "trunk"), "--x"), cache / "trunk" / "record.json"
    )
    steps[0] = step("--ssm-base", str(cache / "trunk" / "ssm-0"))
    steps.insert(0, upstream)
    (out / "checkpoint").write_text("from SSMs since retrained")
    (cache / "done" / "boost.started.json").write_text(json.dumps({"argv": list(steps[1].argv)}))
    build_fixture("tiny", tmp_path, log=lambda _: None)
    assert (out / "seen.txt").read_text() == ""
    steps.pop(0)

    shared.mkdir()
    (shared / "model.bin").write_text("kept")
    steps[0] = step("--other", where=shared)
    build_fixture("tiny", tmp_path, log=lambda _: None)
    assert (shared / "model.bin").exists()


def test_a_dry_run_runs_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench_fixture, "fixture_steps", lambda *_: fake_steps(tmp_path))
    lines: list[str] = []
    build = build_fixture("tiny", tmp_path, dry_run=True, log=lines.append)
    assert build.steps == [] and not (tmp_path / "runs.txt").exists()
    assert all("to build: python -c" in line for line in lines)


def test_a_failing_step_writes_no_marker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    step = Step("bad", ("-c", "raise SystemExit(3)"), tmp_path / "never")
    monkeypatch.setattr(bench_fixture, "fixture_steps", lambda *_: [step])
    with pytest.raises(Exception, match="exit status 3"):
        build_fixture("tiny", tmp_path, log=lambda _: None)
    assert not (tmp_path / "bench-fixture" / "tiny" / "done" / "bad.json").exists()


def test_suites_resolve_by_name_or_json_file(tmp_path: Path) -> None:
    assert resolve_suite("quick") is SUITES["quick"] and SUITES["quick"].fixture == "tiny"
    path = tmp_path / "suite.json"
    settings = {
        "fixture": "tiny",
        "categories": ["qa"],
        "decodings": [{"do_sample": True, "temperature": 0.7, "seed": 3}],
        "shapes": {"chain_length": 3},
        "batch_sizes": [1],
    }
    path.write_text(json.dumps(settings))
    config = resolve_suite(str(path))
    assert config.categories == ("qa",) and config.batch_sizes == (1,)
    assert config.decodings == (Decoding(do_sample=True, temperature=0.7, seed=3),)
    assert config.shapes.chain_length == 3 and config.shapes.beam_depth == 4
    path.write_text(json.dumps({"repeat": 3}))
    with pytest.raises(ValueError, match=r"unknown suite settings \['repeat'\]"):
        resolve_suite(str(path))
    with pytest.raises(FileNotFoundError, match="no suite 'nope'"):
        resolve_suite("nope")
    with pytest.raises(ValueError, match="unknown fixture"):
        fixture_steps("huge", tmp_path, threads=1)


def test_bench_needs_models_and_prompts_unless_it_runs_the_suite(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--llm", "x"])
    assert exit_info.value.code == 2
    assert "bench needs --ssm, --prompts, --out (or --suite)" in capsys.readouterr().err


def test_bench_suite_dry_run_lists_the_fixture_steps(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`make bench SUITE=quick SUITE_FLAGS=--dry-run`: the training side builds the suite's fixture."""
    assert bench_fixture.main(["--suite", "quick", "--artifacts", str(tmp_path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "[fixture tiny] reference-llm: to build:" in out and "export: to build:" in out
    assert "[fixture tiny] generalist: to build:" in out and "export-generalist: to build:" in out
    assert not (tmp_path / "bench-fixture").exists()


def test_the_suite_finds_its_fixture_by_the_build_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """The decoder never builds a fixture: it reads the record the last build left, or says how to
    build one."""
    assert main(["bench", "--suite", "quick", "--artifacts", str(tmp_path), "--dry-run"]) == 2
    assert "the fixture 'tiny' is not built" in capsys.readouterr().err
    monkeypatch.setattr(bench_fixture, "fixture_steps", lambda *_: fake_steps(tmp_path))
    build_fixture("tiny", tmp_path, log=lambda _: None)
    record = read_fixture(tmp_path, "tiny")
    assert record["paths"]["export"] == str(tmp_path / "bench-fixture" / "tiny" / "pool-export")
    assert record["paths"]["sampled_export"] == str(
        tmp_path / "bench-fixture" / "tiny" / "pool-sampled-export"
    )
    assert record["paths"]["generalist_export"] == str(
        tmp_path / "bench-fixture" / "tiny" / "generalist-export"
    )
    assert [step["name"] for step in record["steps"]] == ["a", "b", "c"] and not record["steps"][0]["cached"]
    assert main(["bench", "--suite", "quick", "--artifacts", str(tmp_path), "--dry-run"]) == 0
    assert "the suite would run on the fixture tiny" in capsys.readouterr().out


def test_steps_after_boost_use_the_ssms_the_boost_run_produced(tmp_path: Path) -> None:
    """Boost-tuning stops early when every training sample is reproduced: the later steps must
    name only the SSMs that exist (a build once failed on a missing ssm-2)."""
    pool = tmp_path / "bench-fixture" / "small" / "pool"
    planned = {s.name: s for s in fixture_steps("small", tmp_path, threads=1)}
    assert sum(a.endswith("ssm-2") for a in planned["predictor-data"].argv) == 1  # before the run: as planned
    pool.mkdir(parents=True)
    (pool / "boost_record.json").write_text(json.dumps({"rounds": [{"ssm": 0}, {"ssm": 1}]}))
    steps = {s.name: s for s in fixture_steps("small", tmp_path, threads=1)}
    for name in ("predictor-data", "profile", "sequoia-acceptance"):
        named = [a for a in steps[name].argv if a.startswith(str(pool / "ssm-"))]
        assert named == [str(pool / "ssm-0"), str(pool / "ssm-1")], name


# What every step of the `small` fixture runs: a step whose command differs is rebuilt, so these
# must not change without a reason to rebuild (the mix of domains, specialists and the generalist
# changed every step after the reference LLM; the trunk, 2026-12-01, changed the boost run and all
# after it).
SMALL = "artifacts/bench-fixture/small"
LLM = "artifacts/reference-llm/small/model"
SSMS = [f"{SMALL}/pool/ssm-{i}" for i in range(3)]
POOL_PROMPTS = "tinystories_train_openings:400,self_instruct_seed:200,eagle_qa:200,gsm8k:200"
POOL_DATA = "tinystories_train_openings+self_instruct_seed+eagle_qa+gsm8k"
PREDICTOR_PROMPTS = "gutenberg_openings:60,eagle_alpaca:40,eagle_gsm8k:40"
PREDICTOR_DATA = "gutenberg_openings+eagle_alpaca+eagle_gsm8k"
DISTILL_FLAGS = ("--max-new-tokens", "64", "--batch-size", "16", "--keep-wrong-answers")
RECORDED_ARGV = {
    "reference-llm": [
        "specboost.training.reference_llm",
        "--preset",
        "small",
        "--out",
        "artifacts/reference-llm/small",
    ],
    f"distill-{POOL_DATA}": [
        *("specboost.training.distill", "--llm", LLM, "--prompts", POOL_PROMPTS),
        *("--out", f"{SMALL}/distill/{POOL_DATA}", *DISTILL_FLAGS),
    ],
    "trunk": [
        *("specboost.training.boost", "--distilled", f"{SMALL}/distill/{POOL_DATA}"),
        *("--llm", LLM, "--out", f"{SMALL}/trunk", "--num-ssms", "1", "--max-steps", "600"),
    ],
    "boost": [
        *("specboost.training.boost", "--distilled", f"{SMALL}/distill/{POOL_DATA}"),
        *("--llm", LLM, "--out", f"{SMALL}/pool", "--num-ssms", "3", "--max-steps", "200"),
        *("--ssm-base", f"{SMALL}/trunk/ssm-0"),
        *("--boost-mode", "specialists", "--em-rounds", "4", "--em-span", "8"),
    ],
    f"distill-{PREDICTOR_DATA}": [
        *("specboost.training.distill", "--llm", LLM, "--prompts"),
        *(
            PREDICTOR_PROMPTS,
            "--out",
            f"{SMALL}/distill/{PREDICTOR_DATA}",
        ),
        *DISTILL_FLAGS,
    ],
    "predictor-data": [
        *("specboost.training.predictor_data", "--llm", LLM, "--ssm", *SSMS),
        *("--distilled", f"{SMALL}/distill/{PREDICTOR_DATA}", "--out", f"{SMALL}/predictor-data"),
    ],
    "predictor": [
        *("specboost.training.train_predictor", "--labels", f"{SMALL}/predictor-data"),
        *("--out", f"{SMALL}/pool/predictor"),
    ],
    "profile": [
        *("specboost.decoder.cli", "profile", "--llm", LLM, "--ssm", *SSMS),
        *("--out", f"{SMALL}/pool/hardware_profile.json", "--threads", "1", "--compile", "--sampled"),
    ],
    "sequoia-acceptance": [
        *("specboost.training.sequoia_trees", "--llm", LLM, "--ssm", *SSMS),
        *("--distilled", f"{SMALL}/distill/{POOL_DATA}"),
        *(
            "--held-out-from",
            f"{SMALL}/pool/boost_record.json",
            "--out",
            f"{SMALL}/pool/sequoia_acceptance.json",
        ),
    ],
    "export": ["specboost.training.export", "--boost", f"{SMALL}/pool", "--out", f"{SMALL}/pool-export"],
    "generalist": [
        *("specboost.training.boost", "--distilled", f"{SMALL}/distill/{POOL_DATA}"),
        *("--llm", LLM, "--out", f"{SMALL}/generalist", "--num-ssms", "1", "--max-steps", "1200"),
    ],
    "export-generalist": [
        *("specboost.training.export", "--boost", f"{SMALL}/generalist"),
        *("--out", f"{SMALL}/generalist-export"),
    ],
    # The pool for sampling.
    f"distill-sampled-{POOL_DATA}": [
        *("specboost.training.distill", "--llm", LLM, "--prompts", POOL_PROMPTS),
        *("--out", f"{SMALL}/distill-sampled/{POOL_DATA}", *DISTILL_FLAGS),
        *("--do-sample", "--temperature", "0.8", "--num-samples", "4", "--top-k-probs", "64"),
    ],
    "boost-sampled": [
        *("specboost.training.boost", "--distilled", f"{SMALL}/distill-sampled/{POOL_DATA}"),
        *("--llm", LLM, "--out", f"{SMALL}/pool-sampled", "--num-ssms", "3", "--max-steps", "1200"),
        *("--loss", "kl", "--boost-mode", "sampled"),
    ],
    # The predictor prompts' text sampled at T = 0.8, the sampled pool's labels along it (on-policy,
    # ALGORITHMS.md 5): rebuilds from here on.
    f"distill-sampled-{PREDICTOR_DATA}": [
        *("specboost.training.distill", "--llm", LLM, "--prompts", PREDICTOR_PROMPTS),
        *("--out", f"{SMALL}/distill-sampled/{PREDICTOR_DATA}", *DISTILL_FLAGS),
        *("--do-sample", "--temperature", "0.8"),
    ],
    "predictor-data-sampled": [
        *("specboost.training.predictor_data", "--llm", LLM, "--ssm"),
        *(f"{SMALL}/pool-sampled/ssm-{i}" for i in range(3)),
        *("--distilled", f"{SMALL}/distill-sampled/{PREDICTOR_DATA}"),
        *("--out", f"{SMALL}/predictor-data-sampled", "--temperature", "0.8", "--widths", "1"),
    ],
    "predictor-sampled": [
        *("specboost.training.train_predictor", "--labels", f"{SMALL}/predictor-data-sampled"),
        *("--out", f"{SMALL}/pool-sampled/predictor"),
    ],
    "profile-sampled": [
        *("specboost.decoder.cli", "profile", "--llm", LLM, "--ssm"),
        *(f"{SMALL}/pool-sampled/ssm-{i}" for i in range(3)),
        *("--out", f"{SMALL}/pool-sampled/hardware_profile.json", "--threads", "1", "--compile", "--sampled"),
        *("--like", f"{SMALL}/pool/hardware_profile.json"),
    ],
    "export-sampled": [
        *("specboost.training.export", "--boost", f"{SMALL}/pool-sampled"),
        *("--out", f"{SMALL}/pool-sampled-export"),
    ],
}


def test_every_fixture_step_keeps_the_command_its_cache_was_built_with() -> None:
    steps = fixture_steps("small", Path("artifacts"), threads=1, build_threads=2)
    assert {s.name: list(s.argv) for s in steps} == {
        name: ["-m", *argv] for name, argv in RECORDED_ARGV.items()
    }


@pytest.mark.parametrize("suite", ["default", "quick"])
def test_both_suites_run_the_compiled_rows_and_learned_compiled_at_every_batch_size(suite: str) -> None:
    """The quick suite has the compiled rows too (its fastest fixed row includes them, and our own
    loop's plain steps: the routed scheduler's "no draft" action), and the learned scheduler runs
    compiled in every table; it is never a fixed speculative row."""
    config = SUITES[suite]
    llm = tiny_llama(layers=1, seed=0)
    models = Models(llm, None, [llm, llm])
    for decoding in config.decodings:
        for size in config.batch_sizes:
            names = {name for name in candidates(config, models, decoding, size) if config.wanted(name)}
            assert {"plain_compiled", "loop_plain+compiled", "learned+compiled"} <= names, (decoding, size)
            assert ("learned" in names) == ("chain[0]+compiled" in names) == (size == 1)
            assert ("batched+compiled" in names) == (size > 1 and suite == "default")  # quick: slow to build
            assert ("batched" in names) == ("engine" in names) == (size > 1)
            # the generalist's chain: greedy batch 1 only (it is trained on greedy outputs)
            generalist = size == 1 and not decoding.do_sample
            assert ({"generalist", "generalist+compiled"} <= names) == generalist, (decoding, size)
            assert generalist or not any(name.startswith("generalist") for name in names)
    assert not speculative("learned+compiled") and speculative("chain[0]+compiled")
    demo = SUITES["demo"]  # the demo's pool ships no generalist
    assert not any(
        demo.wanted(name) for name in candidates(demo, models, GREEDY, 1) if name.startswith("generalist")
    )
