"""Generation options: a `GenerationConfig` resolved exactly as `model.generate` resolves it, and
every field either honoured or refused (ALGORITHMS.md section 2, "Logits processing").

The options of one `generate` call are merged as `generate` merges them (explicit arguments >
the given `generation_config` > the LLM's own > transformers' global defaults, e.g. top_k=50
when sampling), lengths are derived as `generate` derives them (`max_length` = prompt +
`max_new_tokens`, or 20 new tokens by default), and the logits processors are transformers'
own, built by the LLM's `_get_logits_processor` in `generate`'s order. The verifier applies them
to every tree node with that node's own history (`LogitsToProbs.tree_scores`), so greedy output
equals `generate`'s and sampled output has its distribution.

Every field of `GenerationConfig` is in exactly one of `HONOURED`, `NO_EFFECT` (settings that do
not change the tokens `generate` returns for greedy or sampled decoding) and `REFUSED` (a
non-neutral value raises a `ValueError` naming the field); a field this module does not know
(a newer transformers) is refused too, until it is classified. Besides the config, these are
private methods of transformers' `GenerationMixin` (pinned to transformers 5); the option-walk
test in tests/test_generation_options.py fails when one of them changes behaviour.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedModel

from specboost.speculator.sampling import LogitsToProbs, SamplingConfig

HONOURED = frozenset(
    {
        # lengths and stopping
        "max_length",
        "max_new_tokens",
        "min_length",
        "min_new_tokens",
        "max_time",
        "stop_strings",
        "eos_token_id",
        "pad_token_id",
        "bos_token_id",
        # decoding mode and warpers
        "do_sample",
        "temperature",
        "top_k",
        "top_p",
        "min_p",
        "top_h",
        "typical_p",
        "epsilon_cutoff",
        "eta_cutoff",
        # logits processors
        "repetition_penalty",
        "encoder_repetition_penalty",
        "no_repeat_ngram_size",
        "encoder_no_repeat_ngram_size",
        "bad_words_ids",
        "sequence_bias",
        "suppress_tokens",
        "begin_suppress_tokens",
        "forced_bos_token_id",
        "forced_eos_token_id",
        "exponential_decay_length_penalty",
        "remove_invalid_values",
        "renormalize_logits",
    }
)
NO_EFFECT = frozenset(
    {
        # caches and compilation: same tokens, other speed
        "use_cache",
        "cache_implementation",
        "cache_config",
        "max_cache_len",
        "compile_config",
        "disable_compile",
        "prefill_chunk_size",
        "continuous_batching_config",
        # beam-search settings, unused at num_beams=1 (as in `generate`)
        "length_penalty",
        "early_stopping",
        "low_memory",
        # encoder-decoder only
        "decoder_start_token_id",
        # the output is always a SpeculativeOutput / BatchedOutput
        "return_dict_in_generate",
        # tuning of transformers' own assistant model, which is not used
        "num_assistant_tokens",
        "num_assistant_tokens_schedule",
        "assistant_confidence_threshold",
        "max_matching_ngram_size",
        "assistant_lookbehind",
        "target_lookbehind",
        # metadata
        "transformers_version",
        "_from_model_config",
    }
)
_BEAMS = "beam search is not speculative decoding: use num_beams=1 (greedy or sampling)"
_ASSISTED = (
    "it selects transformers' own assisted generation; SpeculativeDecoder speculates with its SSMs: drop it"
)
_UNKNOWN = "this specboost does not know the option, so it cannot promise to honour it"
_OUTPUTS = (
    "SpeculativeDecoder returns sequences and decoding statistics, not per-step scores, logits, "
    "attentions or hidden states: drop it (run llm.generate for those)"
)
# field -> (the values that leave it off, why any other value is refused)
REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "num_beams": ((None, 1), _BEAMS),
    "num_beam_groups": ((None, 1), _BEAMS),
    "diversity_penalty": ((None, 0.0), _BEAMS),
    "constraints": ((None,), "constrained beam search is not supported: drop it"),
    "force_words_ids": ((None,), "constrained beam search is not supported: drop it"),
    "penalty_alpha": ((None, 0.0), "contrastive search is not supported: drop it"),
    "dola_layers": ((None,), "DoLa decoding is not supported: drop it"),
    "guidance_scale": (
        (None, 1.0),
        "classifier-free guidance (an unconditional pass per node) is not supported",
    ),
    "watermarking_config": ((None,), "watermarking is not supported: drop it"),
    "token_healing": ((None, False), "token healing rewrites the prompt, which is not supported: drop it"),
    "is_assistant": (
        (None, False),
        "it makes the LLM an assistant of transformers' assisted generation (stopping on low confidence)",
    ),
    "num_return_sequences": (
        (None, 1),
        "one sequence per prompt row: repeat the prompt in the batch for several samples",
    ),
    "output_scores": ((None, False), _OUTPUTS),
    "output_logits": ((None, False), _OUTPUTS),
    "output_attentions": ((None, False), _OUTPUTS),
    "output_hidden_states": ((None, False), _OUTPUTS),
    "prompt_lookup_num_tokens": ((None,), _ASSISTED),
    "assistant_early_exit": ((None,), _ASSISTED),
    "use_mtp": ((None, False), _ASSISTED),
    "speculation_type": ((None,), _ASSISTED),
    "assistant_ensemble_weight": (
        (None,),
        "it makes verification lossy; SpeculativeDecoder is lossless: drop it",
    ),
}
KNOWN = HONOURED | NO_EFFECT | frozenset(REFUSED)


@dataclass(frozen=True)
class GenerationSettings:
    """One `generate` call's options, resolved for a prompt of a given length."""

    config: GenerationConfig  # resolved as `generate` resolves it (not serialisable: holds tensors)
    probs: LogitsToProbs  # transformers' processors for this prompt
    max_new_tokens: int
    eos_token_ids: frozenset[int]
    stop_strings: tuple[str, ...]
    max_time: float | None  # seconds, or None
    pad_token_id: int | None

    @property
    def sampling(self) -> SamplingConfig:
        return self.probs.config


