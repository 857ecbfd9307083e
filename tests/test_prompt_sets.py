"""Prompt loading (every format, FastChat turns, chat template), held-out split, truncation, errors."""

from __future__ import annotations

import csv
import gzip
import json
import logging
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from specboost.speculator import prompt_sets as data
from specboost.speculator.prompt_sets import (
    BUNDLED_PROMPT_SETS,
    PromptSource,
    bundled_source,
    dedupe_prompts,
    load_prompt_splits,
    load_prompts,
    named_source,
    tokenize_prompts,
    train_heldout_split,
)

PROMPTS = ["Once upon a time", "The cat sat on the mat", "Tell me a story about a dragon"]
SPECIAL = ["<unk>", "<s>", "</s>"]
TEXT = "once upon a time the cat sat on mat tell me story about dragon user assistant :"


@pytest.fixture
def cache(tmp_path: Path) -> str:
    """Keep `datasets`' cache of these tiny files out of the user's cache."""
    return str(tmp_path / "hf_cache")


@pytest.fixture
def tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over TEXT's words that prepends <s>, with a one-line chat template."""
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(SPECIAL + TEXT.split())}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = (
        "{{ bos_token }}{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}assistant :{% endif %}"
    )
    return fast


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def source(path: Path | str, cache: str, **kwargs) -> PromptSource:
    return PromptSource(str(path), cache_dir=cache, **kwargs)


# ---------------------------------------------------------------------------------------------
# Formats


def test_jsonl_prompt_and_answer(tmp_path: Path, cache: str) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", [{"q": p, "a": f"#### {i}"} for i, p in enumerate(PROMPTS)])
    ds = load_prompts(source(path, cache, prompt_field="q", answer_field="a"))
    assert ds.column_names == ["id", "prompt", "answer"]
    assert list(ds["prompt"]) == PROMPTS
    assert list(ds["answer"]) == ["#### 0", "#### 1", "#### 2"]
    assert list(ds["id"]) == [0, 1, 2]


def test_json_array(tmp_path: Path, cache: str) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps([{"prompt": p} for p in PROMPTS]))
    assert list(load_prompts(source(path, cache))["prompt"]) == PROMPTS


def test_parquet(tmp_path: Path, cache: str) -> None:
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": PROMPTS, "n": [1, 2, 3]}), path)
    assert list(load_prompts(source(path, cache))["prompt"]) == PROMPTS


def test_csv(tmp_path: Path, cache: str) -> None:
    path = tmp_path / "p.csv"
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["act", "prompt"])
        writer.writerows([["storyteller", p] for p in PROMPTS])
    assert list(load_prompts(source(path, cache, prompt_field="prompt"))["prompt"]) == PROMPTS


def test_text_one_prompt_a_line(tmp_path: Path, cache: str) -> None:
    path = tmp_path / "p.txt"
    path.write_text(PROMPTS[0] + "\n\n  " + PROMPTS[1] + "  \n" + PROMPTS[2] + "\n")
    assert list(load_prompts(source(path, cache))["prompt"]) == PROMPTS


def test_gzipped_jsonl(tmp_path: Path, cache: str) -> None:
    path = tmp_path / "p.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps({"prompt": p}) + "\n" for p in PROMPTS)
    assert list(load_prompts(source(path, cache))["prompt"]) == PROMPTS


def test_folder_of_shards(tmp_path: Path, cache: str) -> None:
    folder = tmp_path / "shards"
    folder.mkdir()
    write_jsonl(folder / "part-0.jsonl", [{"prompt": p} for p in PROMPTS[:2]])
    write_jsonl(folder / "part-1.jsonl", [{"prompt": PROMPTS[2]}])
    (folder / "LICENSE").write_text("not a prompt file")
    assert sorted(load_prompts(source(folder, cache))["prompt"]) == sorted(PROMPTS)


# ---------------------------------------------------------------------------------------------
# Fields: FastChat turns, dotted paths, templates, chat template


