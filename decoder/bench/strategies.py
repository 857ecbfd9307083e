"""The strategy comparison (ALGORITHMS.md sections 6-8), greedy, on held-out prompts, in one run:

    specboost bench --suite strategies --llm LLM --pool POOL_EXPORT --out artifacts/strategy-compare

(a) trees: tokens per step against tree size n (nodes, root included): the Sequoia tree of the
    SSM's acceptance vector (`sequoia@n`), k chains sharing its n - 1 drafts (`k-chains@n`, k =
    2, 4, 8: the root's top-k tokens, each continued greedily, `sequoia_dp.chains_shape`) and a
    single chain (`chain[s,n-1]`), all drafted by one SSM s (the one strategy="sequoia" picks
    for this hardware), plus that hardware-aware choice itself (`sequoia@auto`);
(b) collective: weighted-majority chains (`majority`) against each SSM's own chain (`chain[i,L]`),
    the pool's merged chains (`pool_chain`) and the weight-pruned merged tree (`pruned`, L nodes);
(c) adaptive lengths: the Minions and BASS controllers (`minions`, `bass`, SSM s) against fixed
    chain lengths (`chain[s,L]`).
Writes strategy_compare.json (headline, groups, DP predictions, every run), strategy_compare.md
and strategy_trees.png, strategy_majority.png, strategy_lengths.png.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

from specboost.decoder.bench.markdown import grid, markdown_table
from specboost.decoder.bench.methods import Models, decoder_method, generate_method
from specboost.decoder.bench.plots import plot_curves, plot_methods
from specboost.decoder.bench.protocol import Log, Plan, Protocol, Report, one_cell
from specboost.decoder.bench.records import GREEDY, Method, RunRecord
from specboost.decoder.bench.summary import MethodRow
from specboost.decoder.bench.workloads import encode_batches, held_out_or_file
from specboost.decoder.strategies import StrategyOptions
from specboost.speculator.sequoia_dp import chains_shape, tree_vs_chains
from specboost.speculator.shapes import ChainShape

HARDWARE_AWARE = "sequoia (hardware-aware)"
Rows = dict[str, MethodRow]


@dataclass(frozen=True, kw_only=True)
class StrategiesConfig(Protocol):
    llm: str = "artifacts/reference-llm/tiny/model"
    pool: str = "artifacts/pool-export"  # exported with its hardware profile and Sequoia vectors
    prompts: str = "tinystories_openings"  # a bundled set (its held-out split) or a prompt file
    max_prompts: int = 5
    repeats: int = 2
    sizes: tuple[int, ...] = (4, 8, 16, 32, 64)  # (a): tree sizes n, root included
    chains: tuple[int, ...] = (2, 4, 8)  # (a): k of the k-chain trees
    chain_length: int = 4  # (b): L of every chain, the majority vote's and the pruning budget
    lengths: tuple[int, ...] = tuple(range(2, 13))  # (c): the fixed chain lengths
    ssm: int | None = None  # the SSM of (a) and (c); None: the one strategy="sequoia" picks

    options: ClassVar[tuple[str, ...]] = (
        *("llm", "pool", "prompts", "max_prompts", "max_new_tokens", "repeats", "warmup", "threads"),
        *("dtype", "device", "chain_length", "ssms"),
    )

    def folder(self) -> str:
        return "strategy-compare"

    def with_options(self, ssms: tuple[str, ...] = (), **given: Any) -> StrategiesConfig:
        """`--ssm I` (one index) names the SSM of (a) and (c)."""
        if ssms:
            if len(ssms) != 1 or not ssms[0].isdigit():
                raise ValueError(f"--ssm with --suite strategies takes one SSM index, got {' '.join(ssms)}")
            given["ssm"] = int(ssms[0])
        return replace(self, **given)

    def methods(self, models: Models) -> tuple[dict[str, Any], dict[str, Callable[[], Method]]]:
        """The names of each comparison's methods, and the methods by name (plain first)."""
        max_new, everyone = self.max_new_tokens, list(range(len(models.ssms)))
        plain = generate_method("plain", "llm.generate, greedy", models, max_new, GREEDY)
        candidates: dict[str, Callable[[], Method]] = {"plain": lambda: plain}

        def add(name: str, description: str, indices: list[int], decoder: Any = None, **kwargs: Any) -> str:
            decoder = decoder or (lambda: models.decoder(indices, **kwargs))
            make = lambda: decoder_method(name, description, models, decoder(), indices, max_new, GREEDY)  # noqa: E731
            candidates.setdefault(name, make)  # a method can serve several comparisons
            return name

        def chain(ssm: int, length: int) -> str:
            return add(
                f"chain[{ssm},{length}]",
                f"SSM {ssm} drafts {ChainShape(length)}",
                [ssm],
                shape=ChainShape(length),
            )

        auto = models.decoder(everyone, strategy="sequoia", strategy_options=StrategyOptions(ssm=self.ssm))
        s, tree = auto.speculator.index, auto.speculator.tree
        sequoia = {n: StrategyOptions(nodes=n, ssm=s) for n in self.sizes}
        trees = {  # (a) Sequoia trees vs k chains vs one chain, one SSM, equal sizes
            "sequoia": {
                n: add(
                    f"sequoia@{n}",
                    f"SSM {s} fills the Sequoia tree of {n} nodes",
                    everyone,
                    strategy="sequoia",
                    strategy_options=o,
                )
                for n, o in sequoia.items()
            },
            "1 chain": {n: chain(s, n - 1) for n in self.sizes},
        }
        for k in self.chains:
            about = f"SSM {s}: the root's top {k} tokens, each continued greedily"
            trees[f"{k} chains"] = {
                n: add(f"{k}-chains@{n}", f"{about}, {n} nodes", [s], shape=chains_shape(n, k))
                for n in self.sizes
                if k < n
            }
        about = f"SSM {s} fills the hardware-aware Sequoia tree ({tree.nodes} nodes, depth {tree.depth})"
        trees[HARDWARE_AWARE] = {tree.nodes: add("sequoia@auto", about, everyone, lambda: auto)}
        shape, length = ChainShape(self.chain_length), self.chain_length  # (b) majority vs single vs merged
        pruning = {"strategy": "pruned", "shape": shape, "strategy_options": StrategyOptions(budget=length)}
        collective = [chain(i, length) for i in everyone] + [
            add("pool_chain", f"every SSM drafts {shape}, merged", everyone, shape=shape),
            add("pruned", f"merged {shape}s cut to the {length} heaviest nodes", everyone, **pruning),
            add("majority", f"the weighted-majority {shape}", everyone, strategy="majority", shape=shape),
        ]
        fixed = {n: chain(s, n) for n in self.lengths}  # (c) adaptive vs fixed lengths, SSM s
        adaptive = [
            add(c, f"SSM {s}, chain length by {c}", [s], length_controller=c) for c in ("minions", "bass")
        ]
        groups = {
            "ssm": s,
            "trees": trees,
            "collective": collective,
            "fixed_lengths": fixed,
            "adaptive": adaptive,
        }
        return groups, candidates

    def plan(self, artifacts: Path, log: Log) -> Plan:
        models = Models.load(self.llm, self.pool, dtype=self.dtype, device=self.device)
        groups, candidates = self.methods(models)
        workload = held_out_or_file(self.prompts, self.max_prompts)
        items = encode_batches(workload.prompts, models.tokenizer, 1, self.max_prompt_tokens, self.device)
        weights = models.pool.acceptance[groups["ssm"]].marginal

        def results(report: Report) -> dict[str, Any]:
            rows = {r.method: r for r in report.tables()[0].rows}
            lengths = mean_lengths(report.runs[0].records, groups["adaptive"])
            predicted = tree_vs_chains(weights, self.sizes, self.chains, None)
            headline = summarise(rows, groups, lengths)
            return {"headline": headline, "groups": groups, "mean_lengths": lengths, "predicted": predicted}

        return one_cell(workload.category, items, candidates, models.info(self.llm, self.pool), results)

    def write(self, report: Report, out: Path, readme: Path | None = None) -> str:
        groups, predicted, lengths = (report.results[k] for k in ("groups", "predicted", "mean_lengths"))
        table = report.tables()[0]
        rows = {r.method: r for r in table.rows}
        report.write_json(out / "strategy_compare.json")
        text = (
            markdown(rows, groups, lengths, predicted) + f"\n\n## Every method\n\n{markdown_table(table)}\n"
        )
        (out / "strategy_compare.md").write_text(text)
        trees = {c: {n: rows[m] for n, m in names.items()} for c, names in groups["trees"].items()}
        guesses = {c: {p["nodes"]: guess(p, c) for p in predicted if p["nodes"] in trees[c]} for c in trees}
        auto = next(iter(trees.pop(HARDWARE_AWARE).items()))
        title = "Sequoia trees vs k independent chains, one SSM, equal sizes"
        curves = {"predicted": guesses, "points": {HARDWARE_AWARE: auto}, "plain": rows["plain"]}
        plot_curves(trees, "tree size n (nodes, root included)", title, out / "strategy_trees.png", **curves)
        colors = {n: "tab:blue" for n in groups["collective"] if n.startswith("chain[")} | {
            "majority": "tab:red"
        }
        title = "Weighted majority vs single SSMs vs the merged pool"
        plot_methods(rows, groups["collective"], colors, title, out / "strategy_majority.png")
        fixed = {"fixed length": {n: rows[m] for n, m in groups["fixed_lengths"].items()}}
        points = {f"{name} (mean length)": (lengths[name], rows[name]) for name in groups["adaptive"]}
        title = "Adaptive (Minions, BASS) vs fixed chain lengths, one SSM"
        plot_curves(
            fixed, "chain length", title, out / "strategy_lengths.png", points=points, plain=rows["plain"]
        )
        return text


