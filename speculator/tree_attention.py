"""Tree attention (ALGORITHMS.md section 1): position ids, the 4D mask, and one forward pass.

All nodes of a tree are fed to a model in ONE forward pass, in topological order, with
position id `past_length + depth(u)` and an additive 4D mask in which node u sees every
cached position, itself and its ancestors, and nothing else; a sliding-window layer sees only
those within its window of positions (`AttentionLayout`). The logits at node u are then the
model's next-token distribution after the path root->u.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import Cache, PreTrainedModel

from specboost.speculator.attention_layout import AttentionLayout
from specboost.speculator.tree import TokenTree, TreeBatch


def tree_position_ids(depths: torch.Tensor, offset: int) -> torch.Tensor:
    """[B, N] position ids `offset + depth(u)` from depths [B, N]."""
    return depths + offset


def tree_attention_mask(
    ancestors: torch.Tensor,  # [B, Q, K] bool: query node x fed tree node (itself and its ancestors)
    cached: torch.Tensor,  # [B, P] bool: the cached positions each row's queries may see
    query_positions: torch.Tensor,  # [B, Q]
    key_positions: torch.Tensor,  # [B, P + K]: the cached positions, then the tree nodes'
    dtype: torch.dtype,
    layout: AttentionLayout | None = None,
) -> torch.Tensor | dict[str, torch.Tensor]:
    """The `attention_mask` of a tree pass: [B, 1, Q, P + K] additive, or one such mask per layer
    type when the model mixes full and sliding-window layers (`AttentionLayout.mask`)."""
    b, q, _ = ancestors.shape
    allowed = torch.cat([cached[:, None, :].expand(b, q, -1), ancestors], dim=-1)
    return (layout or AttentionLayout()).mask(allowed, query_positions, key_positions, dtype)


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [N, V]
    hidden: torch.Tensor | None  # [N, H] last-layer hidden states, when asked for


def _forward(
    model: PreTrainedModel, cache: Cache, input_ids: torch.Tensor, output_hidden: bool, **kwargs
) -> ForwardOutput:
    kwargs.update(past_key_values=cache, use_cache=True, output_hidden_states=output_hidden)
    out = model(input_ids=input_ids, **kwargs)
    hidden = out.hidden_states[-1][0] if output_hidden else None
    return ForwardOutput(logits=out.logits[0], hidden=hidden)


def causal_forward(
    model: PreTrainedModel, cache: Cache, tokens: list[int], output_hidden: bool = False
) -> ForwardOutput:
    """Append a plain chain of tokens to the cached prefix (ordinary causal attention)."""
    input_ids = torch.tensor([tokens], dtype=torch.long, device=model.device)  # [1, N]
    return _forward(model, cache, input_ids, output_hidden)


def tree_forward(
    model: PreTrainedModel,
    cache: Cache,
    tree: TokenTree,
    nodes: range,
    prefix_length: int,
    first_cached_node: int = 0,
    output_hidden: bool = False,
) -> ForwardOutput:
    """Feed the tree nodes `nodes` to `model` in ONE pass with tree attention.

    The cache holds `prefix_length` prefix positions followed by tree nodes
    `first_cached_node .. nodes.start - 1` in index order; the new nodes' K/V are appended in
    index order. Node u gets position id `prefix_length + depth(u) - depth(first_cached_node)`.
    The LLM verifies a whole tree with its root as node 0 (`first_cached_node=0`); an SSM whose
    cache already holds the root expands its tree level by level (`first_cached_node=1`).
    """
    assert cache.get_seq_length() == prefix_length + nodes.start - first_cached_node, "cache out of sync"
    batch = TreeBatch.pack([tree]).to(model.device)
    new = slice(nodes.start, nodes.stop)
    offset = prefix_length - tree.depths[first_cached_node]
    tree_positions = tree_position_ids(batch.depths[:, first_cached_node : nodes.stop], offset)
    prefix = torch.arange(prefix_length, device=model.device)[None]
    mask = tree_attention_mask(
        batch.ancestors[:, new, first_cached_node : nodes.stop],
        torch.ones(1, prefix_length, dtype=torch.bool, device=model.device),
        tree_positions[:, nodes.start - first_cached_node :],
        torch.cat([prefix, tree_positions], dim=-1),
        model.dtype,
        AttentionLayout.of(model),
    )
    return _forward(
        model,
        cache,
        batch.tokens[:, new],
        output_hidden,
        attention_mask=mask,
        position_ids=tree_position_ids(batch.depths[:, new], offset),
    )
