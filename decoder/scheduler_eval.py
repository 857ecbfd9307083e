"""Evaluate the learned scheduler (ALGORITHMS.md section 5) against every fixed shape and an oracle.

    python -m specboost.decoder.scheduler_eval --llm artifacts/reference-llm/tiny/model \\
        --pool artifacts/pool-export --prompts gutenberg_openings --out artifacts/scheduler-eval

On held-out prompts (a bundled set's held-out split, or a prompt file), all greedy and
interleaved in one run (the decoder bench's harness: warm-up, repeats, medians, identical-output
check against plain `llm.generate`):
- `fixed[b,d]`: every SSM of the pool drafts beam search (b, d), merged, for all 15 grid shapes;
- `learned`: the learned scheduler with the pool's predictor and this machine's hardware profile;
- `oracle`: the same decision rule fed the TRUE match lengths (from the LLM's greedy output,
  known in advance); finding them is not counted in its time (`untimed_seconds`), so it bounds
  what a perfect predictor would reach with this cost model. Regret = 1 - learned / oracle
  tokens per second.
Writes scheduler_eval.json, a Markdown table and scheduler_eval.png (tokens/s and tokens/step per
method) into OUT; prints the headline ratios: learned vs the best and the median fixed shape.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
from transformers import PreTrainedModel

from specboost.decoder.bench import (
    BenchConfig,
    BenchReport,
    ForwardCounter,
    Method,
    MethodSummary,
    _hf_method,
    _our_method,
    load_prompts,
    machine_info,
    measure,
    summarise,
)
from specboost.decoder.decoder import SpeculativeDecoder
from specboost.decoder.pool import SSMPool
from specboost.speculator.beam_search import beam_match_lengths
from specboost.speculator.cost_model import CostModel
from specboost.speculator.loading import load_causal_lm, load_tokenizer
from specboost.speculator.predictor import MatchLengthPredictor
from specboost.speculator.prompt_sets import BUNDLED_PROMPT_SETS, bundled_source, load_prompt_splits
from specboost.speculator.scheduler import LearnedScheduler
from specboost.speculator.shapes import BeamShape
from specboost.speculator.speculation import DraftRequest


class OracleScheduler(LearnedScheduler):
    """The learned scheduler's decision rule on the true match lengths of every configuration,
    measured against the LLM's greedy output (`references`: prompt + output token lists)."""

    def __init__(
        self,
        ssms: list[PreTrainedModel],
        predictor: MatchLengthPredictor,
        cost_model: CostModel,
        references: list[list[int]],
    ) -> None:
        super().__init__(ssms, predictor, cost_model, calibration=None)
        self.models = ssms
        self.references = references
        self.wants_hidden = False

    def reset(self, seed: int | None) -> None:
        super().reset(seed)
        self.untimed_seconds = 0.0
        self._reference: list[int] | None = None

    def choose(self, request: DraftRequest) -> list[tuple[int, int] | None]:
        start = time.perf_counter()
        verified, c = request.verified, self.predictor.config
        if self._reference is None:
            matches = [r for r in self.references if r[: len(verified)] == verified]
            if not matches:
                raise ValueError("the oracle has no reference output for this prompt")
            self._reference = matches[0]
        depth = max(c.depths)
        continuation = self._reference[len(verified) : len(verified) + depth]
        reference = torch.tensor([continuation + [-1] * (depth - len(continuation))])
        true = torch.stack(
            [
                torch.cat([beam_match_lengths(m, [verified], reference, b, c.depths, 0)[0] for b in c.widths])
                for m in self.models
            ]
        ).float()  # [S, widths * depths], the predictor's order
        chosen = [self.options[o] for o in self.best(true, request.max_depth)]
        self.untimed_seconds += time.perf_counter() - start
        return chosen

    def report(self) -> dict:
        return super().report() | {"strategy": "oracle", "untimed_seconds": self.untimed_seconds}


def held_out_prompts(name_or_file: str, tokenizer: Any, max_prompts: int | None) -> list[str]:
    """A bundled set's held-out split (never distilled), or every prompt of a file."""
    if name_or_file in BUNDLED_PROMPT_SETS:
        prompts = load_prompt_splits(bundled_source(name_or_file), tokenizer)["held_out"]["prompt"]
    else:
        prompts = load_prompts(name_or_file)
    return list(prompts)[:max_prompts]


def build_methods(
    llm: PreTrainedModel,
    pool: SSMPool,
    tokenizer: Any,
    cost: CostModel,
    references: list[list[int]],
    max_new: int,
) -> list[Method]:
    predictor = pool.predictor
    assert predictor is not None
    ssms, indices = pool.models, list(range(len(pool)))
    methods = [_hf_method("plain", "llm.generate, greedy", llm, ForwardCounter(llm), max_new)]
    for b in predictor.config.widths:
        for d in predictor.config.depths:
            decoder = SpeculativeDecoder(llm, pool, tokenizer, shape=BeamShape(b, d))
            methods.append(
                _our_method(
                    f"fixed[{b},{d}]", f"every SSM drafts BeamShape({b}, {d})", decoder, indices, max_new
                )
            )
    learned = SpeculativeDecoder(llm, pool, tokenizer, strategy="learned", cost_model=cost)
    methods.append(
        _our_method("learned", "learned scheduler (predictor + cost model)", learned, indices, max_new)
    )
    oracle = OracleScheduler(ssms, predictor, cost, references)
    decoder = SpeculativeDecoder(llm, pool, tokenizer, speculator=oracle)
    methods.append(
        _our_method("oracle", "decision rule on the true match lengths", decoder, indices, max_new)
    )
    return methods


