"""The harness's Markdown: the table of a cell group's summary rows (ranked, with the speedup per
category), the suite's report (also the single-file bench's; with each pool's diversity), and
what `specboost bench --suite ... --readme README.md` writes: the whole report into the results
page beside the README (`results_page`: `<the README's folder>/docs/results.md`) and the headline
table into the README."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from specboost.decoder.bench.diversity import ALL
from specboost.decoder.bench.protocol import Report
from specboost.decoder.bench.records import GREEDY
from specboost.decoder.bench.summary import (
    BEST_PLAIN,
    HF_ASSISTED,
    LATENCY_POINTS,
    LEARNED,
    LOOP_PLAIN,
    PHASES,
    MethodRow,
    Spread,
    Table,
    best_fixed,
    fixed,
)

# `--readme README.md`: the report (without its title) goes between RESULTS_MARKERS on the results
# page, `RESULTS_PAGE` relative to the README's folder; the headline table between HEADLINE_MARKERS
# in the README. Each pair must stand in its file once, begin before end: nothing else is touched.
RESULTS_MARKERS = ("<!-- bench-suite: begin -->", "<!-- bench-suite: end -->")
HEADLINE_MARKERS = ("<!-- bench-headline: begin -->", "<!-- bench-headline: end -->")
RESULTS_PAGE = Path("docs/results.md")
ALGORITHMS_PAGE = Path("docs/ALGORITHMS.md")  # the metrics' definitions (section 13), linked
LEARNED_ROWS = (LEARNED, f"{LEARNED}+compiled")  # eager and compiled: the faster is the headline's
MOST_ACTIONS = 8  # a scheduler's actions named in its line; the rest are summed as "other"
SINGLE_CHAIN = re.compile(r"chain\[\d+\](\+compiled)?")  # one SSM's chain, eager or compiled
# Rows set beside the fastest single chain per category (`chains_by_category`): the learned
# scheduler's compiled row, and any row whose name starts with GENERALIST (a generalist SSM's chain).
GENERALIST = "generalist"
LEARNED_COMPILED = LEARNED_ROWS[1]
DIVERSITY_TEXT = (
    "Each SSM's argmax chain of length L, teacher-forced along plain greedy decoding's outputs of this "
    "run (one forward pass per SSM over prompt + output, untimed, after the tables; "
    "`agreement_runs` in speculator/oracle_router.py, as the `learned+oracle` row): at each output "
    "position, the match is the number of consecutive drafted tokens equal to the output's next "
    "tokens, at most L and at most the tokens left. Mean match: its mean over a category's positions. "
    "Hindsight walk: along each output, a step emits 1 + the match at its position (the matched drafts "
    "and the LLM's own token) and moves that far on; tokens/step = new tokens / steps, with one SSM "
    "alone (greedy chain decoding with it) or with the member of longest match at every step (the "
    "union, chosen in hindsight: also the fewest steps). union / best single: the union's tokens/step "
    "over the best single member's in that column (decoder/bench/diversity.py)."
)

LENGTHS_TEXT = (
    "The same walks with chains of each length L the learned scheduler routes (its predictor's "
    "depths from the fixed shape's up), over every output: a chain of L emits at most L + 1 tokens, "
    "so at a short L members that match most of their drafts cannot differ by much."
)


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
    several rows per item, the per-token latency. Under it the fastest fixed row (the reference of
    "vs best fixed") and, per scheduler that reports its actions, what it chose how often and what
    its speculation gate did."""
    batched = any(row.per_token_latency is not None for row in table.rows)
    header = ["rank", "method", "tokens/step", "drafted/step", "acceptance", "per SSM", "draft/verify/other"]
    header += ["tokens/s", *(["ms/token first / last / mean"] if batched else [])]
    header += ["vs plain", "vs best plain", "vs HF assisted", "vs best fixed", "output"]
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
                spread(row.speedup_vs_best_fixed),
                _output(row),
            ]
        )
    lines = [grid(header, cells)]
    if best := best_fixed(table.rows):
        lines.append(f"\nBest fixed row: `{best.method}` ({best.tokens_per_second.median:.1f} tokens/s).")
    lines += [
        f"\n`{row.method}`: its scheduler's decisions took {row.decision_share:.1%} of its wall time."
        for row in table.rows
        if row.decision_share is not None
    ]
    lines += [f"\n{actions_line(row)}" for row in table.rows if row.action_shares is not None]
    lines += [f"\n{gate_line(row)}" for row in table.rows if row.gate is not None]
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


