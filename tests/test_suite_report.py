"""The harness's report computations (decoder/bench/summary.py, report.py, suite.py) on synthetic run records:
the bonus-token convention of ALGORITHMS.md section 13, medians and spread over repeats,
speedups, the identical-output check and per-position acceptance."""

from __future__ import annotations

import itertools
import json
import re
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import BatchEncoding

from specboost.decoder.bench import protocol as protocol_module
from specboost.decoder.bench.diversity import summarise_matches, walks_at
from specboost.decoder.bench.markdown import (
    HEADLINE_MARKERS,
    RESULTS_MARKERS,
    actions_line,
    chains_by_category,
    fill_readme,
    gate_line,
    headline_markdown,
    markdown_report,
    markdown_table,
    results_page,
    speculative,
)
from specboost.decoder.bench.methods import batch_choices
from specboost.decoder.bench.protocol import GREEDY, Plan, Protocol, Report, measure, run_cells
from specboost.decoder.bench.records import (
    Cell,
    CellRun,
    Method,
    MethodResult,
    MethodSet,
    RunRecord,
    TableRun,
    row_stats,
)
from specboost.decoder.bench.suite import SuiteConfig
from specboost.decoder.bench.summary import (
    Spread,
    accepted_at_least,
    action_shares,
    best_fixed,
    gate_report,
    median_per_token_latency,
    summarise,
    tables,
)
from specboost.speculator.hindsight_walk import walk_positions


def stats(match_lengths: list[int], drafted_per_step: int, ssm: int = 0, times=(0.2, 0.6, 0.2)) -> dict:
    """DecodeStats.to_dict()-like: one SSM drafting `drafted_per_step` tokens every step."""
    steps = len(match_lengths)
    draft, verify, other = times
    return {
        "match_lengths": match_lengths,
        "proposed_per_ssm": {ssm: drafted_per_step * steps},
        "accepted_per_ssm": {ssm: sum(match_lengths)},
        "time_draft": draft,
        "time_verify": verify,
        "time_other": other,
        "strategy": {},
    }


def ours(
    method: str, repeat: int, seconds: float, match_lengths: list[int], identical: bool = True
) -> RunRecord:
    """A speculative run: every step emits its accepted drafts plus the LLM's own (bonus) token."""
    return RunRecord(
        method=method,
        item=0,
        repeat=repeat,
        new_tokens=sum(m + 1 for m in match_lengths),
        llm_steps=len(match_lengths),
        seconds=seconds,
        identical=identical,
        draft_tokens=4 * len(match_lengths),
        accepted_tokens=sum(match_lengths),
        stats=stats(match_lengths, 4),
    )


def hf(
    method: str, repeat: int, seconds: float, tokens: int, steps: int, identical: bool = True
) -> RunRecord:
    return RunRecord(method, 0, repeat, tokens, steps, seconds, identical)


MATCHES = [3, 1, 0, 4]  # 8 + 4 bonus = 12 new tokens in 4 LLM passes
METHODS = {"plain": "llm.generate", "hf_assisted[0]": "HF 0", "hf_assisted[1]": "HF 1", "chain[0]": "ours"}


def records(chain_identical: bool = True) -> list[RunRecord]:
    """Three repeats: plain takes 1.2 s, 1.0 s, 1.1 s for 12 tokens; chain[0] 0.4 s, 0.45 s, 0.5 s."""
    out = []
    for repeat, (plain, hf0, hf1, chain) in enumerate(
        [(1.2, 0.8, 0.6, 0.4), (1.0, 0.9, 0.5, 0.45), (1.1, 1.0, 0.55, 0.5)]
    ):
        out += [
            hf("plain", repeat, plain, 12, 12),
            hf("hf_assisted[0]", repeat, hf0, 12, 5),
            hf("hf_assisted[1]", repeat, hf1, 12, 4),
            ours("chain[0]", repeat, chain, MATCHES, chain_identical),
        ]
    return out


def rows_by_name(rows):
    return {row.method: row for row in rows}


def test_tokens_per_step_counts_the_bonus_token() -> None:
    rows = rows_by_name(summarise(records(), METHODS, greedy=True))
    assert rows["plain"].tokens_per_step == 1.0  # one token per LLM forward pass
    assert rows["chain[0]"].tokens_per_step == pytest.approx(12 / 4)  # 8 accepted drafts + 4 LLM tokens
    assert rows["hf_assisted[1]"].tokens_per_step == 3.0
    assert rows["chain[0]"].draft_tokens_per_step == 4.0
    assert rows["chain[0]"].acceptance_rate == pytest.approx(8 / 16)
    assert rows["chain[0]"].acceptance_rate_per_ssm == {0: pytest.approx(0.5)}
    assert rows["plain"].acceptance_rate is None and rows["plain"].accepted_at_least is None


def test_medians_and_spread_are_over_repeats_paired_side_by_side() -> None:
    rows = rows_by_name(summarise(records(), METHODS, greedy=True))
    assert rows["plain"].tokens_per_second == Spread(12 / 1.1, 12 / 1.2, 12 / 1.0)
    # Speedup per repeat = plain's time / chain's time in that same repeat: 3.0, 2.22, 2.2.
    speedup = rows["chain[0]"].speedup_vs_plain
    assert (speedup.median, speedup.low, speedup.high) == pytest.approx((1.0 / 0.45, 2.2, 3.0))
    assert rows["plain"].speedup_vs_plain == Spread(1.0, 1.0, 1.0)


def test_speedup_vs_hf_assisted_is_against_the_fastest_one() -> None:
    rows = rows_by_name(summarise(records(), METHODS, greedy=True))
    # hf_assisted[1] is the faster (median 0.55 s): chain vs it per repeat = 1.5, 1.11, 1.1.
    vs_hf = rows["chain[0]"].speedup_vs_hf_assisted
    assert (vs_hf.median, vs_hf.low, vs_hf.high) == pytest.approx((0.5 / 0.45, 1.1, 1.5))
    assert rows["hf_assisted[1]"].speedup_vs_hf_assisted == Spread(1.0, 1.0, 1.0)


