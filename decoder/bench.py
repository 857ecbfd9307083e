"""The decoder bench: our speculative modes against plain and Hugging Face assisted generation.

    specboost bench --llm PATH --ssm PATH [PATH ...] --prompts FILE --out DIR

For every prompt, the methods run interleaved (all methods, repeat after repeat), after a few
untimed warm-up runs; all are greedy, so every method must reproduce plain `llm.generate`'s
tokens exactly: a method whose output differs is flagged and not ranked. Metric names follow
ALGORITHMS.md section 13: tokens per step = new tokens / LLM verification passes; speedup =
wall time of plain decoding / wall time of the method, on the same prompts, side by side.
Wall times are medians over repeats per prompt, summed over prompts.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

import torch
import transformers
from transformers import (
    BatchEncoding,
    PreTrainedModel,
)

from specboost.decoder.decoder import SpeculativeDecoder
from specboost.speculator.loading import DTYPES, LoadedModels, load_models
from specboost.speculator.shapes import BeamShape, ChainShape, DraftShape, TopologyShape

# Method families; those marked per-SSM run once with each single SSM ("chain[1]" = SSM 1 alone).
PER_SSM_METHODS = ("hf_assisted", "chain", "stairs")
POOL_METHODS = ("pool_chain", "pool_beam", "pool_topology")
ALL_METHODS = ("plain", *PER_SSM_METHODS, *POOL_METHODS)
DEFAULT_TOPOLOGY = ((2,), (2, 1), (1, 1, 1), (1, 1, 1))  # children counts per level: 11 nodes, depth 4


# Prompts --------------------------------------------------------------------------------------
def load_prompts(path: str | Path) -> list[str]:
    """Prompts from a text file (one per non-empty line) or, for a `.jsonl` file, from records with
    a "prompt" field or a "turns" list (FastChat / Spec-Bench; the first turn is used)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no prompt file at {path}")
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if path.suffix == ".jsonl":
        prompts = [
            _prompt_from_record(_json_line(line, path, i), path, i) for i, line in enumerate(lines, start=1)
        ]
    else:
        prompts = lines
    if not prompts:
        raise ValueError(f"the prompt file {path} holds no prompts")
    return prompts


def _json_line(text: str, path: Path, line: int) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(
            f"{path}:{line}: not valid JSON ({error.msg} at column {error.colno}); fix the line"
        ) from None


def _prompt_from_record(record: object, path: Path, line: int) -> str:
    if not isinstance(record, dict):
        raise ValueError(f'{path}:{line}: a JSONL prompt must be an object with a "prompt" or "turns" field')
    if isinstance(record.get("prompt"), str):
        return record["prompt"]
    turns = record.get("turns")
    if isinstance(turns, list) and turns and isinstance(turns[0], str):
        return turns[0]
    raise ValueError(f'{path}:{line}: a JSONL prompt needs a "prompt" string or a "turns" list of strings')


# Configuration and results ---------------------------------------------------------------------
@dataclass
class BenchConfig:
    llm: Path  # folder of the target LLM
    ssms: list[Path]  # folders of the SSMs
    prompts: Path  # .txt (one prompt per line) or .jsonl ("prompt" or "turns")
    out: Path | None = None  # folder for bench.json; None writes nothing
    tokenizer: Path | None = None  # default: the LLM folder
    max_new_tokens: int = 64
    repeats: int = 3  # timed runs per method and prompt; the median counts
    warmup: int = 1  # untimed runs per method before timing (on the first prompt)
    max_prompts: int | None = None  # use only the first N prompts
    methods: tuple[str, ...] = ALL_METHODS  # families to run, from ALL_METHODS ("plain" always runs)
    chain_length: int = 4  # ChainShape(length) for chain, pool_chain and stairs
    beam_width: int = 2  # BeamShape(width, depth) for pool_beam
    beam_depth: int = 4
    topology_children: tuple[tuple[int, ...], ...] = DEFAULT_TOPOLOGY  # TopologyShape for pool_topology
    dtype: str = "float32"
    device: str = "cpu"
    threads: int | None = None  # torch CPU threads; None keeps torch's default

    def __post_init__(self) -> None:
        unknown = sorted(set(self.methods) - set(ALL_METHODS))
        if unknown:
            raise ValueError(f"unknown bench methods {unknown}; choose from {list(ALL_METHODS)}")
        if self.max_new_tokens < 1 or self.repeats < 1 or self.warmup < 0:
            raise ValueError("max_new_tokens and repeats must be >= 1 and warmup >= 0")
        if self.max_prompts is not None and self.max_prompts < 1:
            raise ValueError(f"max_prompts must be >= 1, got {self.max_prompts}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")