def chains_by_category(table: Table) -> str | None:
    """Per category and over all, the fastest single-SSM chain row beside `learned+compiled` and
    every GENERALIST row (what the pool's scheduler and a generalist SSM make of the member that
    serves each category best), read from the table's timed rows: speedup vs plain and, beside
    the chain, the row's median tokens/s over the chain's. None without a single-chain row
    (batch > 1)."""
    if not any(SINGLE_CHAIN.fullmatch(row.method) for row in table.rows):
        return None
    beside = [
        row.method
        for row in table.rows
        if row.method == LEARNED_COMPILED or row.method.startswith(GENERALIST)
    ]
    cells = []
    for category, rows in {**table.per_category, ALL: table.rows}.items():
        ranked = [row for row in rows if SINGLE_CHAIN.fullmatch(row.method) and row.speedup_vs_plain]
        chain = max(ranked, key=lambda row: row.speedup_vs_plain.median, default=None)
        by_name = {row.method: row for row in rows}
        cells.append(
            [
                category,
                "-" if chain is None else f"`{chain.method}` {chain.speedup_vs_plain.median:.2f}x",
                *(_beside(by_name[name], chain) for name in beside),
            ]
        )
    lead = (
        "Per category, the fastest single-SSM chain (`chain[i]`, eager or compiled), beside "
        f"`{LEARNED_COMPILED}` and any row named `{GENERALIST}...` where they ran: speedup vs plain "
        "(median over repeats); in brackets, the row's median tokens/s over that chain's."
    )
    header = ["category", "fastest single chain", *(f"`{name}`" for name in beside)]
    return f"{lead}\n\n{grid(header, cells)}"


def _beside(row: MethodRow, chain: MethodRow | None) -> str:
    if row.speedup_vs_plain is None:
        return "output differs"
    ratio = (
        "" if chain is None else f" ({row.tokens_per_second.median / chain.tokens_per_second.median:.2f}x)"
    )
    return f"{row.speedup_vs_plain.median:.2f}x{ratio}"


def diversity_markdown(diversity: dict[str, dict[str, Any]]) -> list[str]:
    """Per pool (`diversity.Diversity` as suite.json keeps it), the member x category matrix of
    mean matches and the hindsight walk's tokens/step, each SSM alone and the union."""
    lines = [DIVERSITY_TEXT]
    for name, pool in diversity.items():
        columns, members = list(pool["positions"]), range(len(pool["mean_match"][ALL]))
        header = ["", *(f"{column} ({pool['positions'][column]})" for column in columns)]
        matrix = [[f"SSM {i}", *(f"{pool['mean_match'][c][i]:.2f}" for c in columns)] for i in members]
        walk = [
            [f"SSM {i} alone", *(f"{pool['tokens_per_step'][c][i]:.2f}" for c in columns)] for i in members
        ]
        walk += [
            ["union (best member per step)", *(f"{pool['union_tokens_per_step'][c]:.2f}" for c in columns)],
            ["union / best single", *(f"{pool['union_gain'][c]:.2f}x" for c in columns)],
        ]
        lines += [
            "",
            f"**{name}** (L = {pool['chain_length']}; {pool['prompts'][ALL]} outputs, output positions in "
            "brackets): mean match per SSM and category",
            "",
            grid(header, matrix),
            "",
            "Hindsight walk, tokens/step:",
            "",
            grid(header, walk),
        ]
        if pool.get("by_length"):
            lines += ["", LENGTHS_TEXT, "", length_grid(pool["by_length"], [c for c in columns if c != ALL])]
    return lines


