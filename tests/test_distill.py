"""Distillation data: schema, left-padding correctness, resume after a kill, settings, filters, errors,
and two processes under `accelerate launch`."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import subprocess
import time
from collections import Counter
from pathlib import Path

import psutil
import pyarrow.parquet as pq
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from specboost.speculator.model_info import check_model_location
from specboost.speculator.prompt_sets import PromptSource, bundled_source, load_prompt_splits
from specboost.training import distill as distill_module
from specboost.training.distill import (
    DistillConfig,
    default_out_name,
    distill,
    filter_reason,
    final_number,
    load_distilled,
    main,
    repeated_block,
)
from specboost.training.launch import accelerate_launch
from specboost.training.run_shards import read_shards

SPECIAL = ["<pad>", "<s>", "</s>", "<unk>"]
WORDS = [
    *("once", "upon", "a", "time", "the", "cat", "sat", "on", "mat", "tell", "me", "story"),
    *("about", "dragon", "big", "red", "dog", "ran", "far", "away", "home"),
]
PROMPTS = [
    "once upon a time",
    "the cat sat on the mat",
    "tell me a story about a dragon",
    "big red dog",
    "the dog ran far far away from home",
    "a cat",
    "tell me about the big red dragon",
    "once the dog sat",
    "story time",
    "the mat on the cat on the mat",
    "away home",
    "dragon",
]


@pytest.fixture
def llm(tmp_path: Path) -> str:
    """A tiny random Llama and a word-level tokenizer (with <pad>, <s> prepended) saved to a folder."""
    vocab = {w: i for i, w in enumerate(SPECIAL + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    folder = tmp_path / "llm"
    LlamaForCausalLM(config).save_pretrained(folder)
    fast.save_pretrained(folder)
    return str(folder)


@pytest.fixture
def prompts(tmp_path: Path) -> str:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"question": p, "answer": "#### 1"}) + "\n" for p in PROMPTS))
    return str(path)


@pytest.fixture(autouse=True)
def _hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))


def make_config(llm: str, prompts: str, **kwargs) -> DistillConfig:
    settings = {"prompt_field": "question", "max_new_tokens": 6, "batch_size": 4, "shard_size": 3}
    return DistillConfig(llm=llm, prompts=prompts, **{**settings, **kwargs})


def test_schema_and_metadata(llm: str, prompts: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    metadata = distill(make_config(llm, prompts), out)
    rows = load_distilled(out, keep_filtered=True)
    assert {"id", "prompt", "prompt_ids", "output_ids", "finish_reason"} <= set(rows.column_names)
    assert set(rows["finish_reason"]) <= {"eos", "length"}
    assert len(rows) == len(set(rows["id"])) == metadata["counts"]["train_prompts"] == 11
    assert metadata["split"] == "train" and metadata["counts"]["held_out_prompts"] == 1
    assert metadata["generation"]["do_sample"] is False
    assert set(metadata["counts"]["filtered"]) == {"empty", "truncated", "repetition", "wrong_answer"}
    assert json.loads((out / "metadata.json").read_text()) == metadata
    assert len(list((out / "shards").glob("shard-*.parquet"))) == 4  # 11 prompts, 3 a shard
    assert not list(out.rglob(".*.tmp-*"))


def test_greedy_matches_unpadded_generate(llm: str, prompts: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    distill(make_config(llm, prompts, max_new_tokens=8), out)
    model = AutoModelForCausalLM.from_pretrained(llm, dtype=torch.float32).eval()
    rows = load_distilled(out, keep_filtered=True)
    assert len({len(p) for p in rows["prompt_ids"]}) > 1  # batches really are padded
    for prompt_ids, output_ids, reason in zip(
        rows["prompt_ids"], rows["output_ids"], rows["finish_reason"], strict=True
    ):
        expected = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=8, do_sample=False, pad_token_id=0
        )[0, len(prompt_ids) :].tolist()
        if 2 in expected:
            expected = expected[: expected.index(2) + 1]
        assert output_ids == expected
        assert reason == ("eos" if expected[-1] == 2 else "length")


def test_resume_after_kill_loses_and_duplicates_nothing(
    llm: str, prompts: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = make_config(llm, prompts)
    reference = load_distilled(distill(config, tmp_path / "ref") and tmp_path / "ref", keep_filtered=True)

    out = tmp_path / "out"
    kill_at_third_shard(config, out, monkeypatch)
    assert not (out / "data.parquet").exists()

    metadata = distill(dataclasses.replace(config, batch_size=2), out)  # batch size may change
    assert metadata["counts"]["resumed_from"] == 6 and metadata["counts"]["generated_this_run"] == 5
    resumed = load_distilled(out, keep_filtered=True)
    assert resumed["id"] == reference["id"] and len(set(resumed["id"])) == 11
    assert resumed["output_ids"] == reference["output_ids"]
    assert not list(out.rglob(".*.tmp-*"))

    # A rerun of a finished run generates nothing and keeps one row per prompt.
    assert distill(config, out)["counts"]["generated_this_run"] == 0
    assert len(load_distilled(out, keep_filtered=True)) == 11


def kill_at_third_shard(config: DistillConfig, out: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run `config` into `out`, killed while writing its third shard: two complete shards and a
    stray temporary file remain."""
    real_write, written = distill_module.write_shard, []

    def dying_write(folder: Path, rows: list) -> Path:
        if len(written) == 2:
            (folder / "shards" / ".shard-000000099-00003.parquet.tmp-1").write_bytes(b"half a parq")
            raise KeyboardInterrupt
        written.append(real_write(folder, rows))
        return written[-1]

    monkeypatch.setattr(distill_module, "write_shard", dying_write)
    with pytest.raises(KeyboardInterrupt):
        distill(config, out)
    monkeypatch.setattr(distill_module, "write_shard", real_write)


