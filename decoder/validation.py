"""Checks at the API boundary, with messages that say what to change."""

from __future__ import annotations

from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from specboost.speculator.model_info import context_length, output_vocab_size

__all__ = ["check_causal_lm", "check_same_vocabulary", "context_length", "model_name", "output_vocab_size"]

_CAUSAL_LM_CLASSES = frozenset(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())


def model_name(model: PreTrainedModel) -> str:
    path = getattr(model.config, "_name_or_path", "") or ""
    return f"{type(model).__name__}({path})" if path else type(model).__name__


def check_causal_lm(model: object, role: str) -> None:
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"the {role} must be a transformers PreTrainedModel, got {type(model).__name__}")
    if getattr(model.config, "is_encoder_decoder", False) or type(model).__name__ not in _CAUSAL_LM_CLASSES:
        raise ValueError(
            f"the {role} {model_name(model)} is not a causal language model; load it with "
            "AutoModelForCausalLM.from_pretrained(...)"
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