def length_grid(by_length: dict, categories: list[str]) -> str:
    """The hindsight walks at each chain length (`diversity.walks_at`, keyed by L): the best single
    member and the union over every output, union / best per category, and the reference (the
    generalist) where measured."""
    reference = all("reference" in walks for walks in by_length.values())
    header = ["L", "best member", "union", "union / best", *(f"union / best, {c}" for c in categories)]
    header += ["generalist", "union / generalist"] if reference else []
    rows = []
    for length, walks in by_length.items():
        row = [str(length), f"SSM {walks['best_member']} {walks['best']:.2f}", f"{walks['union']:.2f}"]
        row += [f"{walks['gain'][c]:.2f}x" for c in (ALL, *categories) if c in walks["gain"]]
        if reference:
            row += [f"{walks['reference']:.2f}", f"{walks['union'] / walks['reference']:.2f}x"]
        rows.append(row)
    return grid(header, rows)


def actions_line(row: MethodRow) -> str:
    """What a scheduler chose how often: its `MOST_ACTIONS` most frequent actions with their share
    of its steps, the rest summed as "other"."""
    shares = list(row.action_shares.items())  # largest first
    parts = [f"{name} {share:.0%}" for name, share in shares[:MOST_ACTIONS]]
    if rest := shares[MOST_ACTIONS:]:
        parts.append(f"other {sum(share for _, share in rest):.0%}")
    return f"`{row.method}` chose: {', '.join(parts)} (of {row.action_steps} steps)."


def gate_line(row: MethodRow) -> str:
    """What a scheduler's speculation gate did over the table (ALGORITHMS.md 5.4): its steps on,
    its trials of each regime and those won, what the lost ones cost, its shadow checks and those
    passed (where the report has them: a greedy gate's, since 2026-12-07), and, after the last
    call, its regime and the seconds of it owed before the next trial (what keeps a regime that
    lost off)."""
    gate = row.gate
    steps = gate["steps_on"] + gate["steps_off"]
    on = gate["steps_on"] / steps if steps else 0.0
    regime = "speculating" if gate["on"] else "off"
    checks = gate.get("shadow_checks")
    checked = f"; shadow checks {checks} ({gate['shadow_checks_passed']} passed)" if checks else ""
    return (
        f"`{row.method}`'s speculation gate (warm-up calls included): on for {on:.0%} of {steps} steps; "
        f"trials of speculation {gate['trials_on']} ({gate['trials_on_won']} won, "
        f"{gate['context_trials']} started by a call's context), of plain decoding {gate['trials_off']} "
        f"({gate['trials_off_won']} won){checked}; the lost ones cost {gate['seconds_lost']:.3f} s. "
        f"After the last call: {regime}, {gate['seconds_owed']:.3f} s owed before the next trial "
        f"({gate['lost_in_a_row']} lost in a row)."
    )


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


def models_line(report: Report) -> str:
    """The models (fixture or given), the workloads and the timing protocol, in one sentence."""
    c, params, models = report.config, report.models["parameters"], report.models

    def pool(info: dict[str, Any]) -> str:
        ssms = ", ".join(f"{p / 1e6:.2f}M" for p in info["parameters"]["ssms"])
        return f"pool `{info['pool']}` ({len(info['parameters']['ssms'])} SSMs: {ssms})"

    pools = pool(models)
    if "sampled" in models:
        pools = f"greedy rows on the {pools}, sampled rows on the {pool(models['sampled'])}"
    if "generalist" in models:  # a pool of one SSM
        generalist = models["generalist"]
        pools += f", generalist `{generalist['pool']}` ({generalist['parameters']['ssms'][0] / 1e6:.2f}M)"
    if c.prompts is not None:
        workloads = f"Workload: `{c.prompts}`, {c.prompts_per_category or 'all'} prompts"
    else:
        source = "held-out" if c.spec_bench is None else f"Spec-Bench (`{c.spec_bench}`)"
        categories = ", ".join(report.tables()[0].per_category)
        workloads = f"Workloads: {categories}; {c.prompts_per_category} {source} prompts per category"
    return (
        f"{'Models given' if report.fixture is None else f'Fixture `{c.fixture}`'}: "
        f"LLM `{models['llm']}` ({params['llm'] / 1e6:.1f}M parameters), {pools}. {workloads}, "
        f"{c.max_new_tokens} new tokens; {c.repeats} repeats after {c.warmup} warm-up, "
        "methods interleaved in shuffled orders."
    )


