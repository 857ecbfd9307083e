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
    positions of the accepted tree nodes (ALGORITHMS.md section 1). The kept prefix stays where
    it is and only the few positions after it move, so a step costs O(accepted), not O(length)."""
    keep = torch.as_tensor(keep, dtype=torch.long)
    stay = _unmoved_prefix(keep)
    moved = keep[stay:]
    for layer in cache.layers:
        if type(layer) is not DynamicLayer:
            raise NotImplementedError(
                f"KV compaction does not support cache layers of type {type(layer).__name__}"
            )
        if not layer.is_initialized or layer.keys.numel() == 0:
            continue
        index = moved.to(layer.keys.device)
        length = stay + len(moved)
        if len(moved):  # gather first: targets may overlap sources
            layer.keys[..., stay:length, :] = layer.keys.index_select(-2, index)
            layer.values[..., stay:length, :] = layer.values.index_select(-2, index)
        layer.keys = layer.keys[..., :length, :]
        layer.values = layer.values[..., :length, :]


def _unmoved_prefix(keep: torch.Tensor) -> int:
    """Length of the leading run of `keep` equal to 0, 1, 2, ..."""
    same = keep == torch.arange(len(keep))
    return len(keep) if bool(same.all()) else int((~same).nonzero()[0])


def crop_cache(cache: Cache, length: int) -> None:
    """Keep the first `length` positions."""
    if cache.get_seq_length() > length:
        compact_cache(cache, torch.arange(length))
