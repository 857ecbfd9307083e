"""A benchmark run killed midway resumes from its checkpoint (decoder/bench/checkpoint.py): the
tables it finished are not run again, the report has every table once, and the suite's results
computed after the tables (the pools' diversity, the SSMs' measured TV) equal an uninterrupted
run's; a checkpoint of another run, or one that cannot be read, is ignored with a line saying why.
On a synthetic configuration (no models) and on the suite over the tiny stand-in models."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from transformers import BatchEncoding

from specboost.decoder.bench.markdown import markdown_report
from specboost.decoder.bench.protocol import CHECKPOINT, GREEDY, Log, Plan, Protocol, Report
from specboost.decoder.bench.records import Decoding, Method, MethodResult, MethodSet
from specboost.decoder.bench.suite import SuiteConfig
from specboost.decoder.tiny_models import build_tiny_models

SAMPLED = Decoding(do_sample=True)
SETTINGS = [(GREEDY, 1), (GREEDY, 2), (SAMPLED, 1)]
TITLES = ["greedy, batch 1", "greedy, batch 2", "sample(T=1, top_p=1), batch 1"]


class Synthetic(Protocol):
    """Three tables of two categories of one item, plain and one other method. The tables whose
    methods were built go into `built`; building the one at `kill_at` is killed (KeyboardInterrupt)."""

    built: ClassVar[list[tuple[Decoding, int]]] = []
    kill_at: ClassVar[tuple[Decoding, int] | None] = None

    def plan(self, artifacts: Path, log: Log) -> Plan:
        item = BatchEncoding({"input_ids": torch.zeros(1, 2, dtype=torch.long)})

        def methods(decoding: Decoding, size: int, _: BatchEncoding) -> MethodSet:
            if (decoding, size) == self.kill_at:
                raise KeyboardInterrupt
            self.built.append((decoding, size))
            run = lambda _: MethodResult([[1, 2]], 2, [0.01])  # noqa: E731
            return MethodSet([Method(name, name, run) for name in ("plain", "other")])

        return Plan(SETTINGS, ["stories", "qa"], lambda *_: [item], methods, {"llm": "synthetic"})


@pytest.fixture
def synthetic(monkeypatch: pytest.MonkeyPatch) -> type[Synthetic]:
    monkeypatch.setattr(Synthetic, "built", [])
    monkeypatch.setattr(Synthetic, "kill_at", None)
    return Synthetic


def titles(report: Report) -> list[str]:
    return [table.title for table in report.tables()]


def test_a_killed_run_goes_on_after_its_finished_tables(synthetic: type[Synthetic], tmp_path: Path) -> None:
    """Killed in its second table, the run left the first in the checkpoint; run again, it builds
    and runs the other two only, its partial reports and its report have every table once, and
    its wall time counts the earlier run's."""
    checkpoint, config = tmp_path / CHECKPOINT, synthetic(repeats=1, warmup=0)
    synthetic.kill_at = SETTINGS[1]
    with pytest.raises(KeyboardInterrupt):
        config.run(log=lambda _: None, checkpoint=checkpoint)
    assert synthetic.built == SETTINGS[:1]
    earlier = json.loads(checkpoint.read_text())
    assert [table["batch_size"] for table in earlier["tables"]] == [1]

    synthetic.kill_at, synthetic.built[:] = None, []
    lines: list[str] = []
    partials: list[Report] = []
    report = config.run(log=lines.append, on_table=partials.append, checkpoint=checkpoint)
    assert synthetic.built == SETTINGS[1:]  # the finished table was not run again
    assert (
        f"[bench] resuming: 1 of 3 tables finished by an earlier run ({checkpoint}); delete it to start over"
        in lines
    )
    assert [titles(partial) for partial in partials] == [TITLES[:2], TITLES]
    assert titles(report) == TITLES and [run.cell.category for run in report.runs] == ["stories", "qa"] * 3
    assert report.seconds >= earlier["seconds"] > 0

    synthetic.built[:] = []  # a run on the whole checkpoint runs nothing
    assert titles(config.run(log=lines.append, checkpoint=checkpoint)) == TITLES and not synthetic.built
    assert lines[-1].startswith("[bench] resuming: 3 of 3 tables")


