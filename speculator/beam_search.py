"""Batched SpecInfer beam search scored against a known continuation (ALGORITHMS.md sections 3, 5).

The match length of a beam tree under the greedy rule is the longest prefix of any of its beams
that equals the LLM's greedy continuation. `beam_match_lengths` computes it for many contexts at
once (the predictor's labels; the oracle scheduler), with exactly the drafter's search
(`draft_plans.BeamPlan`: the top-`width` of beam score + log-softmax over beams x vocabulary).
The beams alive after d steps are those of a depth-d search, so one search yields every depth.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel

from specboost.speculator.model_info import CACHE_ARGUMENT
from specboost.speculator.padding import left_pad


@torch.no_grad()
def beam_match_lengths(
    ssm: PreTrainedModel,
    contexts: list[list[int]],
    reference: torch.Tensor,  # [P, max(depths)]
    width: int,
    depths: tuple[int, ...],
    pad_id: int,
) -> torch.Tensor:
    """Match length [P, len(depths)] of the SSM's width-`width` beam search after each context,
    stopped at each depth, against the reference continuation (greedy rule: the best beam)."""
    rows, device = len(contexts), ssm.device
    ids, mask = (t.to(device).repeat_interleave(width, 0) for t in left_pad(contexts, pad_id))
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    cache = DynamicCache()
    logits = ssm(
        input_ids=ids, attention_mask=mask, position_ids=positions, **{CACHE_ARGUMENT: cache}
    ).logits[:, -1]
    scores = torch.full((rows, width), float("-inf"), dtype=torch.float64, device=device)
    scores[:, 0] = 0.0  # one live beam at the root (its copies only pad the batch)
    beams = torch.zeros(rows, width, 0, dtype=torch.long, device=device)
    reference = reference.to(device)
    matches = []
    for step in range(1, max(depths) + 1):
        logp = torch.log_softmax(logits.double(), dim=-1).view(rows, width, -1) + scores[..., None]
        vocab = logp.shape[-1]
        top = torch.topk(logp.flatten(1), width)  # [P, width]
        parent, token = top.indices // vocab, top.indices % vocab
        scores = top.values
        beams = torch.cat([beams.gather(1, parent[..., None].expand(-1, -1, step - 1)), token[..., None]], -1)
        if step in depths:
            hits = (beams == reference[:, None, :step]).long().cumprod(-1).sum(-1)  # [P, width]
            matches.append(hits.max(-1).values)
        if step == max(depths):
            break
        cache.batch_select_indices((torch.arange(rows, device=device)[:, None] * width + parent).flatten())
        mask = torch.cat([mask, mask.new_ones(rows * width, 1)], -1)
        positions = positions[:, -1:] + 1
        logits = ssm(
            input_ids=token.reshape(-1, 1),
            attention_mask=mask,
            position_ids=positions,
            **{CACHE_ARGUMENT: cache},
        ).logits[:, -1]
    return torch.stack(matches, -1).cpu()
