"""Every field of `GenerationConfig` is honoured exactly as `llm.generate` honours it, or refused.

`CASES` gives every field of this transformers' `GenerationConfig` a non-neutral value and says
how to check it (a field missing from `CASES` fails `test_every_field_has_a_case`, so a field
added by a future transformers release fails until it is handled):

- "greedy": decoding through `SpeculativeDecoder` (a noisy-copy SSM drafting chains, a beam
  tree, a fixed topology, and a batch of two prompts of different lengths) equals
  `llm.generate` with the same option, token for token (float64); for processors the option must
  also change the output (otherwise the case proves nothing).
- "sample": the joint distribution of the first tokens sampled through the decoder passes a
  chi-square test against the exact distribution that `llm.generate` itself samples from (its
  own processed scores, `output_scores=True`, enumerated over every prefix).
- "refused": a ValueError that names the field.
Each case passes the option as a keyword argument; `test_generation_config_equals_keywords`
passes the same options in a `GenerationConfig`.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import char_tokenizer, noisy_copy, tiny_llama
from test_sampling_lossless import ALPHA, gof_pvalue, marginal, spread
from transformers import GenerationConfig
from transformers.generation import CompileConfig, ContinuousBatchingConfig, WatermarkingConfig
from transformers.generation.logits_process import LogitsProcessorList, RepetitionPenaltyLogitsProcessor

from specboost.decoder import BeamShape, ChainShape, SpeculativeDecoder, TopologyShape
from specboost.decoder.generation_options import HONOURED, KNOWN, NO_EFFECT, REFUSED
from specboost.decoder.sequence import new_sequence
from specboost.speculator.sampling import LogitsToProbs, SamplingConfig

VOCAB = 64
PROMPT = [5, 9, 11, 2, 30]
NEW = 14
Options = Callable[[list[int]], dict[str, Any]]  # the greedy reference continuation -> options


def _const(**options: Any) -> Options:
    return lambda ref: options


# field -> (kind, options built from the greedy reference continuation `ref` of PROMPT)
CASES: dict[str, tuple[str, Options]] = {
    # lengths and stopping
    "max_length": ("greedy", _const(max_length=len(PROMPT) + 7, max_new_tokens=None)),
    "max_new_tokens": ("greedy", _const(max_new_tokens=9)),
    "min_length": ("greedy", lambda ref: dict(eos_token_id=ref[1], min_length=len(PROMPT) + 8)),
    "min_new_tokens": ("greedy", lambda ref: dict(eos_token_id=ref[1], min_new_tokens=8)),
    "max_time": ("greedy", _const(max_time=600.0)),
    "stop_strings": ("greedy", lambda ref: dict(stop_strings=["@", char_tokenizer().decode(ref[4:6])])),
    "eos_token_id": ("greedy", lambda ref: dict(eos_token_id=[63, ref[3]])),
    "pad_token_id": ("greedy", _const(pad_token_id=7)),
    "bos_token_id": ("greedy", _const(bos_token_id=3)),
    # processors
    "repetition_penalty": ("greedy", _const(repetition_penalty=3.0)),
    "encoder_repetition_penalty": ("greedy", _const(encoder_repetition_penalty=30.0)),
    "no_repeat_ngram_size": ("greedy", _const(no_repeat_ngram_size=1)),
    "encoder_no_repeat_ngram_size": (  # forbids the prompt's tokens, which the first option favours
        "greedy",
        _const(encoder_repetition_penalty=30.0, encoder_no_repeat_ngram_size=1),
    ),
    "bad_words_ids": ("greedy", lambda ref: dict(bad_words_ids=[[ref[0]], [ref[2], ref[3]]])),
    "sequence_bias": ("greedy", lambda ref: dict(sequence_bias={(ref[1],): -50.0, (ref[0], ref[1]): 30.0})),
    "suppress_tokens": ("greedy", lambda ref: dict(suppress_tokens=[ref[1], ref[5]])),
    "begin_suppress_tokens": ("greedy", lambda ref: dict(begin_suppress_tokens=[ref[0]])),
    "forced_bos_token_id": ("greedy", _const(forced_bos_token_id=17)),  # acts on a one-token prompt
    "forced_eos_token_id": ("greedy", _const(forced_eos_token_id=23)),
    "exponential_decay_length_penalty": (
        "greedy",
        lambda ref: dict(
            eos_token_id=min(set(range(VOCAB)) - set(ref)), exponential_decay_length_penalty=(1, 3.0)
        ),
    ),
    "remove_invalid_values": ("greedy", _const(remove_invalid_values=True)),
    "renormalize_logits": ("sample", _const(renormalize_logits=True, temperature=0.8)),
    # sampling and warpers
    "do_sample": ("sample", _const()),
    "temperature": ("sample", _const(temperature=0.6)),
    "top_k": ("sample", _const(top_k=3)),
    "top_p": ("sample", _const(top_p=0.7)),
    "min_p": ("sample", _const(min_p=0.15)),
    "top_h": ("sample", _const(top_h=0.95)),
    "typical_p": ("sample", _const(typical_p=0.95)),
    "epsilon_cutoff": ("sample", _const(epsilon_cutoff=0.1)),
    "eta_cutoff": ("sample", _const(eta_cutoff=0.1)),
    # settings that leave generate's tokens as they are
    "use_cache": ("greedy", _const(use_cache=False)),
    "cache_implementation": ("greedy", _const(cache_implementation="static")),
    "cache_config": ("greedy", _const(cache_config={"max_batch_size": 1})),
    "max_cache_len": ("greedy", _const(max_cache_len=64)),
    "compile_config": ("greedy", _const(compile_config=CompileConfig(fullgraph=False))),
    "disable_compile": ("greedy", _const(disable_compile=True)),
    "prefill_chunk_size": ("greedy", _const(prefill_chunk_size=2)),
    "continuous_batching_config": ("greedy", _const(continuous_batching_config=ContinuousBatchingConfig())),
    "length_penalty": ("greedy", _const(length_penalty=2.0)),
    "early_stopping": ("greedy", _const(early_stopping=True)),
    "low_memory": ("greedy", _const(low_memory=True)),
    "decoder_start_token_id": ("greedy", _const(decoder_start_token_id=3)),
    "return_dict_in_generate": ("greedy", _const(return_dict_in_generate=True)),
    "num_assistant_tokens": ("greedy", _const(num_assistant_tokens=7)),
    "num_assistant_tokens_schedule": ("greedy", _const(num_assistant_tokens_schedule="constant")),
    "assistant_confidence_threshold": ("greedy", _const(assistant_confidence_threshold=0.2)),
    "max_matching_ngram_size": ("greedy", _const(max_matching_ngram_size=3)),
    "assistant_lookbehind": ("greedy", _const(assistant_lookbehind=5)),
    "target_lookbehind": ("greedy", _const(target_lookbehind=5)),
    "transformers_version": ("greedy", _const(transformers_version="0.0.1")),
    "_from_model_config": ("greedy", _const(_from_model_config=True)),
    # refused
    "num_beams": ("refused", _const(num_beams=2)),
    "num_beam_groups": ("refused", _const(num_beams=2, num_beam_groups=2, diversity_penalty=0.5)),
    "diversity_penalty": ("refused", _const(diversity_penalty=0.5)),
    "constraints": ("refused", _const(constraints=["a"])),
    "force_words_ids": ("refused", _const(force_words_ids=[[3]])),
    "penalty_alpha": ("refused", _const(penalty_alpha=0.6, top_k=4)),
    "dola_layers": ("refused", _const(dola_layers="low")),
    "guidance_scale": ("refused", _const(guidance_scale=1.5)),
    "watermarking_config": ("refused", _const(watermarking_config=WatermarkingConfig())),
    "token_healing": ("refused", _const(token_healing=True)),
    "num_return_sequences": ("refused", _const(num_return_sequences=2)),
    "is_assistant": ("refused", _const(is_assistant=True, assistant_confidence_threshold=0.5)),
    "output_scores": ("refused", _const(output_scores=True)),
    "output_logits": ("refused", _const(output_logits=True)),
    "output_attentions": ("refused", _const(output_attentions=True)),
    "output_hidden_states": ("refused", _const(output_hidden_states=True)),
    "prompt_lookup_num_tokens": ("refused", _const(prompt_lookup_num_tokens=3)),
    "assistant_early_exit": ("refused", _const(assistant_early_exit=1)),
    "use_mtp": ("refused", _const(use_mtp=True)),
    "speculation_type": ("refused", _const(speculation_type="dflash")),
    "assistant_ensemble_weight": ("refused", _const(assistant_ensemble_weight=0.5)),
}
# Honoured options whose case must change the greedy output (a case that changes nothing proves
# nothing); these are neutral on a tiny random model or by nature.
NEUTRAL_HERE = {"max_time", "pad_token_id", "bos_token_id", "remove_invalid_values"}
CHANGES_OUTPUT = {n for n, (kind, _) in CASES.items() if kind == "greedy" and n in HONOURED} - NEUTRAL_HERE
ONE_TOKEN_PROMPT = {"forced_bos_token_id"}  # forced BOS acts only at the first position


def test_every_field_has_a_case() -> None:
    """A field of a newer transformers fails here until it is classified and tested."""
    fields = set(GenerationConfig().to_dict())
    assert fields == set(CASES), (
        f"unclassified: {sorted(fields - set(CASES))}; gone: {sorted(set(CASES) - fields)}"
    )
    assert fields == KNOWN, f"decoder/generation_options.py does not classify {sorted(fields - KNOWN)}"
    assert not (HONOURED & NO_EFFECT) and not (HONOURED & set(REFUSED)) and not (NO_EFFECT & set(REFUSED))
    for name, (kind, _) in CASES.items():
        assert (kind == "refused") == (name in REFUSED), name
    assert set(GREEDY) >= CHANGES_OUTPUT and set(GREEDY) >= ONE_TOKEN_PROMPT


# Models ---------------------------------------------------------------------------------------------
@functools.cache
def greedy_models() -> tuple[torch.nn.Module, torch.nn.Module]:
    llm = tiny_llama(layers=2, seed=4, vocab=VOCAB)
    return llm, noisy_copy(llm, scale=0.15, seed=1)


@functools.cache
def tokenizer():
    return char_tokenizer()


def decoders() -> dict[str, SpeculativeDecoder]:
    llm, ssm = greedy_models()
    shapes = {
        "chain": ChainShape(4),
        "beam": BeamShape(2, 3),
        "topology": TopologyShape.from_children_counts([[2], [2, 1], [1, 0, 0]]),
    }
    return {name: SpeculativeDecoder(llm, [ssm], tokenizer(), shape=shape) for name, shape in shapes.items()}


def reference(prompt: list[int], **options: Any) -> list[int]:
    llm, _ = greedy_models()
    options = {"max_new_tokens": NEW, **options}
    options = {k: v for k, v in options.items() if v is not None}
    ids = torch.tensor([prompt])
    out = llm.generate(ids, attention_mask=torch.ones_like(ids), tokenizer=tokenizer(), **options)
    sequences = out.sequences if isinstance(out, dict) or hasattr(out, "sequences") else out
    return sequences[0].tolist()


def decode(dec: SpeculativeDecoder, prompt: list[int], **options: Any) -> list[int]:
    options = {"max_new_tokens": NEW, **options}
    return dec.generate(torch.tensor([prompt]), **options).sequences[0].tolist()


GREEDY = sorted(name for name, (kind, _) in CASES.items() if kind == "greedy")


@pytest.mark.parametrize("field", GREEDY)
def test_greedy_option_equals_generate(field: str) -> None:
    prompt = [5] if field in ONE_TOKEN_PROMPT else PROMPT
    baseline = reference(prompt)
    options = CASES[field][1](baseline[len(prompt) :])
    expected = reference(prompt, **options)
    if field in CHANGES_OUTPUT:
        plain = reference(prompt, **{k: v for k, v in options.items() if k != field})
        assert expected != plain, f"{field}={options} does not change generate's output: a vacuous case"
    for name, dec in decoders().items():
        assert decode(dec, prompt, **options) == expected, f"{field} via {name} differs from llm.generate"
    # A batch: each row equals its own generate (the second, shorter row is left-padded).
    other = [41, 8] if len(prompt) > 1 else [8]
    batch = torch.tensor([prompt, [0] * (len(prompt) - len(other)) + other])
    mask = torch.ones_like(batch)
    mask[1, : len(prompt) - len(other)] = 0
    out = decoders()["chain"].generate(batch, attention_mask=mask, **({"max_new_tokens": NEW} | options))
    for row, row_prompt in enumerate((prompt, other)):
        want = reference(row_prompt, **options)[len(row_prompt) :]
        got = out.sequences[row, len(prompt) :].tolist()[: len(want)]
        assert got == want, f"{field}: batch row {row} differs from llm.generate"


@pytest.mark.parametrize("field", sorted(n for n, (k, _) in CASES.items() if k == "refused"))
def test_refused_option_names_the_field(field: str) -> None:
    dec = decoders()["chain"]
    with pytest.raises(ValueError, match=field):
        decode(dec, PROMPT, **CASES[field][1]([]))


def test_generation_config_equals_keywords() -> None:
    """The same options given in a GenerationConfig (and as the LLM's own) give the same output."""
    dec = decoders()["chain"]
    baseline = reference(PROMPT)[len(PROMPT) :]
    options = dict(repetition_penalty=2.0, suppress_tokens=[baseline[0]], max_new_tokens=NEW)
    expected = reference(PROMPT, **options)
    assert decode(dec, PROMPT, generation_config=GenerationConfig(**options)) == expected
    with pytest.raises(ValueError, match="num_beams"):
        decode(dec, PROMPT, generation_config=GenerationConfig(num_beams=3))


def test_unknown_option_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="unknown generation options"):
        decode(decoders()["chain"], PROMPT, not_an_option=3)