def test_a_method_whose_greedy_output_differs_is_flagged_and_not_ranked() -> None:
    rows = summarise(records(chain_identical=False), METHODS, greedy=True)
    by_name = rows_by_name(rows)
    chain = by_name["chain[0]"]
    assert chain.identical_to_plain is False
    assert chain.rank is None and chain.speedup_vs_plain is None and chain.speedup_vs_hf_assisted is None
    assert chain.tokens_per_step == 3.0  # still reported
    ranked = sorted((r for r in rows if r.rank is not None), key=lambda r: r.rank)
    assert [r.method for r in ranked] == ["hf_assisted[1]", "hf_assisted[0]", "plain"]
    assert [r.rank for r in ranked] == [1, 2, 3]


def test_ranking_orders_by_median_speedup() -> None:
    rows = rows_by_name(summarise(records(), METHODS, greedy=True))
    assert [rows[m].rank for m in ("chain[0]", "hf_assisted[1]", "hf_assisted[0]", "plain")] == [1, 2, 3, 4]


def test_a_differing_hf_assisted_run_is_not_the_reference() -> None:
    rs = [
        r if r.method != "hf_assisted[1]" else hf(r.method, r.repeat, r.seconds, 12, 4, False)
        for r in records()
    ]
    vs_hf = rows_by_name(summarise(rs, METHODS, greedy=True))["chain[0]"].speedup_vs_hf_assisted
    assert vs_hf.median == pytest.approx(2.0)  # against hf_assisted[0] now: 0.8/0.4, 0.9/0.45, 1/0.5


def test_sampled_runs_are_not_compared_token_wise_but_ranked_by_speed() -> None:
    rs = records(chain_identical=False)  # the token check means nothing when sampling
    rows = rows_by_name(summarise(rs, METHODS, greedy=False))
    assert all(row.identical_to_plain is None for row in rows.values())
    assert rows["chain[0]"].rank == 1 and rows["chain[0]"].speedup_vs_plain.median == pytest.approx(1 / 0.45)


def test_acceptance_by_position_is_the_share_of_steps_accepting_at_least_k() -> None:
    r = ours("chain[0]", 0, 1.0, [0, 1, 2, 4])
    assert accepted_at_least([r]) == [0.75, 0.5, 0.25, 0.25]
    assert accepted_at_least([ours("chain[0]", 0, 1.0, [0, 0])]) == []
    assert accepted_at_least([hf("plain", 0, 1.0, 4, 4)]) is None


def test_time_split_sums_the_decoders_phases() -> None:
    split = rows_by_name(summarise(records(), METHODS, greedy=True))["chain[0]"].time_split
    assert split == pytest.approx({"draft": 0.2, "verify": 0.6, "other": 0.2})


def test_the_schedulers_decision_share_is_over_the_methods_wall_time() -> None:
    timed = records()
    for r in timed:
        if r.method == "chain[0]":
            r.stats["strategy"] = {"decision_seconds": r.seconds / 40}
    rows = rows_by_name(summarise(timed, METHODS, greedy=True))
    assert rows["chain[0]"].decision_share == pytest.approx(0.025)
    assert rows["plain"].decision_share is None and rows["hf_assisted[0]"].decision_share is None
    table = tables([CellRun(Cell("stories", "greedy", True, 1), METHODS, timed)])[0]
    assert "`chain[0]`: its scheduler's decisions took 2.5% of its wall time." in markdown_table(table)


def test_every_method_needs_records() -> None:
    with pytest.raises(ValueError, match="no records"):
        summarise([r for r in records() if r.method != "chain[0]"], METHODS, greedy=True)


def cell_runs() -> list[CellRun]:
    greedy = [CellRun(Cell(c, "greedy", True, 1), METHODS, records(c != "math")) for c in ("stories", "math")]
    sampled = CellRun(Cell("stories", "sample(T=0.8, top_p=1)", False, 1), METHODS, records(False))
    return [*greedy, sampled]


def test_tables_group_cells_by_decoding_and_batch_size() -> None:
    greedy, sampled = tables(cell_runs())
    assert greedy.title == "greedy, batch 1" and list(greedy.per_category) == ["stories", "math"]
    assert sampled.title == "sample(T=0.8, top_p=1), batch 1"
    stories = rows_by_name(greedy.per_category["stories"])["chain[0]"]
    assert stories.identical_to_plain is True and stories.rank == 1
    # Over all categories the chain differs (in math): flagged, not ranked.
    assert rows_by_name(greedy.rows)["chain[0]"].rank is None
    text = markdown_table(greedy)
    assert "**DIFFERS**" in text and "| - | `chain[0]` |" in text
    assert "| `chain[0]` | 2.22 | - |" in text  # per category: stories 2.22x, math not ranked


MACHINE = {
    "cpu": "Test CPU",
    "cpu_count": 2,
    "load_average": 3.0,
    "torch_threads": 1,
    "dtype": "float32",
    "device": "cpu",
    "torch": "2.x",
    "transformers": "5.x",
}


def suite_report(tmp_path: Path, runs: list[CellRun]) -> Report:
    models = {"llm": "llm", "pool": "pool", "parameters": {"llm": 2_000_000, "ssms": [300_000]}}
    build = {"name": "tiny", "paths": {"llm": "llm", "export": "pool"}, "steps": [], "seconds": 0.0}
    return Report(SuiteConfig(fixture="tiny"), MACHINE, models, runs, {"x": {"m": "why"}}, fixture=build)


def test_markdown_report_states_the_machine_first(tmp_path: Path) -> None:
    text = markdown_report(suite_report(tmp_path, cell_runs()))
    lines = text.splitlines()
    assert lines[0] == "# specboost benchmark suite"
    assert lines[2].startswith(
        "**Machine:** Test CPU (2 cores, load average 3.0 when the suite started), no GPU; "
        "torch threads 1, float32 on cpu"
    )
    assert "## greedy, batch 1" in text and "## sample(T=0.8, top_p=1), batch 1" in text
    assert "- x: `m`: why" in text


