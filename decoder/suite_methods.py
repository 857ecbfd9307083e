"""The benchmark suite's methods, built on an LLM and its exported pool (the fixture's, or given).

Batch size 1: plain `llm.generate`, and the best plain decoding transformers offers (a static
cache, eager and compiled: `plain_static`, `plain_compiled`); Hugging Face assisted generation with
each single SSM; our chain with each single SSM, eager and compiled (`+compiled`); Stairs
validation (greedy only); the pool's merged trees (SpecInfer: every SSM drafts a chain, or a
beam); every further strategy of `SpeculativeDecoder` that this version has
(`strategies.STRATEGIES`: weighted majority, with and without an adaptive length, the
weight-pruned pool tree, Sequoia); the learned scheduler.
Batch size > 1: plain batched `llm.generate` (and its static-cache, eager and compiled) against
the pool's chains decoded as one ragged batch (BASS), eager and compiled, and served by the
pipelined engine (Minions; two groups of half the batch). Each keeps every row's latency and output
length in its stats (`suite_report.row_stats`) for BASS's per-token latency.

A method that cannot run here (a strategy missing its inputs, sampling where it is greedy only,
batched decoding not implemented) is skipped with the reason: `MethodSet.skipped`.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from transformers import (
    BatchEncoding,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.generation import CompileConfig

from specboost.decoder.batched import pad_token_id
from specboost.decoder.bench import (
    Decoding,
    ForwardCounter,
    Method,
    MethodResult,
    _hf_method,
    _new_tokens,
    _our_method,
)
from specboost.decoder.decoder import SpeculativeDecoder
from specboost.decoder.engine import Engine, EngineConfig
from specboost.decoder.loop import BatchConfig
from specboost.decoder.pool import SSMPool
from specboost.decoder.stats import DecodeStats
from specboost.decoder.strategies import STRATEGIES
from specboost.decoder.suite_report import HF_ASSISTED, PLAIN, PLAIN_COMPILED, PLAIN_STATIC, row_stats
from specboost.speculator.loading import DTYPES, load_causal_lm, load_tokenizer
from specboost.speculator.shapes import BeamShape, ChainShape

# Strategies with their own rows below; every other name in STRATEGIES gets a row of its own.
_BUILT_IN = ("pool", "learned")
# Strategies that also get a "+adaptive" row (length_controller=ADAPTIVE_LENGTH; ALGORITHMS.md 7).
ADAPTIVE_STRATEGIES = ("majority",)
ADAPTIVE_LENGTH = "minions"
BASS = f"chain length by {BatchConfig().length_controller}"  # batches pick one length per step


@dataclass
class SuiteModels:
    """The LLM, its tokenizer and the exported SSM pool every method of the suite runs on."""

    llm: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    pool: SSMPool
    counter: ForwardCounter  # the LLM's forward passes, for plain and HF assisted generation

    @classmethod
    def load(cls, llm_path: str | Path, pool_path: str | Path, dtype: str, device: str) -> SuiteModels:
        llm = load_causal_lm(llm_path, DTYPES[dtype], device)
        tokenizer = load_tokenizer(llm_path)
        pool = SSMPool.from_pretrained(pool_path, device=device, dtype=DTYPES[dtype])
        pool.check_llm(llm, tokenizer)
        return cls(llm, tokenizer, pool, ForwardCounter(llm))

    def float32_outputs(self, encoded: Sequence[BatchEncoding], max_new: int) -> list[list[int]]:
        """Greedy float32 plain decoding of every prompt batch (the reference of low-precision runs;
        rows after one another, as `_new_tokens` lays them out)."""
        llm32 = copy.deepcopy(self.llm).float()
        with torch.inference_mode():
            outputs = [
                llm32.generate(**enc.to(llm32.device), max_new_tokens=max_new, do_sample=False)[
                    :, enc.input_ids.shape[1] :
                ]
                .flatten()
                .tolist()
                for enc in encoded
            ]
        del llm32
        return outputs

    def parameters(self) -> dict[str, int | list[int]]:
        def count(model: PreTrainedModel) -> int:
            return sum(p.numel() for p in model.parameters())

        return {"llm": count(self.llm), "ssms": [count(m) for m in self.pool.models]}


@dataclass(frozen=True)
class Shapes:
    chain_length: int = 4  # ChainShape for chain[i], stairs, pool_chain, majority, batched
    beam_width: int = 2  # BeamShape for pool_beam
    beam_depth: int = 4


@dataclass
class MethodSet:
    methods: list[Method]  # PLAIN first
    skipped: dict[str, str] = field(default_factory=dict)  # method -> why it did not run


def build_methods(
    models: SuiteModels,
    decoding: Decoding,
    batch_size: int,
    max_new: int,
    shapes: Shapes,
    probe: BatchEncoding,
    compiled: bool = True,
) -> MethodSet:
    """The methods for one decoding and batch size (without the compiled ones unless `compiled`);
    each candidate runs once on `probe` (the first warm-up run), and one that raises is skipped with
    the error as its reason."""
    candidates = _candidates(models, decoding, batch_size, max_new, shapes)
    if not compiled:
        candidates = {name: make for name, make in candidates.items() if not name.endswith("compiled")}
    out = MethodSet([])
    for name, make in candidates.items():
        try:
            method = make()
            with torch.inference_mode():
                method.run(probe.input_ids, probe.attention_mask)
        except (ValueError, NotImplementedError) as error:
            if name == PLAIN:
                raise
            out.skipped[name] = f"{type(error).__name__}: {error}"
            continue
        out.methods.append(method)
    return out


def _candidates(
    models: SuiteModels, decoding: Decoding, batch_size: int, max_new: int, shapes: Shapes
) -> dict[str, Callable[[], Method]]:
    llm, pool, tok = models.llm, models.pool, models.tokenizer
    chain = ChainShape(shapes.chain_length)
    beam = BeamShape(shapes.beam_width, shapes.beam_depth)
    everyone = list(range(len(pool)))

    def hf(name: str, description: str, compiled: bool = False, **kwargs: object) -> Callable[[], Method]:
        def make() -> Method:
            method = _hf_method(name, description, llm, models.counter, max_new, decoding, **kwargs)
            return replace(method, compiled=compiled)

        return make

    def best_plain(batch: str) -> dict[str, Callable[[], Method]]:
        """transformers' fastest plain decoding: a static cache, eager and compiled."""
        return {
            PLAIN_STATIC: hf(PLAIN_STATIC, f"llm.generate{batch}, static cache", **STATIC_EAGER),
            PLAIN_COMPILED: hf(
                PLAIN_COMPILED, f"llm.generate{batch}, static cache, compiled", True, **static_compiled()
            ),
        }

    # Two groups of half the batch each, so that drafting one overlaps verifying the other.
    engine_config = EngineConfig(batch_size=max(1, batch_size // 2), num_groups=2, pipeline=True)

    def engine(name: str, description: str) -> Callable[[], Method]:
        def make() -> Method:
            decoder = SpeculativeDecoder(llm, pool, tok, shape=chain)
            return _engine_method(name, description, decoder, engine_config, max_new, decoding)

        return make

    def ours(name: str, description: str, indices: list[int], **kwargs: object) -> Callable[[], Method]:
        def make() -> Method:
            ssms = pool if indices == everyone else [pool.models[i] for i in indices]
            decoder = SpeculativeDecoder(llm, ssms, tok, **({"compile": False} | kwargs))
            if batch_size > 1:
                method = _batched_method(name, description, decoder, max_new, decoding)
            else:
                method = _our_method(name, description, decoder, indices, max_new, decoding)
            return replace(method, compiled=decoder.calls.enabled)

        return make

    if batch_size > 1:
        plain = hf(PLAIN, f"llm.generate, batch of {batch_size}, left padding")
        batch = f", batch of {batch_size}"
        with_latencies = {
            name: (lambda make=make: _with_row_latencies(make(), eos_ids(llm)))
            for name, make in {PLAIN: plain, **best_plain(batch)}.items()
        }
        return {
            **with_latencies,
            "batched": ours(
                "batched", f"{chain} by all SSMs, one ragged batch ({BASS})", everyone, shape=chain
            ),
            "batched+compiled": ours(
                "batched+compiled",
                f"{chain} by all SSMs, one ragged batch ({BASS}), compiled",
                everyone,
                shape=chain,
                compile=True,
            ),
            "engine": engine(
                "engine",
                f"{chain} by all SSMs ({BASS}), pipelined serving engine: "
                f"{engine_config.num_groups} groups of {engine_config.batch_size}",
            ),
        }
    out = {PLAIN: hf(PLAIN, "llm.generate"), **best_plain("")}
    for i, ssm in enumerate(pool.models):
        name = f"{HF_ASSISTED}[{i}]"
        out[name] = hf(name, f"llm.generate(assistant_model=SSM {i})", assistant_model=ssm)
    for i in everyone:
        out[f"chain[{i}]"] = ours(f"chain[{i}]", f"{chain} drafted by SSM {i}", [i], shape=chain)
        out[f"chain[{i}]+compiled"] = ours(
            f"chain[{i}]+compiled", f"{chain} drafted by SSM {i}, compiled", [i], shape=chain, compile=True
        )
    out["stairs[0]"] = ours(
        "stairs[0]", f"{chain} drafted by SSM 0, Stairs verification", [0], shape=chain, verification="stairs"
    )
    for name, shape in (("pool_chain", chain), ("pool_beam", beam)):
        out[name] = ours(name, f"{shape} by all SSMs, merged (SpecInfer)", everyone, shape=shape)
    strategy_shapes = {"majority": chain, "pruned": beam}  # others draft their own trees
    for strategy in (s for s in STRATEGIES if s not in _BUILT_IN):
        kwargs: dict[str, object] = {"strategy": strategy}
        description = f'strategy="{strategy}"'
        if strategy in strategy_shapes:
            kwargs["shape"] = strategy_shapes[strategy]
            description += f", {strategy_shapes[strategy]}"
        out[strategy] = ours(strategy, description, everyone, **kwargs)
        if strategy in ADAPTIVE_STRATEGIES:
            name = f"{strategy}+adaptive"
            description += f', length_controller="{ADAPTIVE_LENGTH}"'
            out[name] = ours(name, description, everyone, length_controller=ADAPTIVE_LENGTH, **kwargs)
    description = "learned scheduler (the pool's predictor and hardware profile)"
    out["learned"] = _with_predictor(ours("learned", description, everyone, strategy="learned"), pool)
    return out


STATIC_EAGER = {"cache_implementation": "static", "disable_compile": True}
SSM_PROBE_TOKENS = 32  # tokens per timed SSM generation in `ssm_token_seconds`


def ssm_token_seconds(pool: SSMPool, prompt: torch.Tensor, repeats: int) -> dict[str, list[float]]:
    """Per SSM, seconds per token of its own plain decoding with a static cache, eager and compiled
    (the cost a drafted token is held against): the median of `repeats` interleaved timed runs of
    `generate` on `prompt` [1, L], after one untimed run each."""
    runs = {"static": STATIC_EAGER, "compiled": static_compiled()}
    times: dict[str, list[list[float]]] = {kind: [[] for _ in pool.models] for kind in runs}
    kwargs = dict(max_new_tokens=SSM_PROBE_TOKENS, min_new_tokens=SSM_PROBE_TOKENS, do_sample=False)
    with torch.inference_mode():
        for repeat in range(repeats + 1):
            for i, ssm in enumerate(pool.models):
                for kind, options in runs.items():
                    start = time.perf_counter()
                    ssm.generate(prompt, attention_mask=torch.ones_like(prompt), **kwargs, **options)
                    if repeat:  # the first round warms up (and compiles)
                        times[kind][i].append((time.perf_counter() - start) / SSM_PROBE_TOKENS)
    return {kind: [statistics.median(t) for t in per_ssm] for kind, per_ssm in times.items()}


def static_compiled() -> dict[str, object]:
    """`generate` kwargs for a static cache and a compiled forward, on any device (transformers
    compiles by itself only on accelerators)."""
    mode = "reduce-overhead" if torch.cuda.is_available() else "default"
    config = CompileConfig(fullgraph=False, dynamic=False, mode=mode)
    config._compile_all_devices = True
    return {"cache_implementation": "static", "compile_config": config}


def _with_predictor(make: Callable[[], Method], pool: SSMPool) -> Callable[[], Method]:
    """The learned scheduler's row, refused for a pool without a predictor: strategy="learned"
    would fall back to the fixed shape and the row would measure another method under its name."""

    def checked() -> Method:
        if pool.predictor is None:
            raise ValueError(
                "the pool ships no match-length predictor (`make predictor`, then `make export`), so "
                'strategy="learned" would run the fixed shape'
            )
        return make()

    return checked


def _batched_method(
    name: str, description: str, decoder: SpeculativeDecoder, max_new: int, decoding: Decoding
) -> Method:
    """`decoder.generate` on a whole left-padded batch (`BatchedOutput`: one `DecodeStats` per
    row in `stats.sequences`)."""
    seed = decoding.seed if decoding.do_sample else None

    def run(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> MethodResult:
        out = decoder.generate(
            input_ids, attention_mask=attention_mask, max_new_tokens=max_new, seed=seed, **decoding.options()
        )
        return _rows_result(_new_tokens(out.sequences, input_ids), out.stats.sequences, out.stats.latencies)

    return Method(name, description, run)


def _engine_method(
    name: str,
    description: str,
    decoder: SpeculativeDecoder,
    config: EngineConfig,
    max_new: int,
    decoding: Decoding,
) -> Method:
    """The batch's rows as requests to a serving `Engine` (started and closed within the run);
    the new tokens of each row padded as batched `generate` pads them, row after row."""
    seed = decoding.seed if decoding.do_sample else None

    def run(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> MethodResult:
        prompts = [ids[mask.bool()] for ids, mask in zip(input_ids, attention_mask, strict=True)]
        with Engine(decoder, config) as engine:
            results = engine.run(prompts, max_new_tokens=max_new, seed=seed, **decoding.options())
        pad = pad_token_id(decoder, frozenset())
        width = max(len(r.new_tokens) for r in results)
        tokens = [t for r in results for t in r.new_tokens + [pad] * (width - len(r.new_tokens))]
        return _rows_result(tokens, [r.stats for r in results], [r.latency for r in results])

    return Method(name, description, run)


def _with_row_latencies(method: Method, eos: frozenset[int]) -> Method:
    """Plain batched `llm.generate` with each row's latency and output length in its stats: the
    batch returns at once, so every row's latency is the whole call's wall time."""

    def run(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> MethodResult:
        start = time.perf_counter()
        result = method.run(input_ids, attention_mask)  # its tokens are on the host: synchronised
        seconds = time.perf_counter() - start
        lengths = row_lengths(result.tokens, input_ids.shape[0], eos)
        return replace(result, stats=row_stats([seconds] * len(lengths), lengths))

    return Method(method.name, method.description, run)


def eos_ids(llm: PreTrainedModel) -> frozenset[int]:
    eos = llm.generation_config.eos_token_id
    return frozenset([] if eos is None else [eos] if isinstance(eos, int) else eos)


def row_lengths(tokens: Sequence[int], rows: int, eos: frozenset[int]) -> list[int]:
    """New tokens of each row of a batch's padded output (`rows` rows of equal width, row after
    row): through the row's first EOS (padding follows it), or the whole width."""
    width = len(tokens) // rows
    return [
        next((i + 1 for i, t in enumerate(tokens[b * width : (b + 1) * width]) if t in eos), width)
        for b in range(rows)
    ]


def _rows_result(tokens: list[int], rows: Sequence[DecodeStats], latencies: Sequence[float]) -> MethodResult:
    stats = merged_stats(rows)
    data = stats.to_dict() | row_stats(latencies, [s.new_tokens for s in rows])
    return MethodResult(tokens, stats.llm_steps, stats.draft_tokens, stats.accepted_tokens, data)


def merged_stats(rows: Sequence[DecodeStats]) -> DecodeStats:
    """Several sequences' statistics as one: counts summed (LLM passes per sequence, as
    `BatchStats.tokens_per_step` counts them), every row's match lengths, phase times summed
    (each row's are the batch's wall time, so their shares are the batch's)."""
    total = DecodeStats()
    for s in rows:
        for name in ("llm_steps", "new_tokens", "draft_tokens", "accepted_tokens"):
            setattr(total, name, getattr(total, name) + getattr(s, name))
        for phase in ("draft", "verify", "other", "total"):
            setattr(total, f"time_{phase}", getattr(total, f"time_{phase}") + getattr(s, f"time_{phase}"))
        for i, n in s.proposed_per_ssm.items():
            total.proposed_per_ssm[i] += n
        for i, n in s.accepted_per_ssm.items():
            total.accepted_per_ssm[i] += n
        total.match_lengths += s.match_lengths
    return total
