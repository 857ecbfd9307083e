"""The harness's Markdown: the table of a cell group's summary rows (ranked, with the speedup per
category), the suite's report (also the single-file bench's) and the README's results section."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specboost.decoder.bench.protocol import Report
from specboost.decoder.bench.summary import LATENCY_POINTS, PHASES, MethodRow, Spread, Table

# The README's generated results go between these lines (in its "## Benchmark results" section).
README_MARKERS = ("<!-- bench-suite: begin -->", "<!-- bench-suite: end -->")


def machine_line(machine: dict[str, Any]) -> str:
    gpu = f"GPU {machine['gpu']}" if "gpu" in machine else "no GPU"
    load = f"load average {machine['load_average']:.1f} when the suite started"
    return (
        f"{machine['cpu']} ({machine['cpu_count']} cores, {load}), {gpu}; "
        f"torch threads {machine['torch_threads']}, {machine['dtype']} on {machine['device']}; "
        f"torch {machine['torch']}, transformers {machine['transformers']}"
    )


def not_run(skipped: dict[str, dict[str, str]]) -> list[str]:
    return [f"- {group}: `{name}`: {why}" for group, items in skipped.items() for name, why in items.items()]


def number(value: float | None, fmt: str = ".2f") -> str:
    return "-" if value is None else format(value, fmt)


def spread(value: Spread | None) -> str:
    return "-" if value is None else f"{value.median:.2f}x ({value.low:.2f}-{value.high:.2f})"


def _output(row: MethodRow) -> str:
    if row.agreement_with_float32 is not None:
        return f"{row.agreement_with_float32:.0%} = float32 plain"
    return {True: "same", False: "**DIFFERS**", None: "sampled"}[row.identical_to_plain]


def _latency(row: MethodRow) -> str:
    if row.per_token_latency is None:
        return "-"
    return " / ".join(f"{row.per_token_latency[p] * 1e3:.2f}" for p in LATENCY_POINTS)


def grid(header: list[str], rows: list[list[str]]) -> str:
    """A Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def markdown_table(table: Table) -> str:
    """The headline table (categories together), ranked, and the speedup of every category; with
    several rows per item, the per-token latency."""
    batched = any(row.per_token_latency is not None for row in table.rows)
    header = ["rank", "method", "tokens/step", "drafted/step", "acceptance", "per SSM", "draft/verify/other"]
    header += ["tokens/s", *(["ms/token first / last / mean"] if batched else [])]
    header += ["vs plain", "vs best plain", "vs HF assisted", "output"]
    cells = []
    for row in sorted(table.rows, key=lambda r: (r.rank is None, r.rank or 0)):
        per_ssm = " ".join(f"{i}:{a:.2f}" for i, a in (row.acceptance_rate_per_ssm or {}).items()) or "-"
        split = "/".join(f"{row.time_split[p]:.0%}" for p in PHASES) if row.time_split else "-"
        cells.append(
            [
                number(row.rank, "d"),
                f"`{row.method}`",
                f"{row.tokens_per_step:.2f}",
                number(row.draft_tokens_per_step, ".1f"),
                number(row.acceptance_rate),
                per_ssm,
                split,
                f"{row.tokens_per_second.median:.1f}",
                *([_latency(row)] if batched else []),
                spread(row.speedup_vs_plain),
                spread(row.speedup_vs_best_plain),
                spread(row.speedup_vs_hf_assisted),
                _output(row),
            ]
        )
    lines = [grid(header, cells)]
    lines += [
        f"\n`{row.method}`: its scheduler's decisions took {row.decision_share:.1%} of its wall time."
        for row in table.rows
        if row.decision_share is not None
    ]
    if table.compiled_warmup:
        lines.append(
            "\nCompiled methods: untimed warm-up on every prompt (graph compilation included), seconds: "
            + ", ".join(f"`{name}` {s:.0f}" for name, s in table.compiled_warmup.items())
            + f"; graphs compiled during timed runs: {table.timed_compilations}."
        )
    categories = list(table.per_category)
    by_category = []
    for row in table.rows:
        speedups = [
            next(r for r in table.per_category[c] if r.method == row.method).speedup_vs_plain
            for c in categories
        ]
        by_category.append([f"`{row.method}`", *(number(s.median if s else None) for s in speedups)])
    lines += ["", "Speedup vs plain per category (median over repeats):", ""]
    return "\n".join([*lines, grid(["method", *categories], by_category)])