def guess(prediction: dict[str, Any], curve: str) -> float | None:
    """The DP's predicted tokens per step of a tree-size curve at one size (None: no prediction)."""
    if curve == "sequoia":
        return prediction["sequoia"]
    k = int(curve.split()[0]) if curve[0].isdigit() else None
    return prediction["chains"].get(k)


def mean_lengths(records: list[RunRecord], names: list[str]) -> dict[str, float]:
    """Mean chain length per step that a length controller chose (first repeat of every prompt)."""
    chosen = {
        name: [
            n for r in records if (r.method, r.repeat) == (name, 0) for n in r.stats["strategy"]["lengths"]
        ]
        for name in names
    }
    return {name: statistics.mean(lengths) for name, lengths in chosen.items()}


def rate(row: MethodRow) -> float:
    return row.tokens_per_second.median


def summarise(rows: Rows, groups: dict[str, Any], lengths: dict[str, float]) -> dict[str, Any]:
    """The headline: what each comparison shows, in ratios."""
    trees, per_size = groups["trees"], {}
    for n, name in trees["sequoia"].items():
        best = max(
            (trees[c][n] for c in trees if c.endswith(" chains") and n in trees[c]),
            key=lambda m: rows[m].tokens_per_step,
        )
        value = rows[name].tokens_per_step
        per_size[n] = {
            "sequoia_tokens_per_step": value,
            "best_k_chains": best,
            "gain_over_best_k_chains": value / rows[best].tokens_per_step,
            "gain_over_one_chain": value / rows[trees["1 chain"][n]].tokens_per_step,
        }
    single = max((m for m in groups["collective"] if m.startswith("chain[")), key=lambda m: rate(rows[m]))
    fixed = [rows[m] for m in groups["fixed_lengths"].values()]
    best_fixed, median_fixed, majority = (
        max(fixed, key=rate),
        statistics.median(map(rate, fixed)),
        rate(rows["majority"]),
    )
    adaptive = {
        name: {
            "mean_length": lengths[name],
            "tokens_per_second": rate(rows[name]),
            "vs_best_fixed": rate(rows[name]) / rate(best_fixed),
            "vs_median_fixed": rate(rows[name]) / median_fixed,
        }
        for name in groups["adaptive"]
    }
    return {
        "ssm": groups["ssm"],
        "trees": per_size,
        "majority_tokens_per_second": majority,
        "best_single_ssm": single,
        "majority_vs_best_single_ssm": majority / rate(rows[single]),
        "majority_vs_pool_chain": majority / rate(rows["pool_chain"]),
        "best_fixed_length": best_fixed.method,
        "adaptive": adaptive,
        "all_identical": all(r.identical_to_plain for r in rows.values()),
    }


