"""Batched and pipelined decoding measured side by side (ALGORITHMS.md sections 10, 11, 13).

    python -m specboost.decoder.batch_bench --out artifacts/batch-bench

For each batch size B (1, 2, 4, 8, 16) one workload of prompts (all submitted at time 0) is
decoded greedily by

- `plain`: `llm.generate` on static left-padded batches of B prompts, one batch after another;
- `batched`: our ragged batched speculative decoding (`BatchedDecoder`) on the same batches;
- `engine_sequential`: the serving engine with groups of B and continuous batching, its SSM and
  LLM rounds one after the other in one thread (`pipeline=False`);
- `engine_pipelined`: the same engine with the SSM and LLM workers in two threads.

The methods run interleaved, repeat after repeat, after an untimed warm-up. Metrics (section 13):
throughput = output tokens of the workload / its wall time; normalized latency = mean over
requests of (time until the caller holds the request's output) / its output tokens (static
batches hand out their outputs when `generate` returns; the engine as each request finishes).
Medians over repeats. Every method's tokens are checked against per-sequence greedy
`llm.generate` (batch of one, untimed). Writes batch_bench.json, batch_bench.md and
batch_bench.png under --out.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from specboost.decoder.batched import BatchedDecoder
from specboost.decoder.bench import machine_info
from specboost.decoder.decoder import SpeculativeDecoder
from specboost.decoder.engine import Engine, EngineConfig
from specboost.speculator.beam_search import left_pad
from specboost.speculator.loading import load_models
from specboost.speculator.prompt_sets import bundled_source, load_prompt_splits
from specboost.speculator.shapes import ChainShape

METHODS = ("plain", "batched", "engine_sequential", "engine_pipelined")


@dataclass
class BatchBenchConfig:
    llm: Path = Path("artifacts/reference-llm/tiny/model")
    ssms: list[Path] = field(default_factory=lambda: [Path("artifacts/pool/ssm-0")])
    prompt_sets: tuple[str, ...] = ("tinystories_openings", "gutenberg_openings")  # held-out splits
    num_prompts: int = 32
    max_new_tokens: int = 48
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16)
    chain_length: int = 4  # the chain the BASS controller starts from
    num_groups: int = 2  # engine groups in flight
    repeats: int = 3
    threads: int = 1
    dtype: str = "float32"
    device: str = "cpu"
    out: Path | None = Path("artifacts/batch-bench")


@dataclass
class Run:
    """One timed run of one method over the whole workload at one batch size."""

    method: str
    batch_size: int
    repeat: int
    seconds: float
    output_tokens: int
    normalized_latency: float
    identical: bool  # every request's tokens equal its per-sequence greedy reference

    @property
    def throughput(self) -> float:
        return self.output_tokens / self.seconds


# The workload ---------------------------------------------------------------------------------------------
def workload(config: BatchBenchConfig, tokenizer) -> list[list[int]]:
    """Held-out prompts of the prompt sets (never used to train the SSMs), shuffled with a fixed
    seed so that batches mix them."""
    texts = [
        p
        for name in config.prompt_sets
        for p in load_prompt_splits(bundled_source(name))["held_out"]["prompt"]
    ]
    random.Random(0).shuffle(texts)
    return [tokenizer(text).input_ids for text in texts[: config.num_prompts]]


def until_eos(tokens: list[int], eos: set[int]) -> list[int]:
    """The generated tokens up to and including the first EOS (the padding after it dropped)."""
    ends = [k for k, token in enumerate(tokens) if token in eos]
    return tokens[: ends[0] + 1] if ends else tokens


# The methods: each returns (new tokens per request, seconds until each request's output is out) --------
Outcome = tuple[list[list[int]], list[float]]


def static_batches(
    prompts: list[list[int]], size: int, pad: int
) -> list[tuple[range, torch.Tensor, torch.Tensor]]:
    return [
        (range(i, min(i + size, len(prompts))), *left_pad(prompts[i : i + size], pad))
        for i in range(0, len(prompts), size)
    ]


def run_plain(llm, prompts: list[list[int]], size: int, max_new: int, pad: int, eos: set[int]) -> Outcome:
    tokens, done = [], []
    start = time.perf_counter()
    for rows, ids, mask in static_batches(prompts, size, pad):
        out = llm.generate(
            ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False, pad_token_id=pad
        )
        finished = time.perf_counter() - start
        tokens += [until_eos(row, eos) for row in out[:, ids.shape[1] :].tolist()]
        done += [finished] * len(rows)
    return tokens, done


def run_batched(
    decoder: SpeculativeDecoder, prompts: list[list[int]], size: int, max_new: int, pad: int
) -> Outcome:
    tokens, done = [], []
    batched = BatchedDecoder(decoder)
    start = time.perf_counter()
    for rows, ids, mask in static_batches(prompts, size, pad):
        out = batched.generate(ids, mask, max_new_tokens=max_new, do_sample=False)
        finished = time.perf_counter() - start
        tokens += [
            out.sequences[b, ids.shape[1] : ids.shape[1] + s.new_tokens].tolist()
            for b, s in enumerate(out.stats.sequences)
        ]
        done += [finished] * len(rows)
    return tokens, done


def run_engine(
    decoder: SpeculativeDecoder, prompts: list[list[int]], config: EngineConfig, max_new: int
) -> Outcome:
    with Engine(decoder, config) as engine:
        start = time.perf_counter()
        handles = [engine.submit(prompt, max_new_tokens=max_new, do_sample=False) for prompt in prompts]
        results = [handle.result() for handle in handles]
    done = [h.submitted + r.latency - start for h, r in zip(handles, results, strict=True)]
    return [r.new_tokens for r in results], done


# Running ---------------------------------------------------------------------------------------------------
def run_bench(config: BatchBenchConfig, log: Callable[[str], None] = print) -> dict:
    torch.set_num_threads(config.threads)
    models = load_models(config.llm, config.ssms, None, config.dtype, config.device)
    llm, tok = models.llm, models.tokenizer
    decoder = SpeculativeDecoder(
        llm, models.ssms, tok, shape=ChainShape(config.chain_length), ssm_tokenizers=models.ssm_tokenizers
    )
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    eos_id = llm.generation_config.eos_token_id
    eos = set() if eos_id is None else {eos_id} if isinstance(eos_id, int) else set(eos_id)
    prompts = workload(config, tok)
    max_new = config.max_new_tokens
    with torch.inference_mode():
        log(f"references: {len(prompts)} prompts, one at a time")
        references = [
            until_eos(
                llm.generate(torch.tensor([p]), max_new_tokens=max_new, do_sample=False, pad_token_id=pad)[
                    0, len(p) :
                ].tolist(),
                eos,
            )
            for p in prompts
        ]

        def methods(size: int) -> dict[str, Callable[[list[list[int]]], Outcome]]:
            return {
                "plain": lambda ps: run_plain(llm, ps, size, max_new, pad, eos),
                "batched": lambda ps: run_batched(decoder, ps, size, max_new, pad),
                "engine_sequential": lambda ps: run_engine(
                    decoder, ps, EngineConfig(size, config.num_groups, pipeline=False), max_new
                ),
                "engine_pipelined": lambda ps: run_engine(
                    decoder, ps, EngineConfig(size, config.num_groups, pipeline=True), max_new
                ),
            }

        for run in methods(2).values():  # warm-up
            run(prompts[:4])
        runs: list[Run] = []
        for repeat in range(config.repeats):
            for size in config.batch_sizes:
                for name, run in methods(size).items():
                    tokens, done = run(prompts)
                    counts = [len(t) for t in tokens]
                    runs.append(
                        Run(
                            method=name,
                            batch_size=size,
                            repeat=repeat,
                            seconds=max(done),
                            output_tokens=sum(counts),
                            normalized_latency=statistics.mean(
                                d / n for d, n in zip(done, counts, strict=True)
                            ),
                            identical=tokens == references,
                        )
                    )
                    r = runs[-1]
                    log(
                        f"repeat {repeat} B={size:2d} {name:18s} {r.throughput:7.1f} tok/s  "
                        f"{r.normalized_latency * 1000:6.1f} ms/token  {'same' if r.identical else 'DIFFERS'}"
                    )
    report = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(config).items()}
        | {"ssms": [str(p) for p in config.ssms]},
        "machine": machine_info(config),
        "workload": {
            "prompts": len(prompts),
            "prompt_tokens": [len(p) for p in prompts],
            "reference_tokens": sum(len(r) for r in references),
        },
        "summary": summarise(runs, config.batch_sizes),
        "runs": [asdict(r) | {"throughput": r.throughput} for r in runs],
    }
    if config.out is not None:
        write_outputs(report, config.out)
    return report


def summarise(runs: list[Run], batch_sizes: tuple[int, ...]) -> list[dict]:
    """Per batch size and method: medians over repeats, and ratios to plain batched generate."""
    rows = []
    for size in batch_sizes:
        median = {
            name: {
                "throughput": statistics.median(
                    r.throughput for r in runs if (r.method, r.batch_size) == (name, size)
                ),
                "normalized_latency": statistics.median(
                    r.normalized_latency for r in runs if (r.method, r.batch_size) == (name, size)
                ),
                "identical": all(r.identical for r in runs if (r.method, r.batch_size) == (name, size)),
            }
            for name in METHODS
        }
        for name in METHODS:
            median[name]["speedup_vs_plain"] = median[name]["throughput"] / median["plain"]["throughput"]
        gain = median["engine_pipelined"]["throughput"] / median["engine_sequential"]["throughput"]
        rows.append({"batch_size": size, "methods": median, "pipelining_gain": gain})
    return rows


def markdown(report: dict) -> str:
    header = ["B"] + [f"{m} tok/s (x plain)" for m in METHODS] + ["pipelining gain"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in report["summary"]:
        cells = [str(row["batch_size"])]
        for name in METHODS:
            m = row["methods"][name]
            flag = "" if m["identical"] else " DIFFERS"
            cells.append(f"{m['throughput']:.0f} ({m['speedup_vs_plain']:.2f}x){flag}")
        cells.append(f"{row['pipelining_gain']:.2f}x")
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "Normalized latency (ms per output token):",
        "",
        "| B | " + " | ".join(METHODS) + " |",
        "|" + "---|" * (len(METHODS) + 1),
    ]
    for row in report["summary"]:
        cells = [f"{row['methods'][name]['normalized_latency'] * 1000:.1f}" for name in METHODS]
        lines.append(f"| {row['batch_size']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [row["batch_size"] for row in report["summary"]]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for name in METHODS:
        for ax, key, scale in ((axes[0], "throughput", 1), (axes[1], "normalized_latency", 1000)):
            ax.plot(
                sizes,
                [row["methods"][name][key] * scale for row in report["summary"]],
                marker="o",
                label=name,
            )
    axes[0].set(xlabel="batch size", ylabel="output tokens / s", xscale="log", title="throughput")
    axes[1].set(
        xlabel="batch size",
        ylabel="ms per output token",
        xscale="log",
        yscale="log",
        title="normalized latency",
    )
    for ax in axes:
        ax.set_xticks(sizes, [str(s) for s in sizes])
    axes[0].legend()
    machine = report["machine"]
    workload = f"{report['workload']['prompts']} prompts x {report['config']['max_new_tokens']} new tokens"
    fig.suptitle(f"{machine['cpu']}, {machine['torch_threads']} torch thread(s), {workload}, greedy")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(report: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "batch_bench.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "batch_bench.md").write_text(markdown(report))
    plot(report, out / "batch_bench.png")


def main(argv: list[str] | None = None) -> int:
    default = BatchBenchConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llm", type=Path, default=default.llm)
    parser.add_argument("--ssm", type=Path, nargs="+", default=default.ssms)
    parser.add_argument("--prompt-sets", nargs="+", default=list(default.prompt_sets))
    parser.add_argument("--num-prompts", type=int, default=default.num_prompts)
    parser.add_argument("--max-new-tokens", type=int, default=default.max_new_tokens)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=list(default.batch_sizes))
    parser.add_argument("--chain-length", type=int, default=default.chain_length)
    parser.add_argument("--num-groups", type=int, default=default.num_groups)
    parser.add_argument("--repeats", type=int, default=default.repeats)
    parser.add_argument("--threads", type=int, default=default.threads)
    parser.add_argument("--dtype", default=default.dtype)
    parser.add_argument("--device", default=default.device)
    parser.add_argument("--out", type=Path, default=default.out)
    args = parser.parse_args(argv)
    config = BatchBenchConfig(
        llm=args.llm,
        ssms=args.ssm,
        prompt_sets=tuple(args.prompt_sets),
        num_prompts=args.num_prompts,
        max_new_tokens=args.max_new_tokens,
        batch_sizes=tuple(args.batch_sizes),
        chain_length=args.chain_length,
        num_groups=args.num_groups,
        repeats=args.repeats,
        threads=args.threads,
        dtype=args.dtype,
        device=args.device,
        out=args.out,
    )
    try:
        report = run_bench(config)
    except (FileNotFoundError, ValueError, NotImplementedError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(markdown(report))
    identical = all(m["identical"] for row in report["summary"] for m in row["methods"].values())
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
