"""Left padding of token-id lists into a batch, as `model.generate` expects for decoder-only models."""

from __future__ import annotations

import torch


def left_pad(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids [B, T] and attention_mask [B, T], padded on the left."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, sequence in enumerate(sequences):
        ids[row, width - len(sequence) :] = torch.tensor(sequence, dtype=torch.long)
        mask[row, width - len(sequence) :] = 1
    return ids, mask
