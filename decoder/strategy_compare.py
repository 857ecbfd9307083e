"""Compare the speculation strategies of ALGORITHMS.md sections 6-8 side by side.

    python -m specboost.decoder.strategy_compare --llm artifacts/reference-llm/tiny/model \\
        --pool artifacts/pool-export --prompts tinystories_openings --out artifacts/strategy-compare

(`make strategy-compare`: measures the pool's acceptance vectors and exports it first). On
held-out prompts, all greedy and interleaved in ONE run of the decoder bench's harness (warm-up,
repeats, medians, every output checked against plain `llm.generate`):

(a) trees: tokens per step against tree size n (nodes, root included): the Sequoia tree of the
    SSM's acceptance vector (`sequoia@n`), k chains sharing its n - 1 drafts (`k-chains@n`, k =
    2, 4, 8: the root's top-k tokens, each continued greedily, `sequoia_dp.chains_shape`) and a
    single chain (`chain[s,n-1]`), all drafted by one SSM s (the one that strategy="sequoia"
    picks for this hardware), plus that hardware-aware choice itself (`sequoia@auto`);
(b) collective: tokens/s of weighted-majority chains (`majority`) against each SSM's own chain
    (`chain[i,L]`), the pool's merged chains (`pool_chain`) and the weight-pruned merged tree
    (`pruned`, a budget of L nodes);
(c) adaptive lengths: the Minions and BASS controllers (`minions`, `bass`, SSM s) against fixed
    chain lengths (`chain[s,L]`).

Writes strategy_compare.json (headline, summary, configuration, machine, every run),
strategy_compare.md (the tables) and strategy_trees.png, strategy_majority.png,
strategy_lengths.png into OUT (`strategy_compare_plots`); prints the headline. Exit status 1 if
any output differs from plain decoding.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specboost.decoder.bench import (
    BenchReport,
    ForwardCounter,
    Method,
    MethodSummary,
    RunRecord,
    _hf_method,
    _our_method,
    machine_info,
    measure,
    summarise,
)
from specboost.decoder.decoder import SpeculativeDecoder
from specboost.decoder.pool import SSMPool
from specboost.decoder.scheduler_eval import held_out_prompts
from specboost.decoder.strategies import StrategyOptions
from specboost.decoder.strategy_compare_plots import plot_lengths, plot_majority, plot_trees
from specboost.speculator.loading import load_causal_lm, load_tokenizer
from specboost.speculator.sequoia_dp import chains_shape, tree_vs_chains
from specboost.speculator.shapes import ChainShape


@dataclass
class CompareConfig:
    llm: str  # the LLM folder
    pool: str  # an exported pool with hardware profile and Sequoia acceptance vectors
    prompts: str = "tinystories_openings"  # a bundled set (its held-out split) or a prompt file
    max_prompts: int = 5
    max_new_tokens: int = 64
    repeats: int = 2
    warmup: int = 1
    threads: int = 1
    sizes: tuple[int, ...] = (4, 8, 16, 32, 64)  # (a): tree sizes n, root included
    chains: tuple[int, ...] = (2, 4, 8)  # (a): k of the k-chain trees
    chain_length: int = 4  # (b): L of every chain, the majority vote's and the pruning budget
    lengths: tuple[int, ...] = tuple(range(2, 13))  # (c): the fixed chain lengths
    ssm: int | None = None  # the SSM of (a) and (c); None: the one strategy="sequoia" picks
    dtype: str = "float32"  # for machine_info
    device: str = "cpu"


@dataclass
class Groups:
    """The method names of each comparison (a method can serve several)."""

    ssm: int  # the SSM of (a) and (c)
    trees: dict[str, dict[int, str]] = field(default_factory=dict)  # curve -> tree size -> method
    collective: list[str] = field(default_factory=list)
    fixed_lengths: dict[int, str] = field(default_factory=dict)  # L -> method
    adaptive: list[str] = field(default_factory=list)


class MethodSet:
    """Methods by name, each built once; plain generate first (the reference output)."""

    def __init__(
        self, llm: PreTrainedModel, pool: SSMPool, tokenizer: PreTrainedTokenizerBase, max_new: int
    ) -> None:
        self.llm, self.pool, self.tokenizer, self.max_new = llm, pool, tokenizer, max_new
        plain = _hf_method("plain", "llm.generate, greedy", llm, ForwardCounter(llm), max_new)
        self.methods: dict[str, Method] = {"plain": plain}

    def decoder(self, indices: list[int], **kwargs: Any) -> SpeculativeDecoder:
        """A decoder over the SSMs `indices`: the whole pool, with its files, when it is every SSM."""
        ssms = self.pool if len(indices) == len(self.pool) else [self.pool.models[i] for i in indices]
        return SpeculativeDecoder(self.llm, ssms, self.tokenizer, **kwargs)

    def add(
        self,
        name: str,
        description: str,
        indices: list[int],
        decoder: SpeculativeDecoder | None = None,
        **decoder_kwargs: Any,
    ) -> str:
        if name not in self.methods:
            decoder = decoder or self.decoder(indices, **decoder_kwargs)
            self.methods[name] = _our_method(name, description, decoder, indices, self.max_new)
        return name

    def chain(self, ssm: int, length: int) -> str:
        shape = ChainShape(length)
        return self.add(f"chain[{ssm},{length}]", f"SSM {ssm} drafts {shape}", [ssm], shape=shape)


def build_methods(config: CompareConfig, methods: MethodSet) -> Groups:
    everyone = list(range(len(methods.pool)))
    auto = methods.decoder(everyone, strategy="sequoia", strategy_options=StrategyOptions(ssm=config.ssm))
    s, tree = auto.speculator.index, auto.speculator.tree
    groups = Groups(s)
    # (a) Sequoia trees vs k chains vs one chain, one SSM, equal sizes.
    groups.trees["sequoia"] = {
        n: methods.add(
            f"sequoia@{n}",
            f"SSM {s} fills the Sequoia tree of {n} nodes",
            everyone,
            strategy="sequoia",
            strategy_options=StrategyOptions(nodes=n, ssm=s),
        )
        for n in config.sizes
    }
    groups.trees["1 chain"] = {n: methods.chain(s, n - 1) for n in config.sizes}
    for k in config.chains:
        groups.trees[f"{k} chains"] = {
            n: methods.add(
                f"{k}-chains@{n}",
                f"SSM {s}: the root's top {k} tokens, each continued greedily, {n} nodes",
                [s],
                shape=chains_shape(n, k),
            )
            for n in config.sizes
            if k < n
        }
    description = f"SSM {s} fills the hardware-aware Sequoia tree ({tree.nodes} nodes, depth {tree.depth})"
    groups.trees["sequoia (hardware-aware)"] = {
        tree.nodes: methods.add("sequoia@auto", description, everyone, auto)
    }
    # (b) Weighted majority vs each SSM alone vs the merged pool.
    length = config.chain_length
    groups.collective = [methods.chain(i, length) for i in everyone]
    chain = ChainShape(length)
    groups.collective += [
        methods.add("pool_chain", f"every SSM drafts {chain}, merged", everyone, shape=chain),
        methods.add(
            "pruned",
            f"merged {chain}s cut to the {length} heaviest nodes",
            everyone,
            strategy="pruned",
            shape=chain,
            strategy_options=StrategyOptions(budget=length),
        ),
        methods.add("majority", f"the weighted-majority {chain}", everyone, strategy="majority", shape=chain),
    ]
    # (c) Adaptive vs fixed chain lengths, SSM s.
    groups.fixed_lengths = {n: methods.chain(s, n) for n in config.lengths}
    groups.adaptive = [
        methods.add(name, f"SSM {s}, chain length by {name}", [s], length_controller=name)
        for name in ("minions", "bass")
    ]
    return groups


# Summary ----------------------------------------------------------------------------------------------
def mean_lengths(records: list[RunRecord], names: list[str]) -> dict[str, float]:
    """Mean chain length per step that a length controller chose (first repeat of every prompt)."""
    return {
        name: statistics.mean(
            n for r in records if r.method == name and r.repeat == 0 for n in r.stats["strategy"]["lengths"]
        )
        for name in names
    }


def headline(summary: dict[str, MethodSummary], groups: Groups, lengths: dict[str, float]) -> dict[str, Any]:
    trees = groups.trees
    per_size = {}
    for n, name in trees["sequoia"].items():
        chains = {
            curve: trees[curve][n] for curve in trees if curve.endswith(" chains") and n in trees[curve]
        }
        best = max(chains.values(), key=lambda m: summary[m].tokens_per_step)
        sequoia = summary[name].tokens_per_step
        per_size[n] = {
            "sequoia_tokens_per_step": sequoia,
            "best_k_chains": best,
            "gain_over_best_k_chains": sequoia / summary[best].tokens_per_step,
            "gain_over_one_chain": sequoia / summary[trees["1 chain"][n]].tokens_per_step,
        }
    singles = [summary[m] for m in groups.collective if m.startswith("chain[")]
    best_single = max(singles, key=lambda s: s.tokens_per_second)
    fixed = [summary[m] for m in groups.fixed_lengths.values()]
    best_fixed = max(fixed, key=lambda s: s.tokens_per_second)
    median_fixed = statistics.median(s.tokens_per_second for s in fixed)
    return {
        "ssm": groups.ssm,
        "trees": per_size,
        "majority_tokens_per_second": summary["majority"].tokens_per_second,
        "best_single_ssm": best_single.method,
        "majority_vs_best_single_ssm": summary["majority"].tokens_per_second / best_single.tokens_per_second,
        "majority_vs_pool_chain": summary["majority"].tokens_per_second
        / summary["pool_chain"].tokens_per_second,
        "best_fixed_length": best_fixed.method,
        "adaptive": {
            name: {
                "mean_length": lengths[name],
                "tokens_per_second": summary[name].tokens_per_second,
                "vs_best_fixed": summary[name].tokens_per_second / best_fixed.tokens_per_second,
                "vs_median_fixed": summary[name].tokens_per_second / median_fixed,
            }
            for name in groups.adaptive
        },
        "all_identical": all(s.identical_to_plain for s in summary.values()),
    }


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def markdown(
    summary: dict[str, MethodSummary],
    groups: Groups,
    lengths: dict[str, float],
    predicted: list[dict],
    report: BenchReport,
) -> str:
    """(a) tokens/step measured (DP prediction) per size; (b), (c) per method; then the bench table."""
    trees, sizes = groups.trees, list(groups.trees["sequoia"])
    curves = [c for c in trees if c != "sequoia (hardware-aware)"]
    expected = {row["nodes"]: row for row in predicted}

    def cell(curve: str, n: int) -> str:
        if n not in trees[curve]:
            return "-"
        row = expected[n]
        guess = row["sequoia"] if curve == "sequoia" else row["chains"][int(curve.split()[0])]
        return f"{summary[trees[curve][n]].tokens_per_step:.2f} ({guess:.2f})"

    def numbers(name: str) -> list[str]:
        s = summary[name]
        return [f"{s.tokens_per_step:.2f}", f"{s.tokens_per_second:.1f}", f"{s.speedup_vs_plain or 0:.2f}x"]

    auto = summary["sequoia@auto"]
    header = ["tokens/step", "tokens/s", "vs plain"]
    length_rows = [[name, str(n), *numbers(name)] for n, name in groups.fixed_lengths.items()]
    length_rows += [[name, f"{lengths[name]:.1f} (mean)", *numbers(name)] for name in groups.adaptive]
    return "\n\n".join(
        [
            f"## (a) Tokens per step by tree size (SSM {groups.ssm}; measured, DP prediction in parentheses)",
            markdown_table(["nodes", *curves], [[str(n), *(cell(c, n) for c in curves)] for n in sizes]),
            f"`sequoia@auto`: {auto.description}: {auto.tokens_per_step:.2f} tokens/step, "
            f"{auto.tokens_per_second:.1f} tokens/s ({auto.speedup_vs_plain or 0:.2f}x plain).",
            "## (b) Weighted majority vs single SSMs vs the merged pool",
            markdown_table(["method", *header], [[name, *numbers(name)] for name in groups.collective]),
            "## (c) Adaptive vs fixed chain lengths",
            markdown_table(["method", "length", *header], length_rows),
            "## Every method",
            f"```\n{report.table()}\n```",
        ]
    )


# Run --------------------------------------------------------------------------------------------------
def run(config: CompareConfig, out: Path) -> dict[str, Any]:
    torch.set_num_threads(config.threads)  # before the pool's profile is looked up: it is per thread count
    llm = load_causal_lm(config.llm)
    tokenizer = load_tokenizer(config.llm)
    pool = SSMPool.from_pretrained(config.pool)
    pool.check_llm(llm, tokenizer)
    methods = MethodSet(llm, pool, tokenizer, config.max_new_tokens)
    groups = build_methods(config, methods)
    prompts = held_out_prompts(config.prompts, tokenizer, config.max_prompts)
    encoded = [tokenizer(p, return_tensors="pt") for p in prompts]
    method_list = list(methods.methods.values())
    records = measure(method_list, encoded, config.repeats, config.warmup, print)
    report = BenchReport(asdict(config), machine_info(config), summarise(method_list, records), records)
    predicted = tree_vs_chains(pool.acceptance[groups.ssm].marginal, config.sizes, config.chains, None)
    return write_results(report, groups, predicted, out)


def write_results(report: BenchReport, groups: Groups, predicted: list[dict], out: Path) -> dict[str, Any]:
    """The JSON, the Markdown tables and the plots of one run, into `out`; returns the JSON."""
    summary = {s.method: s for s in report.summary}
    lengths = mean_lengths(report.records, groups.adaptive)
    result = {
        "headline": headline(summary, groups, lengths),
        "groups": asdict(groups),
        "predicted": predicted,
        **report.to_json(),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "strategy_compare.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "strategy_compare.md").write_text(markdown(summary, groups, lengths, predicted, report) + "\n")
    plot_trees(summary, groups.trees, predicted, out / "strategy_trees.png")
    plot_majority(summary, groups.collective, out / "strategy_majority.png")
    plot_lengths(summary, groups.fixed_lengths, groups.adaptive, lengths, out / "strategy_lengths.png")
    print(report.table())
    print_headline(result["headline"])
    print(f"wrote {out}")
    return result


def print_headline(h: dict[str, Any]) -> None:
    gains = [t["gain_over_best_k_chains"] for t in h["trees"].values()]
    print(
        f"\n(a) Sequoia vs the best of k chains at equal size (SSM {h['ssm']}): tokens/step x{min(gains):.2f}"
        f"..x{max(gains):.2f} over sizes {list(h['trees'])}"
    )
    print(
        f"(b) majority {h['majority_tokens_per_second']:.1f} tokens/s: "
        f"{h['majority_vs_best_single_ssm']:.2f}x the best single SSM ({h['best_single_ssm']}), "
        f"{h['majority_vs_pool_chain']:.2f}x pool_chain"
    )
    for name, a in h["adaptive"].items():
        print(
            f"(c) {name}: mean length {a['mean_length']:.1f}, {a['tokens_per_second']:.1f} tokens/s, "
            f"{a['vs_best_fixed']:.2f}x the best fixed length ({h['best_fixed_length']}), "
            f"{a['vs_median_fixed']:.2f}x the median one"
        )
    print(f"outputs identical to plain generate: {h['all_identical']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llm", required=True, help="the LLM folder")
    p.add_argument("--pool", required=True, help="exported pool with hardware profile and acceptance vectors")
    p.add_argument(
        "--prompts", default="tinystories_openings", help="bundled set (its held-out split) or file"
    )
    p.add_argument("--max-prompts", type=int, default=5)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--ssm", type=int, help="the SSM of (a) and (c) (default: strategy='sequoia''s pick)")
    p.add_argument("--out", type=Path, default=Path("artifacts/strategy-compare"))
    args = p.parse_args(argv)
    config = CompareConfig(
        llm=args.llm,
        pool=args.pool,
        prompts=args.prompts,
        max_prompts=args.max_prompts,
        max_new_tokens=args.max_new_tokens,
        repeats=args.repeats,
        warmup=args.warmup,
        threads=args.threads,
        ssm=args.ssm,
    )
    try:
        result = run(config, args.out)
    except (FileNotFoundError, ValueError, NotImplementedError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0 if result["headline"]["all_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
