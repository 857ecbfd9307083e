"""The harness's plots (matplotlib, PNG), drawn from summary rows (`summary.MethodRow`) and run
records; metric names of ALGORITHMS.md section 13."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from specboost.decoder.bench.protocol import CellRun
from specboost.decoder.bench.summary import MethodRow, Table

Rows = dict[str, MethodRow]  # by method name


def _save(fig: plt.Figure, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _rate(row: MethodRow) -> float:
    return row.tokens_per_second.median


def plot_speedup(table: Table, path: Path) -> None:
    """Speedup vs plain per method (ranked order) and category; the "all" bar has the min-max
    spread over repeats as its error bar. Methods whose output differs have no bar."""
    rows = sorted(table.rows, key=lambda r: (r.rank is None, r.rank or 0))
    groups = ["all", *table.per_category]
    width = 0.8 / len(groups)
    fig, ax = plt.subplots(figsize=(max(8, len(rows) * 0.7), 4.5))
    for g, group in enumerate(groups):
        by_name = {
            r.method: r.speedup_vs_plain
            for r in (table.rows if group == "all" else table.per_category[group])
        }
        spreads = [by_name[r.method] for r in rows]
        errors = None
        if group == "all":
            errors = [
                [s.median - s.low if s else 0 for s in spreads],
                [s.high - s.median if s else 0 for s in spreads],
            ]
        xs = [i + (g - (len(groups) - 1) / 2) * width for i in range(len(rows))]
        ax.bar(xs, [s.median if s else math.nan for s in spreads], width, label=group, yerr=errors, capsize=2)
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


def plot_acceptance_by_position(tables: Sequence[Table], path: Path) -> None:
    """One panel per table (decoding): per method, the share of verification steps that accept at
    least k drafted tokens, over k (steps that draft nothing, as the learned scheduler may choose,
    count as accepting none)."""
    fig, axes = plt.subplots(1, len(tables), figsize=(7 * len(tables), 4.5), squeeze=False)
    for ax, table in zip(axes.flat, tables, strict=True):
        ax.set_prop_cycle(color=plt.cm.tab20.colors)
        for r in table.rows:
            if r.accepted_at_least:
                ax.plot(
                    range(1, len(r.accepted_at_least) + 1), r.accepted_at_least, marker=".", label=r.method
                )
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
    """One panel per method: each SSM's weight over the weight updates of the whole run."""
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


def plot_methods(rows: Rows, names: Sequence[str], colors: dict[str, str], title: str, path: Path) -> None:
    """Tokens/s (plain's as a dotted line) and tokens/step of each method; `colors` marks some."""
    fig, axes = plt.subplots(2, 1, figsize=(max(6, len(names) * 0.6), 7), sharex=True)
    color = [colors.get(n, "tab:gray") for n in names]
    axes[0].bar(names, [_rate(rows[n]) for n in names], color=color)
    axes[0].axhline(_rate(rows["plain"]), color="black", linewidth=0.8, linestyle=":", label="plain")
    axes[1].bar(names, [rows[n].tokens_per_step for n in names], color=color)
    axes[0].set(ylabel="tokens / s", title=title)
    axes[1].set(ylabel="tokens / step")
    axes[0].legend(fontsize="small")
    axes[1].tick_params(axis="x", rotation=70)
    _save(fig, path)


def plot_curves(
    curves: dict[str, dict[float, MethodRow]],
    xlabel: str,
    title: str,
    path: Path,
    predicted: dict[str, dict[float, float]] | None = None,
    points: dict[str, tuple[float, MethodRow]] | None = None,
    latency: bool = False,
    plain: MethodRow | None = None,
) -> None:
    """Two panels over x (tree size, chain length, batch size; log scale for sizes): tokens/step
    (or, with `latency`, ms per output token) and tokens/s of each curve's methods; `predicted`
    dashed beside the first panel's curves, `points` as single markers (a method at its own x),
    `plain`'s tokens/s as a dotted line."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))

    def first(row: MethodRow) -> float:
        return row.per_token_latency["mean"] * 1e3 if latency else row.tokens_per_step

    for k, (label, methods) in enumerate(curves.items()):
        xs = sorted(methods)
        width = 4 if k == 0 and predicted else 1.5  # a Sequoia tree can be a chain: keep both visible
        (line,) = left.plot(xs, [first(methods[x]) for x in xs], "o-", linewidth=width, label=label)
        right.plot(xs, [_rate(methods[x]) for x in xs], "o-", linewidth=width, label=label)
        if predicted and label in predicted:
            left.plot(xs, [predicted[label][x] for x in xs], "--", color=line.get_color(), alpha=0.6)
    for (label, (x, row)), marker in zip((points or {}).items(), "*s^", strict=False):
        left.plot([x], [first(row)], marker, markersize=12, label=label)
        right.plot([x], [_rate(row)], marker, markersize=12, label=label)
    if plain is not None:
        right.axhline(_rate(plain), color="black", linewidth=0.8, linestyle=":", label="plain")
    left.set(xlabel=xlabel, ylabel="ms per output token" if latency else "tokens / step")
    right.set(xlabel=xlabel, ylabel="tokens / s")
    if "size" in xlabel:
        ticks = sorted({x for methods in curves.values() for x in methods})
        for ax in (left, right):
            ax.set(xscale="log")
            ax.minorticks_off()
            ax.set_xticks(ticks, [f"{x:g}" for x in ticks])
    if predicted:
        left.set_title("measured (solid) and DP prediction (dashed)", fontsize="medium")
    for ax in (left, right):
        ax.legend(fontsize="small")
    fig.suptitle(title)
    _save(fig, path)
