"""Bad input fails early, with an error that says what is wrong and what to change."""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import VOCAB, tiny_gpt2, tiny_llama, tiny_opt
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    BertConfig,
    BertModel,
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    T5Config,
    T5ForConditionalGeneration,
)

from specboost.decoder import BeamShape, ChainShape, Rule, SpeculativeDecoder, TopologyShape
from specboost.decoder.sequence import sequence_rule

PROMPT = torch.tensor([[3, 4, 5]])


@functools.cache
def llm() -> PreTrainedModel:
    return tiny_llama(layers=2, seed=0)


@functools.cache
def ssm(seed: int = 1) -> PreTrainedModel:
    return tiny_llama(layers=1, seed=seed)


def word_tokenizer(words: list[str]) -> PreTrainedTokenizerFast:
    """A small word-level tokenizer over `words` (the first one is the unknown token)."""
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token=words[0])


def tiny_bert() -> BertModel:
    config = BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
    )
    return BertModel(config).double().eval()


def tiny_t5() -> T5ForConditionalGeneration:
    config = T5Config(vocab_size=VOCAB, d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8)
    return T5ForConditionalGeneration(config).double().eval()


# Models -------------------------------------------------------------------------------------------
def test_vocabulary_mismatch_names_both_models() -> None:
    big_llm = tiny_gpt2(layers=1, vocab=80)
    big_llm.config._name_or_path = "org/target-llm"
    small = tiny_llama(layers=1, vocab=VOCAB)
    small.config._name_or_path = "org/draft-ssm"
    with pytest.raises(ValueError, match="vocabulary mismatch") as info:
        SpeculativeDecoder(big_llm, [small])
    message = str(info.value)
    assert "GPT2LMHeadModel(org/target-llm)" in message and "LlamaForCausalLM(org/draft-ssm)" in message
    assert "SSM 0" in message and "64" in message and "80" in message


def test_vocabulary_mismatch_reports_the_offending_ssm_of_a_pool() -> None:
    with pytest.raises(ValueError, match=r"SSM 2 OPTForCausalLM predicts 65 tokens.*predicts 64"):
        SpeculativeDecoder(llm(), [ssm(1), ssm(2), tiny_opt(layers=1, vocab=VOCAB + 1)])


def test_ssms_on_another_device_than_the_llm_are_refused_with_the_fix() -> None:
    llm, ssm = tiny_llama(layers=1), tiny_llama(layers=1, seed=1).to("meta")
    with pytest.raises(
        ValueError, match=r"SSM 0 is on meta but the LLM on cpu: move it there first \(ssm.to\('cpu'\)"
    ):
        SpeculativeDecoder(llm, [ssm])


def test_tokenizer_mismatch() -> None:
    words = [f"w{i}" for i in range(VOCAB)]
    llm_tok = word_tokenizer(words)
    other = word_tokenizer([*words[:-1], "different"])  # same size, one word differs
    with pytest.raises(ValueError, match=r"tokenizer mismatch: SSM 1 .*differs from the LLM") as info:
        SpeculativeDecoder(llm(), [ssm(1), ssm(2)], tokenizer=llm_tok, ssm_tokenizers=[llm_tok, other])
    assert "LlamaForCausalLM" in str(info.value)
    # The same vocabulary (even another tokenizer object) is fine, and None skips the check.
    decoder = SpeculativeDecoder(
        llm(), [ssm(1), ssm(2)], tokenizer=llm_tok, ssm_tokenizers=[word_tokenizer(words), None]
    )
    assert decoder.generate(PROMPT, max_new_tokens=3).stats.new_tokens == 3


@pytest.mark.parametrize("role", ["LLM", "SSM 0"])
@pytest.mark.parametrize("factory", [tiny_bert, tiny_t5], ids=["bert-encoder", "t5-encoder-decoder"])
def test_non_causal_models_are_refused(role: str, factory) -> None:
    model = factory()
    name = type(model).__name__
    models_ = (model, [ssm()]) if role == "LLM" else (llm(), [model])
    with pytest.raises(ValueError, match=rf"the {role} {name} is not a causal language model") as info:
        SpeculativeDecoder(*models_)
    assert "AutoModelForCausalLM" in str(info.value)


