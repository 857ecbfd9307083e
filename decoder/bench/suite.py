"""The benchmark suite: every method against plain and Hugging Face assisted generation on held-out
workloads by category, greedy and sampled, at batch sizes 1 and 8; on SSM folders and one prompt
file, the single-file bench. Writes suite.json (bench.json), report.md and the plots.

    specboost bench --suite default                  # the `small` fixture (make bench builds it)
    specboost bench --suite my_suite.json --spec-bench question.jsonl --out DIR
    specboost bench --suite default --llm MY_LLM --pool MY_POOL_EXPORT   # your own models
    specboost bench --suite default --llm MY_LLM --pool MY_POOL --sampled-pool MY_SAMPLING_POOL
    specboost bench --llm LLM --ssm SSM ... --prompts FILE --out DIR      # the single-file bench

Batch size 1: plain `llm.generate`, and transformers' best plain decoding (a static cache, eager and
compiled); HF assisted generation, our chain (eager and compiled) and Stairs with each single SSM;
the pool's merged trees (SpecInfer); every further `strategy=` (`strategies.DRAFTING`); the learned
scheduler (eager and compiled) and, greedy, its rule on the true match lengths (the hindsight
oracle, eager and compiled: `learned+oracle`, `learned+oracle+compiled`); greedy only, the
generalist's chain at the `chain[i]` rows' length, eager and compiled (`generalist`,
`generalist+compiled`: one SSM trained greedily on the pool's data for the whole pool's steps, the
baseline a pool must beat; the fixture's, or `generalist`; no sampled rows, as it is trained on
greedy outputs only); sampled only, k-sequential verification (`pool_chain+kseq`) and three sampled
chains of SSM 0 (`chain[0]x3`, MSS and `+kseq`: the drafted tokens of a 3-SSM `pool_chain`).
Batch > 1: plain batched `generate` against the pool's chains as one ragged batch (BASS, eager and
compiled), the pipelined engine (Minions: two groups of half the batch) and the learned scheduler,
compiled (the engine's eager in a suite without compiled rows), on the ragged batch and in the
serving engine with one group of the whole batch
(`learned+engine`: compiled passes in two groups whose rows join and leave at different steps meet a
new shape at almost every round, docs/limitations.md). Every table's "vs best fixed" is against its
fastest row that is not the learned scheduler's, measured in the same run. A method that cannot run
here is listed under "Not run" with the reason.

Sampled rows run on the pool for sampling when there is one (the fixture's, or `sampled_pool`),
greedy rows on the pool; per sampled cell group the report gives each SSM's measured total
variation to the LLM (`ssm_tv`). After the tables, untimed, each pool's diversity on plain greedy
decoding's outputs (`diversity`, decoder/bench/diversity.py): every SSM's mean match per category
and the hindsight union's tokens/step against the best single member's, at the fixed shape's chain
length and at each longer depth of the pool's predictor (the learned scheduler's chains), the
generalist's chain alone beside the greedy pool's.
"""

from __future__ import annotations

import functools
import json
import math
import re
import statistics
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, ClassVar

import torch
from transformers import BatchEncoding, PreTrainedModel

from specboost.decoder.bench.diversity import greedy_outputs, pool_diversity
from specboost.decoder.bench.markdown import GENERALIST, fill_readme, markdown_report
from specboost.decoder.bench.methods import (
    STATIC_EAGER,
    Kept,
    Models,
    decoder_method,
    engine_method,
    generate_method,
    keeping_rows,
    kept_from_json,
    kept_json,
    static_compiled,
    unpadded,
)
from specboost.decoder.bench.plots import (
    plot_acceptance_by_position,
    plot_speedup,
    plot_ssm_weights,
    plot_tokens_per_step,
    weight_histories,
)
from specboost.decoder.bench.protocol import PARTIAL_REPORT, Log, Plan, Protocol, Report, build_methods
from specboost.decoder.bench.records import GREEDY, Decoding, Method, MethodSet
from specboost.decoder.bench.summary import HF_ASSISTED, LOOP_PLAIN, PLAIN
from specboost.decoder.bench.workloads import (
    CATEGORIES,
    Workload,
    bundled_workloads,
    encode_batches,
    held_out_or_file,
    load_spec_bench,
)
from specboost.decoder.decoder import SpeculativeDecoder
from specboost.decoder.engine import EngineConfig
from specboost.decoder.generation_options import resolve
from specboost.decoder.loop import BatchConfig
from specboost.decoder.strategies import DRAFTING, StrategyOptions
from specboost.speculator.atomic_files import write_text_atomic
from specboost.speculator.oracle_router import OracleRouter
from specboost.speculator.sampling import LogitsToProbs
from specboost.speculator.shapes import BeamShape, ChainShape, TopologyShape

