"""Pool export (training/export.py) and loading (decoder/pool.py): a fake boost run built from the
tiny models, exported, loaded back and decoded with; the hub push runs against a mocked HfApi."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from conftest import noisy_copy, tiny_llama
from transformers import AutoModelForCausalLM, AutoTokenizer

from specboost.decoder import (
    BeamShape,
    ChainShape,
    SpeculativeDecoder,
    SSMPool,
    StrategyOptions,
    TopologyShape,
    strategies,
)
from specboost.decoder import pool as pool_module
from specboost.decoder.cli import build_decoder, build_parser
from specboost.decoder.cli import main as cli_main
from specboost.decoder.compilation import compile_by_default
from specboost.decoder.pool import MANIFEST_FILE, PoolDefaults, tokenizer_vocab_hash
from specboost.decoder.profiler import ProfileConfig, profile
from specboost.decoder.tiny_models import build_tiny_models, build_tokenizer
from specboost.speculator.cost_model import PROFILE_FILE, device_key, load_cost_model, save_cost_model
from specboost.speculator.loading import LoadError
from specboost.speculator.predictor import PREDICTOR_DIR, MatchLengthPredictor, PredictorConfig
from specboost.speculator.sequoia_acceptance import ACCEPTANCE_FILE, AcceptanceVector, save_acceptance_file
from specboost.training import export

ROUNDS = [
    {"ssm": 0, "path": "ssm-0", "train_samples": 36, "marked": 0, "held_out_acceptance": 0.7125,
     "held_out_mean_match_length": 2.345, "pool_coverage": 0.7125, "steps": 40, "final_loss": 1.23456},
    {"ssm": 1, "path": "ssm-1", "train_samples": 21, "marked": 15, "held_out_acceptance": 0.5432,
     "held_out_mean_match_length": 1.876, "pool_coverage": 0.8123, "steps": 30, "final_loss": 1.5},
]  # fmt: skip
BASE = "HuggingFaceTB/SmolLM-135M"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path]]:
    return build_tiny_models(tmp_path_factory.mktemp("tiny"))


def make_boost(root: Path, tiny: tuple[Path, list[Path]]) -> Path:
    """A boost run folder as training/boost.py writes it, with hand-written numbers."""
    llm_dir, ssm_dirs = tiny
    boost, distilled = root / "boost", root / "distill"
    for i, ssm_dir in enumerate(ssm_dirs):
        shutil.copytree(ssm_dir, boost / f"ssm-{i}")
    distilled.mkdir()
    metadata = {"llm": str(llm_dir), "config": {"prompts": "tinystories_openings"}, "counts": {"kept": 36}}
    (distilled / "metadata.json").write_text(json.dumps(metadata))
    record = {
        "llm": str(llm_dir),
        "distilled": str(distilled),
        "base": BASE,
        "marking": "sample",
        "rounds": ROUNDS,
        "held_out_ids": [3, 7, 11, 19],
        "seed": 0,
        "versions": {"torch": torch.__version__},
    }
    (boost / export.RECORD_FILE).write_text(json.dumps(record))
    return boost


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory, tiny: tuple[Path, list[Path]]) -> tuple[Path, Path]:
    """(boost folder, export folder): read-only for the tests that share it."""
    root = tmp_path_factory.mktemp("exported")
    boost = make_boost(root, tiny)
    export.export_pool(boost, root / "pool-export")
    return boost, root / "pool-export"


def read(path: Path) -> Any:
    return json.loads(path.read_text())


# ---------------------------------------------------------------- export


def test_export_writes_models_cards_and_readme(exported: tuple[Path, Path]) -> None:
    _, out = exported
    for i, entry in enumerate(ROUNDS):
        folder = out / f"ssm-{i}"
        for name in ("model.safetensors", "config.json", "tokenizer.json", "README.md"):
            assert (folder / name).is_file(), name
        card = (folder / "README.md").read_text()
        assert card.startswith("---\nlibrary_name: transformers\n")
        assert "- speculative-decoding\n- specboost\n" in card and f"base_model: {BASE}\n" in card
        assert f"{entry['held_out_acceptance']:.3f}" in card
        assert f"{entry['held_out_mean_match_length']:.2f}" in card
        assert f"Boost round: {i + 1} of 2" in card
        assert "`tinystories_openings`" in card and str(exported[0].parent / "llm") not in card
        assert "assistant_model=assistant" in card and f'subfolder="ssm-{i}"' in card
        assert f'SpeculativeDecoder.from_pretrained(llm, "{out}", tokenizer)' in card
        assert "strategy `pool`, shape `ChainShape(length=4)`, length controller none" in card
    readme = (out / "README.md").read_text()
    assert "0.812" in readme and "| `ssm-1` | 2 |" in readme and "decoding" in readme


def test_manifest_fields(exported: tuple[Path, Path], tiny: tuple[Path, list[Path]]) -> None:
    _, out = exported
    manifest = read(out / MANIFEST_FILE)
    tokenizer = AutoTokenizer.from_pretrained(tiny[0])
    assert manifest["format_version"] == 1
    assert manifest["llm"] == {
        "name_or_path": str(tiny[0]),
        "vocab_size": len(tokenizer),
        "tokenizer_vocab_hash": tokenizer_vocab_hash(tokenizer),
    }
    assert [(s["path"], s["round"]) for s in manifest["ssms"]] == [("ssm-0", 1), ("ssm-1", 2)]
    assert manifest["ssms"][1]["held_out_acceptance"] == ROUNDS[1]["held_out_acceptance"]
    assert manifest["weights"] == [0.5, 0.5]
    assert manifest["predictor"] is None and manifest["hardware_profile"] is None
    assert manifest["base"] == BASE and manifest["marking"] == "sample"
    assert manifest["decoding"] == {  # unset: the decoder's own defaults
        "strategy": "pool",
        "shape": {"kind": "chain", "length": 4, "samples": 1},
        "length_controller": None,
    }


def test_predictor_and_hardware_profile_are_carried(tmp_path: Path, tiny: tuple[Path, list[Path]]) -> None:
    boost = make_boost(tmp_path, tiny)
    (boost / "predictor").mkdir()
    (boost / "predictor" / "weights.safetensors").write_bytes(b"x")
    (boost / "hardware_profile.json").write_text('{"verify_ms": [1.0]}')
    record = read(boost / export.RECORD_FILE)
    (boost / export.RECORD_FILE).write_text(json.dumps({**record, "base": "config:tenth"}))
    manifest = export.export_pool(boost, tmp_path / "out")
    card = (tmp_path / "out" / "ssm-0" / "README.md").read_text()
    assert "base_model:" not in card and "fresh Llama" in card  # boost's "config:PRESET": no hub base
    assert manifest["predictor"] == {"path": "predictor"}
    assert manifest["hardware_profile"] == {"path": "hardware_profile.json"}
    assert (tmp_path / "out" / "predictor" / "weights.safetensors").is_file()
    assert read(tmp_path / "out" / "hardware_profile.json") == {"verify_ms": [1.0]}


def test_sequoia_acceptance_is_carried_and_decodes(
    tmp_path: Path, tiny: tuple[Path, list[Path]], exported: tuple[Path, Path]
) -> None:
    """`make sequoia-acceptance` writes BOOST/sequoia_acceptance.json; the export ships it, the
    manifest names it, `SSMPool` loads it and strategy="sequoia" decodes with it."""
    boost = make_boost(tmp_path, tiny)
    vectors = [AcceptanceVector((0.5, 0.2), "greedy", 10), AcceptanceVector((0.7, 0.1), "greedy", 10)]
    save_acceptance_file(vectors, boost / ACCEPTANCE_FILE, samples=2)
    manifest = export.export_pool(boost, tmp_path / "out")
    assert manifest["sequoia_acceptance"] == {"path": ACCEPTANCE_FILE}
    pool = SSMPool.from_pretrained(tmp_path / "out")
    assert pool.acceptance == vectors
    llm = AutoModelForCausalLM.from_pretrained(tiny[0]).eval()
    options = StrategyOptions(nodes=6)
    decoder = SpeculativeDecoder(llm, ssms=pool, strategy="sequoia", strategy_options=options)
    ids = torch.randint(4, 260, (1, 8))
    result = decoder.generate(ids, max_new_tokens=16)
    expected = llm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
    assert torch.equal(result.sequences, expected)
    assert result.stats.strategy["ssm"] == 1  # the vector that promises more
    assert read(exported[1] / MANIFEST_FILE)["sequoia_acceptance"] is None
    assert SSMPool.from_pretrained(exported[1]).acceptance is None


def test_failure_mid_export_leaves_no_partial_folder(
    tmp_path: Path, tiny: tuple[Path, list[Path]], monkeypatch: pytest.MonkeyPatch
) -> None:
    boost, out = make_boost(tmp_path, tiny), tmp_path / "exports" / "pool"
    real = export.export_ssm

    def fail_on_second(*args: Any) -> None:
        if args[3] == 1:
            raise RuntimeError("disk full")
        real(*args)

    monkeypatch.setattr(export, "export_ssm", fail_on_second)
    with pytest.raises(RuntimeError, match="disk full"):
        export.export_pool(boost, out)
    assert not out.exists() and list(out.parent.iterdir()) == []
    # An earlier export survives a failed re-export untouched.
    monkeypatch.setattr(export, "export_ssm", real)
    export.export_pool(boost, out)
    before = (out / MANIFEST_FILE).read_text()
    monkeypatch.setattr(export, "export_ssm", fail_on_second)
    with pytest.raises(RuntimeError):
        export.export_pool(boost, out)
    assert (out / MANIFEST_FILE).read_text() == before and (out / "ssm-1" / "model.safetensors").is_file()
    assert sorted(p.name for p in out.parent.iterdir()) == ["pool"]


def test_export_refuses_foreign_folder_and_missing_record(
    tmp_path: Path, tiny: tuple[Path, list[Path]]
) -> None:
    boost = make_boost(tmp_path, tiny)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="not an exported SSM pool"):
        export.export_pool(boost, tmp_path / "mine")
    (boost / export.RECORD_FILE).unlink()
    with pytest.raises(FileNotFoundError, match=r"boost_record\.json is missing"):
        export.export_pool(boost, tmp_path / "out")


# ---------------------------------------------------------------- SSMPool


def test_pool_round_trip_and_decoding(exported: tuple[Path, Path], tiny: tuple[Path, list[Path]]) -> None:
    _, out = exported
    llm_dir, ssm_dirs = tiny
    pool = SSMPool.from_pretrained(out)
    assert len(pool) == 2 and list(pool) == pool.models and pool.weights == [0.5, 0.5]
    ids = torch.randint(4, 260, (1, 12))
    for model, ssm_dir in zip(pool, ssm_dirs, strict=True):
        original = AutoModelForCausalLM.from_pretrained(ssm_dir).eval()
        with torch.no_grad():
            assert torch.equal(model(ids).logits, original(ids).logits)
    llm = AutoModelForCausalLM.from_pretrained(llm_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(llm_dir)
    pool.check_llm(llm, tokenizer)
    decoder = SpeculativeDecoder(llm, ssms=pool, tokenizer=tokenizer)
    result = decoder.generate(ids, max_new_tokens=24)
    expected = llm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)
    assert torch.equal(result.sequences, expected)
    assert result.stats.accepted_tokens > 0


def test_check_llm_mismatch(exported: tuple[Path, Path], tiny: tuple[Path, list[Path]]) -> None:
    pool = SSMPool.from_pretrained(exported[1])
    with pytest.raises(ValueError, match=r"vocabulary mismatch: .*\(260 tokens\).* predicts 64"):
        pool.check_llm(tiny_llama())
    llm = AutoModelForCausalLM.from_pretrained(tiny[0])
    other = build_tokenizer()
    other.add_tokens(["<extra>"])
    with pytest.raises(ValueError, match=r"tokenizer mismatch.*vocab hash sha256:"):
        pool.check_llm(llm, other)
    with pytest.raises(ValueError, match="tokenizer mismatch"):  # the decoder checks the pool's tokenizer too
        SpeculativeDecoder(llm, ssms=pool, tokenizer=other)


def test_pool_missing_folder_manifest_ssm(
    tmp_path: Path, exported: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(FileNotFoundError, match="folder does not exist"):
        SSMPool.from_pretrained(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=f"{MANIFEST_FILE} is missing"):
        SSMPool.from_pretrained(tmp_path / "empty")
    broken = tmp_path / "broken"
    shutil.copytree(exported[1], broken)
    shutil.rmtree(broken / "ssm-1")
    with pytest.raises(FileNotFoundError, match="lists SSM 'ssm-1'"):
        SSMPool.from_pretrained(broken)

    def offline(repo_id: str, **kwargs: Any) -> str:
        raise OSError("offline mode is enabled")

    monkeypatch.setattr(pool_module, "snapshot_download", offline)
    with pytest.raises(LoadError, match=r"could not download the SSM pool 'org/pool'.*offline"):
        SSMPool.from_pretrained("org/pool")


def test_pool_from_hub_id_uses_snapshot(exported: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[str] = []

    def snapshot(repo_id: str, **kwargs: Any) -> str:
        asked.append(repo_id)
        return str(exported[1])

    monkeypatch.setattr(pool_module, "snapshot_download", snapshot)
    assert len(SSMPool.from_pretrained("org/pool")) == 2 and asked == ["org/pool"]


# ---------------------------------------------------------------- decoding defaults


def test_from_pretrained_decodes_as_llm_generate(
    exported: tuple[Path, Path], tiny: tuple[Path, list[Path]]
) -> None:
    """LLM and pool by folder: the LLM folder's tokenizer, the manifest's defaults (a chain of 4)."""
    llm_dir, _ = tiny
    decoder = SpeculativeDecoder.from_pretrained(llm_dir, exported[1])
    assert decoder.speculator.shape == ChainShape(4) and decoder.tokenizer.name_or_path == str(llm_dir)
    llm = AutoModelForCausalLM.from_pretrained(llm_dir).eval()
    ids = torch.randint(4, 260, (1, 10))
    expected = llm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False)
    result = decoder.generate(ids, max_new_tokens=20)
    assert torch.equal(result.sequences, expected) and result.stats.accepted_tokens > 0


def test_manifest_defaults_and_overrides(tmp_path: Path, tiny: tuple[Path, list[Path]]) -> None:
    boost, out = make_boost(tmp_path, tiny), tmp_path / "out"
    argv = ["--boost", str(boost), "--out", str(out), "--strategy", "majority", "--chain-length", "3"]
    assert export.main([*argv, "--length-controller", "bass"]) == 0
    assert read(out / MANIFEST_FILE)["decoding"] == {
        "strategy": "majority",
        "shape": {"kind": "chain", "length": 3, "samples": 1},
        "length_controller": "bass",
    }
    assert (
        "strategy `majority`, shape `ChainShape(length=3)`, length controller bass"
        in (out / "README.md").read_text()
    )
    llm = AutoModelForCausalLM.from_pretrained(tiny[0]).eval()
    pool = SSMPool.from_pretrained(out)
    assert pool.defaults == PoolDefaults("majority", ChainShape(3), "bass")
    ids = torch.randint(4, 260, (1, 8))
    expected = llm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    report = SpeculativeDecoder.from_pretrained(llm, pool).generate(ids, max_new_tokens=12).stats.strategy
    assert report["strategy"] == "majority" and report["length_controller"]["name"] == "bass"
    # A keyword given overrides its default only; strategy= replaces them all.
    decoder = SpeculativeDecoder.from_pretrained(llm, pool, length_controller=None)
    assert (
        decoder.speculator.report()["strategy"] == "majority" and decoder.speculator.length_controller is None
    )
    decoder = SpeculativeDecoder.from_pretrained(llm, pool, strategy="pool")
    assert decoder.speculator.report() == {"strategy": "pool", "shape": "ChainShape(length=4)"}
    assert torch.equal(decoder.generate(ids, max_new_tokens=12).sequences, expected)


def test_generate_with_pool_takes_the_manifest_defaults(
    tmp_path: Path, tiny: tuple[Path, list[Path]], capsys: pytest.CaptureFixture[str]
) -> None:
    boost, out = make_boost(tmp_path, tiny), tmp_path / "out"
    export.export_pool(boost, out, defaults=PoolDefaults(shape=BeamShape(2, 3)))
    argv = ["generate", "--llm", str(tiny[0]), "--pool", str(out), "--prompt", "Once", "--json"]
    assert cli_main([*argv, "--max-new-tokens", "6"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["stats"]["strategy"]["shape"] == "BeamShape(width=2, depth=3)"
    assert cli_main([*argv, "--max-new-tokens", "6", "--depth", "2"]) == 0  # the pool's width kept
    assert json.loads(capsys.readouterr().out)["stats"]["strategy"]["shape"] == "BeamShape(width=2, depth=2)"
    tokenizer = AutoTokenizer.from_pretrained(tiny[0])
    llm = AutoModelForCausalLM.from_pretrained(tiny[0]).eval()
    ids = tokenizer("Once", return_tensors="pt").input_ids
    expected = tokenizer.decode(llm.generate(ids, max_new_tokens=6, do_sample=False)[0, ids.shape[1] :])
    assert result["text"] == expected


def test_a_manifest_without_decoding_loads_with_the_decoder_defaults(
    tmp_path: Path, exported: tuple[Path, Path], tiny: tuple[Path, list[Path]]
) -> None:
    old = tmp_path / "old"
    shutil.copytree(exported[1], old)
    manifest = read(old / MANIFEST_FILE)
    del manifest["decoding"]
    (old / MANIFEST_FILE).write_text(json.dumps(manifest))
    assert SSMPool.from_pretrained(old).defaults == PoolDefaults() == PoolDefaults("pool", ChainShape(4))
    decoder = SpeculativeDecoder.from_pretrained(tiny[0], old)
    assert decoder.speculator.report() == {"strategy": "pool", "shape": "ChainShape(length=4)"}


def test_decoding_block_round_trip_and_refusals(
    tmp_path: Path, exported: tuple[Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    for defaults in (
        PoolDefaults("pruned", BeamShape(3, 2)),
        PoolDefaults("pool", TopologyShape((-1, 0, 0, 1))),
        PoolDefaults("sequoia"),
    ):
        block = json.loads(json.dumps(defaults.to_manifest()))
        assert PoolDefaults.from_manifest({"decoding": block}) == defaults
    assert PoolDefaults("sequoia").to_manifest()["shape"] is None
    with pytest.raises(ValueError, match="a length controller sets chain lengths"):
        PoolDefaults(shape=BeamShape(2, 2), length_controller="bass")
    broken = tmp_path / "broken"
    shutil.copytree(exported[1], broken)
    manifest = read(broken / MANIFEST_FILE)
    for bad, message in [
        ({"kind": "star"}, "shape kind must be one of"),
        ({"kind": "chain", "len": 3}, "a chain shape takes"),
    ]:
        (broken / MANIFEST_FILE).write_text(json.dumps({**manifest, "decoding": {"shape": bad}}))
        with pytest.raises(
            ValueError, match=rf'{MANIFEST_FILE}: the "decoding" block is invalid \({message}'
        ):
            SSMPool.from_pretrained(broken)
    (broken / MANIFEST_FILE).write_text(json.dumps({**manifest, "decoding": {"rule": "mss"}}))
    with caplog.at_level(logging.WARNING, logger="specboost.decoder.pool"):
        assert SSMPool.from_pretrained(broken).defaults == PoolDefaults()
    assert "ignoring the decoding choices ['rule']" in caplog.text


def test_export_refuses_defaults_the_pool_cannot_decode(
    tmp_path: Path, tiny: tuple[Path, list[Path]], capsys: pytest.CaptureFixture[str]
) -> None:
    boost, out = make_boost(tmp_path, tiny), tmp_path / "out"
    with pytest.raises(ValueError, match="a pool's strategy must be one of"):  # plain drafts nothing
        export.export_pool(boost, out, defaults=PoolDefaults("plain"))
    with pytest.raises(ValueError, match="--strategy learned needs the learned scheduler's") as error:
        export.export_pool(boost, out, defaults=PoolDefaults("learned"))
    assert f"`make predictor-data predictor SCHED_POOL={boost}`" in str(error.value)
    argv = ["--boost", str(boost), "--out", str(out)]
    assert export.main([*argv, "--strategy", "sequoia"]) == 2
    assert f"`make sequoia-acceptance BOOST_OUT={boost}`" in capsys.readouterr().err
    assert export.main([*argv, "--strategy", "majority", "--beam", "2", "2"]) == 2
    assert "strategy='majority' votes on chains" in capsys.readouterr().err
    assert not out.exists()
    (boost / "predictor").mkdir()  # any predictor folder: export copies, it does not load it
    assert export.main([*argv, "--strategy", "learned"]) == 0
    assert read(out / MANIFEST_FILE)["decoding"]["strategy"] == "learned"


# ---------------------------------------------------------------- the learned scheduler by default


def add_predictor_and_profile(boost: Path, tiny: tuple[Path, list[Path]]) -> None:
    """A random match-length predictor and this machine's hardware profile (measured fast) in BOOST,
    where `make predictor` and `make profile` put them."""
    llm_dir, ssm_dirs = tiny
    llm = AutoModelForCausalLM.from_pretrained(llm_dir).eval()
    ssms = [AutoModelForCausalLM.from_pretrained(d).eval() for d in ssm_dirs]
    config = ProfileConfig(verify_sizes=(1, 8, 32), prefix_length=8, repeats=1)
    save_cost_model(profile(llm, ssms, config, show_progress=False), boost / PROFILE_FILE)
    torch.manual_seed(0)
    predictor = MatchLengthPredictor(PredictorConfig(input_size=llm.config.hidden_size, num_ssms=len(ssms)))
    predictor.save_pretrained(boost / PREDICTOR_DIR)


@pytest.fixture(scope="module")
def learned_export(
    tmp_path_factory: pytest.TempPathFactory, tiny: tuple[Path, list[Path]]
) -> tuple[Path, Path]:
    """(boost folder with a predictor and a profile, its export with no decoding option given):
    read-only for the tests that share it."""
    root = tmp_path_factory.mktemp("learned")
    boost = make_boost(root, tiny)
    add_predictor_and_profile(boost, tiny)
    export.export_pool(boost, root / "pool-export")
    return boost, root / "pool-export"


def test_export_recommends_learned_with_a_predictor_and_a_profile(
    tmp_path: Path, learned_export: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    boost, exported_pool = learned_export
    assert read(exported_pool / MANIFEST_FILE)["decoding"] == {
        "strategy": "learned",
        "shape": {"kind": "chain", "length": 4, "samples": 1},  # only without its predictor
        "length_controller": None,
    }
    assert SSMPool.from_pretrained(exported_pool).defaults == PoolDefaults("learned")
    card = (exported_pool / "README.md").read_text()
    assert "strategy `learned`, shape plain decoding or one SSM's chain, the SSM and length picked" in card
    assert 'strategy="pool",\nshape=ChainShape(4)` for a fixed chain of 4' in card
    assert export.main(["--boost", str(boost), "--out", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    assert "[export] decoding defaults: strategy `learned`" in printed
    assert "holds a match-length predictor and a hardware profile" in printed


@pytest.mark.parametrize(
    ("present", "missing"),
    [
        ((), "no match-length predictor and no hardware profile: `make predictor-data predictor"),
        (("predictor",), "no hardware profile: `make profile SCHED_POOL="),
        (("hardware_profile",), "no match-length predictor: `make predictor-data predictor SCHED_POOL="),
    ],
)
def test_export_without_a_predictor_and_a_profile_recommends_a_chain_of_4(
    tmp_path: Path,
    tiny: tuple[Path, list[Path]],
    capsys: pytest.CaptureFixture[str],
    present: tuple[str, ...],
    missing: str,
) -> None:
    boost = make_boost(tmp_path, tiny)
    if "predictor" in present:
        (boost / PREDICTOR_DIR).mkdir()  # export copies it, it does not load it
    if "hardware_profile" in present:
        (boost / PROFILE_FILE).write_text("{}")
    assert export.main(["--boost", str(boost), "--out", str(tmp_path / "out")]) == 0
    manifest = read(tmp_path / "out" / MANIFEST_FILE)
    assert PoolDefaults.from_manifest(manifest) == PoolDefaults("pool", ChainShape(4))
    printed = capsys.readouterr().out
    assert "[export] decoding defaults: strategy `pool`, shape `ChainShape(length=4)`" in printed
    assert missing in printed


def test_explicit_export_options_win_over_the_recommendation(
    tmp_path: Path, learned_export: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """A predictor and a profile in BOOST, yet --strategy (or a shape or length controller, which
    mean strategy pool without one) decides."""
    argv = ["--boost", str(learned_export[0]), "--out", str(tmp_path / "out")]
    for options, expected in [
        (["--strategy", "pool"], PoolDefaults("pool", ChainShape(4))),
        (["--chain-length", "3"], PoolDefaults("pool", ChainShape(3))),
        (["--beam", "2", "3"], PoolDefaults("pool", BeamShape(2, 3))),
        (["--length-controller", "bass"], PoolDefaults("pool", ChainShape(4), "bass")),
        (["--strategy", "majority"], PoolDefaults("majority", ChainShape(4))),
        (["--strategy", "learned", "--beam", "2", "3"], PoolDefaults("learned", BeamShape(2, 3))),
    ]:
        assert export.main([*argv, *options]) == 0
        assert SSMPool.from_pretrained(tmp_path / "out").defaults == expected, options
        assert "[export] as given by the options" in capsys.readouterr().out


def test_from_pretrained_decodes_with_the_learned_scheduler_a_pool_recommends(
    learned_export: tuple[Path, Path], tiny: tuple[Path, list[Path]]
) -> None:
    llm_dir, _ = tiny
    llm = AutoModelForCausalLM.from_pretrained(llm_dir).eval()
    ids = torch.randint(4, 260, (1, 10))
    expected = llm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    decoder = SpeculativeDecoder.from_pretrained(llm_dir, learned_export[1])
    assert decoder.calls.enabled == compile_by_default(decoder.llm.device)  # compile="auto": CUDA only
    result = decoder.generate(ids, max_new_tokens=12)
    assert result.stats.strategy["strategy"] == "learned"
    assert torch.equal(result.sequences, expected)
    # A fixed chain: strategy="pool" with its shape; a shape alone over "learned" means the same.
    fixed = SpeculativeDecoder.from_pretrained(llm, learned_export[1], strategy="pool", shape=ChainShape(4))
    assert fixed.speculator.report() == {"strategy": "pool", "shape": "ChainShape(length=4)"}
    assert torch.equal(fixed.generate(ids, max_new_tokens=12).sequences, expected)
    chain = SpeculativeDecoder.from_pretrained(llm, learned_export[1], shape=ChainShape(6))
    assert chain.speculator.report() == {"strategy": "pool", "shape": "ChainShape(length=6)"}
    bass = SpeculativeDecoder.from_pretrained(llm, learned_export[1], length_controller="bass")
    assert bass.speculator.report()["strategy"] == "pool"
    # One SSM of the pool, a fixed chain: the SSM's folder, or the loaded pool's model.
    pool = SSMPool.from_pretrained(learned_export[1])
    one = SpeculativeDecoder(llm, [pool.models[1]], pool.tokenizer, shape=ChainShape(4))
    assert torch.equal(one.generate(ids, max_new_tokens=12).sequences, expected)


def test_generate_and_serve_decode_with_the_learned_scheduler_a_pool_recommends(
    learned_export: tuple[Path, Path], tiny: tuple[Path, list[Path]], capsys: pytest.CaptureFixture[str]
) -> None:
    models = ["--llm", str(tiny[0]), "--pool", str(learned_export[1])]
    argv = ["generate", *models, "--prompt", "Once", "--json", "--max-new-tokens", "6"]
    for options, strategy, shape in [
        ([], "learned", None),
        (["--strategy", "pool"], "pool", "ChainShape(length=4)"),
        (["--length", "3"], "pool", "ChainShape(length=3)"),
        (["--strategy", "pool", "--ssm", str(learned_export[1] / "ssm-0")], None, None),
    ]:
        if strategy is None:  # --ssm and --pool together: a usage error; one SSM is --ssm POOL/ssm-0
            with pytest.raises(SystemExit):
                cli_main([*argv, *options])
            continue
        assert cli_main([*argv, *options]) == 0
        report = json.loads(capsys.readouterr().out)["stats"]["strategy"]
        assert report["strategy"] == strategy and report.get("shape") == shape, options
    one = ["generate", "--llm", str(tiny[0]), "--ssm", str(learned_export[1] / "ssm-0"), "--prompt", "Once"]
    assert cli_main([*one, "--json", "--max-new-tokens", "6"]) == 0
    assert json.loads(capsys.readouterr().out)["stats"]["strategy"]["shape"] == "ChainShape(length=4)"
    decoder = build_decoder(build_parser().parse_args(["serve", *models]))  # what `specboost serve` serves
    ids = torch.randint(4, 260, (1, 6))
    assert decoder.generate(ids, max_new_tokens=4).stats.strategy["strategy"] == "learned"


def test_a_recommended_learned_scheduler_measures_here_when_the_profile_is_foreign(
    tmp_path: Path,
    learned_export: tuple[Path, Path],
    tiny: tuple[Path, list[Path]],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The pool's profile was measured elsewhere (another machine or thread count): the learned
    scheduler the pool recommends measures this machine's latencies, with a warning saying how to
    avoid it; an explicit strategy="learned" refuses the profile as before; force_profile uses it."""
    foreign = tmp_path / "pool"
    shutil.copytree(learned_export[1], foreign)
    here = load_cost_model(foreign / PROFILE_FILE, device_key("cpu", torch.float32))
    document = read(foreign / PROFILE_FILE)
    document["profiles"] = {"cuda: Elsewhere|float32": next(iter(document["profiles"].values()))}
    (foreign / PROFILE_FILE).write_text(json.dumps(document))
    measured: list[int] = []

    def measure(*args: Any, **kwargs: Any) -> Any:
        measured.append(1)
        return here

    monkeypatch.setattr(strategies, "profile", measure)
    llm = AutoModelForCausalLM.from_pretrained(tiny[0]).eval()
    pool = SSMPool.from_pretrained(foreign)
    with pytest.raises(ValueError, match="not on this machine"):
        SpeculativeDecoder.from_pretrained(llm, pool, strategy="learned")
    with caplog.at_level(logging.WARNING, logger="specboost.decoder.pool"):
        decoder = SpeculativeDecoder.from_pretrained(llm, pool)
    assert measured == [1] and "measured on cuda: Elsewhere|float32, not on this machine" in caplog.text
    assert "--force-profile" in caplog.text and pool.manifest["hardware_profile"] is not None  # not changed
    assert (
        decoder.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4).stats.strategy["strategy"] == "learned"
    )
    SpeculativeDecoder.from_pretrained(llm, pool, force_profile=True)
    assert measured == [1]  # the foreign profile, as forced
    argv = [
        "generate",
        "--llm",
        str(tiny[0]),
        "--pool",
        str(foreign),
        "--prompt",
        "Once",
        "--max-new-tokens",
        "4",
    ]
    assert cli_main(argv) == 0 and measured == [1, 1]