def test_non_models_are_refused() -> None:
    with pytest.raises(TypeError, match="the LLM must be a transformers PreTrainedModel, got Linear"):
        SpeculativeDecoder(torch.nn.Linear(2, 2), [ssm()])
    with pytest.raises(TypeError, match="the SSM 0 must be a transformers PreTrainedModel, got str"):
        SpeculativeDecoder(llm(), ["gpt2"])


def test_empty_ssm_pool() -> None:
    with pytest.raises(ValueError, match="at least one SSM"):
        SpeculativeDecoder(llm(), [])


# Prompts and lengths ------------------------------------------------------------------------------
def test_empty_prompt() -> None:
    decoder = SpeculativeDecoder(llm(), [ssm()])
    with pytest.raises(ValueError, match="the prompt is empty"):
        decoder.generate(torch.zeros(1, 0, dtype=torch.long), max_new_tokens=4)
    with pytest.raises(ValueError, match="the prompt is empty"):
        decoder.generate(PROMPT, attention_mask=torch.zeros_like(PROMPT), max_new_tokens=4)


def test_left_padding_is_dropped_with_the_attention_mask() -> None:
    decoder = SpeculativeDecoder(llm(), [ssm()])
    padded = torch.tensor([[0, 0, 3, 4, 5]])
    mask = torch.tensor([[0, 0, 1, 1, 1]])
    out = decoder.generate(padded, attention_mask=mask, max_new_tokens=5)
    assert out.sequences[0, :3].tolist() == [3, 4, 5]
    assert out.sequences.tolist() == decoder.generate(PROMPT, max_new_tokens=5).sequences.tolist()


@pytest.mark.parametrize("bad", [0, -1, -10])
def test_max_new_tokens_must_be_positive(bad: int) -> None:
    decoder = SpeculativeDecoder(llm(), [ssm()])
    with pytest.raises(ValueError, match=rf"max_new_tokens must be a positive integer, got {bad}"):
        decoder.generate(PROMPT, max_new_tokens=bad)


def test_max_new_tokens_defaults_as_in_generate() -> None:
    """Nothing set: transformers' default of 20 new tokens, as `llm.generate`."""
    out = SpeculativeDecoder(llm(), [ssm()]).generate(PROMPT)
    assert torch.equal(out.sequences, llm().generate(PROMPT, do_sample=False))


def test_prompt_longer_than_the_context() -> None:
    gpt2 = tiny_gpt2(layers=1)  # 128 positions
    decoder = SpeculativeDecoder(gpt2, [tiny_gpt2(layers=1, seed=1)])
    with pytest.raises(ValueError, match=r"the prompt has 129 tokens but the LLM's context holds 128"):
        decoder.generate(torch.randint(0, VOCAB, (1, 129)), max_new_tokens=2)
    with pytest.raises(ValueError, match="shorten the prompt"):
        decoder.generate(torch.randint(0, VOCAB, (1, 400)), max_new_tokens=2)


def test_batch_larger_than_one_decodes_every_row() -> None:
    """A batch runs ragged batched decoding (tests/test_batched.py); what it cannot do it refuses."""
    decoder = SpeculativeDecoder(llm(), [ssm()])
    out = decoder.generate(torch.tensor([[1, 2, 3], [4, 5, 6]]), max_new_tokens=4)
    assert out.sequences.shape == (2, 7) and out.finish_reasons == ["length", "length"]
    with pytest.raises(ValueError, match=r"input_ids must be \[batch, length\]"):
        decoder.generate(torch.zeros(0, 3, dtype=torch.long), max_new_tokens=4)
    stairs = SpeculativeDecoder(llm(), [ssm()], verification="stairs")
    with pytest.raises(ValueError, match="verification='stairs' is for one sequence"):
        stairs.generate(torch.tensor([[1, 2, 3], [4, 5, 6]]), max_new_tokens=4)


def test_input_ids_of_the_wrong_rank() -> None:
    decoder = SpeculativeDecoder(llm(), [ssm()])
    with pytest.raises(ValueError, match=r"input_ids must be \[batch, length\]"):
        decoder.generate(torch.zeros(1, 2, 3, dtype=torch.long), max_new_tokens=4)
    # A 1-D prompt is read as a batch of one.
    assert decoder.generate(PROMPT[0], max_new_tokens=2).sequences.shape == (1, 5)