def test_write_report_writes_json_markdown_and_plots(tmp_path: Path) -> None:
    runs = cell_runs()
    for r in runs[0].records:  # a weighted-majority method records its SSM weights
        if r.stats is not None:
            r.stats["strategy"] = {"weights": [[1.0], [1.25]]}
    SuiteConfig(fixture="tiny").write(suite_report(tmp_path, runs), tmp_path / "out")
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert files == [
        "acceptance_by_position.png",
        "report.md",
        "speedup.png",
        "ssm_weights.png",
        "suite.json",
        "tokens_per_step_vs_tree_size.png",
    ]
    data = json.loads((tmp_path / "out" / "suite.json").read_text())
    assert data["machine"]["cpu"] == "Test CPU" and len(data["runs"]) == 3
    assert data["tables"][0]["rows"][0]["method"] == "plain"


RESULTS_BEFORE = "# Results\n\nHow to read them.\n\n<!-- bench-suite: begin -->\n"
RESULTS_AFTER = "<!-- bench-suite: end -->\n\n## Other results\n"
README_BEFORE = "# x\n\n## Results\n\nThe headline.\n\n<!-- bench-headline: begin -->\n"
README_AFTER = "<!-- bench-headline: end -->\n\n## Next\n"


def checkout(tmp_path: Path) -> tuple[Path, Path]:
    """A README and its results page (docs/results.md beside it), each with old numbers between
    its markers."""
    readme, page = tmp_path / "README.md", tmp_path / "docs" / "results.md"
    page.parent.mkdir(parents=True)
    readme.write_text(README_BEFORE + "old headline\n" + README_AFTER)
    page.write_text(RESULTS_BEFORE + "old numbers\n" + RESULTS_AFTER)
    return readme, page


def batch_run(decoding: str, greedy: bool) -> CellRun:
    """Batch 2: plain batched generation against batched decoding."""
    records = batch_records(0, 1.0, (0.2, 0.6)) + batch_records(1, 1.1, (0.3, 0.5))
    return CellRun(Cell("stories", decoding, greedy, 2), BATCH_METHODS, records)


def headline_report(tmp_path: Path) -> Report:
    """Greedy and two sampled decodings at batch 1 (the learned scheduler greedy only), greedy and
    the first sampled decoding at batch 2."""
    learned = {**METHODS, "learned": "the learned scheduler"}

    def runs(decoding: str, greedy: bool, with_learned: bool) -> CellRun:
        rs = records()
        if with_learned:
            rs += [ours("learned", r.repeat, r.seconds * 1.5, MATCHES) for r in rs if r.method == "chain[0]"]
        return CellRun(Cell("stories", decoding, greedy, 1), learned if with_learned else METHODS, rs)

    t08, t1 = "sample(T=0.8, top_p=1)", "sample(T=1, top_p=1)"
    cells = [runs("greedy", True, True), runs(t08, False, False), runs(t1, False, False)]
    cells += [batch_run("greedy", True), batch_run(t08, False)]
    report = suite_report(tmp_path, cells)
    report.skipped = {f"{t08}, batch 1": {"learned": "no predictor"}, f"{t1}, batch 1": {"learned": "idem"}}
    return report


def test_readme_option_puts_the_full_report_on_the_results_page(tmp_path: Path) -> None:
    readme, page = checkout(tmp_path)
    assert results_page(readme) == page
    report = suite_report(tmp_path, cell_runs())
    assert fill_readme(readme, report, Path("artifacts/bench-suite/tiny")) == page
    text = page.read_text()
    assert text.startswith(RESULTS_BEFORE) and text.endswith(RESULTS_AFTER) and "old numbers" not in text
    assert "**Machine:** Test CPU" in text and "### greedy, batch 1" in text and "- x: `m`: why" in text
    assert "`artifacts/bench-suite/tiny/report.md`" in text
    assert "# specboost benchmark suite" not in text  # the report's own title is left out
    assert "([ALGORITHMS.md](ALGORITHMS.md) section 13)" in text  # linked from docs/, beside it
    assert "(docs/ALGORITHMS.md)" in markdown_report(report)  # report.md keeps the checkout's path
    fill_readme(readme, report, Path("artifacts/bench-suite/tiny"))
    assert page.read_text() == text  # idempotent


def test_readme_option_regenerates_the_headline_table_into_the_readme(tmp_path: Path) -> None:
    readme, page = checkout(tmp_path)
    report = headline_report(tmp_path)
    fill_readme(readme, report, Path("artifacts/bench-suite/tiny"))
    text = readme.read_text()
    assert text.startswith(README_BEFORE) and text.endswith(README_AFTER) and "old headline" not in text
    assert "**Machine:** Test CPU" in text and "Fixture `tiny`" in text
    assert "[The full results](docs/results.md)" in text
    table = [line for line in text.splitlines() if line.startswith("| ")]
    assert (
        table[0] == "| decoding, batch | plain `generate` | best plain | best fixed speculative | learned |"
    )
    # Greedy and the first sampled decoding only, batch 1 then batch 2, in the report's order.
    assert [row.split(" | ")[0] for row in table[1:]] == [
        "| greedy, batch 1",
        "| sample(T=0.8, top_p=1), batch 1",
        "| greedy, batch 2",
        "| sample(T=0.8, top_p=1), batch 2",
    ]
    greedy = table[1].split(" | ")
    # plain: 12 tokens in 1.1 s (median); chain[0], the fastest fixed speculative row (HF assisted
    # is not this decoder's), 12 in 0.45 s, per repeat 3.0, 2.22, 2.2x; the learned row takes 1.5x
    # chain[0]'s time: 2.0, 1.48, 1.47x.
    assert greedy[1] == "10.9 tokens/s" and greedy[2] == "`plain` 10.9 tokens/s, 1.00x"
    assert greedy[3] == "`chain[0]` 26.7 tokens/s, 2.22x"
    assert greedy[4] == "17.8 tokens/s, 1.48x |"
    assert table[2].endswith("| not run |")  # skipped, with its reason on the results page
    assert table[3].split(" | ")[3].startswith("`batched` ") and table[3].endswith("| - |")  # no row
    assert "sample(T=1" not in "\n".join(table)  # on the results page only
    assert "sample(T=1, top_p=1), batch 1" in page.read_text()
    assert headline_markdown(report, "docs/results.md") in text  # the README holds what the code makes