def test_a_pool_recommending_learned_without_a_predictor_falls_back_to_its_shape(
    tmp_path: Path,
    exported: tuple[Path, Path],
    tiny: tuple[Path, list[Path]],
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A manifest that recommends "learned" but ships no predictor (edited by hand): the decoder's
    warning and the fixed shape, from Python and the command line; --strategy learned still refuses."""
    edited = tmp_path / "pool"
    shutil.copytree(exported[1], edited)
    manifest = read(edited / MANIFEST_FILE)
    (edited / MANIFEST_FILE).write_text(
        json.dumps({**manifest, "decoding": PoolDefaults("learned").to_manifest()})
    )
    with caplog.at_level(logging.WARNING, logger="specboost.decoder.strategies"):
        decoder = SpeculativeDecoder.from_pretrained(tiny[0], edited)
    assert "needs a match-length predictor" in caplog.text
    assert decoder.speculator.report() == {"strategy": "pool", "shape": "ChainShape(length=4)"}
    argv = [
        "generate",
        "--llm",
        str(tiny[0]),
        "--pool",
        str(edited),
        "--prompt",
        "Once",
        "--max-new-tokens",
        "4",
    ]
    assert cli_main(argv) == 0
    assert cli_main([*argv, "--strategy", "learned"]) == 2
    assert "--strategy learned needs --predictor DIR" in capsys.readouterr().err


# ---------------------------------------------------------------- push


class FakeApi:
    calls: ClassVar[list[tuple[str, tuple, dict]]] = []

    def __init__(self, token: str | None = None) -> None:
        FakeApi.calls.append(("init", (), {"token": token}))

    def create_repo(self, *args: Any, **kwargs: Any) -> str:
        FakeApi.calls.append(("create_repo", args, kwargs))
        return "https://huggingface.co/org/pool"

    def upload_folder(self, *args: Any, **kwargs: Any) -> None:
        FakeApi.calls.append(("upload_folder", args, kwargs))


def test_push_calls_create_repo_and_upload_folder(
    tmp_path: Path, tiny: tuple[Path, list[Path]], monkeypatch: pytest.MonkeyPatch
) -> None:
    boost, out = make_boost(tmp_path, tiny), tmp_path / "out"
    FakeApi.calls = []
    monkeypatch.delenv("HUB_REPO", raising=False)
    monkeypatch.setattr(export, "get_token", lambda: "hf_fake")
    monkeypatch.setattr(export, "HfApi", FakeApi)
    assert export.main(["--boost", str(boost), "--out", str(out), "--hub-repo", "org/pool"]) == 0
    names = [c[0] for c in FakeApi.calls]
    assert names == ["init", "create_repo", "upload_folder"]
    assert FakeApi.calls[0][2] == {"token": "hf_fake"}
    _, args, kwargs = FakeApi.calls[1]
    assert args == ("org/pool",) and kwargs["exist_ok"] is True and kwargs["repo_type"] == "model"
    upload = FakeApi.calls[2][2]
    assert upload["folder_path"] == str(out) and upload["repo_id"] == "org/pool"
    assert 'from_pretrained(llm, "org/pool", tokenizer)' in (out / "ssm-0" / "README.md").read_text()
    # HUB_REPO works like --hub-repo.
    FakeApi.calls = []
    monkeypatch.setenv("HUB_REPO", "org/other")
    assert export.main(["--boost", str(boost), "--out", str(out)]) == 0
    assert FakeApi.calls[1][1] == ("org/other",)


def test_push_without_token_says_how_to_log_in(
    tmp_path: Path,
    tiny: tuple[Path, list[Path]],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    boost, out = make_boost(tmp_path, tiny), tmp_path / "out"
    FakeApi.calls = []
    monkeypatch.delenv("HUB_REPO", raising=False)
    monkeypatch.setattr(export, "get_token", lambda: None)
    monkeypatch.setattr(export, "HfApi", FakeApi)
    assert export.main(["--boost", str(boost), "--out", str(out), "--hub-repo", "org/pool"]) == 2
    assert "hf auth login" in capsys.readouterr().err
    assert FakeApi.calls == [] and not out.exists()
    with pytest.raises(RuntimeError, match="HF_TOKEN"):
        export.require_token()


def test_sampling_away_from_the_pools_temperature_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    """A pool fitted to p at T = 0.8 (manifest target_temperature): sampling at 0.8 or greedy says
    nothing; sampling at 1.0 warns once per decoder, naming both temperatures."""
    llm = tiny_llama(seed=0)
    pool = SSMPool([noisy_copy(llm, 0.1, seed=1)], None, {"target_temperature": 0.8}, [1.0])
    assert pool.target_temperature == 0.8
    decoder = SpeculativeDecoder(llm, pool, shape=ChainShape(2))
    ids = torch.tensor([[1, 2, 3]])
    with caplog.at_level(logging.WARNING, logger="specboost.decoder.pool"):
        decoder.generate(ids, max_new_tokens=3)
        decoder.generate(ids, max_new_tokens=3, do_sample=True, temperature=0.8, seed=0)
        assert not caplog.records
        for seed in range(2):
            decoder.generate(ids, max_new_tokens=3, do_sample=True, temperature=1.0, seed=seed)
    assert len(caplog.records) == 1
    assert "temperature 1" in caplog.text and "temperature 0.8" in caplog.text
    assert SSMPool([llm], None, {}, [1.0]).target_temperature is None