# Option combinations ------------------------------------------------------------------------------
TOPOLOGY = TopologyShape.from_children_counts([[2], [1, 1]])

BAD_COMBINATIONS = [
    # (constructor kwargs, number of SSMs, generate kwargs, error message pattern)
    pytest.param(
        dict(shape=BeamShape(2, 3), rule="mss"),
        1,
        dict(do_sample=True),
        r"rule='mss' is only lossless on trees drafted as \['sampled'\].*'beam'.*rule='target'",
        id="mss-with-beam-tree",
    ),
    pytest.param(
        dict(shape=TOPOLOGY, rule="mss"),
        1,
        dict(do_sample=True),
        r"rule='mss' is only lossless.*'sampled_without_replacement'",
        id="mss-with-topology-tree",
    ),
    pytest.param(
        dict(shape=TOPOLOGY, rule="without_replacement"),
        2,
        dict(do_sample=True),
        r"rule='without_replacement'.*works with a single SSM; use rule='target' for a pool",
        id="without-replacement-with-2-ssms",
    ),
    pytest.param(
        dict(shape=ChainShape(3), rule="without_replacement"),
        1,
        dict(do_sample=True),
        r"rule='without_replacement' is only lossless on trees drafted as \['sampled_without_replacement'\]",
        id="without-replacement-with-chain",
    ),
    *(
        pytest.param(
            dict(shape=shape, rule="k_sequential"),
            1,
            dict(do_sample=True),
            rf"rule='k_sequential' is only lossless on trees drafted as \['sampled'\], .*'{kind}'.*'target'",
            id=f"k-sequential-with-{kind}",
        )
        for kind, shape in [("beam", BeamShape(2, 2)), ("sampled_without_replacement", TOPOLOGY)]
    ),
    pytest.param(
        dict(shape=ChainShape(3, samples=2), rule="k_sequential"),
        1,
        dict(do_sample=False),
        r"rule='k_sequential' is a sampling rule; set do_sample=True",
        id="k-sequential-greedy",
    ),
    pytest.param(
        dict(rule="greedy"),
        1,
        dict(do_sample=True),
        r"rule='greedy' verifies greedy decoding",
        id="greedy-sampling",
    ),
    pytest.param(
        dict(rule="mss"),
        1,
        dict(do_sample=False),
        r"rule='mss' is a sampling rule; set do_sample=True",
        id="mss-greedy",
    ),
    pytest.param(
        dict(rule="target", shape=BeamShape()),
        1,
        dict(),
        r"rule='target' is a sampling rule",
        id="target-greedy",
    ),
    pytest.param(
        dict(verification="stairs"),
        1,
        dict(do_sample=True),
        r"verification='stairs' is a greedy baseline; use do_sample=False",
        id="stairs-sampling",
    ),
    pytest.param(
        dict(verification="stairs", shape=BeamShape(2, 2)),
        1,
        dict(),
        r"verification='stairs' validates one greedy chain: use a single SSM with ChainShape",
        id="stairs-beam",
    ),
    pytest.param(
        dict(verification="stairs", shape=TOPOLOGY),
        1,
        dict(),
        r"verification='stairs' validates one greedy chain",
        id="stairs-topology",
    ),
    pytest.param(
        dict(verification="stairs", shape=ChainShape(3)),
        2,
        dict(),
        r"verification='stairs' validates one greedy chain: use a single SSM",
        id="stairs-2-ssms",
    ),
    pytest.param(
        dict(),
        1,
        dict(stop_strings=["\n\n"]),
        r"stop_strings need a tokenizer: pass tokenizer= to SpeculativeDecoder",
        id="stop-strings-without-tokenizer",
    ),
    pytest.param(
        dict(),
        1,
        dict(generation_config=GenerationConfig(num_beams=4)),
        r"not supported by SpeculativeDecoder: num_beams=4",
        id="num-beams",
    ),
    pytest.param(
        dict(), 1, dict(do_sample=True, temperature=0.0), r"temperature must be > 0", id="zero-temperature"
    ),
    pytest.param(dict(), 1, dict(do_sample=True, top_p=1.5), r"top_p must be in \(0, 1\]", id="top-p"),
    pytest.param(dict(), 1, dict(do_sample=True, top_k=-2), r"top_k must be >= 0", id="top-k"),
]