def update_readme(readme: Path, body: str, source: str) -> None:
    """Replace what stands between the README's two `README_MARKERS` with `body`, after a line
    naming its `source`."""
    text = readme.read_text()
    begin, end = README_MARKERS
    if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
        raise ValueError(f"{readme} needs the lines {begin} and {end}, once each, to put the results between")
    head, rest = text.split(begin)
    tail = rest.split(end)[1]
    readme.write_text(f"{head}{begin}\n{source}\n\n{body}{end}{tail}")


def draft_cost_line(table: Table, ssm_seconds: dict[str, list[float]]) -> str:
    """Per single-SSM chain row: its time per drafted token against a plain static-cache decoding
    step of that SSM alone (eager rows against eager, compiled against compiled)."""
    parts = []
    for row in table.rows:
        if row.method.startswith("chain[") and row.draft_ms_per_token is not None:
            index = int(row.method[len("chain[") : row.method.index("]")])
            plain_ms = ssm_seconds["compiled" if row.method.endswith("compiled") else "static"][index] * 1e3
            parts.append(
                f"`{row.method}` {row.draft_ms_per_token:.2f} ms = {row.draft_ms_per_token / plain_ms:.2f}x "
                f"SSM {index}'s {plain_ms:.2f} ms"
            )
    lead = "Drafting cost per drafted token vs one plain static-cache step of the same SSM"
    return f"{lead} (eager vs eager, compiled vs compiled): " + "; ".join(parts) + "."


def level_cost_line(table: Table) -> str | None:
    """Per pool row: its drafting time per tree level against the best single-SSM chain's (eager
    against eager, compiled against compiled), and its tokens per step against its drafted tokens:
    what each extra SSM costs and buys (None without both kinds of rows)."""
    singles = [row for row in table.rows if row.method.startswith("chain[") and row.draft_ms_per_level]
    parts = []
    for row in table.rows:
        if row.method.startswith(("chain[", "stairs[")) or not row.draft_ms_per_level or row.rank is None:
            continue
        compiled = row.method.endswith("compiled")
        peers = [s for s in singles if s.method.endswith("compiled") == compiled and s.rank is not None]
        if not peers:
            continue
        best = min(peers, key=lambda s: s.rank)
        parts.append(
            f"`{row.method}` {row.draft_ms_per_level:.2f} ms/level = "
            f"{row.draft_ms_per_level / best.draft_ms_per_level:.2f}x `{best.method}`'s, "
            f"{row.tokens_per_step:.2f} tokens/step for {row.draft_tokens_per_step:.1f} drafted "
            f"({best.tokens_per_step:.2f} for {best.draft_tokens_per_step:.1f})"
        )
    if not parts:
        return None
    return "Drafting per tree level vs the fastest single-SSM chain: " + "; ".join(parts) + "."


def tv_line(measured: dict[str, Any]) -> str:
    """Each SSM's measured TV to the LLM in a sampled cell group (`suite.measured_tv`)."""
    pools = "; ".join(
        f"{name}: " + ", ".join(f"SSM {j} {tv:.3f}" for j, tv in enumerate(values))
        for name, values in measured["tv"].items()
    )
    return (
        "Measured TV(p, q_j) of each SSM to the LLM at this decoding (p and q processed as `generate` "
        f"samples: temperature, top-k, top-p), mean over the {measured['positions']} positions of plain "
        f"decoding's outputs here, teacher-forced (1 - TV: one sampled draft token's acceptance): {pools}."
    )


