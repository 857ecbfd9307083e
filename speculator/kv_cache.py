"""KV cache compaction: after verification the cache must hold exactly prefix + accepted path."""

from __future__ import annotations

import torch
from transformers import Cache, DynamicCache
from transformers.cache_utils import DynamicLayer


def new_cache() -> DynamicCache:
    """A plain dynamic cache (full-attention layers), which `compact_cache` can index freely."""
    return DynamicCache()


def compact_cache(cache: Cache, keep: torch.Tensor | list[int]) -> None:
    """Keep only the sequence positions `keep` (in that order) of every layer, in place.

    `keep` indexes the cache's sequence axis; typically the prefix positions followed by the
    positions of the accepted tree nodes (ALGORITHMS.md section 1)."""
    for layer in cache.layers:
        if type(layer) is not DynamicLayer:
            raise NotImplementedError(
                f"KV compaction does not support cache layers of type {type(layer).__name__}"
            )
        if not layer.is_initialized or layer.keys.numel() == 0:
            continue
        index = torch.as_tensor(keep, dtype=torch.long, device=layer.keys.device)
        layer.keys = layer.keys.index_select(-2, index)
        layer.values = layer.values.index_select(-2, index)


def crop_cache(cache: Cache, length: int) -> None:
    """Keep the first `length` positions."""
    if cache.get_seq_length() > length:
        compact_cache(cache, torch.arange(length))
