"""The SSMs of a boost run before training: a fresh Llama sized as a share of the LLM, the checks on
a given base, each round's seeded start (optionally with LoRA adapters), and a saved one loaded."""

from __future__ import annotations

import math
from pathlib import Path

import peft
import torch
import transformers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from specboost.speculator.loading import load_causal_lm, load_config, load_tokenizer
from specboost.training.boost_config import BoostConfig


def llama_parameters(
    vocab: int, hidden: int, layers: int, heads: int, kv: int, head_dim: int, inter: int, tied: bool
) -> int:
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv * head_dim
    return (
        vocab * hidden * (1 if tied else 2) + layers * (attention + 3 * hidden * inter + 2 * hidden) + hidden
    )


def sized_ssm_config(
    llm: PretrainedConfig, fraction: float, tokenizer: PreTrainedTokenizerBase
) -> LlamaConfig:
    """A Llama with the LLM's vocabulary and about `fraction` of its parameters (embeddings included):
    the LLM's head size and attention grouping, fewer heads and layers."""
    c = llm.get_text_config()
    hidden, layers = c.hidden_size, c.num_hidden_layers
    heads = c.num_attention_heads
    kv = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or hidden // heads
    inter = getattr(c, "intermediate_size", None) or 4 * hidden
    tied = bool(getattr(c, "tie_word_embeddings", True))
    target = fraction * llama_parameters(c.vocab_size, hidden, layers, heads, kv, head_dim, inter, tied)
    best: tuple[float, dict[str, int]] | None = None
    for n_heads in range(1, heads + 1):
        h = n_heads * head_dim
        n_kv = max(
            d for d in range(1, n_heads + 1) if n_heads % d == 0 and d <= max(1, n_heads * kv // heads)
        )
        i = max(8, round(h * inter / hidden / 8) * 8)
        for n_layers in range(1, layers + 1):
            size = llama_parameters(c.vocab_size, h, n_layers, n_heads, n_kv, head_dim, i, tied)
            shape = {"hidden": h, "layers": n_layers, "heads": n_heads, "kv": n_kv, "inter": i}
            if best is None or abs(math.log(size / target)) < best[0]:
                best = (abs(math.log(size / target)), shape)
    assert best is not None
    s = best[1]
    return LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=s["hidden"],
        intermediate_size=s["inter"],
        num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv"],
        head_dim=head_dim,
        max_position_embeddings=getattr(c, "max_position_embeddings", None) or 2048,
        rms_norm_eps=getattr(c, "rms_norm_eps", 1e-6),
        tie_word_embeddings=tied,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )


def check_base_vocab(base: str, llm_config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase) -> None:
    """An SSM must draft in the LLM's vocabulary: same output size and, if it has one, same tokenizer."""
    base_vocab = load_config(base).get_text_config().vocab_size
    llm_vocab = llm_config.get_text_config().vocab_size
    if base_vocab != llm_vocab:
        raise ValueError(
            f"the SSM base {base} has a vocabulary of {base_vocab} tokens but the LLM has {llm_vocab}: "
            "SSM drafts must be LLM token ids; give a base trained with the LLM's tokenizer, "
            "or drop --ssm-base to build SSMs from a config sized for the LLM"
        )
    try:
        base_tokenizer = load_tokenizer(base)
    except ValueError:
        return  # weights only: the LLM's tokenizer is saved with every SSM
    if base_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise ValueError(
            f"the SSM base {base} has {base_vocab} output ids like the LLM, but its tokenizer maps "
            "tokens to other ids: give a base trained with the LLM's tokenizer, or drop --ssm-base"
        )


def build_ssm(config: BoostConfig, ssm_config: LlamaConfig | None, round_index: int) -> PreTrainedModel:
    """A fresh SSM for round `round_index` (seeded), from the base or the sized config."""
    transformers.set_seed(config.seed + round_index)
    if config.ssm_base is not None:
        model = load_causal_lm(config.ssm_base, torch.float32).train()
    else:
        assert ssm_config is not None
        model = LlamaForCausalLM(ssm_config)
    if config.lora:
        lora = peft.LoraConfig(
            r=config.lora_rank,
            lora_alpha=config.lora_alpha,
            target_modules="all-linear",
            task_type="CAUSAL_LM",
        )
        model = peft.get_peft_model(model, lora)
    return model


def context_of(model: PreTrainedModel) -> int | None:
    value = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    return value if isinstance(value, int) and value > 0 else None


def load_ssm(path: Path) -> PreTrainedModel:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