def test_max_time_ends_generation_with_reason_time() -> None:
    out = decoders()["chain"].generate(torch.tensor([PROMPT]), max_new_tokens=200, max_time=0.0)
    assert out.finish_reason == "time" and 1 <= out.stats.new_tokens < 200


# Sampling ------------------------------------------------------------------------------------------
SAMPLE_VOCAB = 6
SAMPLE_PROMPT = [0, 4, 2]
SAMPLES = 400


@functools.cache
def sampling_models() -> tuple[torch.nn.Module, torch.nn.Module]:
    llm = spread(tiny_llama(layers=2, seed=1, vocab=SAMPLE_VOCAB))
    return llm, spread(tiny_llama(layers=1, seed=2, vocab=SAMPLE_VOCAB))


@torch.no_grad()
def generate_distribution(
    options: dict[str, Any],
    length: int,
    llm: torch.nn.Module | None = None,
    prompt: list[int] = SAMPLE_PROMPT,
) -> torch.Tensor:
    """[V] * length: the joint distribution `llm.generate` samples the first `length` tokens after
    `prompt` from, from its own processed scores (`output_scores`), one call per prefix."""
    llm = llm if llm is not None else sampling_models()[0]
    vocab = llm.config.vocab_size
    joint = torch.ones(1, dtype=torch.float64)
    prefixes: list[list[int]] = [[]]
    for _ in range(length):
        rows = []
        for prefix in prefixes:
            ids = torch.tensor([prompt + prefix], device=llm.device)
            out = llm.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=True,
                max_new_tokens=1,
                output_scores=True,
                return_dict_in_generate=True,
                **options,
            )
            rows.append(torch.softmax(out.scores[0][0].double(), -1).cpu())
        joint = (joint[:, None] * torch.stack(rows)).reshape(-1)
        prefixes = [[*p, t] for p in prefixes for t in range(vocab)]
    return joint.reshape([vocab] * length)