def test_readme_option_needs_both_marker_pairs_and_writes_nothing_without_them(tmp_path: Path) -> None:
    report = suite_report(tmp_path, cell_runs())
    readme, page = checkout(tmp_path)
    readme.write_text("# no markers\n")
    with pytest.raises(ValueError, match=re.escape(f"README.md needs the lines {HEADLINE_MARKERS[0]} and")):
        fill_readme(readme, report, Path("out"))
    assert "old numbers" in page.read_text()  # the results page is left as it was
    readme, page = checkout(tmp_path / "again")
    page.write_text(RESULTS_BEFORE + RESULTS_BEFORE + RESULTS_AFTER)  # the begin line twice
    with pytest.raises(ValueError, match=re.escape(f"results.md needs the lines {RESULTS_MARKERS[0]} and")):
        fill_readme(readme, report, Path("out"))
    assert "old headline" in readme.read_text()
    page.write_text(RESULTS_AFTER + RESULTS_BEFORE)  # end before begin
    with pytest.raises(ValueError, match="once each"):
        fill_readme(readme, report, Path("out"))
    page.unlink()
    with pytest.raises(
        FileNotFoundError, match=re.escape("results.md does not exist: --readme writes the full results")
    ):
        fill_readme(readme, report, Path("out"))


def test_the_checkouts_readme_and_results_page_have_their_markers(tmp_path: Path) -> None:
    """The real README carries the headline markers and the headline in the format the code writes
    (its table header and legend); docs/results.md the full results' markers."""
    root = Path(__file__).resolve().parents[1]
    made = headline_markdown(headline_report(tmp_path), "docs/results.md").splitlines()
    header, legend = next(line for line in made if line.startswith("| ")), made[-1]
    assert header in (root / "README.md").read_text() and legend in (root / "README.md").read_text()
    for path, markers in (
        (root / "README.md", HEADLINE_MARKERS),
        (root / "docs" / "results.md", RESULTS_MARKERS),
    ):
        text = path.read_text()
        assert all(text.count(marker) == 1 for marker in markers), path
        assert text.index(markers[0]) < text.index(markers[1])


# Per-token latency at batch > 1 (BASS, ALGORITHMS.md section 11) ---------------------------------
BATCH_METHODS = {"plain": "llm.generate, batch of 2", "batched": "ours, one ragged batch"}


def batch_records(
    repeat: int, plain: float, batched: tuple[float, float], prompt: int = 0
) -> list[RunRecord]:
    """A batch of 2 rows: plain returns both after `plain` s, with 10 and 4 new tokens; batched
    decoding finishes its rows (4 and 10 new tokens) after `batched` s."""
    plain_run = hf("plain", repeat, plain, 20, 20)
    plain_run.item, plain_run.stats = prompt, row_stats([plain, plain], [10, 4])
    ours_run = ours("batched", repeat, max(batched), [3, 3, 3, 3, 1])  # 14 new tokens
    ours_run.item = prompt
    ours_run.stats |= row_stats(batched, [4, 10])
    return [plain_run, ours_run]


def test_per_token_latency_is_first_last_and_mean_per_batch_median_over_repeats() -> None:
    rs = [
        *batch_records(0, 1.0, (0.2, 0.6)),  # plain 0.1, 0.25 s/token; batched 0.05, 0.06
        *batch_records(1, 1.2, (0.3, 0.5)),  # plain 0.12, 0.3; batched 0.075, 0.05
        *batch_records(2, 0.8, (0.4, 0.8)),  # plain 0.08, 0.2; batched 0.1, 0.08
    ]
    rows = rows_by_name(summarise(rs, BATCH_METHODS, greedy=True))
    # Plain's rows finish together: first/last = its lower/higher per-token latency.
    assert rows["plain"].per_token_latency == pytest.approx({"first": 0.1, "last": 0.25, "mean": 0.175})
    # Batched: first = the 4-token row (0.05, 0.075, 0.1), last = the 10-token row (0.06, 0.05, 0.08),
    # mean 0.055, 0.0625, 0.09.
    assert rows["batched"].per_token_latency == pytest.approx({"first": 0.075, "last": 0.06, "mean": 0.0625})
    assert rows["plain"].time_split is None and rows["plain"].acceptance_rate_per_ssm is None
    assert rows["batched"].time_split == pytest.approx({"draft": 0.2, "verify": 0.6, "other": 0.2})
    # Batch 1 keeps no row latencies.
    assert rows_by_name(summarise(records(), METHODS, greedy=True))["chain[0]"].per_token_latency is None


def test_per_token_latency_of_a_repeat_is_the_mean_over_its_batches() -> None:
    rs = batch_records(0, 1.0, (0.2, 0.6)) + batch_records(0, 2.0, (0.8, 2.0), prompt=1)
    # Batched: the first batch 0.05 (first), 0.06 (last) s/token; the second 0.2 and 0.2.
    latency = median_per_token_latency([r for r in rs if r.method == "batched"])
    assert latency == pytest.approx({"first": 0.125, "last": 0.13, "mean": 0.1275})


def test_only_batch_tables_show_the_per_token_latency() -> None:
    batch_cell = CellRun(Cell("stories", "greedy", True, 2), BATCH_METHODS, batch_records(0, 1.0, (0.2, 0.6)))
    single, batch = tables([cell_runs()[0], batch_cell])
    single_header = markdown_table(single).splitlines()[0]
    assert single_header == (
        "| rank | method | tokens/step | drafted/step | acceptance | per SSM | draft/verify/other "
        "| tokens/s | vs plain | vs best plain | vs HF assisted | vs best fixed | output |"
    )
    lines = markdown_table(batch).splitlines()
    assert "| tokens/s | ms/token first / last / mean | vs plain |" in lines[0]
    assert lines[1] == "|" + "---|" * 14
    assert any("`plain`" in line and "| 100.00 / 250.00 / 175.00 |" in line for line in lines)
    assert any("`batched`" in line and "| 50.00 / 60.00 / 55.00 |" in line for line in lines)


