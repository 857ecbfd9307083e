"""Ragged batched speculative decoding (BASS, ALGORITHMS.md sections 7 and 11): its output.

`SpeculativeDecoder.generate(input_ids [B, L], attention_mask)` with B > 1 runs `BatchedDecoder`:
every row becomes a sequence with its own accepted length, EOS, stop strings and random stream,
and the decode loop (`decoder/loop.py`) runs them as one group: one LLM pass per step over a
padded cache with per-row positions. A row that accepts fewer tokens is never waited for, and one
that finishes leaves the group. Chain strategies draft one length per step for the whole batch,
BASS Algorithm 1 by default (section 7).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers import GenerationConfig

from specboost.decoder.loop import BatchConfig, LoopParts, decode
from specboost.decoder.sequence import new_sequence
from specboost.decoder.stats import DecodeStats, per_token_latency
from specboost.decoder.validation import check_generate_arguments, output_vocab_size


# Batched generate ------------------------------------------------------------------------------------
@dataclass
class BatchStats:
    """Statistics of one batched `generate` (metric names of ALGORITHMS.md section 13).

    Per sequence, `sequences[b]` is a `DecodeStats` whose times are the wall time that sequence
    spent in draft and verification rounds (shared with the other rows of the batch).
    Per-token latency of a sequence = its latency (start to its last token) / its new tokens;
    BASS reports it for the sequence that finishes first, the one that finishes last, and the mean
    over the batch (ALGORITHMS.md section 11).
    """

    sequences: list[DecodeStats]
    latencies: list[float]  # seconds from the start to each sequence's last token
    llm_steps: int = 0  # batched verification passes
    lengths: list[int] = field(default_factory=list)  # the batch's chain length per step
    time_draft: float = 0.0
    time_verify: float = 0.0
    time_other: float = 0.0
    time_total: float = 0.0

    @property
    def new_tokens(self) -> int:
        return sum(s.new_tokens for s in self.sequences)

    @property
    def tokens_per_second(self) -> float:
        """Throughput: output tokens of all sequences per second."""
        return self.new_tokens / self.time_total if self.time_total else 0.0

    @property
    def tokens_per_step(self) -> float:
        """New tokens per sequence and LLM pass (the mean accepted length, bonus token included)."""
        steps = sum(s.llm_steps for s in self.sequences)
        return self.new_tokens / steps if steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        drafted = sum(s.draft_tokens for s in self.sequences)
        return sum(s.accepted_tokens for s in self.sequences) / drafted if drafted else 0.0

    @property
    def per_token_latencies(self) -> list[float]:
        return [t / max(1, s.new_tokens) for t, s in zip(self.latencies, self.sequences, strict=True)]

    @property
    def per_token_latency(self) -> dict[str, float]:
        """Seconds per token of the first and last sequence to finish, and the batch mean."""
        return per_token_latency(self.latencies, [s.new_tokens for s in self.sequences])

    def to_dict(self) -> dict:
        out = {name: getattr(self, name) for name in ("latencies", "llm_steps", "lengths")}
        out |= {
            f"time_{phase}": getattr(self, f"time_{phase}") for phase in ("draft", "verify", "other", "total")
        }
        for name in (
            "new_tokens",
            "tokens_per_second",
            "tokens_per_step",
            "acceptance_rate",
            "per_token_latency",
        ):
            out[name] = getattr(self, name)
        out["sequences"] = [s.to_dict() for s in self.sequences]
        return out


@dataclass
class BatchedOutput:
    sequences: torch.Tensor  # [B, L + new]: the input rows, then new tokens; pad after a row ends
    stats: BatchStats
    finish_reasons: list[str]  # per row: "eos" | "length" | "stop_string"


class BatchedDecoder:
    """Batched `generate` for a `SpeculativeDecoder` (its models, strategy and rule)."""

    def __init__(self, decoder: LoopParts, config: BatchConfig | None = None) -> None:
        self.decoder = decoder
        self.config = config or BatchConfig()

    def generate(
        self,
        input_ids: torch.Tensor,  # [B, L], left-padded
        attention_mask: torch.Tensor | None = None,  # [B, L]
        *,
        generation_config: GenerationConfig | None = None,
        seed: int | None = None,
        **options: object,
    ) -> BatchedOutput:
        """Like `SpeculativeDecoder.generate` for every row, each row as if generated alone;
        `options` are its keyword arguments (max_new_tokens, do_sample, ..., any `GenerationConfig`
        field). Row b samples with a seed derived from `seed`."""
        check_generate_arguments(
            input_ids, attention_mask, options, seed, output_vocab_size(self.decoder.llm)
        )
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, length], got shape {tuple(input_ids.shape)}")
        decoder, batch = self.decoder, input_ids.shape[0]
        masks = [None] * batch if attention_mask is None else list(attention_mask)
        seeds = row_seeds(seed, batch)
        rows = [
            new_sequence(decoder, ids, mask, generation_config, options, s, tag=b)
            for b, (ids, mask, s) in enumerate(zip(input_ids, masks, seeds, strict=True))
        ]
        start = time.perf_counter()
        for row in rows:
            row.started = start
        group = decode(decoder, rows, self.config)
        # Every row joined at the first step, so the last to finish spent every step in the loop.
        last = max(rows, key=lambda row: row.finished).stats
        stats = BatchStats(
            sequences=[row.stats for row in rows],
            latencies=[row.finished - start for row in rows],
            llm_steps=group.llm_steps,
            lengths=group.lengths,
            time_draft=last.time_draft,
            time_verify=last.time_verify,
            time_other=last.time_other,
            time_total=time.perf_counter() - start,
        )
        pad = pad_token_id(decoder, rows[0].stop.eos_token_ids, rows[0].settings.pad_token_id)
        sequences = _pad_right([row.new_tokens for row in rows], pad, input_ids.device)
        return BatchedOutput(
            torch.cat([input_ids, sequences], dim=1), stats, [row.finish_reason for row in rows]
        )


def row_seeds(seed: int | None, rows: int) -> list[int | None]:
    """One seed per row, derived from `seed` (independent streams, reproducible)."""
    if seed is None:
        return [None] * rows
    generator = torch.Generator("cpu").manual_seed(seed)  # host numbers: no device involved
    return torch.randint(2**62, (rows,), generator=generator, device="cpu").tolist()


def pad_token_id(decoder: LoopParts, eos_ids: frozenset[int], requested: int | None = None) -> int:
    """What `generate` pads finished rows with: the call's pad token (`requested`: its
    `pad_token_id` option or generation config, as `generate` resolves it), else the model's, else
    the (smallest) EOS token, else 0."""
    pad = requested if requested is not None else decoder.llm.generation_config.pad_token_id
    if pad is None:
        pad = getattr(decoder.llm.config, "pad_token_id", None)
    if pad is None:
        pad = min(eos_ids, default=0)
    return int(pad[0] if isinstance(pad, list) else pad)


def _pad_right(rows: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    width = max(len(row) for row in rows)
    return torch.tensor(
        [[*row, *[pad] * (width - len(row))] for row in rows], dtype=torch.long, device=device
    )