SAMPLED = [*sorted(name for name, (kind, _) in CASES.items() if kind == "sample"), "repetition_penalty"]


@pytest.mark.parametrize("field", SAMPLED)
def test_sampled_option_has_generates_distribution(field: str) -> None:
    options = CASES[field][1]([]) if field != "repetition_penalty" else {"repetition_penalty": 3.0}
    llm, ssm = sampling_models()
    exact = generate_distribution(options, 2)
    if field != "do_sample":  # the option must move the distribution, or the check proves nothing
        assert 0.5 * float((exact - generate_distribution({}, 2)).abs().sum()) > 0.02, (
            f"{field} changes nothing"
        )
    dec = SpeculativeDecoder(llm, [ssm], shape=ChainShape(2))
    counts: Counter = Counter()
    accepted = 0
    for seed in range(SAMPLES):
        out = dec.generate(
            torch.tensor([SAMPLE_PROMPT]), max_new_tokens=2, do_sample=True, seed=seed, **options
        )
        counts[tuple(out.sequences[0, len(SAMPLE_PROMPT) :].tolist())] += 1
        accepted += out.stats.accepted_tokens
    assert accepted > 0.05 * SAMPLES, "no draft was accepted: the check would not cover verification"
    assert gof_pvalue(marginal(counts, 2), exact) >= ALPHA