def requested_sampling(llm: PreTrainedModel, **options: Any) -> SamplingConfig:
    """The sampling `generate(do_sample=True, **options)` applies for this LLM: the options given
    (None: unset) over the LLM's generation config over transformers' defaults (top_k=50), as
    `resolve` merges them for a request. Offline estimates of sampled acceptance (the predictor's
    labels, Sequoia's acceptance vectors) measure p and q under these settings: taken at the
    temperature alone, the tiny fixture's labels rated SSM 0's sampled chain of 4 at 1.77 tokens
    where decoding at T = 0.8 accepted about 3 (3.17 with top_k=50; docs/results.md, 2026-11-29)."""
    given = {name: value for name, value in options.items() if value is not None}
    config, _ = llm._prepare_generation_config(None, **{**given, "do_sample": True})
    return SamplingConfig.from_generation_config(config)


@functools.cache
def config_fields() -> frozenset[str]:
    """The fields of this transformers' `GenerationConfig`. Read once: `to_dict` deep-copies the
    config, and each call's `resolve` had built and copied a fresh one twice and copied the
    request's once more: `resolve` took 0.40 ms a call, 0.30 now (the quick fixture's LLM, side by
    side; the rest is transformers' own copy of the LLM's config)."""
    return frozenset(GenerationConfig().to_dict())


def check_fields(config: GenerationConfig) -> None:
    """Raise a ValueError naming every field set to something the decoder cannot reproduce: a
    refused field off its neutral values, or a field of this transformers that this module does
    not know (custom entries that are no `GenerationConfig` field are ignored, as `generate` does).
    Reads the config's attributes in place (`to_dict` would copy them)."""
    fields = config_fields()
    problems = []
    for name, value in vars(config).items():
        if name not in fields or name in HONOURED or name in NO_EFFECT:
            continue
        neutral, reason = REFUSED.get(name, ((None,), _UNKNOWN))
        if value not in neutral:
            problems.append(f"{name}={value!r} ({reason})")
    if problems:
        raise ValueError(f"generation options not supported by SpeculativeDecoder: {'; '.join(problems)}")


def resolve(
    llm: PreTrainedModel,
    generation_config: GenerationConfig | None,
    options: dict[str, Any],
    input_ids: torch.Tensor,  # [1, L]: the prompt, without padding
) -> GenerationSettings:
    """The options of `generate(input_ids, generation_config=..., **options)`, as `generate`
    resolves them for the LLM; unset options (None) are left to the configs."""
    kwargs = {name: value for name, value in options.items() if value is not None}
    given = [kwargs, *([generation_config] if generation_config is not None else []), llm.generation_config]
    has_default_max_length = all(_get(source, "max_length") is None for source in given)
    has_default_min_length = all(_get(source, "min_length") is None for source in given)
    config, unused = llm._prepare_generation_config(copy.deepcopy(generation_config), **kwargs)
    unknown = sorted(set(unused) - config_fields())  # output_* flags come back too
    if unknown:
        raise TypeError(
            f"unknown generation options {unknown}: give GenerationConfig fields "
            "(e.g. max_new_tokens, do_sample, temperature, repetition_penalty)"
        )
    check_fields(config)
    if isinstance(kwargs.get("eos_token_id"), list | tuple) and not kwargs["eos_token_id"]:
        config.eos_token_id = None  # eos_token_id=[]: no EOS token (generate has no way to say so)
    length = input_ids.shape[-1]
    llm._prepare_special_tokens(config, True, device=llm.device, batch_size=1)
    config = llm._prepare_generated_length(
        config, has_default_max_length, has_default_min_length, "input_ids", length, input_ids
    )
    max_new_tokens = config.max_length - length
    if max_new_tokens <= 0:
        raise ValueError(
            f"max_length={config.max_length} leaves no room after the {length}-token prompt: "
            "set max_new_tokens (the number of tokens to generate)"
        )
    sampling = SamplingConfig.from_generation_config(config)
    processors = llm._get_logits_processor(
        config, input_ids_seq_length=length, encoder_input_ids=input_ids, device=llm.device
    )
    greedy_processors = processors
    if config.do_sample:
        greedy = copy.copy(config)
        greedy.do_sample = False
        greedy_processors = llm._get_logits_processor(
            greedy, input_ids_seq_length=length, encoder_input_ids=input_ids, device=llm.device
        )
    eos = config._eos_token_tensor
    stop = config.stop_strings or ()
    pad = config._pad_token_tensor
    return GenerationSettings(
        config=config,
        probs=LogitsToProbs(sampling, processors, greedy_processors),
        max_new_tokens=max_new_tokens,
        eos_token_ids=frozenset() if eos is None else frozenset(eos.flatten().tolist()),
        stop_strings=(stop,) if isinstance(stop, str) else tuple(stop),
        max_time=config.max_time,
        pad_token_id=None if pad is None else int(pad.flatten()[0]),
    )


def _get(source: dict | GenerationConfig, name: str) -> Any:
    return source.get(name) if isinstance(source, dict) else getattr(source, name, None)
