"""The plots of `strategy_compare` (matplotlib, PNG); metric names of ALGORITHMS.md section 13."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from specboost.decoder.bench import MethodSummary

HARDWARE_AWARE = "sequoia (hardware-aware)"


def _plain_line(ax: plt.Axes, summary: dict[str, MethodSummary]) -> None:
    ax.axhline(summary["plain"].tokens_per_second, color="black", linewidth=0.8, linestyle=":", label="plain")


def _save(fig: plt.Figure, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_trees(
    summary: dict[str, MethodSummary], trees: dict[str, dict[int, str]], predicted: list[dict], path: Path
) -> None:
    """(a) Tokens/step (measured, and the DP's prediction dashed) and tokens/s against tree size."""
    expected = {row["nodes"]: row for row in predicted}
    fig, (steps, rate) = plt.subplots(1, 2, figsize=(11, 4.5))
    for curve, methods in trees.items():
        sizes = sorted(methods)
        if curve == HARDWARE_AWARE:
            for ax, metric in ((steps, "tokens_per_step"), (rate, "tokens_per_second")):
                value = getattr(summary[methods[sizes[0]]], metric)
                ax.plot(sizes, [value], "*", markersize=14, color="tab:red", label=curve)
            continue
        width = 4 if curve == "sequoia" else 1.5  # a Sequoia tree can be a chain: keep both lines visible
        values = [summary[methods[n]].tokens_per_step for n in sizes]
        (line,) = steps.plot(sizes, values, "o-", linewidth=width, label=curve)
        rank = None if curve == "sequoia" else int(curve.split()[0])
        guess = [expected[n]["sequoia"] if rank is None else expected[n]["chains"][rank] for n in sizes]
        steps.plot(sizes, guess, "--", color=line.get_color(), alpha=0.6)
        rate.plot(
            sizes, [summary[methods[n]].tokens_per_second for n in sizes], "o-", linewidth=width, label=curve
        )
    _plain_line(rate, summary)
    steps.set(xscale="log", xlabel="tree size n (nodes, root included)", ylabel="tokens / step")
    steps.set_title("measured (solid) and DP prediction (dashed)", fontsize="medium")
    rate.set(xscale="log", xlabel="tree size n (nodes, root included)", ylabel="tokens / s")
    for ax in (steps, rate):
        ax.minorticks_off()
        ax.set_xticks(sorted(trees["sequoia"]), [str(n) for n in sorted(trees["sequoia"])])
        ax.legend(fontsize="small")
    fig.suptitle("Sequoia trees vs k independent chains, one SSM, equal sizes")
    _save(fig, path)


def plot_majority(summary: dict[str, MethodSummary], names: list[str], path: Path) -> None:
    """(b) Tokens/s per method, tokens/step written on the bars."""
    fig, ax = plt.subplots(figsize=(max(6, len(names) * 1.1), 4))
    colors = [
        "tab:red" if n == "majority" else "tab:blue" if n.startswith("chain[") else "tab:gray" for n in names
    ]
    bars = ax.bar(names, [summary[n].tokens_per_second for n in names], color=colors)
    for bar, name in zip(bars, names, strict=True):
        ax.annotate(
            f"{summary[name].tokens_per_step:.2f} tok/step",
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            fontsize="small",
        )
    _plain_line(ax, summary)
    ax.set(ylabel="tokens / s", title="Weighted majority vs single SSMs vs the merged pool")
    ax.tick_params(axis="x", rotation=30)
    ax.legend(fontsize="small")
    _save(fig, path)


def plot_lengths(
    summary: dict[str, MethodSummary],
    fixed: dict[int, str],
    adaptive: list[str],
    lengths: dict[str, float],
    path: Path,
) -> None:
    """(c) Tokens/s and tokens/step against the chain length; the controllers at their mean length."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, metric, label in (
        (axes[0], "tokens_per_second", "tokens / s"),
        (axes[1], "tokens_per_step", "tokens / step"),
    ):
        ax.plot(
            list(fixed), [getattr(summary[m], metric) for m in fixed.values()], "o-", label="fixed length"
        )
        for name, marker in zip(adaptive, "s^", strict=False):
            ax.plot(
                lengths[name],
                getattr(summary[name], metric),
                marker,
                markersize=10,
                label=f"{name} (mean length)",
            )
        ax.set(xlabel="chain length", ylabel=label)
    _plain_line(axes[0], summary)
    for ax in axes:
        ax.legend(fontsize="small")
    fig.suptitle("Adaptive (Minions, BASS) vs fixed chain lengths, one SSM")
    _save(fig, path)