FIXTURE_RECORD = "fixture.json"  # written by the fixture's builder (training/bench_fixture.py)
CHAIN_SAMPLES = 3  # chain[0]x3: SSM 0's sampled chains, as many tokens as a 3-SSM pool_chain drafts
# The single-file bench's method families ("plain" always runs).
BENCH_METHODS = ("plain", "hf_assisted", "chain", "stairs", "pool_chain", "pool_beam", "pool_topology")
# The strategies with rows of their own: "pool" is the chain and beam rows ("plain", drafting
# nothing, is plain decoding, measured as `llm.generate`: the PLAIN row).
OWN_ROWS = tuple(s for s in DRAFTING if s != "pool")
METHOD_FAMILIES = (
    *(
        "plain",
        "plain_static",
        "plain_compiled",
        LOOP_PLAIN,
        "hf_assisted",
        "chain",
        "chain+compiled",
        "stairs",
        "pool_chain",
        "pool_chain+compiled",
        "majority+compiled",
        "pool_chain+kseq",
    ),
    *("pool_beam", "pool_topology", *OWN_ROWS, "majority+adaptive", "batched"),
    *("batched+compiled", "engine", f"chainx{CHAIN_SAMPLES}", f"chainx{CHAIN_SAMPLES}+kseq"),
    "learned+compiled",
    "learned+engine",
    "learned+oracle",
    "learned+oracle+compiled",
    *(GENERALIST, f"{GENERALIST}+compiled"),
)
ADAPTIVE_LENGTH = "minions"  # majority+adaptive: length_controller=ADAPTIVE_LENGTH (ALGORITHMS.md 7)
BASS = f"chain length by {BatchConfig().length_controller}"  # batches pick one length per step
SSM_PROBE_TOKENS = 32  # tokens per timed SSM generation in `ssm_token_seconds`


@dataclass(frozen=True)
class Shapes:
    chain_length: int = 4  # ChainShape of chain[i], stairs, pool_chain, majority, batched
    beam_width: int = 2  # BeamShape of pool_beam and pruned
    beam_depth: int = 4
    topology_children: tuple[tuple[int, ...], ...] = ((2,), (2, 1), (1, 1, 1), (1, 1, 1))  # pool_topology