def test_settings_mismatch_is_refused(llm: str, prompts: str, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    distill(make_config(llm, prompts, max_new_tokens=4), out)
    with pytest.raises(ValueError, match=r"other settings.*max_new_tokens"):
        distill(make_config(llm, prompts, max_new_tokens=5), out)
    argv = [
        "--llm",
        llm,
        "--prompts",
        prompts,
        "--prompt-field",
        "question",
        "--out",
        str(out),
        "--do-sample",
    ]
    assert main([*argv, "--max-new-tokens", "4"]) == 2
    assert "other settings" in capsys.readouterr().err


def test_sampling_and_filters_change_without_regenerating(llm: str, prompts: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    config = make_config(
        llm, prompts, answer_field="answer", do_sample=True, temperature=0.8, top_p=0.9, seed=3
    )
    metadata = distill(config, out)
    assert metadata["generation"]["do_sample"] is True and metadata["generation"]["temperature"] == 0.8
    assert metadata["counts"]["filtered"]["truncated"] == 0
    assert set(load_distilled(out, keep_filtered=True)["answer"]) == {"#### 1"}
    strict = distill(dataclasses.replace(config, drop_truncated=True), out)  # filters only: no generation
    assert strict["counts"]["generated_this_run"] == 0
    assert strict["counts"]["filtered"]["truncated"] == strict["counts"]["finish_length"] > 0
    kept = load_distilled(out)
    assert len(kept) == strict["counts"]["kept"] and set(kept["filter"]) <= {""}


def test_repetition_filter() -> None:
    assert repeated_block([5] * 6, max_ngram=4, min_count=6)
    assert not repeated_block([5] * 5, max_ngram=4, min_count=6)
    assert repeated_block([1, 2, 3, 7, 8, 7, 8, 7, 8, 7, 8], max_ngram=4, min_count=4)
    assert not repeated_block([1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3], max_ngram=4, min_count=2)
    assert not repeated_block([5] * 20, max_ngram=4, min_count=0)  # off


def test_answer_check_and_row_filters() -> None:
    assert final_number("Natalia sold 48+24 = 72 clips.\n#### 72") == "72"
    assert final_number("so the answer is 1,250.") == "1250"
    assert final_number("It costs 3.50 dollars") == "3.5"
    assert final_number("no numbers here") is None
    config = DistillConfig(llm="x", prompts="y", repeat_max_ngram=3, repeat_min_count=4, drop_truncated=True)

    def row(output: str, ids: list[int], reason: str = "eos", answer: str = "") -> dict:
        return {"output": output, "output_ids": ids, "finish_reason": reason, "answer": answer}

    assert filter_reason(row("", [2]), config) == "empty"
    assert filter_reason(row("  ", [9, 2]), config) == "empty"
    assert filter_reason(row("a b c", [4, 5, 6], "length"), config) == "truncated"
    assert filter_reason(row("la la la la", [7, 7, 7, 7, 2]), config) == "repetition"
    assert filter_reason(row("so 3 + 4 = 7", [4, 5, 2], answer="... #### 7"), config) == ""
    assert filter_reason(row("so 3 + 4 = 8", [4, 5, 2], answer="... #### 7"), config) == "wrong_answer"
    assert filter_reason(row("text", [4, 5, 2], answer="free-form answer"), config) == ""
    lenient = dataclasses.replace(config, keep_wrong_answers=True)
    assert filter_reason(row("so 3 + 4 = 8", [4, 5, 2], answer="... #### 7"), lenient) == ""


def test_prompt_errors_surface(llm: str, tmp_path: Path, capsys) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"question": "a cat"}) + "\n" + json.dumps({"question": "a dog"}) + "\n")
    cases = [
        (str(tmp_path / "missing.jsonl"), "question", "does not exist"),
        (str(empty), "question", "is empty"),
        (str(other), "instruction", "prompt field 'instruction' not found"),
    ]
    for path, field, message in cases:
        out = tmp_path / f"out-{Path(path).stem}"
        assert main(["--llm", llm, "--prompts", path, "--prompt-field", field, "--out", str(out)]) == 2
        assert message in capsys.readouterr().err


