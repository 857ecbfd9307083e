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
    width: int,  # where the fed nodes' K/V start: the widest row's length
    positions: torch.Tensor,  # [B, N] the new nodes' positions (past + depth)
    fed_positions: torch.Tensor,  # [B, K] the fed nodes' positions
    capacity: int,  # keys in the cache
    dtype: torch.dtype,
    layout: AttentionLayout | None = None,
) -> torch.Tensor | dict[str, torch.Tensor]:
    """The `attention_mask` of a tree pass over a cache of `capacity` keys: [B, 1, N, capacity]
    additive (one per layer type for a model that mixes full and sliding-window layers). Row b's
    key j < lengths[b] is its committed position j; keys width .. width + K - 1 are the fed nodes;
    every other key is padding."""
    layout = layout or AttentionLayout()
    index = torch.arange(capacity, device=visible.device)
    fed_end = width + visible.shape[2]
    allowed = (index < lengths[:, None])[:, None, :].repeat(1, visible.shape[1], 1)  # [B, N, capacity]
    allowed[:, :, width:fed_end] = visible
    keys = None
    if layout.window is not None:  # positions matter only to sliding windows
        keys = index.repeat(len(lengths), 1)  # [B, capacity]
        keys[:, width:fed_end] = fed_positions
    return layout.mask(allowed, positions, keys, dtype)