def fixture_line(build: dict[str, Any] | None) -> str:
    if build is None:
        return "no fixture: the models were given"
    first_build = sum(step["seconds"] for step in build["steps"]) / 60
    if all(step["cached"] for step in build["steps"]):
        return f"fixture cached (its first build took {first_build:.1f} min)"
    return (
        f"fixture built before the suite: {build['seconds'] / 60:.1f} min (all steps: {first_build:.1f} min)"
    )


def markdown_report(report: Report, level: int = 1) -> str:
    """The report: machine first, then one table per decoding and batch size, then what was skipped."""
    c, h, params, models = report.config, "#" * level, report.models["parameters"], report.models
    all_tables = report.tables()

    def pool(info: dict[str, Any]) -> str:
        ssms = ", ".join(f"{p / 1e6:.2f}M" for p in info["parameters"]["ssms"])
        return f"pool `{info['pool']}` ({len(info['parameters']['ssms'])} SSMs: {ssms})"

    pools = pool(models)
    if "sampled" in models:
        pools = f"greedy rows on the {pools}, sampled rows on the {pool(models['sampled'])}"
    if c.prompts is not None:
        workloads = f"Workload: `{c.prompts}`, {c.prompts_per_category or 'all'} prompts"
    else:
        source = "held-out" if c.spec_bench is None else f"Spec-Bench (`{c.spec_bench}`)"
        categories = ", ".join(all_tables[0].per_category)
        workloads = f"Workloads: {categories}; {c.prompts_per_category} {source} prompts per category"
    lines = [
        f"{h} specboost benchmark suite",
        "",
        f"**Machine:** {machine_line(report.machine)}.",
        "",
        f"{'Models given' if report.fixture is None else f'Fixture `{c.fixture}`'}: "
        f"LLM `{models['llm']}` ({params['llm'] / 1e6:.1f}M parameters), {pools}. {workloads}, "
        f"{c.max_new_tokens} new tokens; {c.repeats} repeats after {c.warmup} warm-up, methods interleaved. "
        f"Suite wall time {report.seconds / 60:.1f} min; {fixture_line(report.fixture)}.",
        *(f"\n**Warning:** {note}." for note in models.get("notes", [])),
        "",
        "tokens/step = new tokens / LLM passes (the LLM's own token included: plain = 1.00); drafted/step = "
        "tree size; acceptance = accepted / drafted tokens; draft/verify/other = shares of the decoder's "
        "time; speedup = tokens/s over plain's (or the fastest HF assisted's) in the same repeat: median "
        "(min-max) over repeats ([ALGORITHMS.md](docs/ALGORITHMS.md) section 13); ms/token (batch > 1, BASS) "
        "= a row's latency / its new tokens, of the first and the last row to finish and the batch mean: "
        "median over repeats (plain batched generation returns every row after the whole call). Greedy "
        "outputs must equal plain decoding's: a method that differs is flagged and not ranked.",
    ]
    for table in all_tables:
        lines += ["", f"{h}# {table.title}", "", markdown_table(table)]
        if table.batch_size == 1 and "ssm_token_seconds" in report.results:
            lines += ["", draft_cost_line(table, report.results["ssm_token_seconds"])]
        levels = level_cost_line(table) if table.batch_size == 1 else None
        if levels:
            lines += ["", levels]
        if table.title in report.results.get("ssm_tv", {}):
            lines += ["", tv_line(report.results["ssm_tv"][table.title])]
    if notes := not_run(report.skipped):
        lines += ["", f"{h}# Not run", "", *notes]
    return "\n".join(lines) + "\n"


def fill_readme(readme: Path, report: Report, out: Path) -> None:
    """The report, without its title, between the README's results markers."""
    source = (
        f"Generated by `specboost bench --suite` from `{out}/report.md` (plots and suite.json beside it)."
    )
    update_readme(readme, markdown_report(report, level=2).split("\n", 2)[2], source)
