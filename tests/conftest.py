"""Shared fixtures: deterministic seeds and tiny random models built from configs."""

from __future__ import annotations

import random

import pytest
import torch
from tokenizers import Tokenizer, decoders, models
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    OPTConfig,
    OPTForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

VOCAB = 64


@pytest.fixture(autouse=True, scope="session")
def _one_thread() -> None:
    """Tiny models gain nothing from intra-op threads, and extra threads thrash a loaded machine."""
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed_everything() -> None:
    random.seed(0)
    torch.manual_seed(0)


def tiny_llama(
    layers: int = 2, seed: int = 0, vocab: int = VOCAB, eos: int | None = None, positions: int = 256
) -> PreTrainedModel:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=positions,
        bos_token_id=0,
        eos_token_id=eos,
        pad_token_id=None,
    )
    return LlamaForCausalLM(config).double().eval()


def tiny_gpt2(layers: int = 2, seed: int = 0, vocab: int = VOCAB, eos: int | None = None) -> PreTrainedModel:
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=vocab,
        n_embd=32,
        n_layer=layers,
        n_head=4,
        n_positions=128,
        bos_token_id=0,
        eos_token_id=eos,
    )
    return GPT2LMHeadModel(config).double().eval()


def tiny_opt(layers: int = 2, seed: int = 0, vocab: int = VOCAB, eos: int | None = None) -> PreTrainedModel:
    torch.manual_seed(seed)
    config = OPTConfig(
        vocab_size=vocab,
        hidden_size=32,
        ffn_dim=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        max_position_embeddings=128,
        word_embed_proj_dim=32,
        bos_token_id=0,
        eos_token_id=eos,
        pad_token_id=1,
    )
    return OPTForCausalLM(config).double().eval()


ARCHITECTURES = {"llama": tiny_llama, "gpt2": tiny_gpt2, "opt": tiny_opt}


def noisy_copy(model: PreTrainedModel, scale: float, seed: int) -> PreTrainedModel:
    """`model` with Gaussian noise (relative to each tensor's spread) added to every weight: an SSM
    that agrees with the LLM often, but not always. The noise is drawn on the CPU (the same on
    every device); the copy goes to `model`'s device."""
    copy = type(model)(model.config).to(model.dtype)
    copy.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in copy.parameters():
            spread = p.std() if p.numel() > 1 else p.abs()
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * scale * spread)
    return copy.to(model.device).eval()


CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,"  # VOCAB characters


def char_tokenizer() -> PreTrainedTokenizerFast:
    """Token i is the character CHARS[i] (no merges): text and ids map one to one, and transformers'
    stop-string matching understands it."""
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(CHARS)}, merges=[], unk_token="a"))
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="a")