@pytest.mark.parametrize(("init", "num_ssms", "gen", "message"), BAD_COMBINATIONS)
def test_invalid_option_combinations(init: dict, num_ssms: int, gen: dict, message: str) -> None:
    decoder = SpeculativeDecoder(llm(), [ssm(i + 1) for i in range(num_ssms)], **init)
    with pytest.raises(ValueError, match=message):
        decoder.generate(PROMPT, max_new_tokens=4, **gen)


def test_valid_sampling_combinations_run() -> None:
    """The counterparts of the refused combinations: the lossless rule for each tree kind."""
    for init, num_ssms in [
        (dict(shape=BeamShape(2, 2), rule="target"), 1),
        (dict(shape=BeamShape(2, 2)), 2),  # rule=None maps a beam tree to target sampling
        (dict(shape=ChainShape(3), rule="mss"), 2),
        (dict(shape=ChainShape(3), rule="k_sequential"), 2),
        (dict(shape=ChainShape(2, samples=3), rule="k_sequential"), 1),
        (dict(shape=ChainShape(2, samples=3), rule="mss"), 1),
        (dict(shape=ChainShape(2, samples=2)), 2),  # rule=None maps sampled chains to mss
        (dict(shape=TOPOLOGY, rule="without_replacement"), 1),
        (dict(shape=TOPOLOGY, rule="target"), 2),  # what the refusal of a topology pool suggests
        (dict(shape=TOPOLOGY), 1),
        (dict(shape=TOPOLOGY), 3),  # rule=None maps a sampled topology pool to target sampling
    ]:
        decoder = SpeculativeDecoder(llm(), [ssm(i + 1) for i in range(num_ssms)], **init)
        out = decoder.generate(PROMPT, max_new_tokens=4, do_sample=True, seed=0)
        assert out.stats.new_tokens == 4 and out.finish_reason == "length"


def test_unknown_verification_and_rule_names() -> None:
    with pytest.raises(ValueError, match="verification must be 'tree' or 'stairs', got 'bogus'"):
        SpeculativeDecoder(llm(), [ssm()], verification="bogus")
    with pytest.raises(ValueError, match="'bogus' is not a valid Rule"):
        SpeculativeDecoder(llm(), [ssm()], rule="bogus")
    with pytest.raises(ValueError, match="verification='stairs' is greedy only"):
        SpeculativeDecoder(llm(), [ssm()], verification="stairs", rule="mss")


def test_options_in_the_llms_own_generation_config() -> None:
    """The LLM's own generation_config is honoured like generate honours it, refused options too."""
    model = tiny_llama(layers=1, seed=3)
    model.generation_config.repetition_penalty = 1.5
    decoder = SpeculativeDecoder(model, [ssm()])
    out = decoder.generate(PROMPT, max_new_tokens=12)
    assert torch.equal(out.sequences, model.generate(PROMPT, max_new_tokens=12))
    model.generation_config.num_beams = 2
    with pytest.raises(ValueError, match=r"num_beams=2 \(beam search"):
        decoder.generate(PROMPT, max_new_tokens=3)
    # An explicit neutral value overrides it.
    out = decoder.generate(PROMPT, max_new_tokens=3, generation_config=GenerationConfig(num_beams=1))
    assert out.stats.new_tokens == 3


def test_default_rule_per_tree_kind_and_pool_size() -> None:
    decoder = SpeculativeDecoder(llm(), [ssm(1), ssm(2)], shape=TOPOLOGY)
    assert sequence_rule(decoder, do_sample=True) is Rule.TARGET
    decoder = SpeculativeDecoder(llm(), [ssm(1)], shape=TOPOLOGY)
    assert sequence_rule(decoder, do_sample=True) is Rule.WITHOUT_REPLACEMENT
    assert sequence_rule(decoder, do_sample=False) is Rule.GREEDY
