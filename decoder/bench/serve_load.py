"""Load benchmark of the server: N concurrent clients against `specboost serve`, speculation on
against the same server with speculation off (`strategy="plain"`: plain batched decoding through
the same engine), measured side by side in one run.

    python -m specboost.decoder.bench.serve_load --llm LLM --pool POOL [--requests 64 --concurrency 8]

Both servers run in this process (uvicorn threads on free ports) and are driven in turn, `rounds`
times each, with streamed requests over held-out prompts (never distilled or boosted on; or a
prompt file). Per request it records the time to the first token and the time per later token;
per run, requests/s and generated tokens/s. Report: stdout, report.md and serve_load.json in --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import torch

from specboost.decoder.bench.workloads import CATEGORIES, held_out_or_file, mixed_workload
from specboost.decoder.decoder import SpeculativeDecoder
from specboost.decoder.engine import EngineConfig
from specboost.decoder.serve.app import create_app
from specboost.decoder.serve.background import serve_in_background
from specboost.decoder.serve.config import ServerConfig
from specboost.speculator.loading import DTYPES

MIXED_SETS = [name for names in CATEGORIES.values() for name in names]  # the default prompts' sets


@dataclass(frozen=True)
class LoadConfig:
    requests: int = 64  # timed requests per run
    concurrency: int = 8  # clients sending at once
    max_tokens: int = 64
    temperature: float = 0.0
    warmup: int = 4  # untimed requests per server first
    rounds: int = 2  # runs per server, alternating
    model: str = "bench"  # the `model` the requests name


@dataclass
class RequestTiming:
    first_token: float  # seconds from sending to the first text
    total: float  # seconds from sending to the end of the stream
    tokens: int  # generated tokens (the stream's usage)

    @property
    def per_token(self) -> float | None:
        """Seconds per token after the first."""
        return (self.total - self.first_token) / (self.tokens - 1) if self.tokens > 1 else None


@dataclass
class RunResult:
    mode: str
    seconds: float
    timings: list[RequestTiming] = field(default_factory=list)

    def summary(self) -> dict[str, float]:
        tokens = sum(t.tokens for t in self.timings)
        firsts = sorted(t.first_token for t in self.timings)
        later = sorted(p for t in self.timings if (p := t.per_token) is not None)
        return {
            "requests_per_s": len(self.timings) / self.seconds,
            "tokens_per_s": tokens / self.seconds,
            "ttft_p50_ms": 1e3 * _quantile(firsts, 0.5),
            "ttft_p99_ms": 1e3 * _quantile(firsts, 0.99),
            "token_p50_ms": 1e3 * _quantile(later, 0.5),
            "token_p99_ms": 1e3 * _quantile(later, 0.99),
        }


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return (
        values[0]
        if len(values) == 1
        else statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]
    )


async def _one(client: httpx.AsyncClient, prompt: str, config: LoadConfig) -> RequestTiming:
    body = {
        "model": config.model,
        "prompt": prompt,
        "max_tokens": config.max_tokens,
        "temperature": config.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first, tokens = None, 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"the server failed a request: {event['error']['message']}")
            if first is None and any(c.get("text") for c in event.get("choices", [])):
                first = time.perf_counter() - start
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    total = time.perf_counter() - start
    return RequestTiming(total if first is None else first, total, tokens)


async def drive(
    url: str, prompts: list[str], config: LoadConfig, count: int, headers: dict[str, str] | None = None
) -> tuple[float, list[RequestTiming]]:
    """`count` requests, `config.concurrency` at a time, over `prompts` in turn."""
    gate = asyncio.Semaphore(config.concurrency)
    limits = httpx.Limits(max_connections=config.concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits, headers=headers) as client:

        async def limited(i: int) -> RequestTiming:
            async with gate:
                return await _one(client, prompts[i % len(prompts)], config)

        start = time.perf_counter()
        timings = await asyncio.gather(*(limited(i) for i in range(count)))
        return time.perf_counter() - start, list(timings)


def run_load(
    servers: dict[str, str], prompts: list[str], config: LoadConfig, headers: dict[str, str] | None = None
) -> list[RunResult]:
    """Warm every server, then run `rounds` timed runs per server, alternating."""
    for url in servers.values():
        asyncio.run(drive(url, prompts, config, config.warmup, headers))
    results = []
    for r in range(config.rounds):
        for mode, url in servers.items():
            seconds, timings = asyncio.run(drive(url, prompts, config, config.requests, headers))
            results.append(RunResult(mode, seconds, timings))
            print(f"[serve-load] round {r + 1} {mode}: {len(timings) / seconds:.2f} requests/s")
    return results


def report(results: list[RunResult], config: LoadConfig, setting: dict[str, object]) -> tuple[str, dict]:
    """The median of each figure over the rounds, per mode, and speculation's ratio to plain."""
    modes = list(dict.fromkeys(r.mode for r in results))
    figures = {
        mode: {
            key: statistics.median(r.summary()[key] for r in results if r.mode == mode)
            for key in results[0].summary()
        }
        for mode in modes
    }
    lines = [
        f"Server load: {config.requests} requests x {config.rounds} rounds, {config.concurrency} concurrent, "
        f"{config.max_tokens} tokens, temperature {config.temperature}; "
        + ", ".join(f"{k} {v}" for k, v in setting.items()),
        "",
        "| server | requests/s | tokens/s | TTFT p50 (ms) | TTFT p99 (ms) | per token p50 (ms) "
        "| per token p99 (ms) |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode, f in figures.items():
        lines.append(
            f"| {mode} | {f['requests_per_s']:.2f} | {f['tokens_per_s']:.1f} | {f['ttft_p50_ms']:.0f} | "
            f"{f['ttft_p99_ms']:.0f} | {f['token_p50_ms']:.1f} | {f['token_p99_ms']:.1f} |"
        )
    if "plain" in figures and len(figures) > 1:
        base = figures["plain"]
        for mode, f in figures.items():
            if mode != "plain":
                lines.append(
                    f"\n{mode} vs plain: {f['tokens_per_s'] / base['tokens_per_s']:.2f}x tokens/s, "
                    f"{f['requests_per_s'] / base['requests_per_s']:.2f}x requests/s, per-token p50 "
                    f"{f['token_p50_ms'] / base['token_p50_ms']:.2f}x"
                )
    record = {
        "config": asdict(config),
        "setting": setting,
        "figures": figures,
        "runs": [
            {"mode": r.mode, "seconds": r.seconds, "timings": [asdict(t) for t in r.timings]} for r in results
        ],
    }
    return "\n".join(lines) + "\n", record


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m specboost.decoder.bench.serve_load", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--llm", type=Path, metavar="DIR", help="the LLM's folder (save_pretrained)")
    p.add_argument("--pool", metavar="DIR|ID", help="an exported SSM pool (make export)")
    p.add_argument(
        "--url", help="instead of --llm/--pool: a running `specboost serve`, e.g. http://127.0.0.1:8000"
    )
    p.add_argument(
        "--plain-url", help="with --url: a running server with --strategy plain, to compare against"
    )
    p.add_argument("--api-key", help="with --url: the servers' API key")
    p.add_argument("--model", default="bench", help="the `model` the requests name (default: bench)")
    p.add_argument("--strategy", help="speculation strategy (default: the pool manifest's)")
    p.add_argument("--requests", type=int, default=64, help="timed requests per run (default: 64)")
    p.add_argument("--concurrency", type=int, default=8, help="clients at once (default: 8)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per request (default: 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: 0)")
    p.add_argument("--rounds", type=int, default=2, help="timed runs per server, alternating (default: 2)")
    p.add_argument("--warmup", type=int, default=4, help="untimed requests per server first (default: 4)")
    p.add_argument("--batch-size", type=int, default=8, help="the engine's batch (default: 8)")
    p.add_argument("--num-groups", type=int, default=2, help="engine groups in flight (default: 2)")
    p.add_argument(
        "--prompts",
        help="a bundled prompt set (its held-out split) or a prompt file (default: held-out prompts of every "
        "bench category, mixed)",
    )
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    p.add_argument("--out", type=Path, default=Path("artifacts/serve-bench"), help="report folder")
    return p