@dataclass
class RunRecord:
    """One timed run of one method on one prompt."""

    method: str
    prompt_index: int
    repeat: int
    new_tokens: int
    llm_steps: int  # LLM verification passes (forward passes for plain and HF assisted)
    seconds: float  # wall time of the whole generate call
    identical_to_plain: bool
    draft_tokens: int | None = None  # ours only: HF assisted does not report them
    accepted_tokens: int | None = None
    stats: dict | None = None  # ours: the DecodeStats (DecodeStats.to_dict)
    compilations: int = 0  # graphs torch.compile built during this timed run (0 when warmed up)
    identical_to_float32: bool | None = None  # low-precision greedy runs: same as float32 plain's


@dataclass
class MethodSummary:
    method: str
    description: str
    tokens_per_step: float
    acceptance_rate: float | None
    acceptance_rate_per_ssm: dict[int, float] | None
    tokens_per_second: float
    seconds: float  # sum over prompts of the median wall time over repeats
    identical_to_plain: bool
    speedup_vs_plain: float | None  # None when the output differs (not ranked)
    speedup_vs_hf_assisted: float | None  # against the fastest HF assisted run


@dataclass
class BenchReport:
    config: dict
    machine: dict
    summary: list[MethodSummary]
    records: list[RunRecord] = field(repr=False)

    @property
    def all_identical(self) -> bool:
        return all(s.identical_to_plain for s in self.summary)

    def to_json(self) -> dict:
        return {
            "config": self.config,
            "machine": self.machine,
            "summary": [asdict(s) for s in self.summary],
            "records": [asdict(r) for r in self.records],
        }

    def table(self) -> str:
        header = ("method", "tokens/step", "acceptance", "per SSM", "tokens/s", "vs plain", "vs HF assisted")
        rows = [(*header, "output")]
        for s in self.summary:
            per_ssm = " ".join(f"{i}:{a:.2f}" for i, a in (s.acceptance_rate_per_ssm or {}).items())
            rows.append(
                (
                    s.method,
                    f"{s.tokens_per_step:.2f}",
                    _cell(s.acceptance_rate, ".2f"),
                    per_ssm or "-",
                    f"{s.tokens_per_second:.1f}",
                    _cell(s.speedup_vs_plain, ".2f", "x"),
                    _cell(s.speedup_vs_hf_assisted, ".2f", "x"),
                    "same" if s.identical_to_plain else "DIFFERS",
                )
            )
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        lines = [
            "  ".join(
                [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)]
            )
            for row in rows
        ]
        return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def _cell(value: float | None, fmt: str, suffix: str = "") -> str:
    return "-" if value is None else format(value, fmt) + suffix


# Methods --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Decoding:
    """How every method decodes: greedy (the default), or sampling with one fixed seed, so that
    every repeat of a method draws the same tokens."""

    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0

    @property
    def name(self) -> str:
        return f"sample(T={self.temperature:g}, top_p={self.top_p:g})" if self.do_sample else "greedy"

    def options(self) -> dict:
        """The sampling options of `llm.generate` and `SpeculativeDecoder.generate`."""
        if not self.do_sample:
            return {"do_sample": False}
        return {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p}


GREEDY = Decoding()


