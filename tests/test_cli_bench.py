"""The tiny stand-in models, the `specboost` CLI, the bench harness and the README example.

All on the tiny models of `specboost.decoder.tiny_models`, built once per module in a temporary
folder (a fraction of a second) and loaded back from disk, as a user would.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from specboost.decoder import example
from specboost.decoder.bench.configurations import FILE_BENCH
from specboost.decoder.bench.protocol import CHECKPOINT
from specboost.decoder.bench.suite import SuiteConfig
from specboost.decoder.bench.workloads import read_prompt_file
from specboost.decoder.cli import main
from specboost.decoder.tiny_models import TinyModelsConfig, build_tiny_models

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-models")
    build_tiny_models(out)
    return out


def _paths(models_dir: Path) -> tuple[str, list[str]]:
    return str(models_dir / "llm"), [str(models_dir / "ssm-0"), str(models_dir / "ssm-1")]


# tiny_models ------------------------------------------------------------------------------------
def test_tiny_models_load_back_with_from_pretrained(models_dir: Path) -> None:
    config = TinyModelsConfig()
    for name, layers in [
        ("llm", config.llm_layers),
        *zip(("ssm-0", "ssm-1"), config.ssm_layers, strict=True),
    ]:
        model = AutoModelForCausalLM.from_pretrained(models_dir / name)
        tok = AutoTokenizer.from_pretrained(models_dir / name)
        assert isinstance(model, LlamaForCausalLM)
        assert model.config.num_hidden_layers == layers
        assert model.config.vocab_size == len(tok)
        assert model.generation_config.eos_token_id == tok.eos_token_id
        assert tok.decode(tok("héllo, wörld").input_ids) == "héllo, wörld"  # byte level: any text


def test_tiny_models_are_rebuilt_only_for_new_settings_or_force(tmp_path: Path) -> None:
    weights = tmp_path / "llm" / "model.safetensors"

    def stamp() -> int:
        return weights.stat().st_mtime_ns

    build_tiny_models(tmp_path)
    first = stamp()
    build_tiny_models(tmp_path)
    assert stamp() == first
    build_tiny_models(tmp_path, TinyModelsConfig(seed=1))
    second = stamp()
    assert second != first
    build_tiny_models(tmp_path, TinyModelsConfig(seed=1), force=True)
    assert stamp() != second


def test_tiny_ssms_agree_often_with_the_llm(models_dir: Path) -> None:
    """The point of the stand-ins: SSM drafts are accepted often, but not always."""
    llm_path, ssm_paths = _paths(models_dir)
    llm = AutoModelForCausalLM.from_pretrained(llm_path)
    tok = AutoTokenizer.from_pretrained(llm_path)
    ids = tok("Once upon a time", return_tensors="pt").input_ids
    out = llm.generate(ids, max_new_tokens=32, do_sample=False)
    inputs = out[:, :-1]
    for path in ssm_paths:
        ssm = AutoModelForCausalLM.from_pretrained(path)
        with torch.no_grad():
            agree = (ssm(inputs).logits.argmax(-1) == out[:, 1:])[0, ids.shape[1] - 1 :].float().mean()
        assert 0.2 < agree < 1.0


# CLI: generate ----------------------------------------------------------------------------------
def test_generate_prints_llm_text_and_stats(models_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    llm_path, ssm_paths = _paths(models_dir)
    code = main(
        ["generate", "--llm", llm_path, "--ssm", *ssm_paths, "--prompt", "Hello", "--max-new-tokens", "12"]
    )
    captured = capsys.readouterr()
    assert code == 0
    llm, tok = AutoModelForCausalLM.from_pretrained(llm_path), AutoTokenizer.from_pretrained(llm_path)
    ids = tok("Hello", return_tensors="pt").input_ids
    expected = tok.decode(llm.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1] :])
    assert captured.out == expected + "\n"
    assert re.search(r"12 new tokens \(finish: length\) in \d+ LLM steps: [\d.]+ tokens/step", captured.err)
    assert "acceptance" in captured.err and "SSM 1" in captured.err


def test_generate_json_with_sampling_and_a_beam_tree(
    models_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    llm_path, ssm_paths = _paths(models_dir)
    argv = ["generate", "--llm", llm_path, "--ssm", ssm_paths[0], "--ssm", ssm_paths[1], "--prompt", "Hi"]
    argv += ["--max-new-tokens", "10", "--do-sample", "--temperature", "0.8", "--top-k", "50", "--seed", "3"]
    argv += ["--shape", "beam", "--width", "2", "--depth", "3", "--json"]
    assert main(argv) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["stats"]["new_tokens"] == 10 and first["finish_reason"] == "length"
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["text"] == first["text"]  # --seed: reproducible


def test_generate_missing_model_is_a_clear_error(
    models_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    llm_path, _ = _paths(models_dir)
    missing = models_dir / "no-such-ssm"
    assert main(["generate", "--llm", llm_path, "--ssm", str(missing), "--prompt", "Hi"]) == 2
    assert f"no model found at {missing}" in capsys.readouterr().err


def test_generate_invalid_rule_is_a_clear_error(models_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    llm_path, ssm_paths = _paths(models_dir)
    assert main(["generate", "--llm", llm_path, "--ssm", *ssm_paths, "--prompt", "Hi", "--rule", "mss"]) == 2
    assert "sampling rule" in capsys.readouterr().err


def test_cli_usage_errors_exit_with_a_message(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--prompt", "Hi"])
    assert exit_info.value.code == 2
    assert "--llm" in capsys.readouterr().err


# Bench ------------------------------------------------------------------------------------------
def test_run_bench_compares_all_methods_and_writes_json(models_dir: Path, tmp_path: Path) -> None:
    llm_path, ssm_paths = _paths(models_dir)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Once upon a time\nWhat is the capital of France?\n")
    config = SuiteConfig(
        **FILE_BENCH,
        llm=llm_path,
        ssms=tuple(ssm_paths),
        prompts=str(prompts),
        max_new_tokens=10,
        repeats=1,
        warmup=0,
    )
    report = config.run(log=lambda _: None)
    text = config.write(report, tmp_path / "bench")
    data = json.loads((tmp_path / "bench" / "bench.json").read_text())

    records = [r for run in data["runs"] for r in run["records"]]
    methods = {r["method"] for r in records}
    assert methods == {
        "plain",
        "hf_assisted[0]",
        "hf_assisted[1]",
        "chain[0]",
        "chain[1]",
        "stairs[0]",
        "stairs[1]",
        "pool_chain",
        "pool_beam",
        "pool_topology",
    }
    assert len(records) == len(methods) * 2  # 2 prompts x 1 repeat
    assert all(r["identical"] and r["new_tokens"] == 10 for r in records)
    assert not report.differing()
    summary = {s["method"]: s for s in data["tables"][0]["rows"]}
    assert (
        summary["plain"]["tokens_per_step"] == 1.0 and summary["plain"]["speedup_vs_plain"]["median"] == 1.0
    )
    assert summary["pool_chain"]["acceptance_rate"] is not None
    assert set(summary["pool_chain"]["acceptance_rate_per_ssm"]) == {"0", "1"}
    assert set(summary["chain[1]"]["acceptance_rate_per_ssm"]) == {"1"}  # the bench's SSM numbering
    assert summary["hf_assisted[0]"]["acceptance_rate"] is None
    assert data["machine"]["torch_threads"] == 1 and data["machine"]["dtype"] == "float32"
    assert "tokens/step" in text and "pool_topology" in text


def test_bench_cli_prints_the_table(
    models_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    llm_path, ssm_paths = _paths(models_dir)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "turns": ["Tell me a story."]}) + "\n")
    argv = [
        "bench",
        "--llm",
        llm_path,
        "--ssm",
        *ssm_paths,
        "--prompts",
        str(prompts),
        "--out",
        str(tmp_path),
    ]
    argv += [
        "--max-new-tokens",
        "6",
        "--repeats",
        "1",
        "--warmup",
        "0",
        "--methods",
        "chain",
        "--threads",
        "1",
    ]
    checkpoint = tmp_path / CHECKPOINT
    checkpoint.write_text("{")  # a killed run's, cut short: read, ignored, then written anew
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert "vs plain" in out and "vs HF assisted" in out
    assert re.search(r"^\| \d+ \| `chain\[1\]` \| [\d.]+ \| [\d.]+", out, re.MULTILINE)
    assert (tmp_path / "bench.json").is_file()
    # the table was written as it finished, and the partial report and checkpoint removed once the
    # whole report was
    assert f"[bench] the tables so far: {tmp_path / 'report.partial.md'}" in err
    assert f"[bench] ignoring the checkpoint {checkpoint}: unreadable (JSONDecodeError" in err
    assert not (tmp_path / "report.partial.md").exists() and (tmp_path / "report.md").is_file()
    assert not checkpoint.exists()


def test_bench_config_rejects_unknown_methods(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown bench methods"):
        SuiteConfig(**FILE_BENCH | {"methods": ("plain", "medusa")}, llm="x", ssms=("y",), prompts="p.txt")
    with pytest.raises(ValueError, match=r"unknown bench methods \['medusa'\]"):
        SuiteConfig(without=("medusa",))
    assert not SuiteConfig(without=("chain+compiled",)).wanted("chain[1]+compiled")


# Prompt files -----------------------------------------------------------------------------------
def test_read_prompt_file_from_text_one_per_line(tmp_path: Path) -> None:
    path = tmp_path / "p.txt"
    path.write_text("First prompt\n\n  Second prompt, with spaces  \n")
    assert read_prompt_file(path) == ["First prompt", "  Second prompt, with spaces  "]


def test_read_prompt_file_from_jsonl_turns_and_prompt_fields(tmp_path: Path) -> None:
    path = tmp_path / "q.jsonl"
    records = [
        {"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Now shorter."]},  # Spec-Bench
        {"prompt": "Plain prompt"},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert read_prompt_file(path) == ["Write a poem.", "Plain prompt"]


def test_read_prompt_file_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt field"}\n')
    with pytest.raises(ValueError, match=r'bad.jsonl:1: a JSONL prompt needs a "prompt"'):
        read_prompt_file(bad)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    with pytest.raises(ValueError, match="no prompts"):
        read_prompt_file(empty)
    with pytest.raises(FileNotFoundError, match="no prompt file"):
        read_prompt_file(tmp_path / "missing.txt")


def test_bundled_bench_prompts_load() -> None:
    path = README.parent / "data" / "prompts" / "bench_prompts.txt"
    assert 16 <= len(read_prompt_file(path)) <= 24


# The README example ----------------------------------------------------------------------------
def test_example_runs_and_matches_llm_generate(models_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    example.run_example(models_dir)
    out = capsys.readouterr().out
    assert "identical to llm.generate: yes" in out and "tokens/step" in out


def test_readme_shows_the_example_verbatim() -> None:
    source = Path(example.__file__).read_text()
    block = re.search(r"    # --- README example ---\n(.*?)    # --- end of README example ---", source, re.S)
    assert block is not None
    body = "\n".join(line[4:] for line in block.group(1).splitlines())
    assert body.strip() in README.read_text()