def test_speedup_vs_best_plain_is_against_the_fastest_plain_decoding() -> None:
    """`plain_static` and `plain_compiled` (transformers' static cache, eager and compiled) are plain
    decoding too: "vs best plain" divides by the fastest of the three, repeat by repeat."""
    extra = []
    for repeat, (static, compiled) in enumerate([(0.9, 0.8), (0.8, 0.7), (0.85, 0.6)]):
        extra += [hf("plain_static", repeat, static, 12, 12), hf("plain_compiled", repeat, compiled, 12, 12)]
    methods = METHODS | {"plain_static": "static", "plain_compiled": "compiled"}
    rows = rows_by_name(summarise(records() + extra, methods, greedy=True))
    # plain_compiled is the fastest (median 0.7 s): chain vs it per repeat = 2.0, 1.56, 1.2.
    vs_best = rows["chain[0]"].speedup_vs_best_plain
    assert (vs_best.median, vs_best.low, vs_best.high) == pytest.approx((0.7 / 0.45, 0.6 / 0.5, 0.8 / 0.4))
    assert (
        rows["plain"].speedup_vs_best_plain.median < 1
        and rows["plain_compiled"].speedup_vs_best_plain.median == 1
    )
    assert rows["chain[0]"].draft_ms_per_token == pytest.approx(
        1e3 * 0.6 / 48
    )  # 0.2 s x 3 repeats / 48 drafts


def test_low_precision_runs_report_agreement_with_float32_instead_of_failing() -> None:
    """bfloat16: no implementation is exact at near-ties, so greedy rows are not flagged for
    differing from plain; each reports the share of its outputs equal to float32 plain decoding."""
    # Each record is compared with float32 plain decoding's output (identical: equal to it).
    low = [RunRecord(**{**vars(r), "identical": r.repeat != 1}) for r in records()]
    rows = rows_by_name(summarise(low, METHODS, greedy=True, exact=False))
    assert rows["chain[0]"].identical_to_plain is None and rows["chain[0]"].rank is not None
    assert rows["chain[0]"].agreement_with_float32 == pytest.approx(2 / 3)
    table = markdown_table(
        tables([CellRun(Cell("stories", "greedy", True, 1, exact=False), METHODS, low)])[0]
    )
    assert "67% = float32 plain" in table and "DIFFERS" not in table


# vs the best fixed row, and what a learned scheduler chose ----------------------------------------
SCHEDULERS = {"learned": "learned", "learned+compiled": "compiled", "learned+oracle": "oracle", "oracle": "o"}


def with_schedulers(base: list[RunRecord]) -> list[RunRecord]:
    """`base` plus the learned rows and the scheduler evaluation's oracle: `learned` takes 0.3, 0.5,
    0.4 s (median 30 tokens/s, faster than chain[0]'s 26.7), the others 0.1 s; none is fixed."""
    out = list(base)
    for repeat, seconds in enumerate((0.3, 0.5, 0.4)):
        out.append(ours("learned", repeat, seconds, MATCHES))
        out += [ours(name, repeat, 0.1, MATCHES) for name in SCHEDULERS if name != "learned"]
    return out


def test_speedup_vs_best_fixed_is_per_repeat_against_the_fastest_non_learned_row() -> None:
    rows = rows_by_name(summarise(with_schedulers(records()), METHODS | SCHEDULERS, greedy=True))
    # chain[0] (0.4, 0.45, 0.5 s) is the fastest fixed row; learned vs it per repeat: 0.4/0.3,
    # 0.45/0.5, 0.5/0.4 = 1.33, 0.9, 1.25.
    vs_fixed = rows["learned"].speedup_vs_best_fixed
    assert (vs_fixed.median, vs_fixed.low, vs_fixed.high) == pytest.approx((0.5 / 0.4, 0.9, 0.4 / 0.3))
    assert rows["chain[0]"].speedup_vs_best_fixed == Spread(1.0, 1.0, 1.0)
    # plain per repeat: 0.4/1.2, 0.45/1.0, 0.5/1.1.
    assert rows["plain"].speedup_vs_best_fixed.median == pytest.approx(0.45)
    assert rows["learned+oracle"].speedup_vs_best_fixed.median == pytest.approx(4.5)  # 0.45 / 0.1
    assert best_fixed(rows.values()).method == "chain[0]"
    assert not speculative("learned+oracle") and not speculative("oracle")


def test_a_differing_row_is_not_the_best_fixed_one() -> None:
    rows = rows_by_name(summarise(records(chain_identical=False), METHODS, greedy=True))
    assert best_fixed(rows.values()).method == "hf_assisted[1]"
    assert rows["chain[0]"].speedup_vs_best_fixed is None
    # hf_assisted[0] vs hf_assisted[1] per repeat: 0.6/0.8, 0.5/0.9, 0.55/1.0.
    assert rows["hf_assisted[0]"].speedup_vs_best_fixed.median == pytest.approx(0.5 / 0.9)


def test_the_table_names_its_best_fixed_row() -> None:
    runs = [CellRun(Cell("stories", "greedy", True, 1), METHODS | SCHEDULERS, with_schedulers(records()))]
    text = markdown_table(tables(runs)[0])
    assert "| vs HF assisted | vs best fixed | output |" in text.splitlines()[0]
    assert "\nBest fixed row: `chain[0]` (26.7 tokens/s).\n" in text  # 12 tokens / 0.45 s
    learned = next(line for line in text.splitlines() if line.startswith("| ") and "`learned` |" in line)
    assert "| 1.25x (0.90-1.33) | same |" in learned