def test_long_prompts_are_truncated_and_counted(llm: str, tmp_path: Path) -> None:
    path = tmp_path / "long.jsonl"
    long = " ".join(["the cat"] * 40)  # 81 tokens with <s>; context 64 - 6 new tokens = 58
    path.write_text("".join(json.dumps({"question": p}) + "\n" for p in [long, *PROMPTS[:4]]))
    out = tmp_path / "out"
    metadata = distill(make_config(llm, str(path), held_out_fraction=0.2), out)
    assert metadata["counts"]["max_prompt_tokens"] == 58
    rows = pq.read_table(out / "data.parquet").to_pylist()
    assert max(len(r["prompt_ids"]) for r in rows) <= 58
    assert metadata["counts"]["truncated_prompts"] == sum(r["prompt"] == long for r in rows)


def test_missing_llm_folder_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no model found at .*the folder does not exist"):
        check_model_location(tmp_path / "nope")
    assert check_model_location("org/model-name") == "org/model-name"  # a hub id passes through


def test_a_failed_start_does_not_claim_the_run_folder(tmp_path: Path) -> None:
    """Regression: a run with a wrong --llm path used to write run.json first, so the corrected
    command was then refused as 'other settings'."""
    out = tmp_path / "out"
    assert (
        main(["--llm", str(tmp_path / "missing"), "--prompts", "tinystories_openings", "--out", str(out)])
        == 2
    )
    assert not (out / "run.json").exists()


# ---------------------------------------------------------------- two processes (accelerate launch)


def launch_two_processes(argv: list[str], log: Path) -> subprocess.Popen:
    """`accelerate launch --multi_gpu --num_processes 2 -m specboost.training.distill ARGV` on the CPU
    (CUDA hidden: two processes must not share one GPU), output to `log`."""
    options = ["--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no"]
    launch = accelerate_launch([*options, "--dynamo_backend", "no"], "specboost.training.distill", argv)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    with log.open("w") as output:
        return subprocess.Popen(launch, env=env, stdout=output, stderr=output)


def kill_at_first_shard(process: subprocess.Popen, shards: Path, timeout: float = 60) -> None:
    """SIGKILL the launcher and both workers once a shard has been written. The workers are the
    launcher's children but in sessions of their own (torchrun's), so a process group kill would
    miss them."""
    deadline = time.monotonic() + timeout
    while not list(shards.glob("shard-*.parquet")) and process.poll() is None:
        assert time.monotonic() < deadline, "no shard written in time"
        time.sleep(0.02)
    launcher = psutil.Process(process.pid)
    everyone = [*launcher.children(recursive=True), launcher]
    for member in everyone:
        member.kill()
    psutil.wait_procs(everyone)
    process.wait()


@pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="two CPU processes need torch.distributed with the gloo backend, which this torch build lacks",
)
def test_two_processes_split_the_prompts_and_resume_after_a_kill(llm: str, tmp_path: Path) -> None:
    prompts = tmp_path / "many.jsonl"
    pairs = itertools.product(WORDS[:8], WORDS[8:16])  # 64 distinct prompts
    prompts.write_text("".join(json.dumps({"question": f"{a} {b}"}) + "\n" for a, b in pairs))
    out = tmp_path / "out"
    argv = ["--llm", llm, "--prompts", str(prompts), "--prompt-field", "question", "--out", str(out)]
    argv += ["--max-new-tokens", "12", "--batch-size", "1", "--shard-size", "2"]

    kill_at_first_shard(launch_two_processes(argv, tmp_path / "killed.log"), out / "shards")
    assert not (out / "data.parquet").exists()  # killed mid-run
    rerun = launch_two_processes(argv, tmp_path / "rerun.log")
    assert rerun.wait(timeout=120) == 0, (tmp_path / "rerun.log").read_text()

    metadata = json.loads((out / "metadata.json").read_text())
    train = metadata["counts"]["train_prompts"]
    assert metadata["processes"] == 2 and 0 < metadata["counts"]["resumed_from"] < train
    generated = Counter(row["id"] for row in read_shards(out))  # before merging's de-duplication
    assert len(generated) == train and set(generated.values()) == {1}
    # The same rows as one process writes: no prompt lost its output in the split.
    distill(make_config(llm, str(prompts), max_new_tokens=12), tmp_path / "ref")
    reference, rows = (load_distilled(path, keep_filtered=True) for path in (tmp_path / "ref", out))
    assert len(rows) == train and rows["id"] == reference["id"]
    assert rows["output_ids"] == reference["output_ids"]


def test_use_pool_generates_the_same_outputs_through_the_speculative_decoder(
    prompts: str, tmp_path: Path
) -> None:
    """`--use-pool`: an exported pool drafts, the LLM verifies; greedy outputs equal plain distill's."""
    from test_export_pool import make_boost

    from specboost.decoder.tiny_models import build_tiny_models
    from specboost.training import export

    llm_dir, ssm_dirs = build_tiny_models(tmp_path / "tiny")
    export.export_pool(make_boost(tmp_path, (llm_dir, ssm_dirs)), tmp_path / "pool")
    plain = distill(make_config(str(llm_dir), prompts, max_new_tokens=10), tmp_path / "plain")
    pooled = distill(
        make_config(str(llm_dir), prompts, max_new_tokens=10, use_pool=str(tmp_path / "pool")),
        tmp_path / "pooled",
    )
    assert pooled["generation"]["use_pool"] == str(tmp_path / "pool")
    a, b = (
        load_distilled(tmp_path / "plain", keep_filtered=True),
        load_distilled(tmp_path / "pooled", keep_filtered=True),
    )
    assert a["output_ids"] == b["output_ids"] and a["finish_reason"] == b["finish_reason"]
    assert plain["counts"]["rows"] == pooled["counts"]["rows"] == 11
    with pytest.raises(FileNotFoundError, match="no SSM pool"):
        distill(make_config(str(llm_dir), prompts, use_pool=str(tmp_path / "nowhere")), tmp_path / "bad")
    assert not (tmp_path / "bad").exists()  # checked before the run folder is claimed


def test_a_context_refusal_does_not_claim_the_run_folder(
    llm: str, prompts: str, tmp_path: Path, capsys
) -> None:
    """Regression: max_new_tokens filling the whole context was refused after run.json was written,
    so the corrected command was then refused as 'other settings'."""
    out = tmp_path / "out"
    argv = ["--llm", llm, "--prompts", prompts, "--prompt-field", "question", "--out", str(out)]
    assert main([*argv, "--max-new-tokens", "64"]) == 2  # the context holds 64 positions
    assert "context" in capsys.readouterr().err and not (out / "run.json").exists()
    assert main([*argv, "--max-new-tokens", "4"]) == 0