@dataclass(frozen=True, kw_only=True)
class SuiteConfig(Protocol):
    fixture: str = "small"  # its models unless llm with pool or ssms is given (training/bench_fixture.py)
    llm: str | None = None  # the LLM (folder or hub id) with `pool` or `ssms`, instead of the fixture's
    pool: str | None = None  # an exported pool for `llm` (SSMPool.from_pretrained)
    sampled_pool: str | None = None  # with llm and pool: an exported pool serving the sampled rows
    ssms: tuple[str, ...] = ()  # or SSM folders (the single-file bench)
    # an exported pool of one SSM, the generalist rows' (default: the fixture's generalist export)
    generalist: str | None = None
    tokenizer: str | None = None  # default: the LLM's
    categories: tuple[str, ...] = tuple(CATEGORIES)  # bundled categories (unless spec_bench or prompts)
    spec_bench: str | None = None  # a Spec-Bench question file: its categories are the workloads
    prompts: str | None = None  # a prompt file (or a bundled set's held-out split): one workload
    prompts_per_category: int | None = 4  # at batch size b, ceil(n / b) batches of b; None: every prompt
    decodings: tuple[Decoding, ...] = (
        *(GREEDY, Decoding(do_sample=True, temperature=0.8), Decoding(do_sample=True, temperature=1.0)),
    )
    batch_sizes: tuple[int, ...] = (1, 8)
    shapes: Shapes = field(default_factory=Shapes)
    compiled: bool = True  # also the torch.compile'd rows (plain_compiled, chain[i]+compiled, ...)
    methods: tuple[str, ...] | None = None  # method families to run (plain always); None: the suite's
    without: tuple[str, ...] = ()  # method families left out of the suite's rows

    # The `specboost bench` options a suite takes (others are refused with --suite).
    options: ClassVar[tuple[str, ...]] = (
        *("llm", "pool", "sampled_pool", "fixture", "spec_bench", "max_new_tokens", "repeats"),
        *("warmup", "threads", "dtype", "device", "chain_length", "beam_width", "beam_depth"),
        *("readme", "dry_run"),
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if min(self.prompts_per_category or 1, *self.batch_sizes) < 1:
            raise ValueError("prompts_per_category and batch sizes must be >= 1")
        if self.prompts_per_category is None and self.prompts is None:
            raise ValueError("prompts_per_category=None (every prompt) needs a prompt file")
        if (self.llm is None) != (self.pool is None and not self.ssms) or (self.pool and self.ssms):
            raise ValueError(
                "give both llm and pool (a pool exported for that LLM by `make export`) to benchmark "
                "your own models, or llm and SSM folders, or neither to benchmark the fixture"
            )
        if self.sampled_pool and not self.pool:
            raise ValueError(
                "sampled_pool (--sampled-pool) serves the sampled rows beside llm and pool: give all three"
            )
        unknown = sorted(set(self.methods or ()).union(self.without) - set(METHOD_FAMILIES))
        if unknown:
            raise ValueError(f"unknown bench methods {unknown}; choose from {list(METHOD_FAMILIES)}")
        if self.methods is not None and set(self.methods) <= {"plain"}:
            raise ValueError("methods name nothing to compare with plain decoding: add at least one other")

    @property
    def name(self) -> str:
        """The report folder's name: the fixture's, or the given LLM's."""
        return self.fixture if self.llm is None else Path(self.llm).name

    def folder(self) -> str:
        return f"bench-suite/{self.name}"

    @classmethod
    def from_json(cls, path: Path) -> SuiteConfig:
        """A JSON object of SuiteConfig fields (`decodings`: a list of Decoding fields, `shapes`:
        Shapes fields)."""
        data = json.loads(path.read_text())
        unknown = sorted(set(data) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"{path}: unknown suite settings {unknown}")
        if "decodings" in data:
            data["decodings"] = tuple(Decoding(**d) for d in data["decodings"])
        if "shapes" in data:
            data["shapes"] = Shapes(**data["shapes"])
        for name in ("categories", "batch_sizes", "ssms", "methods", "without"):
            if name in data:
                data[name] = tuple(data[name])
        return cls(**data)

    def with_options(self, **given: Any) -> SuiteConfig:
        """Command-line options over the settings (shape options go into `shapes`)."""
        if "max_prompts" in given:  # the single-file bench's
            given["prompts_per_category"] = given.pop("max_prompts")
        shape_names = {f.name for f in fields(Shapes)}
        shapes = replace(self.shapes, **{k: v for k, v in given.items() if k in shape_names})
        rest = {k: v for k, v in given.items() if k not in shape_names}
        return replace(self, shapes=shapes, **rest)

    def wanted(self, name: str) -> bool:
        if name.endswith("compiled") and not self.compiled:
            return False
        family = re.sub(r"\[[^]]*\]", "", name)
        if family in self.without:
            return False
        if self.methods is None:  # the suite's rows: Stairs with SSM 0 alone, no topology
            return name != "pool_topology" and (family != "stairs" or name == "stairs[0]")
        return name == PLAIN or family in self.methods

    def workloads(self) -> list[Workload]:
        if self.spec_bench is not None:
            return load_spec_bench(self.spec_bench)
        if self.prompts is not None:
            return [held_out_or_file(self.prompts, self.prompts_per_category)]
        per = self.prompts_per_category
        return bundled_workloads(self.categories, max(math.ceil(per / b) * b for b in self.batch_sizes))

    # Running ----------------------------------------------------------------------------------------
    def plan(self, artifacts: Path, log: Log) -> Plan:
        """Every cell: batch size x decoding x category, on the fixture's models or the given ones."""
        fixture, llm, pool, sampled = None, self.llm, self.pool, self.sampled_pool
        generalist = self.generalist
        if llm is None:
            fixture = read_fixture(artifacts, self.fixture)
            paths = fixture["paths"]  # builds from before the sampling pool or the generalist lack them
            llm, pool, sampled = paths["llm"], paths["export"], paths.get("sampled_export")
            generalist = generalist or paths.get("generalist_export")
        models = Models.load(
            llm, pool, self.ssms, tokenizer=self.tokenizer, dtype=self.dtype, device=self.device
        )
        samplers = models if sampled is None else models.with_pool(sampled, self.dtype, self.device)
        generalists = None if generalist is None else models.with_pool(generalist, self.dtype, self.device)
        if generalists is not None and len(generalists.ssms) != 1:
            raise ValueError(
                f"the generalist {generalist} must be a pool of one SSM, not {len(generalists.ssms)}"
            )
        workloads = {w.category: w for w in self.workloads()}

        def items(category: str, size: int) -> list[BatchEncoding] | str:
            prompts = workloads[category].prompts  # a prompt file: all of them; else as many per category
            n = (
                len(prompts) // size * size
                if self.prompts
                else math.ceil(self.prompts_per_category / size) * size
            )
            if n == 0 or len(prompts) < n:
                return f"{len(prompts)} prompts, {max(n, size)} needed"
            return encode_batches(prompts[:n], models.tokenizer, size, self.max_prompt_tokens, self.device)

        def reference(decoding: Decoding, batches: list[BatchEncoding]) -> list | None:
            low_precision = self.dtype in ("bfloat16", "float16") and not decoding.do_sample
            return models.reference_rows(batches, self.max_new_tokens) if low_precision else None

        both = {"sampling pool": samplers, "greedy pool": models}
        pools = {"pool": models} if sampled is None else both  # measured_tv, diversity: each's SSMs
        plain_rows: dict[tuple[Decoding, int], Kept] = {}  # plain decoding's outputs, per item

        def diversity(size: int, kept: dict) -> dict[str, Any]:
            """Each pool's `Diversity` on plain decoding's greedy outputs at batch `size`: the
            timed runs' own outputs, teacher-forced after every table is measured."""
            batches = {c: b for c in workloads if not isinstance(b := items(c, size), str)}
            outputs = greedy_outputs(kept.values(), batches)
            if not any(outputs.values()):
                return {}
            chain = self.shapes.chain_length
            return {
                name: asdict(
                    pool_diversity(
                        pool.ssms,
                        outputs,
                        chain,
                        [d for d in router_depths(pool) if d >= chain],
                        generalists.ssms[0] if generalists is not None and pool is models else None,
                    )
                )
                for name, pool in pools.items()
            }

        def results(report: Report) -> dict[str, Any]:
            out = {
                "ssm_tv": {
                    f"{decoding.name}, batch {size}": measured_tv(
                        models.llm, {name: pool.ssms for name, pool in pools.items()}, decoding, kept.values()
                    )
                    for (decoding, size), kept in plain_rows.items()
                    if decoding.do_sample
                }
            }
            greedy = [(size, kept) for (decoding, size), kept in plain_rows.items() if not decoding.do_sample]
            if greedy:  # at the smallest batch size: unpadded rows where batch size 1 ran
                out["diversity"] = diversity(*min(greedy, key=lambda pair: pair[0]))
            if self.methods is None:  # the suite's own rows only: the drafting cost line
                probe = encode_batches(next(iter(workloads.values())).prompts[:1], models.tokenizer, 1, 16)[0]
                out["ssm_token_seconds"] = ssm_token_seconds(
                    models, probe.input_ids.to(self.device), self.repeats, self.compiled
                )
            return out

        def method_set(decoding: Decoding, size: int, probe: BatchEncoding) -> MethodSet:
            """Sampled rows on the sampling pool, keeping plain decoding's outputs (measured_tv, and
            greedy, the pools' diversity)."""
            on = samplers if decoding.do_sample else models
            made = self.method_set(on, decoding, size, probe, generalists)
            plain_rows[decoding, size] = {}  # a table run again (a resumed run) keeps its own alone
            made.methods[0] = keeping_rows(made.methods[0], plain_rows[decoding, size])
            return made

        def table_state(decoding: Decoding, size: int) -> list | None:
            """A finished table's plain outputs (its items and rows), for a checkpoint: a resumed
            run's `results` are computed on every table's."""
            kept = plain_rows.get((decoding, size))
            return None if kept is None else kept_json(kept)

        def restore_table(decoding: Decoding, size: int, state: list | None) -> None:
            if state is not None:
                plain_rows[decoding, size] = kept_from_json(state, self.device)

        settings = [(d, b) for b in self.batch_sizes for d in self.decodings]
        info = models.info(str(llm), str(pool) if pool else list(self.ssms))
        if sampled is not None:
            info["sampled"] = samplers.info(str(llm), str(sampled))
        if generalists is not None:
            info["generalist"] = generalists.info(str(llm), str(generalist))
        target = samplers.pool.manifest.get("target_temperature") if samplers.pool else None
        info["notes"] = [
            f"{d.name} rows ran on a pool trained at target_temperature {target:g}, not at "
            f"T={d.temperature:g}"
            for d in self.decodings
            if d.do_sample and target is not None and d.temperature != target
        ]
        for note in info["notes"]:
            log(f"[bench] warning: {note}")
        return Plan(
            settings,
            list(workloads),
            items,
            method_set,
            info,
            reference,
            fixture=fixture,
            results=results,
            table_state=table_state,
            restore_table=restore_table,
        )

    def method_set(
        self,
        models: Models,
        decoding: Decoding,
        size: int,
        probe: BatchEncoding,
        generalist: Models | None = None,
    ) -> MethodSet:
        """The methods of one decoding and batch size that run here (`build_methods`); the
        generalist rows on `generalist` (the LLM with a pool of one SSM), listed as not run
        without one."""
        made = candidates(self, models, decoding, size, generalist)
        return build_methods({name: make for name, make in made.items() if self.wanted(name)}, probe)

    # Writing ----------------------------------------------------------------------------------------
    def write_partial(self, report: Report, out: Path) -> Path:
        path = out / PARTIAL_REPORT
        write_text_atomic(path, markdown_report(report))
        return path

    def write(self, report: Report, out: Path, readme: Path | None = None) -> str:
        """suite.json (bench.json for a prompt file), report.md and the plots into `out`; with a
        `readme`, also the whole report into the results page beside it (docs/results.md) and the
        headline table into the README (`fill_readme`). Returns the report's Markdown."""
        text = markdown_report(report)
        report.write_json(out / ("suite.json" if self.prompts is None else "bench.json"))
        (out / "report.md").write_text(text)
        all_tables = report.tables()
        plot_speedup(all_tables[0], out / "speedup.png")
        plot_tokens_per_step(all_tables, out / "tokens_per_step_vs_tree_size.png")
        first_size = [t for t in all_tables if t.batch_size == all_tables[0].batch_size]  # every decoding
        plot_acceptance_by_position(first_size, out / "acceptance_by_position.png")
        histories = weight_histories(report.runs)
        if histories:
            plot_ssm_weights(histories, out / "ssm_weights.png")
        if readme is not None:
            fill_readme(readme, report, out)
        return text


def candidates(
    config: SuiteConfig, models: Models, decoding: Decoding, size: int, generalist: Models | None = None
) -> dict[str, Any]:
    """Every method the suite can run at one decoding and batch size, by name, each built when
    called; the reference (plain) first. `generalist`: the generalist rows' models (None: those
    rows raise, and are listed as not run)."""
    max_new, shapes, everyone = config.max_new_tokens, config.shapes, list(range(len(models.ssms)))
    chain, beam = ChainShape(shapes.chain_length), BeamShape(shapes.beam_width, shapes.beam_depth)
    topology = TopologyShape.from_children_counts([list(c) for c in shapes.topology_children])

    def hf(name: str, description: str, compiled: bool = False, **kwargs: Any) -> Any:
        return lambda: generate_method(name, description, models, max_new, decoding, compiled, **kwargs)

    def ours(
        name: str, description: str, indices: list[int] = everyone, on: Models = models, **kwargs: Any
    ) -> Any:
        decoder = functools.partial(on.decoder, indices, **kwargs)
        return lambda: decoder_method(name, description, on, decoder(), indices, max_new, decoding)

    batch = f", batch of {size}, left padding" if size > 1 else ""
    out = {
        PLAIN: hf(PLAIN, f"llm.generate{batch}"),
        "plain_static": hf("plain_static", f"llm.generate{batch}, static cache", **STATIC_EAGER),
        "plain_compiled": hf(
            "plain_compiled", f"llm.generate{batch}, compiled", True, **static_compiled(models.llm.device)
        ),
        LOOP_PLAIN: ours(
            LOOP_PLAIN,
            f'this decoder\'s loop, speculation off (strategy="plain"){batch}, compiled',
            [],
            strategy="plain",
            compile=True,
        ),
    }
    if size > 1:
        engine = EngineConfig(batch_size=max(1, size // 2), num_groups=2, pipeline=True)
        engine_description = (
            f"{chain} by all SSMs ({BASS}), pipelined engine: 2 groups of {engine.batch_size}"
        )
        out["batched"] = ours("batched", f"{chain} by all SSMs, one ragged batch ({BASS})", shape=chain)
        out["batched+compiled"] = ours("batched+compiled", "batched, compiled", shape=chain, compile=True)
        out["engine"] = lambda: engine_method(
            "engine", engine_description, models, engine, max_new, decoding, shape=chain
        )
        # Compiled as the suite's compiled rows are: a suite without them (`compiled=False`) had
        # still compiled this row's graphs (a test's suite of tiny models: over 12 minutes, 68 s since).
        learned_engine = functools.partial(
            engine_method,
            "learned+engine",
            f"learned scheduler, serving engine: 1 group of {size}{', compiled' if config.compiled else ''}",
            models,
            EngineConfig(batch_size=size, num_groups=1, pipeline=False),
            max_new,
            decoding,
            strategy="learned",
            compile=config.compiled,
        )
        out["learned+engine"] = functools.partial(_with_predictor, models, learned_engine)
        return out | learned_rows(models, ours, size)
    for i, ssm in enumerate(models.ssms):
        out[f"{HF_ASSISTED}[{i}]"] = hf(
            f"{HF_ASSISTED}[{i}]", f"llm.generate(assistant_model=SSM {i})", assistant_model=ssm
        )
    for i in everyone:
        out[f"chain[{i}]"] = ours(f"chain[{i}]", f"{chain} drafted by SSM {i}", [i], shape=chain)
        out[f"chain[{i}]+compiled"] = ours(
            f"chain[{i}]+compiled", f"chain[{i}], compiled", [i], shape=chain, compile=True
        )
    if not decoding.do_sample:  # the generalist is trained on greedy outputs only
        rows = {
            GENERALIST: (
                f"{chain} drafted by the generalist (one SSM trained on all the pool's data)",
                False,
            ),
            f"{GENERALIST}+compiled": (f"{GENERALIST}, compiled", True),
        }
        for name, (description, compiled) in rows.items():
            row = functools.partial(ours, name, description, [0])
            out[name] = functools.partial(_with_generalist, generalist, row, shape=chain, compile=compiled)
    for i in everyone:
        description = f"{chain} drafted by SSM {i}, Stairs verification"
        out[f"stairs[{i}]"] = ours(f"stairs[{i}]", description, [i], shape=chain, verification="stairs")
    for name, shape in {"pool_chain": chain, "pool_beam": beam, "pool_topology": topology}.items():
        if len(everyone) > 1 or name != "pool_chain":  # one SSM's pool chain is chain[0]
            out[name] = ours(name, f"{shape} by all SSMs, merged (SpecInfer)", shape=shape)
    if len(everyone) > 1:
        out["pool_chain+compiled"] = ours(
            "pool_chain+compiled", "pool_chain, compiled", shape=chain, compile=True
        )
    if decoding.do_sample:  # k-sequential selection verifies sampled drafts (ALGORITHMS.md 15)
        kseq, samples = {"rule": "k_sequential"}, ChainShape(shapes.chain_length, CHAIN_SAMPLES)
        if len(everyone) > 1:
            out["pool_chain+kseq"] = ours(
                "pool_chain+kseq", 'pool_chain, rule="k_sequential"', shape=chain, **kseq
            )
        name = f"chain[0]x{CHAIN_SAMPLES}"  # SSM 0: the first boosting round, trained on every position
        out[name] = ours(name, f"{samples} drafted by SSM 0, MSS", [0], shape=samples)
        out[f"{name}+kseq"] = ours(f"{name}+kseq", f'{name}, rule="k_sequential"', [0], shape=samples, **kseq)
    if not decoding.do_sample:
        for name, compiled in (("learned+oracle", False), ("learned+oracle+compiled", True)):
            oracle = functools.partial(oracle_method, models, everyone, max_new, decoding, compiled)
            out[name] = functools.partial(_with_predictor, models, oracle)
    for strategy in (s for s in OWN_ROWS if s != "learned"):
        shape = {"majority": chain, "pruned": beam}.get(strategy)  # the others draft their own trees
        kwargs = {"strategy": strategy} | ({"shape": shape} if shape else {})
        description = f'strategy="{strategy}"' + (f", {shape}" if shape else "")
        out[strategy] = ours(strategy, description, **kwargs)
        if strategy == "majority":
            out["majority+compiled"] = ours("majority+compiled", "majority, compiled", compile=True, **kwargs)
            description += f', length_controller="{ADAPTIVE_LENGTH}"'
            out["majority+adaptive"] = ours(
                "majority+adaptive", description, length_controller=ADAPTIVE_LENGTH, **kwargs
            )
    return out | learned_rows(models, ours, size)


def learned_rows(models: Models, ours: Any, size: int) -> dict[str, Any]:
    """The learned scheduler's rows: eager at batch size 1, compiled at every batch size (its
    compiled passes are all warmed up before timing: `ModelCalls.expect_passes`)."""
    description = "learned scheduler (the pool's predictor and hardware profile)"
    rows = {
        "learned+compiled": ours(
            "learned+compiled", f"{description}, compiled", strategy="learned", compile=True
        )
    }
    if size == 1:
        rows["learned"] = ours("learned", description, strategy="learned")
    return {name: functools.partial(_with_predictor, models, make) for name, make in rows.items()}


def oracle_method(
    models: Models, indices: list[int], max_new: int, decoding: Decoding, compiled: bool = False
) -> Method:
    """The learned scheduler's rule fed the true match lengths (`OracleRouter`, ALGORITHMS.md 5.3),
    eager like the `learned` row or `compiled` like `learned+compiled`: the bound a perfect
    predictor would reach on that loop, the rule deciding every step (no speculation gate, 5.4).
    Compiled, its margin over `learned+compiled` is what better estimates could still win there;
    the eager row's also counts the eager loop's cost. Its greedy outputs are generated when a
    prompt is first met, in the untimed warm-up run (`--warmup` >= 1)."""
    name = "learned+oracle+compiled" if compiled else "learned+oracle"
    description = "the learned scheduler's rule on the true match lengths (hindsight oracle)"
    description += ", compiled" if compiled else ""
    decoder = oracle_decoder(models, indices, compiled)
    method = decoder_method(name, description, models, decoder, indices, max_new, decoding)
    return replace(method, warm_every_item=True)


def oracle_decoder(models: Models, indices: list[int], compiled: bool) -> SpeculativeDecoder:
    """A learned decoder without its gate whose router is the oracle, on the costs of its loop."""
    decoder = models.decoder(
        indices, strategy="learned", compile=compiled, strategy_options=StrategyOptions(gate=False)
    )
    scheduler = decoder.speculator
    scheduler.router = OracleRouter(scheduler.router, decoder.llm, scheduler.models)
    scheduler.router.costs_on_compiled_loop(compiled)
    return decoder


def router_depths(models: Models) -> tuple[int, ...]:
    """The chain lengths the learned scheduler can route on `models`' pool: its predictor's depths
    (none without a predictor)."""
    predictor = None if models.pool is None else models.pool.predictor
    return () if predictor is None else tuple(predictor.config.depths)


def _with_predictor(models: Models, make: Any) -> Method:
    """The learned scheduler's row, refused for a pool without a predictor: strategy="learned"
    would fall back to the fixed shape and the row would measure another method under its name."""
    if models.pool is None or models.pool.predictor is None:
        raise ValueError(
            "the pool ships no match-length predictor (`make predictor`, then `make export`), so "
            'strategy="learned" would run the fixed shape'
        )
    return make()


def _with_generalist(generalist: Models | None, make: Any, **kwargs: Any) -> Method:
    """A generalist row (`make` with `kwargs` on the generalist's models), refused without a
    generalist, which a fixture built before its generalist step lacks."""
    if generalist is None:
        raise ValueError(
            "no generalist SSM: the fixture was built before its generalist step (`make bench` builds "
            "it), or the models were given without `generalist` (an exported pool of one SSM)"
        )
    return make(on=generalist, **kwargs)()


def read_fixture(artifacts: Path, name: str) -> dict[str, Any]:
    """The build record the fixture's builder leaves (its model paths, its steps)."""
    path = artifacts / "bench-fixture" / name / FIXTURE_RECORD
    if not path.is_file():
        raise FileNotFoundError(
            f"the fixture {name!r} is not built in {artifacts} ({path} is missing): `make bench` builds it, "
            f"or `python -m specboost.training.bench_fixture --fixture {name}`; or give --llm and --pool"
        )
    return json.loads(path.read_text())


def measured_tv(
    llm: PreTrainedModel,
    pools: dict[str, list[PreTrainedModel]],
    decoding: Decoding,
    outputs: Iterable[tuple[BatchEncoding, list[list[int]]]],
) -> dict[str, Any]:
    """Per pool, each SSM's mean over positions of TV(p, q_j) = 1/2 sum_x |p(x) - q_j(x)| (one
    sampled draft token's rejection chance, ALGORITHMS.md 15), teacher-forced on `outputs` (items
    and the LLM's new tokens); p and q processed as `generate` processes them for `decoding` (the
    LLM's own generation defaults included), each position with its own history."""
    totals = {name: [0.0] * len(ssms) for name, ssms in pools.items()}
    positions = 0
    with torch.inference_mode():
        for batch, rows in outputs:
            for prompt, row in zip(unpadded(batch), rows, strict=True):
                ids = torch.cat([prompt, torch.tensor(row, dtype=prompt.dtype, device=prompt.device)])[None]
                options = decoding.options() | {"max_new_tokens": max(1, len(row))}
                probs = resolve(llm, None, options, prompt[None]).probs
                p = teacher_forced(llm, ids, len(row), probs)
                for name, ssms in pools.items():
                    for j, ssm in enumerate(ssms):
                        totals[name][j] += 0.5 * float(
                            (p - teacher_forced(ssm, ids, len(row), probs)).abs().sum()
                        )
                positions += len(row)
    return {
        "positions": positions,
        "tv": {name: [t / max(1, positions) for t in v] for name, v in totals.items()},
    }


def teacher_forced(model: PreTrainedModel, ids: torch.Tensor, n: int, probs: LogitsToProbs) -> torch.Tensor:
    """[n, V]: `model`'s processed distributions of the last n tokens of `ids` [1, L]."""
    logits = model(ids[:, :-1]).logits[:, ids.shape[1] - 1 - n :]
    return probs.along(logits, ids, ids.shape[1] - n)[0]


def ssm_token_seconds(
    models: Models, prompt: torch.Tensor, repeats: int, compiled: bool
) -> dict[str, list[float]]:
    """Per SSM, seconds per token of its own plain decoding with a static cache, eager and (with
    `compiled`, for the compiled rows) compiled (what a drafted token is held against): the median
    of `repeats` interleaved runs of `generate` on `prompt` [1, L], after one untimed run each."""
    runs = {"static": STATIC_EAGER} | ({"compiled": static_compiled(prompt.device)} if compiled else {})
    times: dict[str, list[list[float]]] = {kind: [[] for _ in models.ssms] for kind in runs}
    kwargs = dict(max_new_tokens=SSM_PROBE_TOKENS, min_new_tokens=SSM_PROBE_TOKENS, do_sample=False)
    with torch.inference_mode():
        for repeat in range(repeats + 1):
            for i, ssm in enumerate(models.ssms):
                for kind, options in runs.items():
                    start = time.perf_counter()
                    ssm.generate(prompt, attention_mask=torch.ones_like(prompt), **kwargs, **options)
                    if repeat:  # the first round warms up (and compiles)
                        times[kind][i].append((time.perf_counter() - start) / SSM_PROBE_TOKENS)
    return {kind: [statistics.median(t) for t in per_ssm] for kind, per_ssm in times.items()}