# Actions per (category, repeat): 61 x "SSM 1 x4", 20 x "SSM 1 x8", 12 x "plain", 7 x "SSM 0 x2".
ACTIONS = {
    "stories": [{"SSM 1 x4": 20, "plain": 4}, {"SSM 1 x4": 10, "SSM 1 x8": 10}, {"SSM 0 x2": 7}],
    "math": [{"SSM 1 x4": 21, "plain": 8}, {"SSM 1 x8": 10}, {"SSM 1 x4": 10}],
}


def learned_runs(actions: dict[str, list[dict[str, int]]] | None) -> list[CellRun]:
    """Two categories with a `learned` row whose strategy reports `actions` per repeat (None: it
    reports none, as before the scheduler counted them)."""
    methods = METHODS | {"learned": "the learned scheduler"}
    runs = []
    for category in ("stories", "math"):
        rs = with_schedulers(records())
        rs = [r for r in rs if r.method in methods]
        for r in rs:
            if r.method == "learned":
                r.stats["strategy"] = {"decision_seconds": 0.0}
                if actions is not None:
                    r.stats["strategy"]["actions"] = actions[category][r.repeat]
        runs.append(CellRun(Cell(category, "greedy", True, 1), methods, rs))
    return runs


def test_action_shares_sum_over_repeats_and_categories_largest_first() -> None:
    row = tables(learned_runs(ACTIONS))[0].row("learned")
    assert row.action_steps == 100
    assert list(row.action_shares.items()) == [
        ("SSM 1 x4", 0.61),
        ("SSM 1 x8", 0.2),
        ("plain", 0.12),
        ("SSM 0 x2", 0.07),
    ]
    text = markdown_table(tables(learned_runs(ACTIONS))[0])
    line = "`learned` chose: SSM 1 x4 61%, SSM 1 x8 20%, plain 12%, SSM 0 x2 7% (of 100 steps)."
    assert f"\n{line}\n" in text
    assert text.count(" chose: ") == 1  # the fixed rows report no actions


def test_action_line_names_the_eight_most_frequent_then_other() -> None:
    counts = {f"SSM 0 x{n}": n for n in range(1, 11)} | {"plain": 10, "never": 0}  # 65 steps
    record = ours("learned", 0, 1.0, MATCHES)
    record.stats["strategy"] = {"actions": counts}
    shares, steps = action_shares([record])
    assert steps == 65 and "never" not in shares
    assert list(shares)[:3] == ["SSM 0 x10", "plain", "SSM 0 x9"]  # ties by name
    row = rows_by_name(summarise([*records(), record], METHODS | {"learned": "l"}, greedy=True))["learned"]
    assert actions_line(row) == (
        "`learned` chose: SSM 0 x10 15%, plain 15%, SSM 0 x9 14%, SSM 0 x8 12%, SSM 0 x7 11%, "
        "SSM 0 x6 9%, SSM 0 x5 8%, SSM 0 x4 6%, other 9% (of 65 steps)."
    )


def test_a_report_without_actions_renders_and_its_json_keeps_the_new_fields(tmp_path: Path) -> None:
    old = learned_runs(None)
    learned = tables(old)[0].row("learned")
    assert learned.action_shares is None and learned.action_steps == 0
    assert " chose: " not in markdown_report(suite_report(tmp_path, old))
    assert action_shares([]) == (None, 0)
    runs = learned_runs(ACTIONS)
    SuiteConfig(fixture="tiny").write(suite_report(tmp_path, runs), tmp_path / "out")
    data = json.loads((tmp_path / "out" / "suite.json").read_text())
    row = {r["method"]: r for r in data["tables"][0]["rows"]}["learned"]
    assert row["action_shares"] == {"SSM 1 x4": 0.61, "SSM 1 x8": 0.2, "plain": 0.12, "SSM 0 x2": 0.07}
    assert row["action_steps"] == 100 and set(row["speedup_vs_best_fixed"]) == {"median", "low", "high"}
    last = [r for r in data["runs"][0]["records"] if r["method"] == "learned"][-1]
    assert last["stats"]["strategy"]["actions"] == {"SSM 0 x2": 7}  # stories, repeat 2
    assert " chose: SSM 1 x4 61%" in (tmp_path / "out" / "report.md").read_text()


def gate_state(steps_on: int, steps_off: int, owed: float) -> dict:
    """A speculation gate's report (`SpeculationGate.report`) after `steps_on + steps_off` steps."""
    return {
        "steps_on": steps_on,
        "steps_off": steps_off,
        "tokens_per_second_on": 900.0,
        "tokens_per_second_off": 1000.0,
        "trials_on": 3,
        "trials_on_won": 1,
        "trials_off": 2,
        "trials_off_won": 2,
        "seconds_lost": 0.0125,
        "context_trials": 1,
        "context": 1.5,
        "lost_context": 1.4,
        "on": False,
        "seconds_owed": owed,
        "lost_in_a_row": 2,
    }


def test_the_gate_line_reads_the_report_after_the_last_call(tmp_path: Path) -> None:
    """A gate counts over every call of its decoder, so the table's line reads the report with the
    most steps, whichever record comes last in the file; rows without a gate get no line."""
    runs = learned_runs(ACTIONS)
    learned = [r for run in runs for r in run.records if r.method == "learned"]
    for k, record in enumerate(learned):  # the last call's report sits in the middle of the list
        record.stats["strategy"]["gate"] = gate_state(10 * k, 40, 0.5) if k != 2 else gate_state(70, 50, 0.25)
    row = tables(runs)[0].row("learned")
    assert row.gate["steps_on"] == 70 and gate_report([]) is None
    assert gate_line(row) == (
        "`learned`'s speculation gate (warm-up calls included): on for 58% of 120 steps; trials of "
        "speculation 3 (1 won, 1 started by a call's context), of plain decoding 2 (2 won); the lost "
        "ones cost 0.013 s. After the last call: off, 0.250 s owed before the next trial (2 lost in a row)."
    )
    text = markdown_table(tables(runs)[0])
    assert text.count("speculation gate") == 1 and f"\n{gate_line(row)}\n" in text
    row.gate |= {"shadow_checks": 5, "shadow_checks_passed": 2}  # a greedy gate's, since 2026-12-07
    assert "of plain decoding 2 (2 won); shadow checks 5 (2 passed); the lost ones" in gate_line(row)
    for record in learned:  # reports from before the trial counts (an older checkpoint): no line
        record.stats["strategy"]["gate"] = {"steps_on": 70, "steps_off": 50, "seconds_lost": 0.0}
    assert tables(runs)[0].row("learned").gate is None
    assert "speculation gate" not in markdown_table(tables(runs)[0])