def markdown_report(report: Report, level: int = 1, algorithms: str = ALGORITHMS_PAGE.as_posix()) -> str:
    """The report: machine first, then one table per decoding and batch size (with the fastest
    single chain per category), then each pool's diversity (`diversity_markdown`), then what was
    skipped.
    `algorithms`: the link to ALGORITHMS.md from where the report is put."""
    h, all_tables = "#" * level, report.tables()
    wall = f"Suite wall time {report.seconds / 60:.1f} min; {fixture_line(report.fixture)}."
    lines = [
        f"{h} specboost benchmark suite",
        "",
        f"**Machine:** {machine_line(report.machine)}.",
        "",
        f"{models_line(report)} {wall}",
        *(f"\n**Warning:** {note}." for note in report.models.get("notes", [])),
        "",
        "tokens/step = new tokens / LLM passes (the LLM's own token included: plain = 1.00); drafted/step = "
        "tree size; acceptance = accepted / drafted tokens; draft/verify/other = shares of the decoder's "
        "time; speedup = tokens/s over plain's (or the best plain decoding's, the fastest HF assisted "
        "generation's, the fastest fixed row's: any but the learned scheduler's) in the same repeat: median "
        f"(min-max) over repeats ([ALGORITHMS.md]({algorithms}) section 13); ms/token (batch > 1, BASS) "
        "= a row's latency / its new tokens, of the first and the last row to finish and the batch mean: "
        "median over repeats (plain batched generation returns every row after the whole call). Greedy "
        "outputs must equal plain decoding's: a method that differs is flagged and not ranked.",
    ]
    for table in all_tables:
        lines += ["", f"{h}# {table.title}", "", markdown_table(table)]
        if chains := chains_by_category(table):
            lines += ["", chains]
        if table.batch_size == 1 and "ssm_token_seconds" in report.results:
            lines += ["", draft_cost_line(table, report.results["ssm_token_seconds"])]
        levels = level_cost_line(table) if table.batch_size == 1 else None
        if levels:
            lines += ["", levels]
        if table.title in report.results.get("ssm_tv", {}):
            lines += ["", tv_line(report.results["ssm_tv"][table.title])]
    if diversity := report.results.get("diversity"):
        lines += ["", f"{h}# Pool diversity (greedy)", "", *diversity_markdown(diversity)]
    if notes := not_run(report.skipped):
        lines += ["", f"{h}# Not run", "", *notes]
    return "\n".join(lines) + "\n"


def headline_tables(tables: list[Table]) -> list[Table]:
    """The tables of the headline: greedy and the report's first sampled decoding, at every batch
    size, in the report's order."""
    sampled = next((t.decoding for t in tables if t.decoding != GREEDY.name), None)
    return [t for t in tables if t.decoding in (GREEDY.name, sampled)]


def fastest(table: Table, keep: Any) -> MethodRow | None:
    """The best ranked row whose method `keep` accepts (None: no such row, or none ranked)."""
    rows = [row for row in table.rows if row.rank is not None and keep(row.method)]
    return min(rows, key=lambda row: row.rank, default=None)


def speculative(method: str) -> bool:
    """A fixed speculative row of this decoder: a fixed row (`summary.fixed`: not the learned
    scheduler's, eager or compiled, nor an oracle's) but not plain decoding (transformers' or our
    loop's) or transformers' assisted generation."""
    return fixed(method) and method not in (*BEST_PLAIN, LOOP_PLAIN) and not method.startswith(HF_ASSISTED)


def _speed(row: MethodRow) -> str:
    return f"{row.tokens_per_second.median:.1f} tokens/s, {row.speedup_vs_plain.median:.2f}x"


def _named(row: MethodRow | None) -> str:
    return "-" if row is None else f"`{row.method}` {_speed(row)}"


