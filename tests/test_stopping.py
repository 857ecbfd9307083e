"""Stopping criteria: EOS, max_new_tokens, stop strings, the context limit."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, char_tokenizer, tiny_gpt2, tiny_llama
from transformers import GenerationConfig

from specboost.decoder import ChainShape, SpeculativeDecoder
from specboost.decoder.stopping import StopCriteria


def test_stop_criteria_keeps_the_stopping_token_and_nothing_after() -> None:
    stop = StopCriteria(max_new_tokens=10, eos_token_ids=frozenset({7}))
    assert stop.extend([1, 2]) == [1, 2] and stop.finish_reason is None
    assert stop.extend([3, 7, 4, 5]) == [3, 7]
    assert stop.finish_reason == "eos" and stop.generated == [1, 2, 3, 7]
    assert stop.extend([1]) == []


def test_stop_criteria_length() -> None:
    stop = StopCriteria(max_new_tokens=3)
    assert stop.extend([1, 2, 3, 4]) == [1, 2, 3]
    assert stop.finish_reason == "length"


def test_stop_string_cuts_after_the_completing_token() -> None:
    llm, ssm, tok = tiny_llama(2, 0), tiny_llama(1, 1), char_tokenizer()
    prompt = torch.tensor([[5, 9, 11]])
    ref = llm.generate(prompt, do_sample=False, max_new_tokens=20)[0, 3:].tolist()
    stop_word = tok.decode([ref[6]])
    first = ref.index(ref[6])
    dec = SpeculativeDecoder(llm, [ssm], tokenizer=tok, shape=ChainShape(3))
    out = dec.generate(prompt, max_new_tokens=20, stop_strings=[stop_word])
    assert out.finish_reason == "stop_string"
    assert out.sequences[0, 3:].tolist() == ref[: first + 1]


def test_generation_ends_at_the_llm_context() -> None:
    llm, ssm = tiny_gpt2(2, 0), tiny_gpt2(1, 1)  # 128 positions
    prompt = torch.randint(0, VOCAB, (1, 120))
    out = SpeculativeDecoder(llm, [ssm], shape=ChainShape(4)).generate(prompt, max_new_tokens=50)
    # The last token comes from the logits at position 127: 129 tokens in all, as with generate.
    assert out.sequences.shape[1] == 129
    assert out.finish_reason == "length"
    ref = llm.generate(prompt, do_sample=False, max_new_tokens=9)
    assert torch.equal(out.sequences, ref)


def test_ssm_with_a_shorter_context_than_the_llm_stops_drafting_but_decoding_goes_on() -> None:
    llm, ssm = tiny_llama(2, 0), tiny_gpt2(1, 1)
    ssm.config.n_positions = ssm.config.max_position_embeddings = 16
    ssm = type(ssm)(ssm.config).double().eval()  # a 16-position GPT-2
    prompt = torch.randint(0, VOCAB, (1, 7))
    ref = llm.generate(prompt, do_sample=False, max_new_tokens=30)
    out = SpeculativeDecoder(llm, [ssm], shape=ChainShape(4)).generate(prompt, max_new_tokens=30)
    assert torch.equal(out.sequences, ref)
    # Once 16 tokens are verified the SSM cannot draft: every later step yields one token.
    assert out.stats.llm_steps >= 37 - 16


@pytest.mark.parametrize("max_new_tokens", [1, 2, 5])
def test_max_new_tokens_is_exact(max_new_tokens: int) -> None:
    llm = tiny_llama(2, 0)
    prompt = torch.tensor([[3, 4]])
    out = SpeculativeDecoder(llm, [llm], shape=ChainShape(4)).generate(prompt, max_new_tokens=max_new_tokens)
    assert out.sequences.shape[1] == 2 + max_new_tokens
    assert out.stats.new_tokens == max_new_tokens and out.finish_reason == "length"


def test_stats_to_dict_is_plain_data() -> None:
    import json

    llm = tiny_llama(2, 0)
    out = SpeculativeDecoder(llm, [llm], shape=ChainShape(2)).generate(
        torch.tensor([[3, 4]]), max_new_tokens=6
    )
    data = json.loads(json.dumps(out.stats.to_dict()))
    assert data["new_tokens"] == 6 and data["llm_steps"] == 2 and data["tokens_per_step"] == 3.0
    assert data["acceptance_rate_per_ssm"] == {"0": 1.0}


def test_generation_config_supplies_unset_options_and_arguments_override_it() -> None:
    llm, ssm = tiny_llama(2, 0), tiny_llama(1, 1)
    prompt = torch.tensor([[5, 9, 11]])
    ref = llm.generate(prompt, do_sample=False, max_new_tokens=12)
    eos = ref[0, 3 + 5].item()
    dec = SpeculativeDecoder(llm, [ssm], shape=ChainShape(3))
    config = GenerationConfig(max_new_tokens=12, do_sample=False, eos_token_id=eos)
    out = dec.generate(prompt, generation_config=config)
    assert out.finish_reason == "eos" and out.sequences[0, -1].item() == eos
    out = dec.generate(prompt, generation_config=config, eos_token_id=[], max_new_tokens=12)
    assert torch.equal(out.sequences, ref) and out.finish_reason == "length"
    # Nothing set: generate's default of 20 new tokens.
    assert torch.equal(dec.generate(prompt).sequences, llm.generate(prompt, do_sample=False))