@dataclass
class MethodResult:
    tokens: list[int]  # the new tokens
    llm_steps: int
    draft_tokens: int | None = None
    accepted_tokens: int | None = None
    stats: dict | None = None
    untimed_seconds: float = 0.0  # time inside the run that is not the method's (an oracle's lookahead)


@dataclass
class Method:
    name: str
    description: str
    # (input_ids [B, L], attention_mask [B, L]); B > 1 only for batched methods (left padding)
    run: Callable[[torch.Tensor, torch.Tensor], MethodResult]
    compiled: bool = False  # runs torch.compile'd graphs: warmed up on every prompt before timing


class ForwardCounter:
    """Counts a model's forward passes (plain and HF assisted generation report no step count)."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.count = 0
        model.register_forward_hook(self._hook)

    def _hook(self, *_: object) -> None:
        self.count += 1


def _new_tokens(sequences: torch.Tensor, input_ids: torch.Tensor) -> list[int]:
    """The generated tokens of every row, row after row."""
    return sequences[:, input_ids.shape[1] :].flatten().tolist()


def _hf_method(
    name: str,
    description: str,
    llm: PreTrainedModel,
    counter: ForwardCounter,
    max_new: int,
    decoding: Decoding = GREEDY,
    **kwargs,
) -> Method:
    def run(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> MethodResult:
        before = counter.count
        if decoding.do_sample:
            torch.manual_seed(decoding.seed)
        out = llm.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=max_new,
            **decoding.options(),
            **kwargs,
        )
        # LLM passes per sequence (a batched pass serves every row), as batched decoding counts them
        return MethodResult(_new_tokens(out, input_ids), (counter.count - before) * input_ids.shape[0])

    return Method(name, description, run)


def _our_method(
    name: str,
    description: str,
    decoder: SpeculativeDecoder,
    ssm_indices: list[int],
    max_new: int,
    decoding: Decoding = GREEDY,
) -> Method:
    seed = decoding.seed if decoding.do_sample else None

    def run(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> MethodResult:
        out = decoder.generate(
            input_ids, attention_mask=attention_mask, max_new_tokens=max_new, seed=seed, **decoding.options()
        )
        s = out.stats
        stats = s.to_dict()
        for key in ("proposed_per_ssm", "accepted_per_ssm", "acceptance_rate_per_ssm"):
            # The decoder numbers its own SSMs 0..n-1; report the bench's numbering.
            stats[key] = {ssm_indices[i]: v for i, v in stats[key].items()}
        tokens = _new_tokens(out.sequences, input_ids)
        untimed = s.strategy.get("untimed_seconds", 0.0)  # an oracle's lookahead is not decoding work
        return MethodResult(tokens, s.llm_steps, s.draft_tokens, s.accepted_tokens, stats, untimed)

    return Method(name, description, run)


def build_methods(config: BenchConfig, models: LoadedModels) -> list[Method]:
    """The methods to compare, in table order; "plain" first (every other method is checked against it)."""
    llm, ssms, tok, max_new = models.llm, models.ssms, models.tokenizer, config.max_new_tokens
    counter = ForwardCounter(llm)
    chain = ChainShape(config.chain_length)

    def ours(
        name: str, description: str, indices: list[int], shape: DraftShape, verification: str = "tree"
    ) -> Method:
        decoder = SpeculativeDecoder(
            llm,
            [ssms[i] for i in indices],
            tok,
            shape=shape,
            verification=verification,
            ssm_tokenizers=[models.ssm_tokenizers[i] for i in indices],
        )
        return _our_method(name, description, decoder, indices, max_new)

    methods = [_hf_method("plain", "llm.generate, greedy", llm, counter, max_new)]
    wanted = set(config.methods)
    for i, ssm in enumerate(ssms):
        if "hf_assisted" in wanted:
            desc = f"llm.generate(assistant_model=SSM {i})"
            methods.append(_hf_method(f"hf_assisted[{i}]", desc, llm, counter, max_new, assistant_model=ssm))
    for family, verification in (("chain", "tree"), ("stairs", "stairs")):
        if family in wanted:
            for i in range(len(ssms)):
                desc = f"{chain} drafted by SSM {i}, {verification} verification"
                methods.append(ours(f"{family}[{i}]", desc, [i], chain, verification))
    pool_shapes: dict[str, DraftShape] = {
        "pool_chain": chain,
        "pool_beam": BeamShape(config.beam_width, config.beam_depth),
        "pool_topology": TopologyShape.from_children_counts([list(c) for c in config.topology_children]),
    }
    for family, shape in pool_shapes.items():
        if family in wanted and not (family == "pool_chain" and len(ssms) == 1):  # = chain[0]
            desc = f"{shape} drafted by all {len(ssms)} SSMs, merged into one tree"
            methods.append(ours(family, desc, list(range(len(ssms))), shape))
    return methods


# Running --------------------------------------------------------------------------------------
def _timed(
    method: Method, input_ids: torch.Tensor, attention_mask: torch.Tensor, device: torch.device
) -> tuple[MethodResult, float]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    result = method.run(input_ids, attention_mask)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return result, time.perf_counter() - start


def _assistant_settings(ssm: PreTrainedModel) -> dict:
    """What HF assisted generation drafts with; None = the transformers default (20 tokens,
    "constant" schedule, confidence threshold 0.4 in transformers 5.x)."""
    config = ssm.generation_config
    names = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")
    return {name: getattr(config, name, None) for name in names}


class OnDevice(Protocol):
    """What `machine_info` reads from a configuration (`BenchConfig`, the suite's `SuiteConfig`)."""

    dtype: str
    device: str


def machine_info(config: OnDevice) -> dict:
    info = {
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "dtype": config.dtype,
        "device": config.device,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "platform": platform.platform(),
    }
    if config.device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(torch.device(config.device))
    return info


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def run_bench(config: BenchConfig, log: Callable[[str], None] | None = None) -> BenchReport:
    """Run every method on every prompt (interleaved), check outputs against plain generation,
    summarise, and write `bench.json` under `config.out` when set."""
    previous_threads = torch.get_num_threads()
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    try:
        report = _run(config, log or (lambda _: None))
    finally:
        torch.set_num_threads(previous_threads)
    if config.out is not None:
        config.out.mkdir(parents=True, exist_ok=True)
        (config.out / "bench.json").write_text(json.dumps(report.to_json(), indent=2) + "\n")
    return report


def _run(config: BenchConfig, log: Callable[[str], None]) -> BenchReport:
    prompts = load_prompts(config.prompts)[: config.max_prompts]
    models = load_models(config.llm, config.ssms, config.tokenizer, config.dtype, config.device)
    methods = build_methods(config, models)
    encoded = [models.tokenizer(p, return_tensors="pt").to(models.llm.device) for p in prompts]
    records = measure(methods, encoded, config.repeats, config.warmup, log)
    config_json = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(config).items()}
    config_json["ssms"] = [str(p) for p in config.ssms]
    config_json["hf_assisted"] = [_assistant_settings(ssm) for ssm in models.ssms]
    return BenchReport(config_json, machine_info(config), summarise(methods, records), records)


