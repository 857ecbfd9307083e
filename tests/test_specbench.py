"""The harness's workloads (decoder/bench/workloads.py): the Spec-Bench question-file
loader, the bundled held-out categories and left-padded batches."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from specboost.decoder.bench.workloads import (
    CATEGORIES,
    Prompt,
    bundled_workloads,
    encode_batches,
    load_spec_bench,
)
from specboost.decoder.tiny_models import build_tiny_models
from specboost.speculator.prompt_sets import BUNDLED_PROMPTS_DIR, bundled_source, load_prompt_splits


def write_jsonl(path: Path, records: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def question(qid: int, category: str, *turns: str) -> dict:
    return {"question_id": qid, "category": category, "turns": list(turns)}


def test_a_spec_bench_file_loads_one_workload_per_category_in_file_order(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "question.jsonl",
        [
            question(1, "writing", "Write a poem.", "Now shorter."),
            question(2, "math", "What is 2 + 2?"),
            question(3, "writing", "Write a story."),
        ],
    )
    workloads = load_spec_bench(path)
    assert [w.category for w in workloads] == ["writing", "math"]
    assert workloads[0].prompts == (
        Prompt("Write a poem.", str(path), 1),  # the first turn
        Prompt("Write a story.", str(path), 3),
    )
    assert workloads[1].prompts == (Prompt("What is 2 + 2?", str(path), 2),)


def test_the_bundled_vicuna_questions_are_a_spec_bench_file() -> None:
    workloads = load_spec_bench(BUNDLED_PROMPTS_DIR / "vicuna_bench.jsonl")
    assert {w.category: len(w.prompts) for w in workloads} == {
        "generic": 10,
        "knowledge": 10,
        "roleplay": 10,
        "common-sense": 10,
        "fermi": 10,
        "counterfactual": 10,
        "coding": 7,
        "math": 3,
        "writing": 10,
    }


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"question_id": 1, "turns": ["Hi"]}, r"question\.jsonl:2: missing field\(s\) category"),
        ({"category": "x"}, r"question\.jsonl:2: missing field\(s\) question_id, turns"),
        (question(1, "", "Hi"), r'question\.jsonl:2: "category" must be a non-empty string'),
        ({"question_id": 1, "category": "x", "turns": "Hi"}, r'"turns" must be a non-empty list of strings'),
        (question(1, "x"), r'"turns" must be a non-empty list of strings'),
        (["not", "an", "object"], r"question\.jsonl:2: not a JSON object"),
    ],
)
def test_an_invalid_question_is_refused_with_its_line(tmp_path: Path, record: object, message: str) -> None:
    path = write_jsonl(tmp_path / "question.jsonl", [question(0, "ok", "Fine."), record])
    with pytest.raises(ValueError, match=message):
        load_spec_bench(path)


def test_broken_json_an_empty_file_and_a_missing_file_are_refused(tmp_path: Path) -> None:
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"question_id": 1,\n')
    with pytest.raises(ValueError, match=r"broken\.jsonl:1: not a JSON object"):
        load_spec_bench(broken)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="holds no questions"):
        load_spec_bench(empty)
    with pytest.raises(FileNotFoundError, match="no Spec-Bench question file"):
        load_spec_bench(tmp_path / "missing.jsonl")


def test_bundled_workloads_take_held_out_prompts_of_each_category() -> None:
    workloads = bundled_workloads(["stories", "math"], per_category=4)
    assert [w.category for w in workloads] == ["stories", "math"]
    stories = workloads[0].prompts
    assert len(stories) == 4
    assert [p.source for p in stories] == ["tinystories_openings", "gutenberg_openings"] * 2  # in turn
    for prompt in (p for w in workloads for p in w.prompts):
        assert prompt.source in CATEGORIES["stories"] + CATEGORIES["math"]
        held_out = load_prompt_splits(bundled_source(prompt.source))["held_out"]
        assert prompt.id in held_out["id"]  # never distilled, never boosted on
    with pytest.raises(ValueError, match="unknown categories"):
        bundled_workloads(["poetry"], 1)


def test_batches_are_left_padded_and_prompts_cut_to_their_end(tmp_path: Path) -> None:
    llm_path, _ = build_tiny_models(tmp_path)
    tok = AutoTokenizer.from_pretrained(llm_path)
    prompts = [Prompt(text, "test", i) for i, text in enumerate(["Hi", "Once upon a time there", "a b c"])]
    (batch,) = encode_batches(prompts, tok, batch_size=2, max_prompt_tokens=64)  # the third is left over
    lengths = batch.attention_mask.sum(dim=1).tolist()
    assert batch.input_ids.shape == (2, max(lengths)) and lengths[0] < lengths[1]
    assert batch.attention_mask[0, : lengths[1] - lengths[0]].sum() == 0  # padding on the left
    singles = encode_batches(prompts, tok, batch_size=1, max_prompt_tokens=3)
    assert [b.input_ids.shape[1] for b in singles] == [
        min(3, n) for n in (*lengths, len(tok("a b c").input_ids))
    ]
    with pytest.raises(ValueError, match="a batch of 8 needs at least 8 prompts"):
        encode_batches(prompts, tok, batch_size=8, max_prompt_tokens=64)
