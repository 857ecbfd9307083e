"""The cost stand-in (decoder/bench/cost_standin.py): a small LLM widened with zero weights to a
large model's shapes computes the same function, so its pool's drafts keep their acceptance."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import noisy_copy, tiny_llama, tiny_opt
from test_export_pool import add_predictor_and_profile, make_boost
from transformers import (
    AutoModelForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from specboost.decoder import ChainShape, SpeculativeDecoder
from specboost.decoder.bench.cost_standin import StandinShape, widen_llm, widen_predictor
from specboost.decoder.cli import main
from specboost.decoder.pool import SSMPool
from specboost.decoder.profiler import ProfileConfig, profile
from specboost.decoder.tiny_models import build_tiny_models
from specboost.speculator.cost_model import PROFILE_FILE, device_key, save_cost_model
from specboost.speculator.predictor import MatchLengthPredictor, PredictorConfig
from specboost.training import export

PROMPTS = ([1, 5, 9, 3, 7], [2, 8, 8, 4, 11, 6, 13])


def tiny_mistral() -> MistralForCausalLM:
    torch.manual_seed(1)
    config = MistralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, tie_word_embeddings=True, pad_token_id=None,
    )  # fmt: skip
    return MistralForCausalLM(config).double().eval()


def tiny_qwen2() -> Qwen2ForCausalLM:
    torch.manual_seed(2)
    config = Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, pad_token_id=None,
    )  # fmt: skip
    return Qwen2ForCausalLM(config).double().eval()  # biases on q, k and v


MODELS = {"llama": tiny_llama, "mistral": tiny_mistral, "qwen2": tiny_qwen2}


@pytest.mark.parametrize("family", sorted(MODELS))
def test_the_stand_in_has_the_shapes_asked_and_the_llms_function(family: str) -> None:
    llm = MODELS[family]()
    shape = StandinShape(llm.config.hidden_size * 3, llm.config.intermediate_size * 2 + 5, 4)
    wide = widen_llm(llm, shape)
    config = wide.config
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (
        96,
        shape.intermediate_size,
        4,
    )
    assert config.num_attention_heads == 3 * llm.config.num_attention_heads
    assert sum(p.numel() for p in wide.parameters()) > 4 * sum(p.numel() for p in llm.parameters())
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        # transformers computes RMSNorm's variance in float32: agreement to its rounding
        torch.testing.assert_close(wide(ids).logits, llm(ids).logits, rtol=0, atol=1e-6)
        options = dict(max_new_tokens=24, do_sample=False)
        assert wide.generate(ids, **options).tolist() == llm.generate(ids, **options).tolist()


def test_the_pools_drafts_are_accepted_on_the_stand_in_as_on_the_llm() -> None:
    """Our decoder verifies on the stand-in (wider grouped heads, zero layers, its KV cache) what it
    verifies on the LLM: the same output and the same accepted drafts."""
    llm = tiny_llama()
    ssm = noisy_copy(llm, 0.3, seed=3)
    wide = widen_llm(llm, StandinShape(64, 160, 3))
    stats = []
    for target in (llm, wide):
        decoder = SpeculativeDecoder(target, [ssm], strategy="pool", shape=ChainShape(4))
        out = decoder.generate(torch.tensor([PROMPTS[1]]), max_new_tokens=32)
        stats.append((out.sequences.tolist(), out.stats.match_lengths))
    assert stats[0] == stats[1] and sum(stats[0][1]) > 0


def test_the_widened_predictor_estimates_what_the_predictor_did() -> None:
    torch.manual_seed(0)
    predictor = MatchLengthPredictor(PredictorConfig(input_size=32, num_ssms=2)).eval()
    with torch.no_grad():
        predictor.input_mean.normal_()
        predictor.input_std.uniform_(0.5, 2.0)
    wide = widen_predictor(predictor, 96)
    hidden = torch.randn(5, 32)
    padded = torch.cat([hidden, torch.zeros(5, 64)], dim=-1)
    torch.testing.assert_close(wide.predict(padded), predictor.predict(hidden))
    assert wide.config.input_size == 96 and wide.config.depths == predictor.config.depths


@pytest.mark.parametrize(
    ("shape", "message"),
    [
        (StandinShape(48, 64, 2), "hidden_size must be a multiple of the LLM's 32, got 48"),
        (StandinShape(64, 32, 1), "intermediate_size must be at least the LLM's 64; num_hidden_layers"),
    ],
)
def test_a_shape_the_llm_cannot_widen_to_is_refused(shape: StandinShape, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        widen_llm(tiny_llama(), shape)


def test_a_model_of_another_layout_is_refused() -> None:
    with pytest.raises(ValueError, match=r"widens Llama-layout models \(llama, mistral, qwen2\), not 'opt'"):
        widen_llm(tiny_opt(), StandinShape(64, 128, 2))


def test_the_cli_writes_a_stand_in_and_its_pool_that_the_learned_scheduler_decodes_with(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`specboost standin`, then `specboost profile` on what it wrote, then the pool's learned
    scheduler on the stand-in: its greedy output is the stand-in's own."""
    tiny = build_tiny_models(tmp_path / "tiny")
    boost = make_boost(tmp_path, tiny)
    add_predictor_and_profile(boost, tiny)
    export.export_pool(boost, tmp_path / "pool")
    llm_dir = tiny[0]
    hidden = AutoModelForCausalLM.from_pretrained(llm_dir).config.hidden_size
    argv = ["standin", "--llm", str(llm_dir), "--pool", str(tmp_path / "pool"), "--out", str(tmp_path / "s")]
    sizes = ["--hidden-size", str(2 * hidden), "--intermediate-size", "300", "--layers", "5"]
    (tmp_path / ".s.partial/llm").mkdir(parents=True)  # what a killed run left
    assert main([*argv, *sizes]) == 0
    printed = capsys.readouterr().out
    assert f"intermediate_size 300, num_hidden_layers 5) and {tmp_path / 's' / 'pool'}" in printed
    assert "specboost profile --llm" in printed
    assert json.loads((tmp_path / "s/pool" / PROFILE_FILE).read_text())["profiles"] == {}  # another LLM's

    wide = AutoModelForCausalLM.from_pretrained(tmp_path / "s/llm").eval()
    pool = SSMPool.from_pretrained(tmp_path / "s/pool")
    assert pool.predictor.config.input_size == 2 * hidden
    config = ProfileConfig(verify_sizes=(1, 8, 32), prefix_length=8, repeats=1)
    save_cost_model(
        profile(wide, pool.models, config, show_progress=False), tmp_path / "s/pool" / PROFILE_FILE
    )
    decoder = SpeculativeDecoder.from_pretrained(wide, tmp_path / "s/pool", strategy="learned", compile=False)
    ids = torch.tensor([[1, 40, 41, 42, 43]])
    out = decoder.generate(ids, max_new_tokens=16)
    assert out.sequences.tolist() == wide.generate(ids, max_new_tokens=16, do_sample=False).tolist()
    assert (
        device_key("cpu", torch.float32)
        in json.loads((tmp_path / "s/pool" / PROFILE_FILE).read_text())["profiles"]
    )

    assert not (tmp_path / ".s.partial").exists()  # the killed run's leftovers cleared, nothing staged left
    assert main([*argv, *sizes]) == 2  # the folder exists now
    assert "exists: remove it or choose another --out" in capsys.readouterr().err
