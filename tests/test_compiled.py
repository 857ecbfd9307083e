"""`SpeculativeDecoder(compile=True)`: the LLM's verify pass and the SSMs' drafting passes run as
torch.compile'd graphs at bucketed shapes (nodes padded; the row padding of compiled caches is
checked without compiling in tests/test_kv_cache.py); greedy output is still `llm.generate`'s,
token for token. Compiling on the CPU takes about a minute; a batch is the `slow` test, and the
CUDA run with CUDA graphs is in tests/test_gpu.py."""

from __future__ import annotations

import pytest
import torch
from conftest import noisy_copy, tiny_llama

from specboost.decoder import ChainShape, SpeculativeDecoder, compilation

PROMPTS = [[3, 17, 42, 8, 8, 51, 23], [12, 5, 60]]


def compiled_decoder(ssms: int = 1, **options: object) -> SpeculativeDecoder:
    llm = tiny_llama(layers=2, seed=0).float()
    pool = [noisy_copy(llm, 0.1, seed=1 + i) for i in range(ssms)]
    return SpeculativeDecoder(llm, pool, shape=ChainShape(3), compile=True, **options)


@pytest.mark.parametrize(
    "pool", [dict(), dict(ssms=3), dict(ssms=3, strategy="majority")], ids=["chain", "pool", "majority"]
)
def test_compiled_decoding_equals_generate(pool: dict) -> None:
    """One SSM, and a stacked pool of 3 (its rows are not padded: blocks of one row per SSM)."""
    dec = compiled_decoder(**pool)
    llm = dec.llm
    assert dec.calls.enabled and dec.calls.get(llm) is not None
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        expected = llm.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12)
        assert torch.equal(dec.generate(ids, max_new_tokens=12).sequences, expected)


@pytest.mark.slow
def test_compiled_batch_equals_generate_per_row() -> None:
    dec = compiled_decoder()
    llm, prompts = dec.llm, PROMPTS
    ids = torch.tensor([prompts[0], [0] * 4 + prompts[1]])
    mask = torch.tensor([[1] * 7, [0] * 4 + [1] * 3])
    out = dec.generate(ids, attention_mask=mask, max_new_tokens=12)
    for row, prompt in enumerate(prompts):
        single = torch.tensor([prompt])
        expected = llm.generate(
            single, attention_mask=torch.ones_like(single), do_sample=False, max_new_tokens=12
        )
        assert out.sequences[row, 7:].tolist() == expected[0, len(prompt) :].tolist()


def test_compile_setting_is_checked() -> None:
    llm = tiny_llama(layers=1, seed=0)
    with pytest.raises(ValueError, match='compile must be True, False or "auto"'):
        SpeculativeDecoder(llm, [llm], compile="yes")
    assert not SpeculativeDecoder(llm, [llm]).calls.enabled  # "auto" on the CPU: eager


def test_compile_without_a_compiler_names_the_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compilation.shutil, "which", lambda name: None)
    llm = tiny_llama(layers=1, seed=0)
    with pytest.raises(RuntimeError, match=r"needs a C\+\+ compiler .* or use compile=False"):
        SpeculativeDecoder(llm, [llm], compile=True)


def test_every_model_keeps_its_compiled_graphs_apart() -> None:
    """torch.compile caps the graphs of one code object (recompile_limit): each model's tree pass
    is a copy of its own, so a process compiling many models (the benchmark suite) never falls
    back to eager."""
    llm, ssm = tiny_llama(layers=1, seed=0), tiny_llama(layers=1, seed=1)
    calls = compilation.ModelCalls(llm.device, enabled=True)
    codes = {id(calls.get(model)._torchdynamo_orig_callable.__code__) for model in (llm, ssm)}
    assert len(codes) == 2 and calls.get(llm) is calls.get(llm)