def test_processors_are_transformers_own() -> None:
    """The decoder builds its processors with the LLM's own `_get_logits_processor`."""
    dec = decoders()["chain"]
    row = new_sequence(
        dec, torch.tensor(PROMPT), None, None, {"repetition_penalty": 1.3, "max_new_tokens": 4}, None
    )
    assert isinstance(row.probs.processors, LogitsProcessorList)
    assert [type(p).__name__ for p in row.probs.processors] == ["RepetitionPenaltyLogitsProcessor"]


@pytest.mark.parametrize("penalty", [None, 1.5])
def test_teacher_forced_processing_gives_each_step_its_own_history(penalty: float | None) -> None:
    """LogitsToProbs.along (distillation targets, the bench's TV) equals processing every step
    alone with the tokens before it, with and without a processor that reads the history."""
    config = SamplingConfig(do_sample=True, temperature=0.7)
    processors = config.warpers()
    if penalty is not None:
        processors.insert(0, RepetitionPenaltyLogitsProcessor(penalty))
    probs = LogitsToProbs(config, processors)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 11, (2, 7), generator=gen)
    logits = torch.randn(2, 4, 11, generator=gen)  # predict ids[:, 3:7]
    expected = torch.stack([probs(logits[:, t], ids[:, : 3 + t]) for t in range(4)], 1)
    assert probs.needs_history == (penalty is not None)
    torch.testing.assert_close(probs.along(logits, ids, 3), expected)