def test_fastchat_turns_give_first_turn(tmp_path: Path, cache: str) -> None:
    records = [{"question_id": i, "category": "x", "turns": [p, "follow-up"]} for i, p in enumerate(PROMPTS)]
    path = write_jsonl(tmp_path / "question.jsonl", records)
    # "turns" is found without naming it, and by name.
    assert list(load_prompts(source(path, cache))["prompt"]) == PROMPTS
    assert list(load_prompts(source(path, cache, prompt_field="turns"))["prompt"]) == PROMPTS


def test_dotted_field_and_template(tmp_path: Path, cache: str) -> None:
    records = [{"instruction": "Continue:", "instances": [{"input": p, "output": ""}]} for p in PROMPTS]
    path = write_jsonl(tmp_path / "tasks.jsonl", records)
    dotted = load_prompts(source(path, cache, prompt_field="instances.0.input"))
    assert list(dotted["prompt"]) == PROMPTS
    templated = load_prompts(source(path, cache, prompt_template="{instruction}\n{instances[0][input]}"))
    assert list(templated["prompt"]) == [f"Continue:\n{p}" for p in PROMPTS]


def test_chat_template(tmp_path: Path, cache: str, tokenizer: PreTrainedTokenizerFast) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in PROMPTS])
    ds = load_prompts(source(path, cache, chat_template=True), tokenizer)
    assert ds.column_names == ["id", "prompt"]
    assert ds[0]["prompt"] == "<s>user : Once upon a time assistant :"
    tokenized = tokenize_prompts(ds, tokenizer, 64, add_special_tokens=False)
    ids = tokenized.dataset[0]["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1


def test_chat_template_needs_a_template(
    tmp_path: Path, cache: str, tokenizer: PreTrainedTokenizerFast
) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in PROMPTS])
    with pytest.raises(ValueError, match="needs a tokenizer"):
        load_prompts(source(path, cache, chat_template=True))
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="no chat_template"):
        load_prompts(source(path, cache, chat_template=True), tokenizer)


def test_empty_prompts_dropped_and_duplicates_removed(tmp_path: Path, cache: str, caplog) -> None:
    records = [{"prompt": p} for p in [PROMPTS[0], "  ", PROMPTS[1], PROMPTS[0], None, PROMPTS[2]]]
    path = write_jsonl(tmp_path / "p.jsonl", records)
    with caplog.at_level(logging.WARNING, logger=data.__name__):
        ds = load_prompts(source(path, cache))
    assert list(ds["prompt"]) == PROMPTS
    assert list(ds["id"]) == [0, 2, 5]  # rows of the source file
    assert "dropped 2 empty prompts of 6" in caplog.text


def test_max_prompts_counts_distinct_prompts(tmp_path: Path, cache: str) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in [PROMPTS[0], PROMPTS[0], *PROMPTS[1:]]])
    assert list(load_prompts(source(path, cache, max_prompts=2))["prompt"]) == PROMPTS[:2]


# ---------------------------------------------------------------------------------------------
# Held-out split


def numbered(n: int) -> Dataset:
    return Dataset.from_dict({"id": list(range(n)), "prompt": [f"prompt {i}" for i in range(n)]})


def test_split_is_deterministic_and_disjoint() -> None:
    ds = numbered(200)
    a = train_heldout_split(ds, 0.1, seed=3)
    b = train_heldout_split(ds, 0.1, seed=3)
    c = train_heldout_split(ds, 0.1, seed=4)
    assert list(a["held_out"]["prompt"]) == list(b["held_out"]["prompt"])
    assert list(a["train"]["prompt"]) == list(b["train"]["prompt"])
    assert set(a["held_out"]["prompt"]) != set(c["held_out"]["prompt"])
    assert len(a["held_out"]) == 20 and len(a["train"]) == 180
    assert not set(a["train"]["prompt"]) & set(a["held_out"]["prompt"])
    assert set(a["train"]["prompt"]) | set(a["held_out"]["prompt"]) == set(ds["prompt"])


def test_split_dedupes_first() -> None:
    ds = Dataset.from_dict({"prompt": ["same", "same", "same", "other", "third", "fourth"]})
    for seed in range(10):
        parts = train_heldout_split(ds, 0.25, seed)
        assert not set(parts["train"]["prompt"]) & set(parts["held_out"]["prompt"])
        assert len(parts["train"]) + len(parts["held_out"]) == 4


