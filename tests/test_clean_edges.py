"""Bad input at the boundaries ends in one clear line (exit 2 from the command line) that says
what to do, never in a traceback: devices, missing, bare-named or truncated checkpoints, argument
types, shapes that draft nothing, malformed prompt files, and exported pools that are damaged,
for another tokenizer or no pool at all."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import huggingface_hub
import pytest
import torch
from conftest import tiny_llama
from test_export_pool import make_boost

from specboost.decoder import ChainShape, SpeculativeDecoder, SSMPool, TopologyShape
from specboost.decoder.bench.workloads import read_prompt_file
from specboost.decoder.cli import main
from specboost.decoder.pool import MANIFEST_FILE
from specboost.decoder.tiny_models import build_tiny_models
from specboost.speculator.loading import LoadError, load_causal_lm, resolve_device
from specboost.training import export


@functools.cache
def _models(root: str) -> tuple[Path, list[Path]]:
    return build_tiny_models(Path(root))


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path]]:
    return _models(str(tmp_path_factory.mktemp("edges") / "models"))


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory, models: tuple[Path, list[Path]]) -> Path:
    """An exported pool of the tiny SSMs, read-only for the tests that share it."""
    root = tmp_path_factory.mktemp("edges-pool")
    export.export_pool(make_boost(root, models), root / "pool")
    return root / "pool"


def copy_of(pool: Path, tmp_path: Path) -> Path:
    shutil.copytree(pool, tmp_path / "pool")
    return tmp_path / "pool"


def generate_with_pool(models: tuple[Path, list[Path]], pool: Path, *extra: str) -> list[str]:
    llm, _ = models
    return [
        "generate",
        "--llm",
        str(llm),
        "--pool",
        str(pool),
        "--prompt",
        "hi",
        "--max-new-tokens",
        "3",
        *extra,
    ]


def one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    """The command's error line (stderr may hold loading progress too), and no traceback."""
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("specboost generate: error: ")]
    assert len(errors) == 1 and "Traceback" not in err, err
    return errors[0]


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
        ("tpu", "unknown device 'tpu'"),  # torch has no such device type: TPUs are its "xla"
        ("xla", "device 'xla' is not supported"),  # a type torch knows, unusable here
        ("meta", "device 'meta' is not supported"),
    ],
)
def test_unusable_devices_are_one_line_errors(models, pool, device: str, message: str, capsys) -> None:
    assert main(generate(models, "--device", device)) == 2
    assert message in one_line_error(capsys)
    assert main(generate_with_pool(models, pool, "--device", device)) == 2  # before the pool loads
    assert message in one_line_error(capsys)
    with pytest.raises(LoadError, match=message):
        SpeculativeDecoder.from_pretrained(models[0], pool, device=device)


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
    for seed in (-1, 2**70):  # torch's generators raise a raw overflow error for these
        with pytest.raises(ValueError, match=r"seed must be in \[0, 2\*\*63\)"):
            dec.generate(ids, max_new_tokens=2, seed=seed)
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


def test_a_truncated_checkpoint_in_a_pool_names_the_file_and_the_repair(
    models, pool: Path, tmp_path: Path, capsys
) -> None:
    broken = copy_of(pool, tmp_path)
    weights = broken / "ssm-1" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    assert main(generate_with_pool(models, broken)) == 2
    err = one_line_error(capsys)
    assert f"the SSM pool is damaged: the model at {broken / 'ssm-1'} could not be read" in err
    assert "model.safetensors may be truncated or corrupt" in err
    repair = "Repair the pool: export it again (`python -m specboost.training.export --boost BOOST_DIR"
    assert f"{repair} --out {broken}`)" in err
    (broken / MANIFEST_FILE).write_text('{"format_version": 1, "ssms": [')  # cut short
    with pytest.raises(LoadError, match=rf"{MANIFEST_FILE} cannot be read \(Expecting value"):
        SSMPool.from_pretrained(broken)


def test_a_pool_for_another_tokenizer_is_refused_through_the_command(
    models, pool: Path, tmp_path: Path, capsys
) -> None:
    other = copy_of(pool, tmp_path)
    manifest = json.loads((other / MANIFEST_FILE).read_text())
    manifest["llm"]["tokenizer_vocab_hash"] = "sha256:" + "0" * 64  # exported for another tokenizer
    (other / MANIFEST_FILE).write_text(json.dumps(manifest))
    assert main(generate_with_pool(models, other)) == 2
    err = one_line_error(capsys)
    assert "tokenizer mismatch: the SSM pool was exported for the tokenizer of the LLM" in err
    assert "use the pool with the LLM and tokenizer it was trained for" in err


def test_pool_that_is_no_pool_and_pool_with_ssm(models, pool: Path, capsys) -> None:
    llm, ssms = models
    assert main(generate_with_pool(models, llm)) == 2
    assert f"{llm} is not an exported SSM pool" in (err := one_line_error(capsys))
    assert "it holds one model: pass model folders as SSMs (`--ssm`" in err
    assert main(generate_with_pool(models, llm.parent)) == 2  # model folders, like a boost run
    assert (
        f"export it first with `python -m specboost.training.export --boost {llm.parent}"
        in one_line_error(capsys)
    )
    with pytest.raises(SystemExit) as exit_code:
        main(generate_with_pool(models, pool, "--ssm", str(ssms[0])))
    assert exit_code.value.code == 2
    assert "argument --ssm: not allowed with argument --pool" in capsys.readouterr().err
    assert main(["generate", "--llm", str(llm), "--prompt", "hi"]) == 2
    assert "give the SSMs: --ssm PATH [PATH ...] or --pool DIR|ID" in capsys.readouterr().err


def test_plain_takes_no_models_nor_shape_options(models, capsys) -> None:
    """`--strategy plain` decodes with the LLM alone; SSMs and shape options are refused, not
    ignored (as they are for sequoia, which builds its own tree)."""
    llm, ssms = models
    plain = ["generate", "--llm", str(llm), "--prompt", "hi", "--max-new-tokens", "3", "--strategy", "plain"]
    assert main(plain) == 0
    assert "3 new tokens (finish: length) in 3 LLM steps" in capsys.readouterr().err
    assert main([*plain, "--ssm", str(ssms[0])]) == 2
    assert "drop --ssm / --pool" in one_line_error(capsys)
    assert main([*plain, "--length", "3", "--width", "2"]) == 2
    assert "--length, --width set a draft shape" in one_line_error(capsys)
    assert main(generate(models, "--strategy", "sequoia", "--nodes", "4", "--length", "3")) == 2
    assert "--length set a draft shape" in one_line_error(capsys)
