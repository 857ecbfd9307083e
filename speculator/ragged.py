"""Ragged batches over one padded KV cache (BASS-PAD, ALGORITHMS.md section 11).

In a batch of speculative decoding every sequence accepts a different number of tokens per step,
so the rows of the cache hold different numbers of positions. `RaggedCache` keeps them in one
`DynamicCache` of shape [B, heads, width, head_dim] where row b's K/V sit at positions
0 .. lengths[b] - 1 and width = max(lengths): the rest of a row is padding (finite, never
attended to). Every forward pass feeds one token tree per row (a plain chain is a tree too: a
prompt prefill, an SSM catching up) with tree attention over that row's own positions, and
position ids that continue each row's own length; `keep` then compacts each row to its old
positions plus the fed nodes it keeps (ALGORITHMS.md section 1), in place, touching only the
positions past the shortest row. Linear layers stay batched; attention runs over the padded
width with the padding masked.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from specboost.speculator.attention_layout import AttentionLayout
from specboost.speculator.tree import TreeBatch
from specboost.speculator.tree_attention import tree_attention_mask, tree_position_ids


def chain_batch(chains: list[list[int]], pad_token: int = 0) -> TreeBatch:
    """Token chains (node u's parent is u - 1) as a `TreeBatch`; an empty chain is all padding."""
    b, n = len(chains), max(1, max((len(c) for c in chains), default=0))
    sizes = torch.tensor([len(c) for c in chains])
    valid = torch.arange(n)[None] < sizes[:, None]  # [B, N]
    tokens = torch.full((b, n), pad_token, dtype=torch.long)
    for row, chain in enumerate(chains):
        tokens[row, : len(chain)] = torch.tensor(chain, dtype=torch.long)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    eye = torch.eye(n, dtype=torch.bool)
    ancestors = torch.where(valid[:, :, None], causal & valid[:, None, :], eye)  # padding: itself only
    depths = torch.arange(n).expand(b, n) * valid
    parents = torch.where(valid, torch.arange(n) - 1, -1)
    return TreeBatch(tokens, parents, depths.clone(), valid, ancestors)


@dataclass
class RaggedOutput:
    logits: torch.Tensor  # [B, N, V]
    hidden: torch.Tensor | None  # [B, N, H] last-layer hidden states, when asked for


class RaggedCache:
    """One model's KV cache over a batch of sequences of different lengths (see the module doc)."""

    def __init__(self, rows: int = 0) -> None:
        self.cache = DynamicCache()
        self.lengths: list[int] = [0] * rows  # cached positions per row
        self._fed_at = 0  # the width before the last `forward`: where its nodes' K/V start

    @property
    def width(self) -> int:
        return self.cache.get_seq_length()

    def __len__(self) -> int:
        return len(self.lengths)

    def _layers(self) -> list[DynamicLayer]:
        for layer in self.cache.layers:
            if type(layer) is not DynamicLayer:
                raise NotImplementedError(
                    f"ragged batches do not support cache layers of type {type(layer).__name__}"
                )
        return [layer for layer in self.cache.layers if layer.is_initialized and layer.keys.numel()]

    # Model passes ----------------------------------------------------------------------------------
    def forward(self, model: PreTrainedModel, batch: TreeBatch, output_hidden: bool = False) -> RaggedOutput:
        """Feed tree row b after row b's cached positions in ONE pass. The new K/V land after the
        padded width; call `keep` next to decide which of them each row keeps."""
        assert len(batch.tokens) == len(self.lengths), "one tree per row"
        batch = batch.to(model.device)
        lengths = torch.tensor(self.lengths, device=model.device)
        self._fed_at = self.width
        # Row b's cached position j is its token j; query node u of row b sees row b's cached
        # positions 0 .. lengths[b] - 1 and its ancestors among the fed nodes.
        cached_positions = torch.arange(self.width, device=model.device)[None].expand(len(lengths), -1)
        positions = tree_position_ids(batch.depths, lengths[:, None])  # [B, N]
        mask = tree_attention_mask(
            batch.ancestors,
            cached_positions < lengths[:, None],
            positions,
            torch.cat([cached_positions, positions], dim=-1),
            model.dtype,
            AttentionLayout.of(model),
        )
        out = model(
            input_ids=batch.tokens,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=self.cache,
            use_cache=True,
            output_hidden_states=output_hidden,
        )
        return RaggedOutput(out.logits, out.hidden_states[-1] if output_hidden else None)

    def keep(self, nodes: list[list[int]]) -> None:
        """After `forward` of N nodes per row: row b keeps its cached positions followed by the fed
        nodes `nodes[b]`, in that order; every other fed position is dropped."""
        layers = self._layers()
        old = self.lengths
        self.lengths = [length + len(kept) for length, kept in zip(old, nodes, strict=True)]
        if not any(self.lengths):
            self.cache = DynamicCache()
            return
        fed_at, total = self._fed_at, layers[0].keys.shape[-2]
        lo, hi = min(old), max(self.lengths)
        # index[b, j]: where position lo + j of row b comes from (itself, a fed node, or padding).
        index = torch.arange(lo, hi).repeat(len(old), 1)
        for row, (length, kept) in enumerate(zip(old, nodes, strict=True)):
            for i, node in enumerate(kept):
                assert 0 <= fed_at + node < total, "kept node out of range"
                index[row, length - lo + i] = fed_at + node
        index = index.to(layers[0].keys.device)[:, None, :, None]
        for layer in layers:
            for name in ("keys", "values"):
                tensor = getattr(layer, name)
                tensor[..., lo:hi, :] = tensor.gather(
                    -2, index.expand(-1, tensor.shape[1], -1, tensor.shape[-1])
                )
                setattr(layer, name, tensor[..., :hi, :])

    # Rows ---------------------------------------------------------------------------------------------
    def truncate(self, row: int, length: int) -> None:
        """Forget the positions of row `row` from `length` on (they become padding)."""
        assert 0 <= length <= self.lengths[row]
        self.lengths[row] = length
        self._trim()

    def select(self, rows: list[int]) -> None:
        """Keep only the rows `rows`, in that order."""
        self.lengths = [self.lengths[r] for r in rows]
        index = torch.tensor(rows, dtype=torch.long)
        for layer in self._layers():
            layer.keys = layer.keys[index.to(layer.keys.device)]
            layer.values = layer.values[index.to(layer.values.device)]
        self._trim()

    def extend(self, other: RaggedCache) -> None:
        """Append the rows of `other` (of the same model) after this cache's rows."""
        mine, theirs = self._layers(), other._layers()
        rows, other_rows = len(self.lengths), len(other.lengths)
        width = max(self.width, other.width)
        self.lengths = self.lengths + other.lengths
        if not (mine or theirs):
            self.cache = DynamicCache()
            return
        template = mine or theirs
        for i, layer in enumerate(template):
            for name in ("keys", "values"):
                like = getattr(layer, name)
                front = _pad(getattr(mine[i], name), width) if mine else _zeros(like, rows, width)
                back = _pad(getattr(theirs[i], name), width) if theirs else _zeros(like, other_rows, width)
                setattr(layer, name, torch.cat([front, back], dim=0))
        if not mine:
            self.cache = other.cache

    def _trim(self) -> None:
        width = max(self.lengths, default=0)
        if width == 0:
            self.cache = DynamicCache()
            return
        for layer in self._layers():
            layer.keys = layer.keys[..., :width, :]
            layer.values = layer.values[..., :width, :]


def _pad(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """Zero-pad the sequence axis of [B, heads, T, dim] to `width`."""
    return torch.nn.functional.pad(tensor, (0, 0, 0, width - tensor.shape[-2]))


def _zeros(like: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """[rows, heads, width, dim] zeros shaped like the cache tensor `like`."""
    return like.new_zeros(rows, like.shape[1], width, like.shape[-1])
