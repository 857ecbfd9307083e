"""Tree attention (ALGORITHMS.md section 1): position ids and the 4D mask of a tree pass.

All nodes of a tree are fed to a model in ONE forward pass, in topological order, with
position id `past_length + depth(u)` and an additive 4D mask in which node u sees every
cached position, itself and its ancestors, and nothing else; a sliding-window layer sees only
those within its window of positions (`AttentionLayout`). The logits at node u are then the
model's next-token distribution after the path root->u. The passes themselves are
`TreeCache.feed` (`speculator/kv_cache.py`).
"""

from __future__ import annotations

import torch

from specboost.speculator.attention_layout import AttentionLayout


def tree_attention_mask(
    visible: torch.Tensor,  # [B, N, K] bool: the K fed nodes (pending, then new) each new node sees
    lengths: torch.Tensor,  # [B] committed positions per row
    width: int | torch.Tensor,  # where the fed nodes' K/V start: the widest row's length (0-d tensor ok)
    positions: torch.Tensor,  # [B, N] the new nodes' positions (past + depth)
    fed_positions: torch.Tensor,  # [B, K] the fed nodes' positions
    capacity: int,  # keys in the cache
    dtype: torch.dtype,
    layout: AttentionLayout | None = None,
) -> torch.Tensor | dict[str, torch.Tensor]:
    """The `attention_mask` of a tree pass over a cache of `capacity` keys: [B, 1, N, capacity]
    additive (one per layer type for a model that mixes full and sliding-window layers). Row b's
    key j < lengths[b] is its committed position j; keys width .. width + K - 1 are the fed nodes;
    every other key is padding. Built from static shapes only (the fed nodes are gathered by key
    offset), so that a compiled pass can build it inside its graph."""
    layout = layout or AttentionLayout()
    b, n, k = visible.shape
    index = torch.arange(capacity, device=visible.device)  # [capacity]
    offset = index - width
    fed = (offset >= 0) & (offset < k)  # [capacity]: the key is a fed node
    slot = offset.clamp(0, k - 1)
    seen = visible.gather(2, slot.expand(b, n, capacity)) & fed  # [B, N, capacity]
    allowed = seen | (index < lengths[:, None])[:, None, :]
    keys = None
    if layout.window is not None:  # positions matter only to sliding windows
        keys = torch.where(fed, fed_positions.gather(1, slot.expand(b, capacity)), index)  # [B, capacity]
    return layout.mask(allowed, positions, keys, dtype)