def test_load_prompt_splits(tmp_path: Path, cache: str) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"prompt {i}"} for i in range(50)])
    parts = load_prompt_splits(source(path, cache, held_out_fraction=0.2, seed=1))
    assert (len(parts["train"]), len(parts["held_out"])) == (40, 10)


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.1, 1.5])
def test_fraction_out_of_range(fraction: float) -> None:
    with pytest.raises(ValueError, match="strictly between 0 and 1"):
        train_heldout_split(numbered(10), fraction, 0)
    with pytest.raises(ValueError, match="strictly between 0 and 1"):
        PromptSource("p.jsonl", held_out_fraction=fraction)


def test_split_too_small() -> None:
    with pytest.raises(ValueError, match="keep any for training"):
        train_heldout_split(numbered(1), 0.5, 0)


# ---------------------------------------------------------------------------------------------
# Tokenization: prompts longer than the budget


def test_truncation_keeps_the_end_and_counts(tokenizer: PreTrainedTokenizerFast, caplog) -> None:
    ds = Dataset.from_dict({"prompt": ["once upon a time the cat sat on the mat", "tell me a story"]})
    with caplog.at_level(logging.WARNING, logger=data.__name__):
        result = tokenize_prompts(ds, tokenizer, max_prompt_tokens=5)
    assert result.num_truncated == 1 and result.max_prompt_tokens == 5
    assert "1 of 2 prompts were longer than 5 tokens" in caplog.text
    long, short = result.dataset
    assert long["truncated"] and not short["truncated"]
    # <s> kept in front, then the last 4 words.
    assert tokenizer.convert_ids_to_tokens(long["input_ids"]) == ["<s>", "sat", "on", "the", "mat"]
    assert tokenizer.convert_ids_to_tokens(short["input_ids"]) == ["<s>", "tell", "me", "a", "story"]


def test_no_truncation_no_warning(tokenizer: PreTrainedTokenizerFast, caplog) -> None:
    ds = Dataset.from_dict({"prompt": PROMPTS})
    with caplog.at_level(logging.WARNING, logger=data.__name__):
        result = tokenize_prompts(ds, tokenizer, max_prompt_tokens=100)
    assert result.num_truncated == 0 and not caplog.records
    assert all(len(ids) <= 100 for ids in result.dataset["input_ids"])


def test_budget_must_be_positive(tokenizer: PreTrainedTokenizerFast) -> None:
    with pytest.raises(ValueError, match="at least 1"):
        tokenize_prompts(Dataset.from_dict({"prompt": PROMPTS}), tokenizer, max_prompt_tokens=0)


# ---------------------------------------------------------------------------------------------
# Errors a user can cause


def test_missing_file(tmp_path: Path, cache: str) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_prompts(source(tmp_path / "nope.jsonl", cache))


@pytest.mark.parametrize(
    ("name", "content"),
    [("e.jsonl", ""), ("e.txt", "\n  \n"), ("e.csv", "act,prompt\n"), ("e.json", "")],
)
def test_empty_file(tmp_path: Path, cache: str, name: str, content: str) -> None:
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(ValueError, match="is empty"):
        load_prompts(source(path, cache, prompt_field="prompt"))


def test_empty_parquet(tmp_path: Path, cache: str) -> None:
    path = tmp_path / "e.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), path)
    with pytest.raises(ValueError, match="is empty"):
        load_prompts(source(path, cache))


def test_all_prompts_empty(tmp_path: Path, cache: str) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": ""}, {"prompt": "   "}])
    with pytest.raises(ValueError, match="every prompt is empty"):
        load_prompts(source(path, cache))


def test_unknown_prompt_field_lists_columns(tmp_path: Path, cache: str) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", [{"question": p, "answer": "1"} for p in PROMPTS])
    with pytest.raises(ValueError, match=r"prompt field 'prompt_text' not found.*question, answer"):
        load_prompts(source(path, cache, prompt_field="prompt_text"))
    with pytest.raises(ValueError, match=r"answer field 'solution' not found.*question, answer"):
        load_prompts(source(path, cache, answer_field="solution"))


