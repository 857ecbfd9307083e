"""The learned scheduler (ALGORITHMS.md section 5) against every fixed shape and an oracle, greedy,
on held-out prompts (a bundled set's held-out split, or a prompt file), in one run:

    specboost bench --suite scheduler --llm LLM --pool POOL_EXPORT --out artifacts/scheduler-eval

- `fixed[b,d]`: every SSM of the pool drafts beam search (b, d), merged, for every grid shape;
- `learned`: the learned scheduler with the pool's predictor and this machine's hardware profile;
- `oracle`: the same decision rule fed the TRUE match lengths (from the LLM's greedy output, known
  in advance); finding them is not counted in its time, so it bounds what a perfect predictor
  would reach with this cost model. Regret = 1 - learned / oracle tokens per second.
Writes scheduler_eval.json, scheduler_eval.md and scheduler_eval.png (tokens/s and tokens/step per
method); the headline: learned vs the best and the median fixed shape.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from specboost.decoder.bench.markdown import markdown_table
from specboost.decoder.bench.methods import Models, decoder_method, generate_method
from specboost.decoder.bench.plots import plot_methods
from specboost.decoder.bench.protocol import Log, Plan, Protocol, Report, one_cell
from specboost.decoder.bench.records import GREEDY
from specboost.decoder.bench.summary import MethodRow
from specboost.decoder.bench.workloads import encode_batches, held_out_or_file
from specboost.speculator.oracle_scheduler import OracleScheduler
from specboost.speculator.shapes import BeamShape


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig(Protocol):
    llm: str = "artifacts/reference-llm/tiny/model"
    pool: str = "artifacts/pool-export"  # exported with its predictor and hardware profile
    prompts: str = "gutenberg_openings"  # a bundled set (its held-out split) or a prompt file
    max_prompts: int = 8
    force_profile: bool = False  # use a hardware profile measured on other hardware

    options: ClassVar[tuple[str, ...]] = (
        *("llm", "pool", "prompts", "max_prompts", "max_new_tokens", "repeats", "warmup", "threads"),
        *("dtype", "device", "force_profile"),
    )

    def folder(self) -> str:
        return "scheduler-eval"

    def plan(self, artifacts: Path, log: Log) -> Plan:
        models, max_new = (
            Models.load(self.llm, self.pool, dtype=self.dtype, device=self.device),
            self.max_new_tokens,
        )
        pool, llm, everyone = models.pool, models.llm, list(range(len(models.ssms)))
        if pool.predictor is None:
            raise ValueError(f"the pool {self.pool} has no predictor: `make predictor`, then `make export`")
        cost = pool.cost_model(llm.device, llm.dtype, self.force_profile)
        if cost is None:
            raise ValueError(
                f"the pool {self.pool} has no hardware profile: `make profile`, then `make export`"
            )
        workload = held_out_or_file(self.prompts, self.max_prompts)
        items = encode_batches(workload.prompts, models.tokenizer, 1, self.max_prompt_tokens, self.device)
        with torch.inference_mode():  # the oracle's knowledge: prompt + greedy output
            references = [
                llm.generate(**b, max_new_tokens=max_new, do_sample=False)[0].tolist() for b in items
            ]

        def ours(name: str, description: str, **kwargs: Any) -> Any:
            decoder = models.decoder(everyone, **kwargs)
            return lambda: decoder_method(name, description, models, decoder, everyone, max_new, GREEDY)

        candidates = {
            "plain": lambda: generate_method("plain", "llm.generate, greedy", models, max_new, GREEDY)
        }
        for b in pool.predictor.config.widths:
            for d in pool.predictor.config.depths:
                candidates[f"fixed[{b},{d}]"] = ours(
                    f"fixed[{b},{d}]", f"every SSM drafts BeamShape({b}, {d})", shape=BeamShape(b, d)
                )
        candidates["learned"] = ours(
            "learned", "learned scheduler (predictor + cost model)", strategy="learned", cost_model=cost
        )
        oracle = OracleScheduler(pool.models, pool.predictor, cost, references)
        candidates["oracle"] = ours("oracle", "decision rule on the true match lengths", speculator=oracle)

        def results(report: Report) -> dict[str, Any]:
            overheads = [
                r.stats["strategy"]["overhead_fraction"]
                for r in report.runs[0].records
                if r.method == "learned"
            ]
            return {"headline": headline(report.tables()[0].rows, statistics.mean(overheads))}

        return one_cell(workload.category, items, candidates, models.info(self.llm, self.pool), results)

    def write(self, report: Report, out: Path, readme: Path | None = None) -> str:
        table = report.tables()[0]
        report.write_json(out / "scheduler_eval.json")
        text = markdown_table(table) + "\n"
        (out / "scheduler_eval.md").write_text(text)
        colors = {"learned": "tab:red", "oracle": "tab:green"}
        title = "Learned scheduler vs fixed beam shapes (b, d) vs oracle"
        rows = {r.method: r for r in table.rows}
        plot_methods(rows, list(rows), colors, title, out / "scheduler_eval.png")
        h = report.results["headline"]
        return text + (
            f"\nlearned {h['learned_tokens_per_second']:.1f} tokens/s: {h['learned_vs_best_fixed']:.2f}x the "
            f"best fixed shape ({h['best_fixed']}), {h['learned_vs_median_fixed']:.2f}x the median fixed "
            f"shape; oracle {h['oracle_tokens_per_second']:.1f} tokens/s (regret {h['regret']:.1%}); "
            f"scheduler overhead {h['scheduler_overhead_fraction']:.1%} of the step time; outputs "
            f"identical: {h['all_identical']}"
        )


def headline(rows: list[MethodRow], overhead: float) -> dict[str, Any]:
    def rate(row: MethodRow) -> float:
        return row.tokens_per_second.median

    by_name = {r.method: r for r in rows}
    fixed = sorted((r for r in rows if r.method.startswith("fixed[")), key=rate)
    learned, oracle = rate(by_name["learned"]), rate(by_name["oracle"])
    median = statistics.median(rate(r) for r in fixed)
    return {
        "learned_tokens_per_second": learned,
        "best_fixed": fixed[-1].method,
        "best_fixed_tokens_per_second": rate(fixed[-1]),
        "median_fixed_tokens_per_second": median,
        "oracle_tokens_per_second": oracle,
        "learned_vs_best_fixed": learned / rate(fixed[-1]),
        "learned_vs_median_fixed": learned / median,
        "regret": 1 - learned / oracle,
        "scheduler_overhead_fraction": overhead,
        "all_identical": all(r.identical_to_plain for r in rows),
    }
