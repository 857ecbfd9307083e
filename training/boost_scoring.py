"""What an SSM, and the pool so far, reproduce of the LLM's outputs, teacher-forced: greedy hits,
the marking rules and the marks they set, sampled acceptance 1 - TV_b, and the held-out scores."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from specboost.training.boost_config import BoostConfig
from specboost.training.boost_data import PadCollator, Targets, fit
from specboost.training.distribution_loss import sampled_acceptance
from specboost.training.ssm_setup import context_of

# ---------------------------------------------------------------- marking rules


def true_runs(hits: torch.Tensor) -> torch.Tensor:
    """runs[t] = how many of hits[t], hits[t+1], ... are True in a row.  hits: [n] bool -> [n] long."""
    runs = torch.zeros(hits.shape[0] + 1, dtype=torch.long)
    for t in range(hits.shape[0] - 1, -1, -1):
        runs[t] = runs[t + 1] + 1 if hits[t] else 0
    return runs[:-1]


def sample_marked(hits: torch.Tensor) -> bool:
    """SpecInfer's rule: the SSM's greedy output is the LLM's output (every argmax matches)."""
    return bool(hits.all())


def span_marked(hits: torch.Tensor, depth: int) -> torch.Tensor:
    """[n] bool: the greedy chain from position t reproduces the next `depth` tokens (or all left)."""
    remaining = torch.arange(hits.shape[0], 0, -1)
    return true_runs(hits) >= remaining.clamp(max=depth)


def match_lengths(hits: torch.Tensor, chain: int) -> torch.Tensor:
    """[n] long: accepted length of a greedy chain of `chain` drafts from every position."""
    return true_runs(hits).clamp(max=chain)


def hits_from_logits(
    logits: torch.Tensor, input_ids: torch.Tensor, prompt_lens: list[int], output_lens: list[int]
) -> list[torch.Tensor]:
    """Per row, [n_out] bool: argmax before output token k equals it.
    logits: [B, T, V]; input_ids: [B, T] = prompt + output, right-padded."""
    predicted = logits.argmax(-1)  # [B, T]; position j predicts token j + 1
    rows = []
    for b, (p, n) in enumerate(zip(prompt_lens, output_lens, strict=True)):
        rows.append((predicted[b, p - 1 : p + n - 1] == input_ids[b, p : p + n]).cpu())
    return rows


def mark(
    config: BoostConfig, hits: dict[int, torch.Tensor], masked: dict[int, set[int]], removed: set[int]
) -> int:
    """Apply this round's marks to `masked` / `removed` in place; returns the count newly marked
    (samples for sample marking, output positions for span marking)."""
    newly = 0
    for sample_id, h in hits.items():
        if config.marking == "sample":
            if sample_marked(h):
                removed.add(sample_id)
                newly += 1
            continue
        positions = {int(t) for t in span_marked(h, config.span_depth).nonzero().flatten()}
        before = masked.setdefault(sample_id, set())
        newly += len(positions - before)
        before |= positions
        if len(before) == h.shape[0]:
            removed.add(sample_id)
    return newly


# ---------------------------------------------------------------- teacher-forced hits and acceptance


def teacher_forced(
    model: PreTrainedModel, rows: list[dict[str, Any]], pad_id: int, batch_size: int, desc: str
) -> Iterator[tuple[list[dict[str, Any]], torch.Tensor, torch.Tensor, list[int], list[int]]]:
    """(rows, input_ids [B, T], logits [B, T, V], prompt lengths, output lengths) per batch of
    `rows`, each fitted to the model's context."""
    model.eval()
    device, max_len = next(model.parameters()).device, context_of(model)
    for start in tqdm(range(0, len(rows), batch_size), desc=desc, leave=False):
        batch = rows[start : start + batch_size]
        pairs = [fit(r["prompt_ids"], r["output_ids"], max_len) for r in batch]
        collated = PadCollator(pad_id)([{"input_ids": p + o, "labels": p + o} for p, o in pairs])
        ids = collated["input_ids"].to(device)  # [B, T]
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=collated["attention_mask"].to(device)).logits
        yield batch, ids, logits, [len(p) for p, _ in pairs], [len(o) for _, o in pairs]