def headline(summary: list[MethodSummary], report_records: list) -> dict[str, Any]:
    by_name = {s.method: s for s in summary}
    fixed = sorted((s for s in summary if s.method.startswith("fixed[")), key=lambda s: s.tokens_per_second)
    learned, oracle = by_name["learned"], by_name["oracle"]
    best, median = fixed[-1], statistics.median(s.tokens_per_second for s in fixed)
    overheads = [r.stats["strategy"]["overhead_fraction"] for r in report_records if r.method == "learned"]
    return {
        "learned_tokens_per_second": learned.tokens_per_second,
        "best_fixed": best.method,
        "best_fixed_tokens_per_second": best.tokens_per_second,
        "median_fixed_tokens_per_second": median,
        "oracle_tokens_per_second": oracle.tokens_per_second,
        "learned_vs_best_fixed": learned.tokens_per_second / best.tokens_per_second,
        "learned_vs_median_fixed": learned.tokens_per_second / median,
        "regret": 1 - learned.tokens_per_second / oracle.tokens_per_second,
        "scheduler_overhead_fraction": statistics.mean(overheads),
        "all_identical": all(s.identical_to_plain for s in summary),
    }


def plot(summary: list[MethodSummary], path: Path) -> None:
    names = [s.method for s in summary]
    colors = ["tab:red" if n == "learned" else "tab:green" if n == "oracle" else "tab:gray" for n in names]
    fig, axes = plt.subplots(2, 1, figsize=(max(8, len(names) * 0.55), 7), sharex=True)
    axes[0].bar(names, [s.tokens_per_second for s in summary], color=colors)
    axes[0].set_ylabel("tokens / s")
    axes[1].bar(names, [s.tokens_per_step for s in summary], color=colors)
    axes[1].set_ylabel("tokens / step")
    axes[1].tick_params(axis="x", rotation=70)
    axes[0].set_title("Learned scheduler vs fixed beam shapes (b, d) vs oracle")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.threads:
        torch.set_num_threads(args.threads)
    llm = load_causal_lm(args.llm)
    tokenizer = load_tokenizer(args.llm)
    pool = SSMPool.from_pretrained(args.pool)
    pool.check_llm(llm, tokenizer)
    if pool.predictor is None:
        raise ValueError(f"the pool {args.pool} has no predictor: `make predictor`, then `make export`")
    cost = pool.cost_model(llm.device, llm.dtype, args.force_profile)
    if cost is None:
        raise ValueError(f"the pool {args.pool} has no hardware profile: `make profile`, then `make export`")
    prompts = held_out_prompts(args.prompts, tokenizer, args.max_prompts)
    encoded = [tokenizer(p, return_tensors="pt") for p in prompts]
    with torch.inference_mode():
        references = [
            llm.generate(**e, max_new_tokens=args.max_new_tokens, do_sample=False)[0].tolist()
            for e in encoded
        ]
    methods = build_methods(llm, pool, tokenizer, cost, references, args.max_new_tokens)
    records = measure(methods, encoded, args.repeats, args.warmup, print)
    summary = summarise(methods, records)
    config = BenchConfig(
        llm=Path(args.llm),
        ssms=[Path(args.pool)],
        prompts=Path(args.prompts),
        max_new_tokens=args.max_new_tokens,
        repeats=args.repeats,
        warmup=args.warmup,
        max_prompts=args.max_prompts,
        threads=args.threads,
    )
    report = BenchReport(
        json.loads(json.dumps(asdict(config), default=str)), machine_info(config), summary, records
    )
    result = {"headline": headline(summary, records), **report.to_json()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "scheduler_eval.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "scheduler_eval.md").write_text(report.table() + "\n")
    plot(summary, args.out / "scheduler_eval.png")
    h = result["headline"]
    print(report.table())
    print(
        f"\nlearned {h['learned_tokens_per_second']:.1f} tokens/s: "
        f"{h['learned_vs_best_fixed']:.2f}x the best fixed shape ({h['best_fixed']}), "
        f"{h['learned_vs_median_fixed']:.2f}x the median fixed shape; "
        f"oracle {h['oracle_tokens_per_second']:.1f} tokens/s (regret {h['regret']:.1%}); "
        f"scheduler overhead {h['scheduler_overhead_fraction']:.1%} of the step time; "
        f"outputs identical: {h['all_identical']}"
    )
    print(f"wrote {args.out}")
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llm", required=True, help="the LLM folder")
    p.add_argument("--pool", required=True, help="exported pool with predictor and hardware profile")
    p.add_argument("--prompts", default="gutenberg_openings", help="bundled set (its held-out split) or file")
    p.add_argument("--max-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--force-profile", action="store_true", help="use a profile of other hardware")
    p.add_argument("--out", type=Path, default=Path("artifacts/scheduler-eval"))
    try:
        run(p.parse_args(argv))
    except (FileNotFoundError, ValueError, NotImplementedError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