def test_no_default_prompt_field(tmp_path: Path, cache: str) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", [{"body": p} for p in PROMPTS])
    with pytest.raises(ValueError, match="set prompt_field to one of: body"):
        load_prompts(source(path, cache))


def test_bad_dotted_path_and_template(tmp_path: Path, cache: str) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", [{"instances": [{"input": p}]} for p in PROMPTS])
    with pytest.raises(ValueError, match="row 0 has no '3'"):
        load_prompts(source(path, cache, prompt_field="instances.3.input"))
    with pytest.raises(ValueError, match="does not fit row 0"):
        load_prompts(source(path, cache, prompt_template="{instruction}"))


def test_unsupported_extension(tmp_path: Path, cache: str) -> None:
    path = tmp_path / "p.xlsx"
    path.write_text("x")
    with pytest.raises(ValueError, match="unsupported prompt file"):
        load_prompts(source(path, cache))


def test_invalid_config() -> None:
    with pytest.raises(ValueError, match="not both"):
        PromptSource("p.jsonl", prompt_field="a", prompt_template="{a}")
    with pytest.raises(ValueError, match="max_prompts"):
        PromptSource("p.jsonl", max_prompts=0)
    with pytest.raises(ValueError, match="empty"):
        PromptSource("")


def test_unreachable_hub(monkeypatch: pytest.MonkeyPatch, cache: str) -> None:
    """A name that is not a local file goes to the hub; offline, the error says to pass a file."""

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'someone/prompts' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(data.datasets, "load_dataset", offline)
    with pytest.raises(FileNotFoundError, match=r"hub may be unreachable.*pass a local"):
        load_prompts(PromptSource("someone/prompts", cache_dir=cache))


def test_dedupe_prompts_keeps_first() -> None:
    ds = Dataset.from_dict({"id": [0, 1, 2], "prompt": ["a", "b", "a"]})
    assert list(dedupe_prompts(ds)["id"]) == [0, 1]


# ---------------------------------------------------------------------------------------------
# Bundled prompt sets (data/prompts/)


def test_every_bundled_prompt_file_is_registered_with_source_and_licence() -> None:
    folder = data.BUNDLED_PROMPTS_DIR
    names = {p.name for p in folder.iterdir()}
    prompt_files = {n for n in names if n.endswith((".jsonl", ".txt")) and not n.endswith("SOURCE.txt")}
    assert prompt_files == {file for file, _ in BUNDLED_PROMPT_SETS.values()}
    for file in prompt_files:
        # A note and a licence share the file's name or a prefix of it (eagle.* covers eagle_qa.jsonl).
        notes = [n for n in names if n.endswith(".SOURCE.txt") and file.startswith(n.split(".")[0])]
        licences = [n for n in names if "LICENSE" in n and file.startswith(n.split(".")[0])]
        assert notes, f"no SOURCE note for {file}"
        assert licences or file == "gutenberg_openings.txt", f"no licence for {file}"  # public domain


@pytest.mark.parametrize("name", sorted(BUNDLED_PROMPT_SETS))
def test_bundled_prompt_set_loads(name: str, cache: str) -> None:
    parts = load_prompt_splits(bundled_source(name, cache_dir=cache))
    train, held_out = parts["train"], parts["held_out"]
    assert len(train) >= 10 and len(held_out) >= 1
    assert all(p.strip() for p in train["prompt"])
    if "answer_field" in BUNDLED_PROMPT_SETS[name][1]:
        assert all("####" in a for a in train["answer"])


def test_unknown_bundled_set() -> None:
    with pytest.raises(ValueError, match="choose one of"):
        bundled_source("nope")


def test_named_source_refuses_misspelt_bundled_names_but_not_hub_ids() -> None:
    """A bare word close to a bundled set is a typo (refused, naming the set); other bare words are
    hub dataset ids, with or without an organisation (a regression: "squad" had been refused)."""
    assert named_source("gsm8k").path == bundled_source("gsm8k").path
    assert named_source("squad").path == "squad"
    assert named_source("rajpurkar/squad").path == "rajpurkar/squad"
    with pytest.raises(ValueError, match="did you mean 'self_instruct_seed'"):
        named_source("self_instruct_seed_tasks")