def test_a_checkpoint_of_another_configuration_is_ignored(synthetic: type[Synthetic], tmp_path: Path) -> None:
    checkpoint = tmp_path / CHECKPOINT
    synthetic(repeats=1, warmup=0).run(log=lambda _: None, checkpoint=checkpoint)
    synthetic.built[:] = []
    lines: list[str] = []
    report = synthetic(repeats=2, warmup=0).run(log=lines.append, checkpoint=checkpoint)
    assert synthetic.built == SETTINGS and titles(report) == TITLES
    assert (
        f"[bench] ignoring the checkpoint {checkpoint}: written for a different run "
        "(what differs: configuration); starting over"
    ) in lines
    data = json.loads(checkpoint.read_text())  # overwritten by this run's
    assert len(data["tables"]) == 3
    assert {record["repeat"] for record in data["tables"][0]["runs"][0]["records"]} == {0, 1}


def _tampered(text: str) -> str:
    """The checkpoint with a field its records do not have in its second table."""
    data = json.loads(text)
    data["tables"][1]["runs"][0]["records"][0]["unknown"] = 1
    return json.dumps(data)


@pytest.mark.parametrize(
    ("corrupt", "why"),
    [
        (lambda text: text[: len(text) // 2], "unreadable (JSONDecodeError"),
        (_tampered, "unreadable (TypeError"),
        (lambda _: "[]", "unreadable (TypeError"),
    ],
    ids=["cut", "tampered", "not-an-object"],
)
def test_a_checkpoint_that_cannot_be_read_is_ignored(
    synthetic: type[Synthetic], tmp_path: Path, corrupt: Any, why: str
) -> None:
    """Nothing of it is used (its first, readable table included): every table runs once."""
    checkpoint, config = tmp_path / CHECKPOINT, synthetic(repeats=1, warmup=0)
    config.run(log=lambda _: None, checkpoint=checkpoint)
    checkpoint.write_text(corrupt(checkpoint.read_text()))
    synthetic.built[:] = []
    lines: list[str] = []
    report = config.run(log=lines.append, checkpoint=checkpoint)
    assert synthetic.built == SETTINGS and titles(report) == TITLES
    ignored = [line for line in lines if line.startswith(f"[bench] ignoring the checkpoint {checkpoint}: ")]
    assert len(ignored) == 1 and why in ignored[0] and ignored[0].endswith("; starting over")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path]]:
    return build_tiny_models(tmp_path_factory.mktemp("tiny"))


def test_the_suite_resumed_computes_its_results_on_every_table(
    tiny: tuple[Path, list[Path]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed while building its third table, the suite resumed runs that table alone, and its
    results, computed on plain decoding's outputs of every table (the greedy table's restored
    from the checkpoint: the pool's diversity; a sampled table's restored and one run again: the
    SSMs' TV), equal an uninterrupted run's; the restored tables are the earlier run's."""
    llm, ssms = tiny
    config = SuiteConfig(
        llm=str(llm),
        ssms=tuple(map(str, ssms)),
        categories=("qa",),
        prompts_per_category=1,
        decodings=(GREEDY, SAMPLED, Decoding(do_sample=True, temperature=0.8)),
        batch_sizes=(1,),
        methods=("chain",),
        max_new_tokens=8,
        repeats=1,
        warmup=0,
        compiled=False,
    )
    whole = config.run(log=lambda _: None)
    assert set(whole.results["ssm_tv"]) == {
        "sample(T=1, top_p=1), batch 1",
        "sample(T=0.8, top_p=1), batch 1",
    }
    assert whole.results["diversity"]["pool"]["prompts"]["all"] == 1

    built, killed = [], []
    method_set = SuiteConfig.method_set

    def counted(self: SuiteConfig, models: Any, decoding: Decoding, *args: Any) -> MethodSet:
        if decoding.temperature == 0.8 and not killed:  # the first run is killed at its third table
            killed.append(decoding)
            raise KeyboardInterrupt
        built.append(decoding.name)
        return method_set(self, models, decoding, *args)

    monkeypatch.setattr(SuiteConfig, "method_set", counted)
    checkpoint, partials = tmp_path / CHECKPOINT, []
    with pytest.raises(KeyboardInterrupt):
        config.run(log=lambda _: None, on_table=partials.append, checkpoint=checkpoint)
    built.clear()
    resumed = config.run(log=lambda _: None, checkpoint=checkpoint)
    assert built == ["sample(T=0.8, top_p=1)"]  # the finished tables were not run again
    assert [table.title for table in resumed.tables()] == [table.title for table in whole.tables()]
    assert [asdict(t) for t in resumed.tables()[:2]] == [asdict(t) for t in partials[-1].tables()]
    assert resumed.results == whole.results
    text = markdown_report(resumed)
    assert all(text.count(f"## {table.title}\n") == 1 for table in whole.tables())