def test_a_batch_s_rows_report_their_group_s_latest_gate() -> None:
    """The rows of a batch share their group's gate, and each row's record takes its report as the
    row finishes: the batch's record keeps the latest (most steps), beside the actions counted per
    row; rows of an ungated scheduler report none."""
    rows = [
        {
            "strategy": "learned",
            "actions": {"off": 30},
            "decision_seconds": 0.1,
            "gate": gate_state(0, 30, 0.5),
        },
        {
            "strategy": "learned",
            "actions": {"off": 40},
            "decision_seconds": 0.2,
            "gate": gate_state(0, 40, 0.4),
        },
    ]
    merged = batch_choices(rows)
    assert merged["gate"]["steps_off"] == 40 and merged["actions"] == {"off": 70}
    assert "gate" not in batch_choices([{k: v for k, v in row.items() if k != "gate"} for row in rows])
    assert batch_choices([{"strategy": "chain"}]) == {}


def test_the_hindsight_walk_and_the_match_matrix_on_known_matches(tmp_path: Path) -> None:
    """SSM 0 matches 2 tokens at the start of a 6-token output, SSM 1 in its middle: alone, each
    takes 4 steps; the member of longest match at every step takes 2 (3 + 3 tokens)."""
    stories = np.array([[2, 0, 0, 0, 0, 0], [0, 0, 0, 2, 1, 0]])
    math = np.array([[1, 0], [0, 0]])  # SSM 0: one step of 2 tokens; SSM 1: 2 steps
    walks = [walk_positions(stories[0]), walk_positions(stories[1]), walk_positions(stories.max(axis=0))]
    assert [len(w) for w in walks] == [4, 4, 2]
    diversity = summarise_matches({"stories": [stories], "math": [math], "qa": []}, chain_length=2)
    assert diversity.positions == {"stories": 6, "math": 2, "all": 8}  # qa: no output, left out
    assert diversity.prompts == {"stories": 1, "math": 1, "all": 2}
    assert diversity.mean_match["stories"] == pytest.approx([2 / 6, 3 / 6])
    assert diversity.mean_match["all"] == pytest.approx([3 / 8, 3 / 8])
    alone = {"stories": [1.5, 1.5], "math": [2.0, 1.0], "all": [8 / 5, 8 / 6]}
    assert {column: pytest.approx(v) for column, v in alone.items()} == diversity.tokens_per_step
    assert diversity.union_tokens_per_step == pytest.approx({"stories": 3.0, "math": 2.0, "all": 8 / 3})
    assert diversity.union_gain == pytest.approx({"stories": 2.0, "math": 1.0, "all": (8 / 3) / (8 / 5)})

    # Uncapped runs (SSM 0's first is 3), and a reference SSM's after the members: at L = 2 the
    # walks above; the reference's chain takes 3 steps on stories and 1 on math: 8 / 4 tokens/step.
    runs = {
        "stories": [np.array([[3, 0, 0, 0, 0, 0], [0, 0, 0, 2, 1, 0], [1, 1, 1, 1, 1, 0]])],
        "math": [np.array([[1, 0], [0, 0], [1, 0]])],
    }
    walks = walks_at(runs, members=2, length=2, reference=True)
    assert walks["best_member"] == 0 and walks["best"] == pytest.approx(8 / 5)
    assert walks["union"] == pytest.approx(8 / 3) and walks["reference"] == pytest.approx(2.0)
    assert walks["gain"] == pytest.approx(diversity.union_gain)
    longer = walks_at(runs, members=2, length=3, reference=False)  # SSM 0 on stories: 0 -> 4 -> 5 -> 6
    assert longer["best"] == pytest.approx(8 / 4) and "reference" not in longer
    diversity = replace(diversity, by_length={2: walks})

    report = suite_report(tmp_path, cell_runs())
    report.results["diversity"] = {"greedy pool": asdict(diversity)}
    SuiteConfig(fixture="tiny").write(report, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "suite.json").read_text())["diversity"] == {
        "greedy pool": json.loads(json.dumps(asdict(diversity)))
    }
    text = (tmp_path / "out" / "report.md").read_text()
    section = text[text.index("## Pool diversity (greedy)") : text.index("## Not run")]
    assert "**greedy pool** (L = 2; 2 outputs, " in section
    for line in (
        "|  | stories (6) | math (2) | all (8) |",
        "| SSM 0 | 0.33 | 0.50 | 0.38 |",
        "| SSM 1 alone | 1.50 | 1.00 | 1.33 |",
        "| union (best member per step) | 3.00 | 2.00 | 2.67 |",
        "| union / best single | 2.00x | 1.00x | 1.67x |",
        "| L | best member | union | union / best | union / best, stories | union / best, math | generalist "
        "| union / generalist |",
        "| 2 | SSM 0 1.60 | 2.67 | 1.67x | 2.00x | 1.00x | 2.00 | 1.33x |",
    ):
        assert f"\n{line}\n" in section
    assert "## Pool diversity" not in markdown_report(suite_report(tmp_path, cell_runs()))  # none measured


