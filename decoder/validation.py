"""Checks at the API boundary, with messages that say what to change."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from specboost.speculator.attention_layout import AttentionLayout
from specboost.speculator.model_info import context_length, output_vocab_size
from specboost.speculator.shapes import BeamShape, ChainShape, TopologyShape

# Seeds are OpenAI's int64, non-negative: torch's generators take seeds below 2**64, and the SSMs'
# streams are seeded a little above the request's (`speculator.speculation.ssm_generator`).
SEED_LIMIT = 2**63

__all__ = [
    "check_causal_lm",
    "check_generate_arguments",
    "check_same_vocabulary",
    "check_shape",
    "context_length",
    "model_name",
    "output_vocab_size",
    "prompt_tokens",
]

_CAUSAL_LM_CLASSES = frozenset(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())


def model_name(model: PreTrainedModel) -> str:
    path = getattr(model.config, "_name_or_path", "") or ""
    return f"{type(model).__name__}({path})" if path else type(model).__name__


def check_causal_lm(model: object, role: str) -> None:
    """A transformers causal LM whose attention tree attention can express (else the
    NotImplementedError of `AttentionLayout.of`, naming the model type)."""
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"the {role} must be a transformers PreTrainedModel, got {type(model).__name__}")
    if getattr(model.config, "is_encoder_decoder", False) or type(model).__name__ not in _CAUSAL_LM_CLASSES:
        raise ValueError(
            f"the {role} {model_name(model)} is not a causal language model; load it with "
            "AutoModelForCausalLM.from_pretrained(...)"
        )
    try:
        AttentionLayout.of(model)
    except NotImplementedError as error:
        raise NotImplementedError(f"the {role} {model_name(model)}: {error}") from None


def check_same_device(llm: PreTrainedModel, ssm: PreTrainedModel, index: int) -> None:
    """Drafts go straight into the LLM's verification pass: the SSMs must sit on the LLM's device."""
    if ssm.device != llm.device:
        raise ValueError(
            f"SSM {index} is on {ssm.device} but the LLM on {llm.device}: move it there first "
            f"(ssm.to({str(llm.device)!r}), or device={str(llm.device)!r} when loading)"
        )


def check_same_vocabulary(
    llm: PreTrainedModel,
    ssm: PreTrainedModel,
    index: int,
    llm_tokenizer: PreTrainedTokenizerBase | None = None,
    ssm_tokenizer: PreTrainedTokenizerBase | None = None,
) -> None:
    """SSMs must share the LLM's tokenizer: draft and target distributions live on one vocabulary."""
    v_llm, v_ssm = output_vocab_size(llm), output_vocab_size(ssm)
    if v_llm != v_ssm:
        raise ValueError(
            f"vocabulary mismatch: SSM {index} {model_name(ssm)} predicts {v_ssm} tokens but the LLM "
            f"{model_name(llm)} predicts {v_llm}; every SSM must use the LLM's tokenizer and vocabulary"
        )
    if (
        llm_tokenizer is not None
        and ssm_tokenizer is not None
        and llm_tokenizer.get_vocab() != ssm_tokenizer.get_vocab()
    ):
        raise ValueError(
            f"tokenizer mismatch: SSM {index} {model_name(ssm)} uses a tokenizer whose vocabulary differs "
            f"from the LLM {model_name(llm)}'s; every SSM must use the LLM's tokenizer"
        )


def check_shape(shape: object) -> None:
    """`shape=` must be one of the draft shapes (a plain number is not a chain length)."""
    if isinstance(shape, TopologyShape) and len(shape.parents) < 2:
        raise ValueError("the topology has no node besides the root, so it drafts nothing: give children")
    if shape is None or isinstance(shape, ChainShape | BeamShape | TopologyShape):
        return
    hint = f"; for a chain of {shape} tokens use shape=ChainShape({shape})" if type(shape) is int else ""
    raise TypeError(
        "shape must be ChainShape(length), BeamShape(width, depth) or TopologyShape(parents), "
        f"got {shape!r}{hint}"
    )


_INTEGER_OPTIONS = (
    "max_new_tokens",
    "max_length",
    "min_new_tokens",
    "min_length",
    "top_k",
    "no_repeat_ngram_size",
)
_REAL_OPTIONS = ("temperature", "top_p", "min_p", "typical_p", "repetition_penalty", "max_time")


def check_generate_arguments(
    input_ids: object, attention_mask: object, options: dict[str, object], seed: object, vocab_size: int
) -> None:
    """Types and shapes of `generate`'s arguments, checked before anything runs (TypeError /
    ValueError saying what to pass)."""
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids must be a torch.Tensor of token ids, got {type(input_ids).__name__}")
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise TypeError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    if input_ids.dim() not in (1, 2) or input_ids.shape[0] == 0:
        raise ValueError(
            f"input_ids must be [batch, length] (or [length]), got shape {tuple(input_ids.shape)}"
        )
    if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab_size):
        raise ValueError(
            f"input_ids must be token ids in [0, {vocab_size}) (the LLM's vocabulary), got values from "
            f"{int(input_ids.min())} to {int(input_ids.max())}"
        )
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
            shape = (
                tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else attention_mask
            )
            raise ValueError(
                f"attention_mask must be a tensor shaped like input_ids {tuple(input_ids.shape)}, got {shape}"
            )
        if not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
            raise ValueError("attention_mask must hold 0 (padding) and 1 (token) only")
    for name in _INTEGER_OPTIONS:
        value = options.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise TypeError(f"{name} must be an integer, got {value!r}")
    for name in _REAL_OPTIONS:
        value = options.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise TypeError(f"{name} must be a number, got {value!r}")
    max_new_tokens = options.get("max_new_tokens")
    if max_new_tokens is not None and max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens}")
    do_sample = options.get("do_sample")
    if do_sample is not None and not isinstance(do_sample, bool):
        raise TypeError(f"do_sample must be True or False, got {do_sample!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise TypeError(f"seed must be an integer, got {seed!r}")
    if seed is not None and not 0 <= seed < SEED_LIMIT:
        raise ValueError(f"seed must be in [0, 2**63), got {seed}")


def prompt_tokens(
    input_ids: torch.Tensor,  # [L]
    attention_mask: torch.Tensor | None,  # [L]
    max_positions: int | None,
) -> list[int]:
    """One prompt's token ids with its (left) padding dropped, checked against the LLM's context."""
    prompt = input_ids.reshape(-1)
    if attention_mask is not None:
        prompt = prompt[attention_mask.reshape(-1).bool().to(prompt.device)]
    if prompt.numel() == 0:
        raise ValueError("the prompt is empty: give at least one token (e.g. the BOS token)")
    if max_positions is not None and prompt.numel() > max_positions:
        raise ValueError(
            f"the prompt has {prompt.numel()} tokens but the LLM's context holds {max_positions}; "
            "shorten the prompt"
        )
    return prompt.tolist()
