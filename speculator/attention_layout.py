"""Which keys each attention layer of a model lets a query see, read from its config, and the
additive masks that say so for a token tree (ALGORITHMS.md section 1, "Sliding windows").

Tree attention hands the model a ready 4D mask, which transformers uses as given for every layer:
a model with sliding-window layers (Mistral, Phi-3, Qwen2 with `use_sliding_window`, Gemma 2/3
with interleaved local and global layers, ...) would then attend past its window. So the mask is
built per layer type: a "sliding_attention" layer additionally hides every key whose *position*
is `window` or more before the query's (transformers' rule: key position > query position -
window). Positions, not cache indices: a tree node sits at `past + depth`, whatever its index.
Models that mix layer types take one mask per type (transformers' `causal_mask_mapping` dict).

Attention that a mask over positions cannot express is refused up front with a
`NotImplementedError` naming the model type: ALiBi biases (BLOOM, MPT, Falcon with `alibi`),
GPT-Neo's local layers (windowed by cache index inside the layer), layer types other than full
and sliding attention (chunked, linear, recurrent), and stateful models without a KV cache.
"""

from __future__ import annotations

import functools
import inspect
import sys
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

FULL = "full_attention"
SLIDING = "sliding_attention"


@dataclass(frozen=True)
class AttentionLayout:
    """The attention types of a model's layers, as far as masking goes."""

    window: int | None = None  # sliding window in positions; None: every layer attends fully
    types: tuple[str, ...] = (FULL,)  # the distinct layer types, in first-layer order
    per_type: bool = False  # the model takes a dict of masks keyed by layer type

    @classmethod
    def of(cls, model: PreTrainedModel) -> AttentionLayout:
        """The layout of `model`; raises NotImplementedError for attention trees cannot express."""
        config = model.config.get_text_config()
        check_expressible(model)
        if not _builds_sliding_masks(model):
            return cls()
        window = getattr(config, "sliding_window", None)
        layer_types = getattr(config, "layer_types", None)
        if layer_types is None:  # Mistral-style: one mask for all layers, windowed if a window is set
            return cls(window, (SLIDING,)) if window else cls()
        unknown = sorted(set(layer_types) - {FULL, SLIDING})
        if unknown:
            raise NotImplementedError(
                f"{config.model_type} has {'/'.join(unknown)} layers, which tree attention cannot mask; "
                "use a model whose layers are full or sliding-window attention"
            )
        types = tuple(dict.fromkeys(layer_types))
        if not window:
            return cls()
        if len(types) > 1 and not _takes_mask_mapping(type(model)):
            raise NotImplementedError(
                f"{config.model_type} mixes full and sliding-window layers but takes one attention mask for "
                "all of them; tree attention cannot give each layer its own"
            )
        return cls(window, types, per_type=len(types) > 1)

    def mask(
        self,
        allowed: torch.Tensor,  # [B, Q, K] bool: the tree structure (prefix, ancestors, padding)
        query_positions: torch.Tensor,  # [B, Q]
        key_positions: torch.Tensor | None,  # [B, K]; None when there is no window
        dtype: torch.dtype,
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """The model's `attention_mask` argument: [B, 1, Q, K] additive, or one per layer type."""
        masks = {FULL: allowed}
        if self.window is not None:
            near = key_positions[:, None, :] > query_positions[:, :, None] - self.window  # [B, Q, K]
            masks[SLIDING] = allowed & near
        additive = {kind: _additive(masks[kind], dtype) for kind in self.types}
        return additive if self.per_type else additive[self.types[0]]


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None]


def check_expressible(model: PreTrainedModel) -> None:
    """Raise NotImplementedError naming the model type if its attention is not a mask over positions."""
    config = model.config.get_text_config()
    kind = config.model_type
    attn_config = getattr(config, "attn_config", None)
    alibi = (
        kind == "bloom"
        or bool(getattr(config, "alibi", False))
        or bool(getattr(attn_config, "alibi", False))
        or getattr(config, "position_embedding_type", None) == "alibi"
    )
    if alibi:
        raise NotImplementedError(
            f"{kind} uses ALiBi attention biases, which tree attention cannot express (the bias follows "
            "cache order, not tree positions); use a model with rotary or learned position embeddings"
        )
    if "local" in (getattr(config, "attention_layers", None) or []):
        raise NotImplementedError(
            f"{kind} has local attention layers windowed by cache index, which tree attention cannot "
            "express; use a model whose attention is windowed by position (e.g. Mistral, Gemma 2)"
        )
    if getattr(model, "_is_stateful", False):
        raise NotImplementedError(
            f"{kind} keeps a recurrent state instead of a KV cache; tree attention needs a KV cache"
        )


def _builds_sliding_masks(model: PreTrainedModel) -> bool:
    """Whether the model's code builds sliding-window masks at all (a `sliding_window` value in a
    config whose model never windows, e.g. OLMoE, changes nothing)."""
    return hasattr(sys.modules.get(type(model).__module__), "create_sliding_window_causal_mask")


@functools.cache
def _takes_mask_mapping(model_class: type) -> bool:
    """Whether the model class accepts `attention_mask` as a dict of masks per layer type."""
    try:
        source = inspect.getsource(sys.modules[model_class.__module__])
    except (OSError, TypeError, KeyError):
        return False
    return "causal_mask_mapping := attention_mask, dict" in source
