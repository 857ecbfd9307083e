"""Reference LLM training end to end on a micro model and a made-up corpus: save, load, record, resume."""

from __future__ import annotations

import dataclasses
import gzip
import json
import random
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from specboost.training.reference_llm import (
    PRESETS,
    RECORD,
    SPECIAL_TOKENS,
    ReferenceLLMConfig,
    count_parameters,
    main,
    train_reference_llm,
)

MICRO = ReferenceLLMConfig(
    vocab_size=320,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    block_size=32,
    batch_size=4,
    learning_rate=1e-2,
    warmup_steps=1,
    max_steps=2,
    eval_steps=2,
    eval_blocks=4,
    save_steps=2,
    logging_steps=1,
    max_new_tokens=8,
)
WORDS = ["the", "cat", "dog", "girl", "boy", "saw", "a", "big", "red", "ball", "ran", "to", "play"]


def write_corpus(root: Path, train_docs: int = 60, valid_docs: int = 10) -> Path:
    """Two sources, as in data/corpus: gzipped JSONL in one folder, plain JSONL in another."""
    rng = random.Random(0)

    def story() -> dict[str, str]:
        sentences = [" ".join(rng.choices(WORDS, k=8)).capitalize() + "." for _ in range(4)]
        return {"source": "test", "title": "", "text": " ".join(sentences)}

    (root / "a").mkdir(parents=True)
    (root / "b").mkdir()
    with gzip.open(root / "a" / "train.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(story()) + "\n" for _ in range(train_docs))
    (root / "a" / "valid.jsonl.gz").write_bytes(
        gzip.compress("".join(json.dumps(story()) + "\n" for _ in range(valid_docs)).encode())
    )
    (root / "b" / "train.jsonl").write_text("".join(json.dumps(story()) + "\n" for _ in range(train_docs)))
    return root


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def trained(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """A 2-step run, shared by the tests that only read its outputs."""
    out = tmp_path_factory.mktemp("run")
    return out, train_reference_llm(MICRO, out, corpus, seed=0, preset="micro")


def test_saved_model_and_tokenizer_load_and_generate(trained: tuple[Path, dict]) -> None:
    out, record = trained
    model = AutoModelForCausalLM.from_pretrained(out / "model")
    tokenizer = AutoTokenizer.from_pretrained(out / "model")
    assert model.config.model_type == "llama"
    assert [tokenizer.pad_token, tokenizer.bos_token, tokenizer.eos_token, tokenizer.unk_token] == list(
        SPECIAL_TOKENS
    )
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    ids = tokenizer("The cat saw a ball.")["input_ids"]
    assert ids[0] == tokenizer.bos_token_id  # prompts start like training documents
    assert tokenizer.decode(ids, skip_special_tokens=True) == "The cat saw a ball."  # byte-level: lossless
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert model.generation_config.max_new_tokens == MICRO.max_new_tokens
    assert model.config.vocab_size == len(tokenizer) == record["tokenizer"]["vocab_size"]
    generated = model.generate(**tokenizer("The cat", return_tensors="pt"), max_new_tokens=4, do_sample=False)
    assert generated.shape[1] <= len(ids) + 4


def test_training_record_fields(trained: tuple[Path, dict], corpus: Path) -> None:
    out, record = trained
    on_disk = json.loads((out / "model" / RECORD).read_text())
    assert on_disk == record
    for field in (
        "config", "seed", "data", "steps", "tokens_seen", "final_validation_loss",
        "final_validation_perplexity", "wall_time_s", "versions", "eval_history", "sample",
    ):  # fmt: skip
        assert field in record, field
    assert record["config"] == dataclasses.asdict(MICRO)
    assert record["steps"] == 2 and record["tokens_seen"] == 2 * MICRO.tokens_per_step
    assert record["resumed_from_step"] is None
    files = record["data"]["files"]
    assert [f["path"] for f in files["train"]] == ["a/train.jsonl.gz", "b/train.jsonl"]
    assert [f["path"] for f in files["validation"]] == ["a/valid.jsonl.gz"]
    assert all(len(f["sha256"]) == 64 for f in files["train"] + files["validation"])
    assert 0 < record["final_validation_loss"] < 10
    assert {"torch", "transformers"} <= set(record["versions"])


def test_two_step_run_matches_stored_loss(trained: tuple[Path, dict]) -> None:
    """Seeded end to end (tokenizer, packing, init, data order): a change here changes training."""
    _, record = trained
    assert record["tokenizer"]["vocab_size"] == 320
    assert record["final_validation_loss"] == pytest.approx(5.4159, abs=0.02)


def test_rerun_with_the_same_config_is_skipped(trained: tuple[Path, dict], corpus: Path, capsys) -> None:
    out, record = trained
    again = train_reference_llm(MICRO, out, corpus, seed=0, preset="micro")
    assert again == record
    assert "already trained" in capsys.readouterr().out


def test_more_steps_resume_from_the_last_checkpoint(corpus: Path, tmp_path: Path) -> None:
    first = train_reference_llm(MICRO, tmp_path, corpus, seed=0)
    assert first["steps"] == 2 and (tmp_path / "checkpoints" / "checkpoint-2").is_dir()
    longer = dataclasses.replace(MICRO, max_steps=4)
    second = train_reference_llm(longer, tmp_path, corpus, seed=0)
    assert second["resumed_from_step"] == 2
    assert second["steps"] == 4 and second["tokens_seen"] == 4 * MICRO.tokens_per_step
    state = json.loads((tmp_path / "checkpoints" / "checkpoint-4" / "trainer_state.json").read_text())
    logged_steps = [e["step"] for e in state["log_history"] if "loss" in e]
    assert logged_steps == [1, 2, 3, 4]  # steps 1-2 come from the first run: continued, not restarted


def test_another_seed_does_not_reuse_checkpoints(corpus: Path, tmp_path: Path) -> None:
    train_reference_llm(MICRO, tmp_path, corpus, seed=0)
    with pytest.raises(ValueError, match="another config, seed or corpus"):
        train_reference_llm(dataclasses.replace(MICRO, max_steps=4), tmp_path, corpus, seed=1)


def test_missing_corpus(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        train_reference_llm(MICRO, tmp_path / "out", tmp_path / "nowhere")


def test_corpus_without_files(tmp_path: Path) -> None:
    (tmp_path / "corpus").mkdir()
    with pytest.raises(ValueError, match=r"no train\.jsonl"):
        train_reference_llm(MICRO, tmp_path / "out", tmp_path / "corpus")


def test_empty_corpus(tmp_path: Path) -> None:
    root = tmp_path / "corpus"
    root.mkdir()
    (root / "train.jsonl").write_text(json.dumps({"text": ""}) + "\n")
    (root / "valid.jsonl").write_text(json.dumps({"text": "  "}) + "\n")
    with pytest.raises(ValueError, match="holds no text"):
        train_reference_llm(MICRO, tmp_path / "out", root)


def test_zero_byte_corpus_file(tmp_path: Path) -> None:
    root = tmp_path / "corpus"
    root.mkdir()
    (root / "train.jsonl.gz").write_bytes(gzip.compress(b""))
    (root / "valid.jsonl").write_text(json.dumps({"text": "Some text."}) + "\n")
    with pytest.raises(ValueError, match="is empty"):
        train_reference_llm(MICRO, tmp_path / "out", root)


def test_corpus_that_is_not_json_lines(tmp_path: Path) -> None:
    root = tmp_path / "corpus"
    root.mkdir()
    (root / "train.jsonl").write_text("Once upon a time.\n")
    (root / "valid.jsonl").write_text("The end.\n")
    with pytest.raises(ValueError, match="not JSON Lines"):
        train_reference_llm(MICRO, tmp_path / "out", root)


def test_corpus_smaller_than_a_block(tmp_path: Path) -> None:
    root = write_corpus(tmp_path / "corpus", train_docs=20, valid_docs=1)
    with pytest.raises(ValueError, match="fewer than 512 tokens"):
        train_reference_llm(dataclasses.replace(MICRO, block_size=512), tmp_path / "out", root)


def test_cli_reports_errors(tmp_path: Path, capsys) -> None:
    assert main(["--out", str(tmp_path / "out"), "--corpus", str(tmp_path / "nowhere")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_presets_are_sized_as_documented() -> None:
    tiny, small = (count_parameters(PRESETS[name]) for name in ("tiny", "small"))
    assert 2e6 <= tiny <= 4e6
    assert 15e6 <= small <= 25e6  # SSMs of ~1/10 of this keep the 10x ratio


@pytest.mark.parametrize(
    "change", [{"hidden_size": 30}, {"num_kv_heads": 3}, {"vocab_size": 200}, {"max_steps": 0}]
)
def test_invalid_configs(change: dict) -> None:
    with pytest.raises(ValueError):
        dataclasses.replace(MICRO, **change)
