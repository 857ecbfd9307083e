"""compare_pool: distilled vs raw-corpus SSM and boosted pool vs one SSM, on a tiny fake boost run."""

from __future__ import annotations

import json
from pathlib import Path

from test_boost import VOCAB, WORDS, save_llama, save_tokenizer, write_distilled
from transformers import AutoTokenizer

from specboost.training.boost import boost
from specboost.training.boost_config import BoostConfig
from specboost.training.compare_pool import RESULT_FILE, compare, main


def fake_boost_run(tmp_path: Path) -> tuple[Path, Path]:
    """A 2-SSM boost run (3 steps each) on a random tiny LLM's tokenizer, and a tiny raw corpus."""
    llm = tmp_path / "llm"
    save_llama(llm, VOCAB)
    save_tokenizer(llm, WORDS)
    rows = [([1, 4 + i % 7, 5 + i % 5], [6 + (i + k) % 20 for k in range(6)]) for i in range(12)]
    distilled = write_distilled(tmp_path / "distilled", rows)
    config = BoostConfig(
        distilled=distilled,
        llm=str(llm),
        num_ssms=2,
        max_steps=3,
        batch_size=4,
        warmup_steps=0,
        save_steps=3,
        held_out_fraction=0.25,
    )
    pool = tmp_path / "pool"
    boost(config, pool)
    corpus = tmp_path / "corpus" / "words"
    corpus.mkdir(parents=True)
    for split, docs in (("train", 60), ("valid", 2)):
        lines = [
            json.dumps({"text": " ".join(WORDS[(d + k) % len(WORDS)] for k in range(20))})
            for d in range(docs)
        ]
        (corpus / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    AutoTokenizer.from_pretrained(llm)  # the tokenizer loads (sanity)
    return pool, corpus.parent


def check(result: dict, per_ssm: int, ssms: int) -> None:
    a, b = result["distilled_vs_raw"], result["pool_vs_single"]
    assert a["raw"]["steps"] == a["distilled"]["steps"] == a["steps"] == per_ssm
    assert b["single"]["steps"] == b["total_steps"] == per_ssm * ssms
    assert b["pool"]["ssms"] == len(b["pool"]["members"]) == ssms
    values = [
        a["distilled"]["held_out_acceptance"],
        a["raw"]["held_out_acceptance"],
        a["distilled"]["single_coverage"],
        a["raw"]["single_coverage"],
        b["pool"]["pool_coverage"],
        b["single"]["single_coverage"],
        b["single"]["held_out_acceptance"],
        *(m["single_coverage"] for m in b["pool"]["members"]),
    ]
    assert all(0.0 <= v <= 1.0 for v in values)
    assert b["pool"]["pool_coverage"] >= max(m["single_coverage"] for m in b["pool"]["members"])
    assert (
        abs(a["acceptance_gain"] - (a["distilled"]["held_out_acceptance"] - a["raw"]["held_out_acceptance"]))
        < 1e-9
    )
    assert abs(b["coverage_gain"] - (b["pool"]["pool_coverage"] - b["single"]["single_coverage"])) < 1e-9


def test_compare_pool_reuses_ssm0_and_writes_json(tmp_path: Path) -> None:
    pool, corpus = fake_boost_run(tmp_path)
    out = tmp_path / "compare"
    result = compare(pool, out, corpus=corpus)
    assert result["distilled_vs_raw"]["distilled"]["source"] == "pool"
    check(result, per_ssm=3, ssms=2)
    assert json.loads((out / RESULT_FILE).read_text()) == json.loads(json.dumps(result))
    assert not list(out.glob(f".{RESULT_FILE}.tmp-*"))


def test_compare_pool_cli_with_other_steps(tmp_path: Path, capsys) -> None:
    pool, corpus = fake_boost_run(tmp_path)
    out = tmp_path / "compare"
    assert main(["--boost", str(pool), "--out", str(out), "--steps", "2", "--corpus", str(corpus)]) == 0
    result = json.loads((out / RESULT_FILE).read_text())
    assert result["distilled_vs_raw"]["distilled"]["source"] == "trained"
    check(result, per_ssm=2, ssms=2)
    printed = capsys.readouterr().out
    assert "boosted pool" in printed and "raw-corpus" in printed


def test_compare_pool_rejects_missing_run(tmp_path: Path) -> None:
    assert main(["--boost", str(tmp_path / "nothing")]) == 2