def output_hits(
    model: PreTrainedModel, rows: list[dict[str, Any]], pad_id: int, batch_size: int, desc: str
) -> dict[int, torch.Tensor]:
    """id -> [n_out] bool: the model's teacher-forced greedy prediction of each LLM output token."""
    hits: dict[int, torch.Tensor] = {}
    for batch, ids, logits, prompt_lens, output_lens in teacher_forced(model, rows, pad_id, batch_size, desc):
        found = hits_from_logits(logits, ids, prompt_lens, output_lens)
        hits.update({r["id"]: h for r, h in zip(batch, found, strict=True)})
    return hits


def output_acceptance(
    model: PreTrainedModel,
    rows: list[dict[str, Any]],
    targets: Targets,
    pad_id: int,
    batch_size: int,
    desc: str,
) -> dict[int, torch.Tensor]:
    """id -> [n_out] float: 1 - TV_b(p, q) at each output position, q = softmax(logits / T) at the
    targets' temperature (distribution_loss.py; positions cut by the context score 0)."""
    found: dict[int, torch.Tensor] = {}
    for batch, _, logits, prompt_lens, output_lens in teacher_forced(model, rows, pad_id, batch_size, desc):
        for b, (r, p, n) in enumerate(zip(batch, prompt_lens, output_lens, strict=True)):
            stored = targets.rows[r["id"]]
            device = logits.device
            accepted = sampled_acceptance(
                logits[b, p - 1 : p + n - 1],
                torch.from_numpy(stored.ids[:n].astype(np.int64)).to(device),
                torch.from_numpy(stored.probs[:n].astype(np.float32)).to(device),
                torch.from_numpy(stored.tail[:n].astype(np.float32)).to(device),
                targets.temperature,
            )
            found[r["id"]] = torch.zeros(len(r["output_ids"]))
            found[r["id"]][:n] = accepted.cpu()
    return found


# ---------------------------------------------------------------- held-out scores, the pool so far


def held_out_scores(hits: dict[int, torch.Tensor], pool_hits: dict[int, torch.Tensor], chain: int) -> dict:
    """This SSM's greedy acceptance and the pool's coverage (pool_hits already includes this SSM)."""
    lengths = torch.cat([match_lengths(h, chain) for h in hits.values()]).float()
    drafted = torch.cat([torch.arange(h.shape[0], 0, -1).clamp(max=chain) for h in hits.values()]).float()
    pool = torch.cat(list(pool_hits.values())).float()
    return {
        "held_out_acceptance": float(lengths.sum() / drafted.sum()),
        "held_out_mean_match_length": float(lengths.mean()),
        "single_coverage": float(torch.cat(list(hits.values())).float().mean()),
        "pool_coverage": float(pool.mean()),
    }


def add_hits(pool_hits: dict[int, torch.Tensor], hits: dict[int, torch.Tensor]) -> None:
    """pool_hits |= hits, row by row (a row cut by `fit` scores only its kept positions)."""
    for k, h in hits.items():
        pool_hits[k][: h.shape[0]] |= h


class HeldOutPool:
    """The held-out split's running pool scores: positions any SSM so far predicts (greedy), and
    the best member's sampled acceptance 1 - TV_b at each position (when the data has p)."""

    def __init__(self, held: list[dict[str, Any]], targets: Targets | None) -> None:
        self.held, self.targets = held, targets
        self.hits = {r["id"]: torch.zeros(len(r["output_ids"]), dtype=torch.bool) for r in held}
        self.accepted = {r["id"]: torch.zeros(len(r["output_ids"])) for r in held} if targets else None

    def add(
        self, ssm: PreTrainedModel, pad_id: int, batch_size: int, desc: str, chain: int | None = None
    ) -> dict[str, Any]:
        """Add an SSM to the pool; with `chain`, return its scores and the pool's."""
        hits = output_hits(ssm, self.held, pad_id, batch_size, desc)
        add_hits(self.hits, hits)
        accepted = None
        if self.targets is not None and self.accepted is not None:
            accepted = output_acceptance(ssm, self.held, self.targets, pad_id, batch_size, f"{desc} sampled")
            self.accepted = pool_max(self.accepted, accepted)
        if chain is None:
            return {}
        scores = held_out_scores(hits, self.hits, chain)
        scores["held_out_sampled_acceptance"] = mean_of(accepted)
        scores["pool_sampled_acceptance"] = mean_of(self.accepted)
        return scores


def mean_of(values: dict[int, torch.Tensor] | None) -> float | None:
    return None if values is None else float(torch.cat(list(values.values())).mean())


def pool_max(pool: dict[int, torch.Tensor], member: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """The best member's acceptance at every position: max over the pool and the new member."""
    return {k: torch.maximum(v, member[k]) for k, v in pool.items()}