def measure(
    methods: list[Method],
    encoded: list[BatchEncoding],
    repeats: int,
    warmup: int,
    log: Callable[[str], None],
    warmup_seconds: dict[str, float] | None = None,
    float32_outputs: list[list[int]] | None = None,
) -> list[RunRecord]:
    """Run every method on every prompt, interleaved; methods[0] is the reference output. A compiled
    method warms up on every prompt (its graphs are built then, untimed); `warmup_seconds` gets each
    method's warm-up wall time (compilation included). `float32_outputs` (per prompt batch: float32
    plain decoding's tokens) marks each run that reproduces them (low-precision runs)."""
    device = encoded[0].input_ids.device
    log(f"{len(methods)} methods, {len(encoded)} prompts, {repeats} repeats, {warmup} warm-up")
    records: list[RunRecord] = []
    with torch.inference_mode():
        for _ in range(warmup):
            for method in methods:
                start = time.perf_counter()
                for enc in encoded if method.compiled else encoded[:1]:
                    method.run(enc.input_ids, enc.attention_mask)
                if warmup_seconds is not None:
                    warmup_seconds[method.name] = (
                        warmup_seconds.get(method.name, 0.0) + time.perf_counter() - start
                    )
        for index, enc in enumerate(encoded):
            reference: list[int] | None = None
            for repeat in range(repeats):
                for method in methods:  # interleaved, so drifts in machine speed hit every method alike
                    graphs = compiled_graphs()
                    result, seconds = _timed(method, enc.input_ids, enc.attention_mask, device)
                    if method is methods[0] and reference is None:
                        reference = result.tokens
                    records.append(
                        RunRecord(
                            method=method.name,
                            prompt_index=index,
                            repeat=repeat,
                            new_tokens=len(result.tokens),
                            llm_steps=result.llm_steps,
                            seconds=seconds - result.untimed_seconds,
                            identical_to_plain=result.tokens == reference,
                            draft_tokens=result.draft_tokens,
                            accepted_tokens=result.accepted_tokens,
                            stats=result.stats,
                            compilations=compiled_graphs() - graphs,
                            identical_to_float32=(
                                None if float32_outputs is None else result.tokens == float32_outputs[index]
                            ),
                        )
                    )
            log(f"prompt {index + 1}/{len(encoded)} done")
    return records


