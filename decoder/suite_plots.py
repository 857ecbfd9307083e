"""The benchmark suite's plots (matplotlib, PNG), from a `Table` of `suite_report` and the run
records; metric names of ALGORITHMS.md section 13."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from specboost.decoder.suite_report import CellRun, MethodRow, Table


def _ranked_first(rows: Sequence[MethodRow]) -> list[MethodRow]:
    return sorted(rows, key=lambda r: (r.rank is None, r.rank or 0))


def plot_speedup(table: Table, path: Path) -> None:
    """Speedup vs plain per method (ranked order) and category; the "all" bar has the min-max
    spread over repeats as its error bar. Methods whose output differs have no bar."""
    rows = _ranked_first(table.rows)
    groups = ["all", *table.per_category]
    width = 0.8 / len(groups)
    fig, ax = plt.subplots(figsize=(max(8, len(rows) * 0.7), 4.5))
    for g, group in enumerate(groups):
        source = table.rows if group == "all" else table.per_category[group]
        by_name = {r.method: r.speedup_vs_plain for r in source}
        xs = [i + (g - (len(groups) - 1) / 2) * width for i in range(len(rows))]
        heights = [by_name[r.method].median if by_name[r.method] else math.nan for r in rows]
        errors = None
        if group == "all":
            spreads = [by_name[r.method] for r in rows]
            errors = [
                [s.median - s.low if s else 0 for s in spreads],
                [s.high - s.median if s else 0 for s in spreads],
            ]
        ax.bar(xs, heights, width, label=group, yerr=errors, capsize=2)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(rows)), [r.method for r in rows], rotation=60, ha="right")
    ax.set(
        ylabel="speedup vs plain (median over repeats)",
        title=f"Speedup per method and category ({table.title})",
    )
    ax.legend(fontsize="small")
    _save(fig, path)


def plot_tokens_per_step(tables: Sequence[Table], path: Path) -> None:
    """Tokens per step against tree size (drafted tokens per LLM pass), one point per method."""
    fig, ax = plt.subplots(figsize=(7, 5))
    for table, marker in zip(tables, "os^v", strict=False):
        rows = [r for r in table.rows if r.draft_tokens_per_step is not None]
        ax.scatter(
            [r.draft_tokens_per_step for r in rows],
            [r.tokens_per_step for r in rows],
            marker=marker,
            label=table.title,
        )
        for r in rows:
            ax.annotate(r.method, (r.draft_tokens_per_step, r.tokens_per_step), fontsize=7, alpha=0.8)
    ax.set(
        xlabel="drafted tokens per LLM pass (tree size)", ylabel="tokens per step (new tokens / LLM passes)"
    )
    ax.set_title("Tokens per step vs tree size")
    ax.legend(fontsize="small")
    _save(fig, path)


def plot_acceptance_by_position(table: Table, path: Path) -> None:
    """Per method: share of verification steps that accept at least k drafted tokens, over k (steps
    that draft nothing, as the learned scheduler may choose, count as accepting none)."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.set_prop_cycle(color=plt.cm.tab20.colors)
    for r in table.rows:
        if r.accepted_at_least:
            ks = range(1, len(r.accepted_at_least) + 1)
            ax.plot(ks, r.accepted_at_least, marker=".", label=r.method)
    ax.set(xlabel="draft position k", ylabel="share of steps accepting >= k tokens", ylim=(0, 1.02))
    ax.set_title(f"Acceptance by position ({table.title})")
    ax.legend(fontsize="x-small", ncol=2)
    _save(fig, path)


def weight_histories(runs: Sequence[CellRun]) -> dict[str, list[list[float]]]:
    """Per method and decoding that keep SSM weights (`DecodeStats.strategy["weights"]`: the
    weighted-majority strategies): the weights after every update, through all its runs in the
    order they ran (one decoder per method and decoding: its weights carry over between runs)."""
    out: dict[str, list[list[float]]] = {}
    for run in runs:
        for r in run.records:
            history = (r.stats or {}).get("strategy", {}).get("weights")
            if history:
                key = f"{r.method} ({run.cell.decoding}, batch {run.cell.batch_size})"
                out.setdefault(key, []).extend(history[1:] if key in out else history)
    return out


def plot_ssm_weights(histories: dict[str, list[list[float]]], path: Path) -> None:
    """One panel per method: each SSM's weight over the weight updates of the whole suite."""
    columns = min(3, len(histories))
    rows = math.ceil(len(histories) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(5 * columns, 3.8 * rows), squeeze=False)
    for ax in axes.flat[len(histories) :]:
        ax.set_visible(False)
    for ax, (method, history) in zip(axes.flat, histories.items(), strict=False):
        for i, series in enumerate(zip(*history, strict=True)):
            ax.plot(series, label=f"SSM {i}")
        ax.set(xlabel="weight update", ylabel="weight $w_i$", yscale="log", title=method)
        ax.legend(fontsize="small")
    _save(fig, path)


def _save(fig: plt.Figure, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
