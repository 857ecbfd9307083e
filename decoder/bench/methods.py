"""How a method decodes one item (a left-padded batch) and what it reports: `llm.generate` (plain,
with a static cache, compiled, or HF assisted), our decoder on one row or a ragged batch, the
serving engine, and any of them on static batches served one after another (`queued`). Rows are
cut at their first EOS, so outputs compare whatever padding follows. `Models`: what they run on.
"""

from __future__ import annotations

import copy
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from transformers import BatchEncoding, PreTrainedModel, PreTrainedTokenizerBase
from transformers.generation import CompileConfig

from specboost.decoder.bench.records import Decoding, Method, MethodResult, latest_gate
from specboost.decoder.compilation import compile_options
from specboost.decoder.decoder import SpeculativeDecoder
from specboost.decoder.engine import Engine, EngineConfig
from specboost.decoder.pool import SSMPool
from specboost.speculator.loading import DTYPES, load_causal_lm, load_models, load_tokenizer

STATIC_EAGER = {"cache_implementation": "static", "disable_compile": True}


class ForwardCounter:
    """Counts a model's forward passes while `counting` (plain and HF assisted generation report no
    step count). The hook is on the model only then, and runs outside any compiled graph: a hook
    traced into our compiled passes would guard on the count and recompile at every call."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.count = 0

    @contextmanager
    def counting(self) -> Iterator[None]:
        handle = self.model.register_forward_hook(self.hook)
        try:
            yield
        finally:
            handle.remove()

    @torch.compiler.disable
    def hook(self, *_: object) -> None:
        self.count += 1


@dataclass
class Models:
    """The LLM, its tokenizer and the SSMs every method runs on: an exported pool, or SSM folders."""

    llm: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    ssms: list[PreTrainedModel]
    pool: SSMPool | None = None  # an exported pool: its weights, predictor, profile, Sequoia vectors
    ssm_tokenizers: list[PreTrainedTokenizerBase | None] | None = None  # SSM folders' own
    counter: ForwardCounter = field(init=False)  # the LLM's forward passes

    def __post_init__(self) -> None:
        self.counter = ForwardCounter(self.llm)
        eos = self.llm.generation_config.eos_token_id
        self.eos = frozenset([] if eos is None else [eos] if isinstance(eos, int) else eos)

    @classmethod
    def load(cls, llm: str, pool: str | None = None, ssms: tuple[str, ...] = (), **options: Any) -> Models:
        """The LLM with an exported `pool` (folder or hub id), or with the SSM folders `ssms`;
        `options`: tokenizer (default: the LLM's), dtype, device."""
        tokenizer, dtype, device = (
            options.get("tokenizer"),
            options.get("dtype", "float32"),
            options.get("device"),
        )
        if pool is None:
            loaded = load_models(llm, list(ssms), tokenizer, dtype, device or "cpu")
            return cls(loaded.llm, loaded.tokenizer, loaded.ssms, None, loaded.ssm_tokenizers)
        model, tok = load_causal_lm(llm, DTYPES[dtype], device), load_tokenizer(tokenizer or llm)
        return cls(model, tok, []).with_pool(pool, dtype, device)

    def with_pool(self, pool: str, dtype: str = "float32", device: str | None = None) -> Models:
        """The same LLM (loaded once) with the exported `pool` (folder or hub id)."""
        exported = SSMPool.from_pretrained(pool, device=device, dtype=DTYPES[dtype])
        exported.check_llm(self.llm, self.tokenizer)
        return Models(self.llm, self.tokenizer, exported.models, exported)

    def decoder(self, indices: list[int], **kwargs: Any) -> SpeculativeDecoder:
        """A decoder (eager unless `compile=`) over the SSMs `indices`: the pool, with its files,
        when it is all of one."""
        every = self.pool is not None and indices == list(range(len(self.ssms)))
        ssms = self.pool if every else [self.ssms[i] for i in indices]
        tokenizers = None if self.ssm_tokenizers is None else [self.ssm_tokenizers[i] for i in indices]
        return SpeculativeDecoder(
            self.llm, ssms, self.tokenizer, **{"compile": False, "ssm_tokenizers": tokenizers} | kwargs
        )

    def rows(self, new: torch.Tensor) -> list[list[int]]:
        """Each row of `new` [B, N] through its first EOS."""
        return [
            row[: next((k + 1 for k, t in enumerate(row) if t in self.eos), len(row))] for row in new.tolist()
        ]

    def info(self, llm: str, pool: str | list[str]) -> dict[str, Any]:
        def count(model: PreTrainedModel) -> int:
            return sum(p.numel() for p in model.parameters())

        return {
            "llm": llm,
            "pool": pool,
            "parameters": {"llm": count(self.llm), "ssms": list(map(count, self.ssms))},
        }

    def reference_rows(self, batches: list[BatchEncoding], max_new: int) -> list[list[list[int]]]:
        """Per batch, each row's greedy `llm.generate` alone (no padding) in float32: what greedy
        methods must reproduce (in low precision: what their agreement is counted against)."""
        llm = self.llm if self.llm.dtype == torch.float32 else copy.deepcopy(self.llm).float()
        out: list[list[list[int]]] = []
        with torch.inference_mode():
            for batch in batches:
                out.append([])
                for prompt in unpadded(batch):
                    ids = prompt[None]
                    new = llm.generate(
                        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False
                    )
                    out[-1] += self.rows(new[:, ids.shape[1] :])
        return out


def unpadded(batch: BatchEncoding) -> list[torch.Tensor]:
    """Each row's own tokens, without its padding."""
    return [ids[mask.bool()] for ids, mask in zip(batch.input_ids, batch.attention_mask, strict=True)]


def generate_method(
    name: str,
    description: str,
    models: Models,
    max_new: int,
    decoding: Decoding,
    compiled: bool = False,
    **kwargs: Any,
) -> Method:
    """`llm.generate` on the item with `kwargs` (a static cache, `assistant_model=SSM`, ...); the
    batch returns at once, so every row's latency is the whole call's."""

    def run(batch: BatchEncoding) -> MethodResult:
        before = models.counter.count
        if decoding.do_sample:
            torch.manual_seed(decoding.seed)
        start = time.perf_counter()
        with models.counter.counting():
            out = models.llm.generate(**batch, max_new_tokens=max_new, **decoding.options(), **kwargs)
        rows = models.rows(out[:, batch.input_ids.shape[1] :])  # on the host: synchronised
        # LLM passes per sequence (a batched pass serves every row), as batched decoding counts them
        return MethodResult(
            rows, (models.counter.count - before) * len(rows), [time.perf_counter() - start] * len(rows)
        )

    return Method(name, description, run, compiled)


def decoder_method(
    name: str,
    description: str,
    models: Models,
    decoder: SpeculativeDecoder,
    indices: list[int],
    max_new: int,
    decoding: Decoding,
) -> Method:
    """`decoder.generate` on the item (one row, or a ragged batch); its SSM i is `indices[i]`.
    Sampled rows are unseeded requests after seeding torch's global stream, as `llm.generate`'s
    are: what most requests are (a seeded request may verify differently: the routed scheduler's
    seeded rows draft chains coupled to the target rule's draws, ALGORITHMS.md 5.3)."""

    def run(batch: BatchEncoding) -> MethodResult:
        if decoding.do_sample:
            torch.manual_seed(decoding.seed)
        out = decoder.generate(**batch, max_new_tokens=max_new, **decoding.options())
        stats = getattr(out.stats, "sequences", [out.stats])  # a batch: BatchStats, a DecodeStats per row
        latencies = getattr(out.stats, "latencies", [out.stats.time_total])
        strategy = out.stats.strategy if len(stats) == 1 else batch_choices([s.strategy for s in stats])
        rows = models.rows(out.sequences[:, batch.input_ids.shape[1] :])
        return MethodResult(rows, sum(s.llm_steps for s in stats), latencies, stats, indices, strategy)

    return Method(name, description, run, decoder.calls.enabled)


def engine_method(
    name: str,
    description: str,
    models: Models,
    config: EngineConfig,
    max_new: int,
    decoding: Decoding,
    **kwargs: Any,
) -> Method:
    """The item's rows as requests to a serving `Engine` over every SSM (started and closed in the
    run); a row's latency is its request's, from submission to its last token."""
    everyone = list(range(len(models.ssms)))
    decoder = models.decoder(everyone, **kwargs)

    def run(batch: BatchEncoding) -> MethodResult:
        if decoding.do_sample:  # unseeded requests, as `decoder_method`'s
            torch.manual_seed(decoding.seed)
        with Engine(decoder, config) as engine:
            results = engine.run(unpadded(batch), max_new_tokens=max_new, **decoding.options())
        stats = [r.stats for r in results]
        latencies = [r.latency for r in results]
        strategy = batch_choices([s.strategy for s in stats])
        return MethodResult(
            [r.new_tokens for r in results],
            sum(s.llm_steps for s in stats),
            latencies,
            stats,
            everyone,
            strategy,
        )

    return Method(name, description, run, decoder.calls.enabled)


def batch_choices(reports: list[dict]) -> dict:
    """The rows' records of a scheduler that decides for a batch (the routed scheduler, ALGORITHMS.md
    5.3) as one: its actions counted per row and step, its decision seconds, which every row's
    record holds for the steps it took part in (the longest row's: all of one group's), and its
    speculation gate's report, which each row's record takes as the row finishes (the latest: the
    one of most steps). {} for other strategies."""
    if not reports or not all("actions" in report for report in reports):
        return {}
    actions: Counter[str] = Counter()
    for report in reports:
        actions.update(report["actions"])
    decision = max(report["decision_seconds"] for report in reports)
    merged = {"strategy": reports[0]["strategy"], "actions": dict(actions), "decision_seconds": decision}
    gate = latest_gate(report["gate"] for report in reports if "gate" in report)
    return merged if gate is None else merged | {"gate": gate}


def queued(method: Method, size: int) -> Method:
    """`method` on consecutive batches of `size` rows of the item, one after another: static batches
    serving requests that all arrived at the start, so a row's latency counts from the start."""

    def run(batch: BatchEncoding) -> MethodResult:
        start, parts = time.perf_counter(), []
        for first in range(0, batch.input_ids.shape[0], size):
            mask = batch.attention_mask[first : first + size]
            used = int(mask.any(dim=0).nonzero()[0])  # these rows' own left padding only
            part = {
                "input_ids": batch.input_ids[first : first + size, used:],
                "attention_mask": mask[:, used:],
            }
            offset = time.perf_counter() - start
            result = method.run(BatchEncoding(part))
            parts.append(replace(result, latencies=[offset + t for t in result.latencies]))
        decoded = None if parts[0].decoded is None else [s for p in parts for s in p.decoded]
        rows, latencies = [r for p in parts for r in p.rows], [t for p in parts for t in p.latencies]
        return MethodResult(rows, sum(p.llm_steps for p in parts), latencies, decoded, parts[0].ssms)

    return replace(method, run=run)


Kept = dict[int, tuple[BatchEncoding, list[list[int]]]]  # by the item's id: the item, its rows
KEPT_TENSORS = ("input_ids", "attention_mask")  # what `kept_json` keeps of an item


def keeping_rows(method: Method, kept: Kept) -> Method:
    """`method`, keeping each item's latest rows in `kept` (by the item's id: item, rows)."""

    def run(batch: BatchEncoding) -> MethodResult:
        result = method.run(batch)
        kept[id(batch)] = (batch, result.rows)
        return result

    return replace(method, run=run)


def kept_json(kept: Kept) -> list[dict[str, list]]:
    """`kept` as JSON, in its order (a checkpoint's: what is computed from the rows afterwards sums
    over them in that order): each item's tensors (`KEPT_TENSORS`) and rows."""
    return [
        {name: batch[name].tolist() for name in KEPT_TENSORS} | {"rows": rows}
        for batch, rows in kept.values()
    ]


def kept_from_json(data: list[dict[str, list]], device: str) -> Kept:
    """`kept_json`'s items back on `device` (what uses them matches items by their prompts, not by
    their ids)."""
    kept: Kept = {}
    for item in data:
        batch = BatchEncoding({name: torch.tensor(item[name], device=device) for name in KEPT_TENSORS})
        kept[id(batch)] = (batch, item["rows"])
    return kept


def static_compiled(device: torch.device) -> dict[str, object]:
    """`generate` kwargs for a static cache and a compiled forward, on any device (transformers
    compiles by itself only on accelerators), compiled as our decoder compiles its passes (CUDA
    graphs; on the CPU, inductor's C++ wrapper), so that both sides of the comparison get the same
    compiler."""
    config = CompileConfig(fullgraph=False, dynamic=False, **({"mode": None} | compile_options(device)))
    config._compile_all_devices = True
    return {"cache_implementation": "static", "compile_config": config}