def compiled_graphs() -> int:
    """Graphs torch.compile has built in this process so far."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


# Summary --------------------------------------------------------------------------------------
def summarise(methods: list[Method], records: list[RunRecord]) -> list[MethodSummary]:
    by_method: dict[str, list[RunRecord]] = defaultdict(list)
    for r in records:
        by_method[r.method].append(r)
    seconds = {name: _summed_medians(rs) for name, rs in by_method.items()}
    hf_times = [
        t for name, t in seconds.items() if name.startswith("hf_assisted") and _identical(by_method[name])
    ]
    best_hf = min(hf_times) if hf_times else None
    summary = []
    for method in methods:
        rs = by_method[method.name]
        identical = _identical(rs)
        first = [r for r in rs if r.repeat == 0]
        new_tokens = sum(r.new_tokens for r in first)
        t = seconds[method.name]
        summary.append(
            MethodSummary(
                method=method.name,
                description=method.description,
                tokens_per_step=new_tokens / max(1, sum(r.llm_steps for r in first)),
                acceptance_rate=_acceptance(first),
                acceptance_rate_per_ssm=_acceptance_per_ssm(first),
                tokens_per_second=new_tokens / t if t else 0.0,
                seconds=t,
                identical_to_plain=identical,
                speedup_vs_plain=seconds["plain"] / t if identical and t else None,
                speedup_vs_hf_assisted=best_hf / t if identical and t and best_hf else None,
            )
        )
    return summary


def _identical(records: list[RunRecord]) -> bool:
    return all(r.identical_to_plain for r in records)


def _summed_medians(records: list[RunRecord]) -> float:
    per_prompt: dict[int, list[float]] = defaultdict(list)
    for r in records:
        per_prompt[r.prompt_index].append(r.seconds)
    return sum(statistics.median(ts) for ts in per_prompt.values())


def _acceptance(records: list[RunRecord]) -> float | None:
    if any(r.draft_tokens is None for r in records):
        return None
    drafted = sum(r.draft_tokens for r in records)
    return sum(r.accepted_tokens for r in records) / drafted if drafted else 0.0


def _acceptance_per_ssm(records: list[RunRecord]) -> dict[int, float] | None:
    if any(r.stats is None for r in records):
        return None
    proposed: dict[int, int] = defaultdict(int)
    accepted: dict[int, int] = defaultdict(int)
    for r in records:
        for i, n in r.stats["proposed_per_ssm"].items():
            proposed[i] += n
        for i, n in r.stats["accepted_per_ssm"].items():
            accepted[i] += n
    return {i: accepted[i] / n if n else 0.0 for i, n in sorted(proposed.items())}