def test_per_category_the_fastest_single_chain_stands_beside_learned_and_generalist_rows() -> None:
    """Plain takes 1.2 s per category; the fastest single chain is `chain[0]` on stories and
    `chain[1]+compiled` on math and over both; `learned+compiled` and a `generalist...` row are
    set beside it, with their tokens/s over its."""
    seconds = {  # method -> (stories, math)
        "chain[0]": (0.4, 0.7),
        "chain[1]+compiled": (0.6, 0.4),
        "learned+compiled": (0.5, 0.8),
        "generalist+compiled": (0.3, 0.6),
    }
    methods = {"plain": "llm.generate"} | {name: name for name in seconds}
    runs = [
        CellRun(
            Cell(category, "greedy", True, 1),
            methods,
            [hf("plain", 0, 1.2, 12, 12)] + [ours(name, 0, s[c], MATCHES) for name, s in seconds.items()],
        )
        for c, category in enumerate(("stories", "math"))
    ]
    text = chains_by_category(tables(runs)[0])
    assert text.startswith("Per category, the fastest single-SSM chain")
    assert text.splitlines()[2:] == [
        "| category | fastest single chain | `learned+compiled` | `generalist+compiled` |",
        "|---|---|---|---|",
        "| stories | `chain[0]` 3.00x | 2.40x (0.80x) | 4.00x (1.33x) |",
        "| math | `chain[1]+compiled` 3.00x | 1.50x (0.50x) | 2.00x (0.67x) |",
        "| all | `chain[1]+compiled` 2.40x | 1.85x (0.77x) | 2.67x (1.11x) |",
    ]
    assert chains_by_category(tables([batch_run("greedy", True)])[0]) is None  # no single chain


def test_a_run_where_every_cell_is_skipped_says_why_instead_of_writing_an_empty_report() -> None:
    """Every category short of prompts: the report had no table and crashed on its first line
    (IndexError in `models_line`)."""
    plan = Plan(
        [(GREEDY, 8)], ["stories", "qa"], lambda category, size: f"2 prompts, {size} needed", None, {}
    )
    with pytest.raises(ValueError, match=r"every cell was skipped \(greedy, batch 8: 2 prompts, 8 needed"):
        run_cells(plan, SuiteConfig(), print)


def test_a_suite_of_plain_decoding_alone_is_refused() -> None:
    with pytest.raises(ValueError, match="nothing to compare with plain decoding"):
        SuiteConfig(methods=("plain",))


def test_the_methods_run_in_shuffled_orders_and_are_judged_against_the_first() -> None:
    """Every method runs every item `repeats` times, in an order shuffled for every item and repeat
    (on a CPU a run's first steps pay for its predecessor's footprint: in a fixed order every method
    always followed the same one); records come back in method order, and a run is identical when
    its rows equal the first method's first run's."""
    calls: list[str] = []

    def method(name: str, rows: list[list[int]]) -> Method:
        def run(_) -> MethodResult:
            calls.append(name)
            return MethodResult([list(r) for r in rows], 1, [0.0])

        return Method(name, name, run)

    methods = [
        method("plain", [[1, 2]]),
        method("same", [[1, 2]]),
        method("other", [[3]]),
        method("x", [[1, 2]]),
    ]
    items = [BatchEncoding({"input_ids": torch.zeros(1, 2, dtype=torch.long)})] * 3
    records, _ = measure(methods, items, Protocol(repeats=4, warmup=0), lambda _: None)
    rounds = [tuple(calls[i : i + 4]) for i in range(0, len(calls), 4)]
    assert len(rounds) == 12 and all(sorted(r) == sorted(m.name for m in methods) for r in rounds)
    assert len(set(rounds)) > 1 and len({r[0] for r in rounds}) > 1  # orders, and who comes first, vary
    assert [(r.item, r.repeat, r.method) for r in records] == [
        (i, k, m.name) for i in range(3) for k in range(4) for m in methods
    ]
    assert {r.method for r in records if not r.identical} == {"other"}


def test_a_slow_warm_up_is_logged_with_its_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A method whose warm-up takes a second or more gets a log line with its seconds and the graphs
    it compiled (a compiled table's warm-ups take minutes on a 2-core CPU); a quick one gets none."""
    graphs = [4]
    monkeypatch.setattr(protocol_module, "compiled_graphs", lambda: graphs[0])
    calls = itertools.count()

    def slow(_) -> MethodResult:
        if next(calls) == 0:  # its warm-up: compiles 3 graphs in a second
            graphs[0] += 3
            time.sleep(protocol_module.WARMUP_LOGGED)
        return MethodResult([[1]], 1, [0.0])

    methods = [
        Method("quick", "quick", lambda _: MethodResult([[1]], 1, [0.0])),
        Method("slow", "slow", slow),
    ]
    lines: list[str] = []
    item = BatchEncoding({"input_ids": torch.zeros(1, 2, dtype=torch.long)})
    _, warmups = measure(methods, [item], Protocol(repeats=1, warmup=1), lines.append)
    assert warmups["quick"] < protocol_module.WARMUP_LOGGED <= warmups["slow"]
    assert [line for line in lines if line.startswith("warm-up")] == [
        f"warm-up slow: {warmups['slow']:.0f} s, 3 graphs compiled"
    ]


def test_each_finished_table_is_handed_over_as_the_run_goes() -> None:
    """After each table (a decoding and batch size: all its categories) the cells run so far are
    handed over, so that a run stopped midway keeps its finished tables (report.partial.md)."""
    item = BatchEncoding({"input_ids": torch.zeros(1, 2, dtype=torch.long)})
    methods = [Method(name, name, lambda _: MethodResult([[1]], 1, [0.0])) for name in ("plain", "x")]
    plan = Plan(
        [(GREEDY, 1), (GREEDY, 2)], ["stories", "qa"], lambda *_: [item], lambda *_: MethodSet(methods), {}
    )
    seen: list[list[tuple[str, int]]] = []

    def finished(tables: list[TableRun]) -> None:
        seen.append([(run.cell.category, run.cell.batch_size) for table in tables for run in table.runs])

    run_cells(plan, Protocol(repeats=1, warmup=0), lambda _: None, finished)
    assert seen == [[("stories", 1), ("qa", 1)], [("stories", 1), ("qa", 1), ("stories", 2), ("qa", 2)]]
