"""The benchmark suite's fixture: a reference LLM and everything the methods need, built once;
with --suite, then the suite on it (`make bench`: `specboost bench --suite` with the same options).

    python -m specboost.training.bench_fixture --fixture tiny [--dry-run] [--build-threads N]
    python -m specboost.training.bench_fixture --suite quick [specboost bench options]

Steps, in order (the same commands as the Makefile's training targets):
reference LLM (`make reference-llm`, into ARTIFACTS/reference-llm/<preset>, shared with it) ->
distillation data on the pool's mix of prompt sets (the train splits of a set of each suite
category: stories, instructions, qa, math; wrong math answers kept, as the SSMs imitate the LLM)
-> a pool of specialists boosted on it (`--boost-mode specialists`: the SSMs split the samples
among themselves by EM, ALGORITHMS.md 4.1) -> distillation data on a second mix (other sets of
the same categories, never boosted on) -> predictor labels -> predictor -> hardware profile
(`specboost profile`) -> Sequoia acceptance vectors (on the boost run's held-out samples) ->
export; then the generalist, the baseline the specialists must beat: one SSM boost-tuned
greedily on the same data for as many steps as the whole pool took -> its export (a pool of one
SSM, no predictor or profile: the suite's `generalist` rows run its chain); then the pool for
sampling: sampled distillation data on the pool's mix (the LLM's top-K distributions at the
sampling temperature) -> a pool boosted for sampling on them -> the second mix's text sampled at
that temperature -> its predictor labels (along that text, its SSMs' sampled chains' expected
acceptance at the profile's sampling temperature, the sampled rule of ALGORITHMS.md 5; greedy
match lengths had ranked its SSMs otherwise than their sampled chains accept, and greedy text
had shown the predictor states sampled requests never meet) -> its predictor -> its
hardware profile (the greedy pool's figures, `specboost profile --like`: the same sizes) -> its
export (no Sequoia vectors). Distillation folders and steps are named as `distill` names a run
(`default_out_name`: the sets joined with "+").
Everything but the reference LLM goes into the cache folder ARTIFACTS/bench-fixture/<fixture>.

A step that finishes writes `done/<step>.json` (atomically) with its command and duration; a
later build skips a step whose marker holds the same command and whose output exists, so a
cached build costs nothing. Once a step runs, every later step that reads what it wrote runs too
(`reads`: an argument of its command names the step's `--out`, a path inside it or a folder
holding it; their markers go before it runs, so a build killed in between still rebuilds them),
each resuming through its own logic (every training step resumes after a kill and
is a no-op when its output is complete); the others stay cached, so a new greedy pool leaves the
sampling pool's distillation and training alone. To rebuild a step from scratch, delete its
output and its marker.
Every build ends by writing `fixture.json` (its model paths and steps) into the cache folder:
`specboost bench --suite` finds the fixture's models there (a record from before the generalist
has no `generalist_export`: the suite then lists its rows as not run).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from specboost.decoder import cli
from specboost.decoder.bench.configurations import resolve_suite
from specboost.decoder.bench.suite import FIXTURE_RECORD, SuiteConfig
from specboost.decoder.pool import MANIFEST_FILE
from specboost.decoder.profiler import SAMPLED_TEMPERATURE
from specboost.speculator.cost_model import PROFILE_FILE
from specboost.speculator.sequoia_acceptance import ACCEPTANCE_FILE
from specboost.training.distill import default_out_name
from specboost.training.run_files import write_json_atomic


@dataclass(frozen=True)
class FixtureSpec:
    """What a fixture is built from; the settings mirror `make demo` / `make predictor`."""

    preset: str  # reference LLM preset (training/reference_llm.py PRESETS)
    # Distilled for boost-tuning (each set's train split): the train sets of the suite's four
    # categories (decoder/bench/workloads.py CATEGORIES), so the specialists have domains to split.
    pool_prompts: str = (
        "tinystories_openings:180,tinystories_train_openings:120,self_instruct_seed:157,"
        "self_instruct:150,eagle_qa:72,gsm8k:270"
    )
    # Distilled for predictor labels: other sets of the same categories, never boosted on (their
    # train splits; the suite decodes only held-out prompts). qa has no second set (eagle_qa is the
    # pool's): the scheduler's online correction (ALGORITHMS.md 5.1) covers it.
    predictor_prompts: str = "gutenberg_openings:60,eagle_alpaca:40,eagle_gsm8k:40"
    # --keep-wrong-answers: the tiny LLM answers every math prompt wrongly, and the answer filter
    # would drop the whole math domain; the SSMs are to imitate the LLM, right or wrong.
    distill_flags: tuple[str, ...] = ("--max-new-tokens", "64", "--batch-size", "16", "--keep-wrong-answers")
    num_ssms: int = 3
    max_steps: int = 400  # per SSM of the greedy pool; the generalist trains num_ssms x max_steps
    # Steps of a trunk: one SSM trained on all the pool's data that every specialist starts from,
    # taken from the pool's num_ssms x max_steps (each member trains the rest / num_ssms steps).
    # Half the budget: on the tiny fixture the members then beat the generalist (union 1.13x it,
    # 0.99-1.02x from scratch); 0: the specialists start from scratch (ALGORITHMS.md 4.1, "Trunk").
    trunk_steps: int = 600
    # Spans of 8 output positions over 4 EM rounds: the largest hindsight union of the splits
    # measured on this data (ALGORITHMS.md 4.1).
    boost_flags: tuple[str, ...] = ("--boost-mode", "specialists", "--em-rounds", "4", "--em-span", "8")
    # Text sampled at the profile's sampling temperature (decoder/profiler.py SAMPLED_TEMPERATURE):
    # distill_flags plus these. The sampled pool's predictor is labelled along such text of the
    # predictor prompts, the states sampled requests meet (ALGORITHMS.md 5, "On-policy labels").
    sampled_text_flags: tuple[str, ...] = ("--do-sample", "--temperature", "0.8")
    # The pool for sampling: its distillation data (the pool's prompts, sampled_text_flags plus
    # these) and its boost flags.
    sampled_distill_flags: tuple[str, ...] = ("--num-samples", "4", "--top-k-probs", "64")
    # 1200 steps per round (3x the greedy pool's): a distribution is slower to fit than an argmax
    # path; at 400 the measured TV at T = 0.8 was 0.39-0.43, at 1200 0.27-0.29 (docs/results.md).
    sampled_boost_flags: tuple[str, ...] = ("--max-steps", "1200", "--loss", "kl", "--boost-mode", "sampled")

    def __post_init__(self) -> None:
        budget = self.num_ssms * self.max_steps
        if not 0 <= self.trunk_steps <= budget - self.num_ssms:
            raise ValueError(
                f"trunk_steps must leave each of the {self.num_ssms} SSMs at least one of the pool's "
                f"{budget} steps (0 <= trunk_steps <= {budget - self.num_ssms}), got {self.trunk_steps}"
            )


FIXTURES: dict[str, FixtureSpec] = {
    # The benchmark target (~1 h of training on 2 cores). Its stories come from the 900 training-
    # story openings (a pool trained on tinystories_openings' 180 alone memorised them in 2 rounds),
    # 400 of them; the other sets give all their train prompts up to 200 (self_instruct_seed 157,
    # eagle_qa 72, gsm8k 200): 829 prompts to distil, about the 900 stories it distilled before.
    "small": FixtureSpec(
        preset="small",
        pool_prompts="tinystories_train_openings:400,self_instruct_seed:200,eagle_qa:200,gsm8k:200",
    ),
    # Minutes: for development and quick runs. 949 prompts of the four categories' train splits
    # (180 before: the generalist memorised them, held-out match 3.27 tokens/step against 3.58 now).
    # 800 steps per SSM: after the trunk's 600 each specialist trains 600 steps on its part (the
    # hindsight union at chains of 16 over three seeds 1.16x the best member, 1.12x with 200 steps
    # each; 1000 fell back to 1.13x: ALGORITHMS.md 4.1, "How long the members branch").
    "tiny": FixtureSpec(preset="tiny", max_steps=800),
}


@dataclass(frozen=True)
class FixturePaths:
    llm: Path  # the reference LLM's model folder
    cache: Path  # ARTIFACTS/bench-fixture/<fixture>
    pool: Path  # the boost run (SSMs, predictor, hardware profile)
    export: Path  # the exported pool (SSMPool.from_pretrained)
    generalist: Path  # the generalist's boost run: one SSM, the pool's data and total steps
    generalist_export: Path  # its export, a pool of one SSM: the suite's generalist rows run on it
    trunk: Path  # the trunk's boost run (one SSM), when the fixture has one
    sampled_pool: Path  # the boost run for sampling (its SSMs and hardware profile)
    sampled_export: Path  # its export: the suite's sampled rows run on it

    @classmethod
    def of(cls, name: str, artifacts: Path) -> FixturePaths:
        cache = artifacts / "bench-fixture" / name
        return cls(
            llm=artifacts / "reference-llm" / fixture_spec(name).preset / "model",
            cache=cache,
            pool=cache / "pool",
            export=cache / "pool-export",
            generalist=cache / "generalist",
            generalist_export=cache / "generalist-export",
            trunk=cache / "trunk",
            sampled_pool=cache / "pool-sampled",
            sampled_export=cache / "pool-sampled-export",
        )


@dataclass(frozen=True)
class Step:
    name: str
    argv: tuple[str, ...]  # arguments of `python` (the running interpreter): the step's identity
    output: Path  # exists once the step is complete
    speed_args: tuple[str, ...] = ()  # appended when run; change speed only, so not in the identity


@dataclass
class StepOutcome:
    name: str
    cached: bool
    seconds: float  # this build's time for the step (the original build time when cached)
    finished: str  # when the step's output was built (ISO time)


@dataclass
class FixtureBuild:
    name: str
    paths: FixturePaths
    steps: list[StepOutcome] = field(default_factory=list)
    seconds: float = 0.0  # wall time of this build


def fixture_spec(name: str) -> FixtureSpec:
    if name not in FIXTURES:
        raise ValueError(f"unknown fixture {name!r}; choose one of {sorted(FIXTURES)}")
    return FIXTURES[name]


def fixture_steps(name: str, artifacts: Path, threads: int, build_threads: int | None = None) -> list[Step]:
    """The build steps of fixture `name`. `threads` is the suite's: the hardware profile is
    measured under the thread count the benchmark runs with, and is rebuilt when it changes. The
    training steps run with `build_threads` (default: every core), which changes only their
    speed, so a fixture built with any thread count is reused."""
    spec, paths = fixture_spec(name), FixturePaths.of(name, artifacts)
    llm, pool, t = str(paths.llm), paths.pool, str(threads)
    speed = ("--threads", str(build_threads or os.cpu_count() or 1))
    ssms = [str(pool / f"ssm-{i}") for i in range(boosted_ssms(pool, spec.num_ssms))]
    # Distillation runs are named as `distill` names them (a list's sets joined with "+", no caps)
    distilled = {
        p: paths.cache / "distill" / default_out_name(p) for p in (spec.pool_prompts, spec.predictor_prompts)
    }
    sampled = paths.sampled_pool
    sampled_distilled = paths.cache / "distill-sampled" / default_out_name(spec.pool_prompts)
    labels = paths.cache / "predictor-data"

    def distill(prompts: str, folder: str = "distill", flags: tuple[str, ...] = ()) -> Step:
        out = paths.cache / folder / default_out_name(prompts)
        argv = _module("training.distill", "--llm", llm, "--prompts", prompts, "--out", str(out))
        return Step(f"{folder}-{out.name}", (*argv, *spec.distill_flags, *flags), out / "data.parquet")

    def boost(
        distilled_data: Path, out: Path, flags: tuple[str, ...], num_ssms: int = spec.num_ssms
    ) -> tuple[str, ...]:
        return _module(
            "training.boost",
            *("--distilled", str(distilled_data), "--llm", llm, "--out", str(out)),
            *("--num-ssms", str(num_ssms), *flags),
        )

    reference_llm = _module("training.reference_llm", "--preset", spec.preset, "--out", str(paths.llm.parent))

    def predictor_steps(
        boosted: Path,
        models: list[str],
        labels: Path,
        text: Path = distilled[spec.predictor_prompts],
        suffix: str = "",
        flags: tuple[str, ...] = (),
    ) -> list[Step]:
        """Labels (each SSM's true match lengths along `text`, the predictor prompts' distilled
        outputs) and the predictor."""
        data = _module(
            "training.predictor_data",
            *("--llm", llm, "--ssm", *models, "--distilled", str(text)),
            *("--out", str(labels), *flags),
        )
        train = _module(
            "training.train_predictor", "--labels", str(labels), "--out", str(boosted / "predictor")
        )
        return [
            Step(f"predictor-data{suffix}", data, labels / "metadata.json", speed),
            Step(f"predictor{suffix}", train, boosted / "predictor" / "predictor_record.json"),
        ]

    def profile(boosted: Path, models: list[str], like: Path | None = None) -> tuple[str, ...]:
        """`specboost profile` of these SSMs beside the LLM, measured at the suite's thread count,
        eager and compiled (the suite has compiled learned rows), with the sampled chains' tables
        (for the pool that serves the suite's sampled rows). The pools' SSMs have one size, so the
        sampled pool's takes the greedy one's figures (`like`) rather than compiling and timing the
        same passes again (444 s of the quick fixture's build)."""
        out = str(boosted / PROFILE_FILE)
        return (
            *_module("decoder.cli", "profile", "--llm", llm, "--ssm", *models, "--out", out),
            *("--threads", t, "--compile", "--sampled", *(("--like", str(like)) if like else ())),
        )

    def export(boosted: Path, out: Path, suffix: str = "") -> Step:
        """The boost run exported as a pool; without a predictor or profile (the generalist) it
        decodes by default with chains of 4, and the suite's rows set their own shape anyway."""
        argv = _module("training.export", "--boost", str(boosted), "--out", str(out))
        return Step(f"export{suffix}", argv, out / MANIFEST_FILE)

    sequoia = _module(
        "training.sequoia_trees",
        *("--llm", llm, "--ssm", *ssms, "--distilled", str(distilled[spec.pool_prompts])),
        *("--held-out-from", str(pool / "boost_record.json"), "--out", str(pool / ACCEPTANCE_FILE)),
    )
    budget = spec.num_ssms * spec.max_steps  # the greedy pool's steps, its trunk's included
    greedy_steps = ("--max-steps", str((budget - spec.trunk_steps) // spec.num_ssms))
    trunk: list[Step] = []
    if spec.trunk_steps:
        trunk_argv = boost(
            distilled[spec.pool_prompts], paths.trunk, ("--max-steps", str(spec.trunk_steps)), 1
        )
        trunk = [Step("trunk", trunk_argv, paths.trunk / "boost_record.json", speed)]
        greedy_steps += ("--ssm-base", str(paths.trunk / "ssm-0"))
    # The generalist: one SSM trained greedily on the pool's data for the whole pool's steps, the
    # baseline the pool's specialists must beat (the suite's `generalist` rows).
    generalist = boost(
        distilled[spec.pool_prompts], paths.generalist, ("--max-steps", str(budget)), num_ssms=1
    )
    sampled_ssms = [str(sampled / f"ssm-{i}") for i in range(boosted_ssms(sampled, spec.num_ssms))]
    return [
        Step("reference-llm", reference_llm, paths.llm / "config.json", speed),
        distill(spec.pool_prompts),
        *trunk,
        Step(
            "boost",
            boost(distilled[spec.pool_prompts], pool, (*greedy_steps, *spec.boost_flags)),
            pool / "boost_record.json",
            speed,
        ),
        distill(spec.predictor_prompts),
        *predictor_steps(pool, ssms, labels),
        Step("profile", profile(pool, ssms), pool / PROFILE_FILE),
        Step("sequoia-acceptance", sequoia, pool / ACCEPTANCE_FILE, speed),
        export(pool, paths.export),
        Step("generalist", generalist, paths.generalist / "boost_record.json", speed),
        export(paths.generalist, paths.generalist_export, "-generalist"),
        distill(
            spec.pool_prompts, "distill-sampled", (*spec.sampled_text_flags, *spec.sampled_distill_flags)
        ),
        Step(
            "boost-sampled",
            boost(sampled_distilled, sampled, spec.sampled_boost_flags),
            sampled / "boost_record.json",
            speed,
        ),
        distill(spec.predictor_prompts, "distill-sampled", spec.sampled_text_flags),
        *predictor_steps(
            sampled,
            sampled_ssms,
            paths.cache / "predictor-data-sampled",
            paths.cache / "distill-sampled" / default_out_name(spec.predictor_prompts),
            "-sampled",
            # The sampled chains' acceptance, as profiled, along sampled text: chains alone (wider
            # beams' greedy labels would need the LLM's greedy continuation, which sampled text leaves).
            ("--temperature", str(SAMPLED_TEMPERATURE), "--widths", "1"),
        ),
        Step("profile-sampled", profile(sampled, sampled_ssms, pool / PROFILE_FILE), sampled / PROFILE_FILE),
        export(sampled, paths.sampled_export, "-sampled"),
    ]


def boosted_ssms(pool: Path, planned: int) -> int:
    """How many SSMs the boost run in `pool` produced: fewer than `planned` when boost-tuning
    stopped early because every training sample was reproduced (training/boost.py); `planned`
    before the run has finished."""
    record = pool / "boost_record.json"
    if not record.is_file():
        return planned
    return len(json.loads(record.read_text())["rounds"])


def _module(name: str, *args: str) -> tuple[str, ...]:
    """`python` arguments that run specboost's module `name` (e.g. "training.boost")."""
    return ("-m", f"specboost.{name}", *args)


def _marker(cache: Path, step: Step) -> Path:
    return cache / "done" / f"{step.name}.json"


def _started_marker(cache: Path, step: Step) -> Path:
    return _marker(cache, step).with_suffix(".started.json")


def cached_outcome(cache: Path, step: Step) -> StepOutcome | None:
    """The outcome recorded by an earlier build of this very step, if its output still exists."""
    marker = _marker(cache, step)
    if not marker.is_file() or not step.output.exists():
        return None
    record = json.loads(marker.read_text())
    if record.get("argv") != list(step.argv):
        return None
    return StepOutcome(step.name, True, record["seconds"], record["finished"])


def reads(step: Step, earlier: Step) -> bool:
    """Whether `step` reads what `earlier` wrote: an argument of its command names `earlier`'s
    `--out` (its output, without one), a path inside it or a folder holding it. A step whose own
    `--out` lies inside an earlier one's counts too: rebuilding that one removes its folder."""
    written = _written(earlier)
    return any(_overlaps(Path(arg).resolve(), written) for arg in step.argv)


def readers(step: Step, later: Sequence[Step]) -> list[Step]:
    """The steps of `later` that read what `step` writes, directly or through one another."""
    found: list[Step] = []
    for candidate in later:
        if any(reads(candidate, source) for source in (step, *found)):
            found.append(candidate)
    return found


def _written(step: Step) -> Path:
    argv = step.argv
    return Path(argv[argv.index("--out") + 1] if "--out" in argv else step.output).resolve()


def _overlaps(a: Path, b: Path) -> bool:
    return a == b or a in b.parents or b in a.parents


def build_fixture(
    name: str,
    artifacts: Path = Path("artifacts"),
    threads: int = 1,
    dry_run: bool = False,
    log: Callable[[str], None] = print,
    build_threads: int | None = None,
) -> FixtureBuild:
    """Run the steps of fixture `name` that are not cached, and every step that `reads` one that
    runs (none with `dry_run`: only report). The steps are listed again after each one, since a
    step's output can shape later commands (the SSMs the boost run produced)."""
    start = time.perf_counter()
    paths = FixturePaths.of(name, artifacts)
    build = FixtureBuild(name, paths)
    stale: set[str] = set()  # steps that read one that runs in this build
    for index in range(len(fixture_steps(name, artifacts, threads, build_threads))):
        steps = fixture_steps(name, artifacts, threads, build_threads)
        step = steps[index]
        outcome = None if step.name in stale else cached_outcome(paths.cache, step)
        if outcome is not None:
            log(f"[fixture {name}] {step.name}: cached (built in {outcome.seconds:.0f} s)")
        else:
            followers = readers(step, steps[index + 1 :])
            stale.update(follower.name for follower in followers)
            log(
                f"[fixture {name}] {step.name}: {'to build: ' if dry_run else ''}"
                f"python {' '.join(step.argv + step.speed_args)}"
            )
            if dry_run:
                continue
            for follower in followers:  # before it runs: a kill from here on leaves them stale
                _forget(paths.cache, follower)
            outcome = _run_step(paths.cache, step)
            log(f"[fixture {name}] {step.name}: done in {outcome.seconds:.0f} s")
        build.steps.append(outcome)
    build.seconds = time.perf_counter() - start
    if not dry_run:
        write_json_atomic(paths.cache / FIXTURE_RECORD, json.loads(json.dumps(asdict(build), default=str)))
    return build


def _forget(cache: Path, step: Step) -> None:
    """A step it reads is about to run: its done-marker goes, so that it runs again even if this
    build is killed before it, and its "started" marker, so that it does not resume a run that
    read the older inputs."""
    _marker(cache, step).unlink(missing_ok=True)
    _started_marker(cache, step).unlink(missing_ok=True)


def _run_step(cache: Path, step: Step) -> StepOutcome:
    """Run `step`. A step that is not resuming its own interrupted run (its "started" marker names
    the same command; `_forget` removed it where a step it reads has run since) first removes what
    its `--out` holds: the output of an earlier recipe or of earlier upstream outputs, which the
    training commands refuse to overwrite (a boost run with other settings) or would resume from
    as if current (labels of SSMs since retrained)."""
    started_marker = _started_marker(cache, step)
    resuming = started_marker.is_file() and json.loads(started_marker.read_text())["argv"] == list(step.argv)
    if not resuming:
        _clear_output(cache, step)
        started_marker.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(started_marker, {"argv": list(step.argv)})
    _marker(cache, step).unlink(missing_ok=True)
    started = time.perf_counter()
    subprocess.run([sys.executable, *step.argv, *step.speed_args], check=True)
    if not step.output.exists():
        raise RuntimeError(f"fixture step {step.name} finished but {step.output} is missing")
    outcome = StepOutcome(
        step.name,
        False,
        time.perf_counter() - started,
        datetime.now(timezone.utc).isoformat(timespec="seconds"),
    )
    write_json_atomic(
        _marker(cache, step),
        {
            "argv": list(step.argv),
            "speed_args": list(step.speed_args),
            "seconds": outcome.seconds,
            "finished": outcome.finished,
        },
    )
    started_marker.unlink()
    return outcome


def _clear_output(cache: Path, step: Step) -> None:
    """Remove the file or folder the step's `--out` names, if it lies inside the fixture's cache
    (the reference LLM's folder, shared with `make reference-llm`, never is)."""
    if "--out" not in step.argv:
        return
    out = Path(step.argv[step.argv.index("--out") + 1]).resolve()
    if cache.resolve() not in out.parents:
        return
    if out.is_dir():
        shutil.rmtree(out)
    elif out.exists():
        out.unlink()


def main(argv: list[str] | None = None) -> int:
    """Build (or check) a fixture; with --suite, that suite's fixture, then run the suite on it."""
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(
        description="Build (or check) the benchmark suite's fixture; with --suite, run it."
    )
    p.add_argument(
        "--suite", metavar="NAME|FILE", help="build its fixture, then `specboost bench` with these options"
    )
    p.add_argument("--fixture", choices=sorted(FIXTURES), help="(default: the suite's, else small)")
    p.add_argument("--artifacts", type=Path, default=Path("artifacts"))
    p.add_argument(
        "--threads", type=int, help="torch threads of the hardware profile (default: the suite's, 1)"
    )
    p.add_argument(
        "--build-threads", type=int, metavar="N", help="training steps' threads (default: all cores)"
    )
    p.add_argument("--dry-run", action="store_true", help="list the steps that would run; run none")
    p.add_argument("--llm", help="with --suite: your own models, no fixture to build")
    args, rest = p.parse_known_args(argv)
    if rest and args.suite is None:
        p.error(f"unrecognized arguments: {' '.join(rest)} (specboost bench options need --suite)")
    config = resolve_suite(args.suite) if args.suite is not None else SuiteConfig()
    if isinstance(config, SuiteConfig) and args.llm is None:
        name, threads = args.fixture or config.fixture, args.threads or config.threads
        build = build_fixture(name, args.artifacts, threads, args.dry_run, build_threads=args.build_threads)
        paths = build.paths
        pools = f"{paths.export}, {paths.generalist_export}, {paths.sampled_export}"
        print(f"[fixture {name}] {build.seconds:.0f} s; pools at {pools}")
    if args.suite is None or args.dry_run:
        return 0
    # The suite's own options: all but --build-threads (and its value).
    argv = [
        a
        for i, a in enumerate(argv)
        if not a.startswith("--build-threads") and argv[i - 1 : i] != ["--build-threads"]
    ]
    return cli.main(["bench", *argv])


if __name__ == "__main__":
    sys.exit(main())