def _learned(table: Table, skipped: dict[str, dict[str, str]]) -> str:
    """The faster learned row (`learned` or `learned+compiled`, named when compiled)."""
    best = fastest(table, lambda m: m in LEARNED_ROWS)
    if best is not None:
        return _speed(best) + (" (compiled)" if best.method != LEARNED else "")
    if any(r.method in LEARNED_ROWS for r in table.rows):
        return "output differs (not ranked)"
    return "not run" if set(LEARNED_ROWS) & set(skipped.get(table.title, {})) else "-"


def headline_markdown(report: Report, results_link: str) -> str:
    """The README's headline: per decoding and batch size of `headline_tables`, plain `generate`,
    the best plain decoding, the best fixed speculative row and the learned scheduler, with the
    setting they were measured in; `results_link` leads to the full tables."""
    rows = []
    for table in headline_tables(report.tables()):
        plain = table.row("plain")
        rows.append(
            [
                table.title,
                f"{plain.tokens_per_second.median:.1f} tokens/s",
                _named(fastest(table, lambda m: m in BEST_PLAIN)),
                _named(fastest(table, speculative)),
                _learned(table, report.skipped),
            ]
        )
    header = ["decoding, batch", "plain `generate`", "best plain", "best fixed speculative", "learned"]
    lines = [
        f"**Machine:** {machine_line(report.machine)}.",
        "",
        models_line(report),
        "",
        grid(header, rows),
        "",
        "tokens/s: median over repeats; x: speedup over plain `generate` in the same repeat, median over "
        "repeats. Best plain: the fastest of `plain`, `plain_static` (static cache) and `plain_compiled` "
        "(static cache, compiled). Best fixed speculative: the fastest of this decoder's rows with a fixed "
        "strategy and shape (every row but plain decoding, HF assisted generation and the learned "
        f"scheduler). -: no such row at this batch size. [The full results]({results_link}) have the "
        "spread over repeats, every method, the speedup per category and why a method did not run.",
    ]
    if differing := report.differing():
        names = ", ".join(f"`{name}`" for name in differing)
        lines += ["", f"**Greedy output differs from plain decoding's (not ranked):** {names}."]
    return "\n".join(lines) + "\n"


def results_page(readme: Path) -> Path:
    """Where `--readme README.md` puts the full results: `RESULTS_PAGE` in the README's folder."""
    return readme.parent / RESULTS_PAGE


def link(target: Path, page: Path) -> str:
    """A relative Markdown link from `page` to `target`."""
    return Path(os.path.relpath(target, page.parent)).as_posix()


def between(path: Path, markers: tuple[str, str], source: str, body: str, what: str) -> str:
    """`path`'s text with what stands between its two `markers` replaced by a line naming the
    `source`, then `body`; `what` names the content in the errors."""
    begin, end = markers
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} does not exist: --readme writes {what} there, between the lines {begin} and {end}"
        )
    text = path.read_text()
    if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
        raise ValueError(f"{path} needs the lines {begin} and {end}, once each, to put {what} between")
    head, rest = text.split(begin)
    tail = rest.split(end)[1]
    return f"{head}{begin}\n{source}\n\n{body}{end}{tail}"


def fill_readme(readme: Path, report: Report, out: Path) -> Path:
    """The report, without its title, between the results markers of the results page beside the
    README (`results_page`), and the headline table between the README's headline markers. Both
    files are checked before either is written. Returns the results page."""
    page = results_page(readme)
    source = f"Generated by `specboost bench --suite` from `{out}/report.md`"
    source += " (plots and suite.json beside it)."
    algorithms = link(readme.parent / ALGORITHMS_PAGE, page)
    body = markdown_report(report, level=2, algorithms=algorithms).split("\n", 2)[2]
    results = between(page, RESULTS_MARKERS, source, body, "the full results")
    headline = headline_markdown(report, link(page, readme))
    front = between(readme, HEADLINE_MARKERS, source, headline, "the headline table")
    page.write_text(results)
    readme.write_text(front)
    return page