def test_a_malformed_jsonl_line_is_reported_with_file_and_line(llm: str, tmp_path: Path, capsys) -> None:
    path = tmp_path / "broken.jsonl"
    path.write_text('{"question": "a cat"}\n{"question": "a dog"\n{"question": "away"}\n')
    out = tmp_path / "out"
    assert main(["--llm", llm, "--prompts", str(path), "--prompt-field", "question", "--out", str(out)]) == 2
    assert f"{path}:2: not valid JSON" in capsys.readouterr().err
    assert not (out / "run.json").exists()


# ---------------------------------------------------------------- stored distributions (ALGORITHMS.md 15)


@pytest.mark.parametrize("do_sample", [True, False], ids=["sampled", "greedy"])
def test_top_k_distributions_match_a_direct_softmax(
    llm: str, prompts: str, tmp_path: Path, do_sample: bool
) -> None:
    """Every output position stores the top-K of softmax(logits / T) of the LLM on the unpadded
    text (what sampling at T draws from; a greedy run records it at --temperature), and the tail."""
    out = tmp_path / "out"
    config = make_config(llm, prompts, top_k_probs=8, temperature=0.7, do_sample=do_sample, seed=1)
    metadata = distill(config, out)
    model = AutoModelForCausalLM.from_pretrained(llm, dtype=torch.float32).eval()
    rows = load_distilled(out, keep_filtered=True)
    schema = pq.read_schema(out / "data.parquet")
    assert str(schema.field("top_k_ids").type) == "list<element: list<element: int32>>"
    assert str(schema.field("top_k_probs").type) == "list<element: list<element: halffloat>>"
    assert str(schema.field("tail_prob").type) == "list<element: float>"
    for row in rows:
        prompt, output = row["prompt_ids"], row["output_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1]  # [n, V]
        p = torch.softmax(logits / 0.7, dim=-1)
        ids = torch.tensor(row["top_k_ids"], dtype=torch.long)  # [n, 8]
        probs, tail = torch.tensor(row["top_k_probs"]), torch.tensor(row["tail_prob"])
        assert ids.shape == (len(output), 8) and tail.shape == (len(output),)
        assert torch.allclose(p.gather(-1, ids), probs, atol=1e-3)  # float16 storage
        assert (probs[:, :-1] >= probs[:, 1:]).all()  # most probable first
        rest = p.scatter(-1, ids, 0.0).max(-1).values
        assert (probs[:, -1] >= rest - 1e-4).all()  # nothing left out beats the stored ones
        assert torch.allclose(tail, 1 - p.gather(-1, ids).sum(-1), atol=1e-5)
        assert torch.allclose(tail, 1 - probs.sum(-1), atol=2e-3)
    d = metadata["distributions"]
    assert d["top_k"] == 8 and d["temperature"] == 0.7 and d["raw_bytes_per_token"] == 8 * 6 + 4
    assert d["recorded_from"] == ("sampled outputs" if do_sample else "greedy outputs")
    assert d["bytes_per_token"] > 0 and d["output_tokens"] == metadata["counts"]["output_tokens"]
    assert json.loads((out / "run.json").read_text())["temperature"] == 0.7  # part of the identity


def test_num_samples_rows_resume_without_duplicates(
    llm: str, prompts: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = make_config(
        llm, prompts, do_sample=True, num_samples=3, top_k_probs=4, shard_size=4, temperature=1.0
    )
    reference = load_distilled(distill(config, tmp_path / "ref") and tmp_path / "ref", keep_filtered=True)
    out = tmp_path / "out"
    kill_at_third_shard(config, out, monkeypatch)
    metadata = distill(config, out)
    assert metadata["counts"]["resumed_from"] == 8 and metadata["counts"]["generated_this_run"] == 25
    rows = load_distilled(out, keep_filtered=True)
    assert rows["id"] == reference["id"] and len(set(rows["id"])) == metadata["counts"]["rows"] == 33
    assert Counter(row["id"] for row in read_shards(out, columns=["id"])) == Counter(rows["id"])
    assert all(i == 3 * p + s for i, p, s in zip(rows["id"], rows["prompt_id"], rows["sample"], strict=True))
    samples = {
        p: sorted(s for q, s in zip(rows["prompt_id"], rows["sample"], strict=True) if q == p)
        for p in rows["prompt_id"]
    }
    assert len(samples) == 11 and all(s == [0, 1, 2] for s in samples.values())
    assert rows["output_ids"] == reference["output_ids"] and rows["top_k_probs"] == reference["top_k_probs"]
    outputs = {
        p: {tuple(o) for q, o in zip(rows["prompt_id"], rows["output_ids"], strict=True) if q == p}
        for p in samples
    }
    assert any(len(texts) > 1 for texts in outputs.values())  # the samples of a prompt differ
    assert metadata["counts"]["samples_per_prompt"] == 3 and metadata["counts"]["train_prompts"] == 11
    with pytest.raises(ValueError, match=r"other settings.*top_k_probs: 4 -> 2"):
        distill(dataclasses.replace(config, top_k_probs=2), out)


def test_top_k_above_the_vocabulary_is_clamped_with_a_notice(
    llm: str, prompts: str, tmp_path: Path, capsys
) -> None:
    out = tmp_path / "out"
    metadata = distill(make_config(llm, prompts), out)  # the default K = 64; the vocabulary has 25
    assert "--top-k-probs 64 is more than the LLM's vocabulary (25 tokens)" in capsys.readouterr().out
    assert metadata["distributions"]["top_k"] == metadata["config"]["top_k_probs"] == 25
    rows = load_distilled(out, keep_filtered=True)
    assert all(t == 0 for tails in rows["tail_prob"] for t in tails)  # the whole vocabulary is stored
    assert all(abs(sum(p) - 1) < 5e-3 for probs in rows["top_k_probs"] for p in probs)
    # A run made without distributions (as before --top-k-probs existed) resumes only without them.
    with pytest.raises(ValueError, match=r"top_k_probs: 25 -> 0"):
        distill(make_config(llm, prompts, top_k_probs=0), out)


def test_distribution_settings_are_checked(llm: str, prompts: str, tmp_path: Path, capsys) -> None:
    argv = ["--llm", llm, "--prompts", prompts, "--prompt-field", "question", "--out", str(tmp_path / "o")]
    assert main([*argv, "--num-samples", "2"]) == 2
    assert "--num-samples 2 needs --do-sample" in capsys.readouterr().err
    assert main([*argv, "--top-k-probs", "-1"]) == 2
    assert "top_k_probs must be >= 0" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    off = distill(make_config(llm, prompts, top_k_probs=0), tmp_path / "off")
    assert off["distributions"] is None
    assert "top_k_ids" not in load_distilled(tmp_path / "off").column_names


# ---------------------------------------------------------------- several prompt sets (domains)

OTHER_PROMPTS = [f"{a} {b}" for a, b in itertools.product(WORDS[12:16], WORDS[16:20])]  # 16, none in PROMPTS


@pytest.fixture
def other(tmp_path: Path) -> str:
    """A second prompt set (no answers), disjoint from `prompts`."""
    path = tmp_path / "other.jsonl"
    path.write_text("".join(json.dumps({"question": p}) + "\n" for p in OTHER_PROMPTS))
    return str(path)


def held_out_prompts(path: str, config: DistillConfig) -> set[str]:
    """The held-out prompts of one set, as an evaluation loading the set by itself sees them."""
    source = PromptSource(
        path, prompt_field="question", held_out_fraction=config.held_out_fraction, seed=config.split_seed
    )
    return set(load_prompt_splits(source)["held_out"]["prompt"])


def test_two_sets_are_split_each_by_itself_and_mixed_with_their_source(
    llm: str, prompts: str, other: str, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    config = make_config(llm, f"{prompts},{other}:5")
    metadata = distill(config, out)
    rows = load_distilled(out, keep_filtered=True)
    assert Counter(rows["source"]) == {"prompts": 11, "other": 5}  # 12 - 1 held out; capped at 5
    assert len(set(rows["id"])) == len(rows) == metadata["counts"]["train_prompts"] == 16
    assert rows["prompt_id"] == rows["id"]
    by_source = {
        name: {p for p, s in zip(rows["prompt"], rows["source"], strict=True) if s == name}
        for name in ("prompts", "other")
    }
    assert by_source["prompts"] <= set(PROMPTS) and by_source["other"] <= set(OTHER_PROMPTS)
    for path, name in ((prompts, "prompts"), (other, "other")):
        held = held_out_prompts(path, config)
        assert held and not held & set(rows["prompt"]), f"a held-out prompt of {name} was distilled"
    # The first set keeps the ids a run of it alone gives; the second's come after its id range.
    alone = distill(make_config(llm, prompts), tmp_path / "alone")
    first = [i for i, s in zip(rows["id"], rows["source"], strict=True) if s == "prompts"]
    assert first == load_distilled(tmp_path / "alone", keep_filtered=True)["id"]
    assert [s["id_offset"] for s in metadata["prompt_sets"]] == [0, len(PROMPTS)]
    assert min(i for i, s in zip(rows["id"], rows["source"], strict=True) if s == "other") >= len(PROMPTS)
    sources = metadata["counts"]["sources"]
    assert sources["other"] | {"filtered": None} == {
        "train_prompts": 5,
        "train_available": 14,
        "held_out_prompts": 2,
        "overlapping_prompts": 0,
        "truncated_prompts": 0,
        "rows": 5,
        "kept": 5 - sum(sources["other"]["filtered"].values()),
        "filtered": None,
    }
    assert sources["prompts"]["rows"] == alone["counts"]["rows"] == 11
    assert sum(s["kept"] for s in sources.values()) == metadata["counts"]["kept"]
    assert metadata["prompt_sets"][1]["max_train_prompts"] == 5


def test_sets_sharing_prompts_distill_each_prompt_once_and_no_held_out_one(
    llm: str, prompts: str, tmp_path: Path
) -> None:
    """A set overlapping another (as bundled `bench` lies inside `vicuna_bench`): its copies of the
    first set's prompts, trained or held out there, are dropped; its own held-out split too."""
    overlap = tmp_path / "overlap.jsonl"
    overlap.write_text("".join(json.dumps({"question": p}) + "\n" for p in PROMPTS[:6] + OTHER_PROMPTS[:6]))
    out = tmp_path / "out"
    config = make_config(llm, f"{prompts},{overlap}", top_k_probs=0)
    metadata = distill(config, out)
    rows = load_distilled(out, keep_filtered=True)
    assert len(set(rows["prompt"])) == len(rows)
    for path in (prompts, str(overlap)):
        assert not held_out_prompts(path, config) & set(rows["prompt"])
    mine = {p for p, s in zip(rows["prompt"], rows["source"], strict=True) if s == "overlap"}
    assert mine and mine <= set(OTHER_PROMPTS[:6])
    counts = metadata["counts"]["sources"]["overlap"]
    assert counts["overlapping_prompts"] == 11 - len(mine) and counts["train_prompts"] == len(mine)


def test_a_set_without_answers_mixes_with_one_that_has_them(llm: str, other: str, tmp_path: Path) -> None:
    """gsm8k brings its reference answers (checked by the answer filter); the other set's are None."""
    out = tmp_path / "out"
    metadata = distill(make_config(llm, f"{other}:3,gsm8k:4", top_k_probs=0), out)
    rows = load_distilled(out, keep_filtered=True)
    answers = {
        s: [a for a, t in zip(rows["answer"], rows["source"], strict=True) if t == s]
        for s in ("other", "gsm8k")
    }
    assert (
        answers["other"] == [None] * 3
        and all("####" in a for a in answers["gsm8k"])
        and len(answers["gsm8k"]) == 4
    )
    assert metadata["counts"]["sources"]["gsm8k"]["filtered"]["wrong_answer"] > 0  # a random LLM
    assert metadata["counts"]["sources"]["other"]["filtered"]["wrong_answer"] == 0
    lenient = distill(make_config(llm, f"{other}:3,gsm8k:4", top_k_probs=0, keep_wrong_answers=True), out)
    assert lenient["counts"]["generated_this_run"] == 0  # a filter: no new run, no regeneration
    assert lenient["counts"]["filtered"]["wrong_answer"] == 0


def test_a_single_set_gets_the_source_column_and_resumes_an_old_run(
    llm: str, prompts: str, tmp_path: Path
) -> None:
    """A run.json written before several sets existed (this identity, byte for byte) still resumes."""
    out = tmp_path / "out"
    config = make_config(llm, prompts, top_k_probs=0)
    old_identity = {
        "llm": llm,
        "prompts": prompts,
        "prompt_field": "question",
        "answer_field": None,
        "chat_template": False,
        "max_prompts": None,
        "held_out_fraction": 0.1,
        "split_seed": 0,
        "max_new_tokens": 6,
        "do_sample": False,
        "shard_size": 3,
        "dtype": "auto",
    }
    assert config.identity() == old_identity
    (out / "shards").mkdir(parents=True)
    (out / "run.json").write_text(json.dumps(old_identity))
    distill(config, out)
    rows = load_distilled(out)
    assert set(rows["source"]) == {"prompts"} and rows.column_names[:4] == [
        "id",
        "prompt_id",
        "sample",
        "source",
    ]
    # A run finished before the column existed: load_distilled names its one set from metadata.json.
    pq.write_table(pq.read_table(out / "data.parquet").drop_columns(["source"]), out / "data.parquet")
    assert set(load_distilled(out)["source"]) == {"prompts"}


def test_two_sets_resume_after_a_kill_with_every_row_once(
    llm: str, prompts: str, other: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = make_config(llm, f"{prompts}:7,{other}", do_sample=True, num_samples=2, top_k_probs=0)
    reference = load_distilled(distill(config, tmp_path / "ref") and tmp_path / "ref", keep_filtered=True)
    out = tmp_path / "out"
    kill_at_third_shard(config, out, monkeypatch)
    metadata = distill(config, out)
    assert metadata["counts"]["resumed_from"] == 6 and metadata["counts"]["rows"] == 2 * (7 + 14)
    assert Counter(row["id"] for row in read_shards(out, columns=["id"])) == Counter(reference["id"])
    assert set(Counter(reference["id"]).values()) == {1}
    rows = load_distilled(out, keep_filtered=True)
    for column in ("id", "prompt_id", "sample", "source", "output_ids"):
        assert rows[column] == reference[column]
    assert Counter(rows["source"]) == {"prompts": 14, "other": 28}


def test_bad_prompt_lists_are_refused_before_the_run_folder_is_claimed(
    llm: str, prompts: str, other: str, tmp_path: Path, capsys
) -> None:
    single = tmp_path / "single.jsonl"
    single.write_text(json.dumps({"question": "a cat"}) + "\n")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    bundled_gsm8k = str(bundled_source("gsm8k").path)
    cases = [
        (
            f"{prompts},self_instruct_seed_tasks",
            "unknown prompt set 'self_instruct_seed_tasks' (did you mean 'self_instruct_seed'?)",
        ),
        (f"{prompts},{empty}", "prompt set 'empty': prompt dataset"),
        (f"{prompts},{other}:3,{prompts}:2", "names the same prompt set more than once (prompts)"),
        (f"gsm8k,{bundled_gsm8k}", "names the same prompt set twice: 'gsm8k' and"),
        (f"{other},{single}", "prompt set 'single': cannot hold out 10% of 1 distinct prompts and keep any"),
        (f"{prompts}:0,{other}", "must be at least 1 train prompt"),
        (f"{prompts},,{other}", "has an empty entry"),
    ]
    for spec, message in cases:
        out = tmp_path / "out"
        argv = ["--llm", llm, "--prompts", spec, "--out", str(out)]
        assert main([*argv, *([] if "gsm8k," in spec else ["--prompt-field", "question"])]) == 2, spec
        assert message in capsys.readouterr().err, spec
        assert not (out / "run.json").exists()


def test_default_out_folder_names_the_sets() -> None:
    assert default_out_name("gsm8k") == "gsm8k"
    assert default_out_name("data/prompts/mine.jsonl") == "mine"
    assert default_out_name("tinystories_openings:60,data/qa.csv:5,gsm8k") == "tinystories_openings+qa+gsm8k"
