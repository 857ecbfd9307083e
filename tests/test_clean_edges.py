"""Bad input at the boundaries ends in one clear line (exit 2 from the command line) that says
what to do, never in a traceback: devices, missing, bare-named or truncated checkpoints, argument
types, shapes that draft nothing, malformed prompt files."""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

import huggingface_hub
import pytest
import torch
from conftest import tiny_llama

from specboost.decoder import ChainShape, SpeculativeDecoder, SSMPool, TopologyShape
from specboost.decoder.bench.workloads import read_prompt_file
from specboost.decoder.cli import main
from specboost.decoder.tiny_models import build_tiny_models
from specboost.speculator.loading import LoadError, load_causal_lm, resolve_device


@functools.cache
def _models(root: str) -> tuple[Path, list[Path]]:
    return build_tiny_models(Path(root))


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path]]:
    return _models(str(tmp_path_factory.mktemp("edges") / "models"))


def generate(models: tuple[Path, list[Path]], *extra: str) -> list[str]:
    llm, ssms = models
    return [
        "generate",
        "--llm",
        str(llm),
        "--ssm",
        str(ssms[0]),
        "--prompt",
        "hi",
        "--max-new-tokens",
        "3",
        *extra,
    ]


@pytest.mark.parametrize(
    ("device", "message"),
    [
        ("foo", "unknown device 'foo': use cpu, cuda, cuda:N or mps"),
        ("tpu", "unknown device 'tpu'"),
        ("meta", "device 'meta' is not supported"),
    ],
)
def test_unusable_devices_are_one_line_errors(models, device: str, message: str, capsys) -> None:
    assert main(generate(models, "--device", device)) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_is_a_one_line_error(models, capsys) -> None:
    assert main(generate(models, "--device", "cuda")) == 2
    assert "device 'cuda' is not available" in capsys.readouterr().err
    with pytest.raises(LoadError, match="use --device cpu"):
        resolve_device("cuda:0")


def test_a_truncated_checkpoint_names_the_file(models, tmp_path: Path, capsys) -> None:
    llm, ssms = models
    broken = tmp_path / "ssm"
    shutil.copytree(ssms[0], broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    assert main(["generate", "--llm", str(llm), "--ssm", str(broken), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "model.safetensors may be truncated or corrupt" in err and "Traceback" not in err
    with pytest.raises(LoadError, match=str(broken)):
        load_causal_lm(broken)


def test_a_bare_name_that_is_no_folder(models, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # no network in tests
    with pytest.raises(LoadError, match="neither a local folder nor reachable on the Hugging Face Hub"):
        load_causal_lm("no-such-model-name")
    llm, _ = models
    assert main(["generate", "--llm", str(llm), "--ssm", "gpt2", "--prompt", "hi"]) == 2
    assert "no model found at gpt2" in capsys.readouterr().err
    with pytest.raises(ValueError, match="could not download the SSM pool"):
        SSMPool.from_pretrained("org/no-such-pool")


def test_a_topology_without_drafted_nodes(models, capsys) -> None:
    with pytest.raises(SystemExit) as exit_code:  # argparse: usage error, exit 2
        main(generate(models, "--shape", "topology", "--topology-children", "[[0]]"))
    assert exit_code.value.code == 2
    assert "has no node besides the root" in capsys.readouterr().err
    llm = tiny_llama(1)
    with pytest.raises(ValueError, match="drafts nothing"):
        SpeculativeDecoder(llm, [llm], shape=TopologyShape((-1,)))


def test_argument_types_are_checked_at_the_api() -> None:
    llm = tiny_llama(1)
    with pytest.raises(TypeError, match=r"for a chain of 4 tokens use shape=ChainShape\(4\)"):
        SpeculativeDecoder(llm, [llm], shape=4)
    dec = SpeculativeDecoder(llm, [llm], shape=ChainShape(2))
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(TypeError, match="input_ids must hold integer token ids"):
        dec.generate(ids.float(), max_new_tokens=2)
    with pytest.raises(TypeError, match=r"max_new_tokens must be an integer, got 2\.5"):
        dec.generate(ids, max_new_tokens=2.5)
    with pytest.raises(TypeError, match="do_sample must be True or False"):
        dec.generate(ids, max_new_tokens=2, do_sample="yes")
    with pytest.raises(TypeError, match="seed must be an integer"):
        dec.generate(ids, max_new_tokens=2, seed=1.5)
    with pytest.raises(ValueError, match=r"token ids in \[0, 64\)"):
        dec.generate(torch.tensor([[1, 64]]), max_new_tokens=2)
    with pytest.raises(ValueError, match="attention_mask must be a tensor shaped like input_ids"):
        dec.generate(ids, attention_mask=torch.ones(1, 2, dtype=torch.long), max_new_tokens=2)
    with pytest.raises(TypeError, match=r"input_ids must be a torch\.Tensor"):
        dec.generate([[1, 2, 3]], max_new_tokens=2)


def test_a_malformed_prompt_line_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": "b"\n')
    with pytest.raises(ValueError, match=rf"{path}:2: not valid JSON"):
        read_prompt_file(path)
    path.write_text('{"prompt": "a"}\n[1, 2]\n')
    with pytest.raises(ValueError, match=rf"{path}:2: a JSONL prompt must be an object"):
        read_prompt_file(path)