def markdown(rows: Rows, groups: dict[str, Any], lengths: dict[str, float], predicted: list[dict]) -> str:
    """(a) tokens/step measured (DP prediction) per size; (b), (c) per method."""
    trees, expected = groups["trees"], {p["nodes"]: p for p in predicted}
    curves = [c for c in trees if c != HARDWARE_AWARE]

    def cell(curve: str, n: int) -> str:
        known = n in trees[curve]
        return (
            f"{rows[trees[curve][n]].tokens_per_step:.2f} ({guess(expected[n], curve):.2f})" if known else "-"
        )

    def numbers(name: str) -> list[str]:
        speedup = rows[name].speedup_vs_plain
        return [
            f"{rows[name].tokens_per_step:.2f}",
            f"{rate(rows[name]):.1f}",
            f"{speedup.median if speedup else 0:.2f}x",
        ]

    auto, header = rows["sequoia@auto"], ["tokens/step", "tokens/s", "vs plain"]
    by_length = [[name, str(n), *numbers(name)] for n, name in groups["fixed_lengths"].items()]
    by_length += [[name, f"{lengths[name]:.1f} (mean)", *numbers(name)] for name in groups["adaptive"]]
    return "\n\n".join(
        [
            f"## (a) Tokens per step by tree size (SSM {groups['ssm']}; measured, DP prediction in brackets)",
            grid(["nodes", *curves], [[str(n), *(cell(c, n) for c in curves)] for n in trees["sequoia"]]),
            f"`sequoia@auto`: {auto.description}: {auto.tokens_per_step:.2f} tokens/step, "
            f"{rate(auto):.1f} tokens/s ({numbers('sequoia@auto')[2]} plain).",
            "## (b) Weighted majority vs single SSMs vs the merged pool",
            grid(["method", *header], [[name, *numbers(name)] for name in groups["collective"]]),
            "## (c) Adaptive vs fixed chain lengths",
            grid(["method", "length", *header], by_length),
        ]
    )
