"""`strategy="plain"` (speculator/no_draft.py): speculation off, through the same decode loop. No
SSMs, nothing drafted, one LLM token per step: greedy output equals `llm.generate` for one row, a
ragged batch and the serving engine, and sampled output equals `llm.generate(do_sample=True)`
token for token under the same seed (the target rule on a root-only tree is one multinomial draw
from p per step, as transformers draws it)."""

from __future__ import annotations

import pytest
import torch
from test_batched import prompts
from test_greedy_equivalence import ARCHS, CASES, check_stats, llm_for, noisy_ssm, prompt_ids, reference

from specboost.decoder import ChainShape, DecodeStats, SpeculativeDecoder
from specboost.decoder.engine import Engine, EngineConfig
from specboost.decoder.strategies import STRATEGIES
from specboost.speculator.beam_search import left_pad

TIMEOUT = 60.0


def plain(arch: str, seed: int = 0) -> SpeculativeDecoder:
    return SpeculativeDecoder(llm_for(arch, seed), [], strategy="plain")


def check_plain_stats(stats: DecodeStats, new_tokens: int) -> None:
    assert stats.llm_steps == stats.new_tokens == new_tokens  # one LLM token per step
    assert stats.draft_tokens == stats.accepted_tokens == stats.draft_levels == 0
    assert stats.match_lengths == [0] * new_tokens
    assert not stats.proposed_per_ssm and stats.strategy == {"strategy": "plain"}


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_generate(arch: str) -> None:
    for llm_seed, prompt_seed, length, max_new in CASES:
        dec = plain(arch, llm_seed)
        ids = prompt_ids(prompt_seed, length)
        out = dec.generate(ids, max_new_tokens=max_new, eos_token_id=None)
        assert torch.equal(out.sequences, reference(arch, llm_seed, ids, max_new))
        check_stats(out, length, num_ssms=0)
        check_plain_stats(out.stats, max_new)


@pytest.mark.parametrize("arch", ARCHS)
def test_batch_equals_generate_per_row(arch: str) -> None:
    rows = prompts(1)
    ids, mask = left_pad(rows, pad_id=0)
    out = plain(arch).generate(ids, attention_mask=mask, max_new_tokens=13, do_sample=False)
    width = ids.shape[1]
    for b, prompt in enumerate(rows):
        expected = reference(arch, 0, torch.tensor([prompt]), 13)[0, len(prompt) :].tolist()
        assert out.sequences[b, width:].tolist() == expected
        check_plain_stats(out.stats.sequences[b], 13)
    assert out.stats.llm_steps == 13  # every row verified in each pass


@pytest.mark.parametrize("pipeline", [True, False], ids=["pipelined", "sequential"])
def test_engine_serves_plain_decoding(pipeline: bool) -> None:
    rows = prompts(2, (1, 6, 3, 17, 5))
    config = EngineConfig(batch_size=2, num_groups=2, pipeline=pipeline)
    with Engine(plain("llama"), config) as engine:
        results = engine.run(rows, timeout=TIMEOUT, max_new_tokens=9)
    for prompt, result in zip(rows, results, strict=True):
        assert (
            result.new_tokens == reference("llama", 0, torch.tensor([prompt]), 9)[0, len(prompt) :].tolist()
        )
        check_plain_stats(result.stats, 9)
    assert engine.stats.draft_tokens == 0 and engine.stats.new_tokens == 9 * len(rows)


@pytest.mark.parametrize("options", [dict(temperature=0.9), dict(temperature=1.3, top_k=8, top_p=0.9)])
def test_sampling_equals_generate_under_the_same_seed(options: dict) -> None:
    llm, dec = llm_for("gpt2", 0), plain("gpt2")
    ids = prompt_ids(4, 5)
    for seed in range(3):
        torch.manual_seed(seed)  # transformers samples from the global stream
        expected = llm.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=True, **options
        )
        out = dec.generate(ids, max_new_tokens=16, do_sample=True, seed=seed, **options)
        assert torch.equal(out.sequences, expected)


def test_ssms_and_strategies_are_matched() -> None:
    assert "plain" in STRATEGIES
    llm = llm_for("llama", 0)
    with pytest.raises(ValueError, match=r"strategy='pool' needs at least one SSM.*strategy='plain'"):
        SpeculativeDecoder(llm, [])
    with pytest.raises(ValueError, match="strategy='majority' needs at least one SSM"):
        SpeculativeDecoder(llm, [], strategy="majority")
    with pytest.raises(ValueError, match=r"strategy='plain' drafts nothing.*pass ssms=\[\]"):
        SpeculativeDecoder(llm, [noisy_ssm("llama", 0, 0.1, 0)], strategy="plain")
    with pytest.raises(ValueError, match="drop shape="):
        SpeculativeDecoder(llm, [], strategy="plain", shape=ChainShape(3))
    with pytest.raises(ValueError, match="length_controller"):
        SpeculativeDecoder(llm, [], strategy="plain", length_controller="bass")
