"""Batched and pipelined decoding side by side (ALGORITHMS.md sections 10, 11, 13), greedy:

    specboost bench --suite batched --llm LLM --ssm SSM --num-prompts 32 --out artifacts/batch-bench

One workload of held-out prompts, all submitted at once, is decoded at each batch size B by
- `plain`: `llm.generate` on static left-padded batches of B prompts, one batch after another;
- `batched`: our ragged batched speculative decoding (BASS) on the same static batches;
- `engine_sequential`: the serving engine with groups of B and continuous batching, its SSM and
  LLM rounds one after the other in one thread (`pipeline=False`);
- `engine_pipelined`: the same engine with the SSM and LLM workers in two threads.
Throughput = output tokens / wall time; normalized latency = mean over requests of (seconds from
the start until the request's last token) / its output tokens. Every method's tokens must equal
per-sequence greedy `llm.generate` (untimed). Writes batch_bench.json, batch_bench.md (a table per
batch size, and every method's) and batch_bench.png.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from specboost.decoder.bench.markdown import grid, markdown_table
from specboost.decoder.bench.methods import Models, decoder_method, engine_method, generate_method, queued
from specboost.decoder.bench.plots import plot_curves
from specboost.decoder.bench.protocol import Log, Plan, Protocol, Report
from specboost.decoder.bench.records import GREEDY, Decoding, MethodSet
from specboost.decoder.bench.workloads import encode_batches, mixed_workload
from specboost.decoder.engine import EngineConfig
from specboost.speculator.shapes import ChainShape

METHODS = ("plain", "batched", "engine_sequential", "engine_pipelined")


@dataclass(frozen=True, kw_only=True)
class BatchedConfig(Protocol):
    llm: str = "artifacts/reference-llm/tiny/model"
    ssms: tuple[str, ...] = ("artifacts/pool/ssm-0",)
    prompt_sets: tuple[str, ...] = ("tinystories_openings", "gutenberg_openings")  # held-out splits
    num_prompts: int = 32
    max_new_tokens: int = 48
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16)
    chain_length: int = 4  # the chain the BASS controller starts from
    num_groups: int = 2  # engine groups in flight

    options: ClassVar[tuple[str, ...]] = (
        *("llm", "ssms", "prompt_sets", "num_prompts", "max_new_tokens", "batch_sizes", "chain_length"),
        *("num_groups", "repeats", "warmup", "threads", "dtype", "device"),
    )

    def folder(self) -> str:
        return "batch-bench"

    def plan(self, artifacts: Path, log: Log) -> Plan:
        models, max_new = (
            Models.load(self.llm, ssms=self.ssms, dtype=self.dtype, device=self.device),
            self.max_new_tokens,
        )
        everyone, chain = list(range(len(models.ssms))), ChainShape(self.chain_length)
        decoder = models.decoder(everyone, shape=chain)
        prompts = mixed_workload(self.prompt_sets, self.num_prompts).prompts
        (item,) = encode_batches(prompts, models.tokenizer, len(prompts), self.max_prompt_tokens, self.device)
        (warmup,) = encode_batches(
            prompts[:4], models.tokenizer, min(4, len(prompts)), self.max_prompt_tokens, self.device
        )
        log(f"references: {len(prompts)} prompts, one at a time")
        reference = models.reference_rows([item], max_new)

        def methods(_: Decoding, size: int, __: Any) -> MethodSet:
            def engine(pipeline: bool) -> Any:
                kind = "pipelined" if pipeline else "sequential"
                config = EngineConfig(size, self.num_groups, pipeline=pipeline)
                about = f"serving engine, {self.num_groups} groups of {size}, {kind}"
                return engine_method(f"engine_{kind}", about, models, config, max_new, GREEDY, shape=chain)

            plain = generate_method(
                "plain", f"llm.generate, static batches of {size}", models, max_new, GREEDY
            )
            ours = decoder_method(
                "batched",
                f"{chain}, ragged static batches of {size}",
                models,
                decoder,
                everyone,
                max_new,
                GREEDY,
            )
            return MethodSet([queued(plain, size), queued(ours, size), engine(False), engine(True)])

        info = models.info(self.llm, list(self.ssms)) | {"prompts": len(prompts)}
        settings = [(GREEDY, size) for size in self.batch_sizes]
        results = lambda report: {"by_batch_size": by_batch_size(report)}  # noqa: E731
        return Plan(
            settings,
            ["+".join(self.prompt_sets)],
            lambda *_: [item],
            methods,
            info,
            lambda *_: reference,
            warmup,
            results=results,
        )

    def write(self, report: Report, out: Path, readme: Path | None = None) -> str:
        report.write_json(out / "batch_bench.json")
        summary = report.results["by_batch_size"]

        def cell(row: dict[str, Any], name: str) -> str:
            m = row["methods"][name]
            flag = "" if m["identical"] else " **DIFFERS**"
            return (
                f"{m['tokens_per_second']:.0f}"
                + ("" if name == "plain" else f" ({m['speedup_vs_plain']:.2f}x)")
                + flag
            )

        throughput = grid(
            ["B", "plain tok/s", *(f"{m} (x plain)" for m in METHODS[1:]), "pipelined / sequential"],
            [
                [str(r["batch_size"]), *(cell(r, m) for m in METHODS), f"{r['pipelining_gain']:.2f}x"]
                for r in summary
            ],
        )
        latency = grid(
            ["B", *(f"{m}, ms/token" for m in METHODS)],
            [
                [
                    str(r["batch_size"]),
                    *(f"{r['methods'][m]['normalized_latency'] * 1e3:.1f}" for m in METHODS),
                ]
                for r in summary
            ],
        )
        every = [f"## {t.title}\n\n{markdown_table(t)}" for t in report.tables()]
        text = "\n\n".join([throughput, "Normalized latency (ms per output token):", latency, *every]) + "\n"
        (out / "batch_bench.md").write_text(text)
        tables = report.tables()
        curves = {m: {t.batch_size: t.row(m) for t in tables} for m in METHODS}
        m = report.machine
        title = (
            f"{m['cpu']}, {m['torch_threads']} torch thread(s), {report.models['prompts']} prompts, greedy"
        )
        plot_curves(curves, "batch size", title, out / "batch_bench.png", latency=True)
        return text


def by_batch_size(report: Report) -> list[dict[str, Any]]:
    """Per batch size and method: median tokens/s and normalized latency over repeats, the speedup
    over plain batched generate; and the pipelining gain (pipelined / sequential engine)."""
    out = []
    for table in report.tables():
        methods = {
            r.method: {
                "tokens_per_second": r.tokens_per_second.median,
                "speedup_vs_plain": r.speedup_vs_plain.median if r.speedup_vs_plain else None,
                "normalized_latency": r.per_token_latency["mean"],
                "identical": r.identical_to_plain is not False,
            }
            for r in table.rows
        }
        gain = (
            methods["engine_pipelined"]["tokens_per_second"]
            / methods["engine_sequential"]["tokens_per_second"]
        )
        out.append({"batch_size": table.batch_size, "methods": methods, "pipelining_gain": gain})
    return out