@contextmanager
def local_servers(args: argparse.Namespace) -> Iterator[tuple[dict[str, str], dict[str, object]]]:
    """Both servers of this run in this process: speculation on (the pool) and off ("plain")."""
    overrides = {"strategy": args.strategy} if args.strategy else {}
    speculative = SpeculativeDecoder.from_pretrained(
        args.llm, args.pool, device=args.device, dtype=args.dtype, **overrides
    )
    plain = SpeculativeDecoder(speculative.llm, [], speculative.tokenizer, strategy="plain")
    engine = EngineConfig(batch_size=args.batch_size, num_groups=args.num_groups)
    server = ServerConfig(
        model_name=args.model, max_tokens_limit=args.max_tokens, default_max_tokens=args.max_tokens
    )
    setting = {
        "strategy": type(speculative.speculator).__name__,
        "batch_size": args.batch_size,
        "num_groups": args.num_groups,
        "device": str(speculative.llm.device),
        "dtype": str(speculative.llm.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
    }
    with (
        serve_in_background(create_app(plain, server, engine)) as plain_url,
        serve_in_background(create_app(speculative, server, engine)) as spec_url,
    ):
        yield {"plain": plain_url, "speculative": spec_url}, setting


@contextmanager
def running_servers(args: argparse.Namespace) -> Iterator[tuple[dict[str, str], dict[str, object]]]:
    """Servers started elsewhere (`specboost serve`): --url, and --plain-url to compare against."""
    servers = {"speculative": args.url} | ({"plain": args.plain_url} if args.plain_url else {})
    yield {mode: servers[mode] for mode in ("plain", "speculative") if mode in servers}, {"servers": servers}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if (
        min(args.requests, args.concurrency, args.max_tokens, args.rounds, args.batch_size) < 1
        or args.warmup < 0
    ):
        parser.error("counts must be >= 1 (--warmup >= 0)")
    local = args.llm is not None or args.pool is not None
    if (args.url is not None) == local or (local and (args.llm is None or args.pool is None)):
        parser.error("give --llm and --pool (servers started here), or --url (a running server), not both")
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return measure(args)
    except (FileNotFoundError, ValueError) as error:  # a bad path, model or prompt file
        print(f"serve_load: error: {error}", file=sys.stderr)
    except httpx.HTTPError as error:
        print(
            f"serve_load: error: the server did not answer as expected ({error}); check --url",
            file=sys.stderr,
        )
    return 2


def measure(args: argparse.Namespace) -> int:
    """Drive the servers, write and print the report."""
    config = LoadConfig(
        args.requests,
        args.concurrency,
        args.max_tokens,
        args.temperature,
        args.warmup,
        args.rounds,
        args.model,
    )
    workload = (
        held_out_or_file(args.prompts, None)
        if args.prompts
        else mixed_workload(MIXED_SETS, 4 * args.requests)
    )
    prompts = [p.text for p in workload.prompts]
    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    servers = running_servers if args.url else local_servers
    with servers(args) as (urls, setting):
        results = run_load(urls, prompts, config, headers)
    prompts_label = (
        args.prompts or f"held-out prompts of {len(MIXED_SETS)} bundled sets (every bench category)"
    )
    text, record = report(results, config, setting | {"prompts": prompts_label})
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "report.md").write_text(text)
    (args.out / "serve_load.json").write_text(json.dumps(record, indent=2) + "\n")
    print(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
