"""Ragged batched speculative decoding (BASS, ALGORITHMS.md sections 7 and 11).

`SpeculativeDecoder.generate(input_ids [B, L], attention_mask)` with B > 1 runs `BatchedDecoder`.
Every sequence keeps its own accepted length, EOS, stop strings, random stream and SSM caches;
each step drafts a tree per sequence (`decoder/batch_drafting.py`) and the LLM verifies all of
them in ONE forward pass over a padded, masked KV cache (`RaggedCache`, BASS-PAD) with
per-sequence position ids. A sequence that accepts fewer tokens is never waited for, and one that
finishes leaves the batch (its cache rows are dropped). Chain strategies draft one length per
step for the whole batch, BASS Algorithm 1 by default (section 7).

`SequenceGroup` is one such batch and its two halves, `draft` (the SSM side) and `verify` (the
LLM side); the serving engine (`decoder/engine.py`) runs several groups through the same calls.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from transformers import GenerationConfig

from specboost.decoder.batch_drafting import batch_length_controller, make_drafting
from specboost.decoder.decoder import record_step
from specboost.decoder.sequence import SequenceState, new_sequence
from specboost.decoder.stats import DecodeStats, PhaseTimer, per_token_latency
from specboost.decoder.validation import check_generate_arguments, output_vocab_size
from specboost.decoder.verifiers import TreeVerifier
from specboost.decoder.verify import Verdict, apply_rule
from specboost.speculator.ragged import RaggedCache, chain_batch
from specboost.speculator.tree import TreeBatch

if TYPE_CHECKING:
    from specboost.decoder.decoder import SpeculativeDecoder


@dataclass(frozen=True)
class BatchConfig:
    """How a batch drafts.

    length_controller: the batch's draft-length rule for chain strategies (ALGORITHMS.md section 7):
        "bass" (BASS Algorithm 1), "minions", or None for the speculator's fixed length. A
        speculator that has its own controller keeps a copy of it.
    length_settings: the controller's config fields; None starts it at the speculator's chain
        length with the rule's other defaults (BASS: l_incre=2, l_mod=10, l_limit=32).
    batched_drafting: the pool's chains are drafted for the whole batch at once (one SSM pass per
        chain position); False drafts sequence by sequence, as every other strategy does.
    """

    length_controller: str | None = "bass"
    length_settings: Mapping[str, int] | None = None
    batched_drafting: bool = True


class SequenceGroup:
    """Sequences verified together, one LLM pass per step: the rows, the LLM's ragged cache over
    them (every verified token of a row but its root, as `TargetState`), the rows' drafting state
    and the batch's length controller. New rows may join between steps (continuous batching); the
    LLM reads their prompts at the start of their first verification."""

    def __init__(self, decoder: SpeculativeDecoder, config: BatchConfig | None = None) -> None:
        if not isinstance(decoder.verifier, TreeVerifier):
            raise ValueError(
                "batched decoding verifies with tree attention; verification='stairs' is for one sequence"
            )
        config = config or BatchConfig()
        speculator = decoder.speculator
        self.llm = decoder.llm
        self.max_positions = decoder.max_positions
        self.keep_hidden = speculator.wants_hidden
        self.drafting = make_drafting(speculator, config.batched_drafting)
        self.controller = batch_length_controller(
            speculator, config.length_controller, config.length_settings
        )
        self.rows: list[SequenceState] = []
        self.target = RaggedCache()
        self._unread = 0  # the last rows, whose prompts the LLM has not read yet
        self.timer = PhaseTimer(self.llm.device)
        self.llm_steps = 0  # verification passes
        self.lengths: list[int] = []  # the batch's chain length per step (chain strategies)

    def __len__(self) -> int:
        return len(self.rows)

    def admit(self, rows: list[SequenceState]) -> None:
        self.rows += rows
        self._unread += len(rows)
        self.drafting.add(rows)

    def retain(self, keep: Callable[[SequenceState], bool]) -> list[SequenceState]:
        """Drop the rows for which `keep` is False (finished, cancelled); returns them."""
        kept = [i for i, row in enumerate(self.rows) if keep(row)]  # once: `keep` may change (cancel)
        if len(kept) == len(self.rows):
            return []
        read = len(self.rows) - self._unread
        removed = [self.rows[i] for i in sorted(set(range(len(self.rows))) - set(kept))]
        self.target.select([i for i in kept if i < read])
        self._unread = sum(i >= read for i in kept)
        self.drafting.retain(self.rows, kept)
        self.rows = [self.rows[i] for i in kept]
        return removed

    # The SSM side ----------------------------------------------------------------------------------
    def draft(self) -> None:
        """Draft every row's tree; one chain length for all (ALGORITHMS.md section 7)."""
        depths = [row.max_depth(self.max_positions) for row in self.rows]
        length = self.controller.length() if self.controller is not None else None
        start = time.perf_counter()
        with self.timer.phase("draft"):
            trees = self.drafting.propose(self.rows, depths, length)
        seconds = time.perf_counter() - start
        for row, tree in zip(self.rows, trees, strict=True):
            row.tree = tree
            row.stats.time_draft += seconds
        if length is not None:
            self.lengths.append(length)

    # The LLM side ----------------------------------------------------------------------------------
    @torch.no_grad()
    def verify(self) -> list[SequenceState]:
        """Verify every row's tree in ONE LLM pass, emit the accepted tokens and the LLM's own,
        apply each row's stopping criteria; returns the rows that finished (no longer in the group)."""
        start = time.perf_counter()
        with self.timer.phase("verify"):
            self._read_prompts()
            trees = [row.tree for row in self.rows]
            out = self.target.forward(self.llm, TreeBatch.pack(trees), self.keep_hidden)
            verdicts = [self._judge(row, out.logits[b, : len(row.tree)]) for b, row in enumerate(self.rows)]
            self.target.keep([[0, *verdict.accepted] for verdict in verdicts])
        seconds = time.perf_counter() - start
        self.llm_steps += 1
        with self.timer.phase("other"):
            for b, (row, verdict) in enumerate(zip(self.rows, verdicts, strict=True)):
                emitted = [row.tree.tokens[u] for u in verdict.accepted] + [verdict.next_token]
                row.tokens.extend(row.stop.extend(emitted))
                record_step(row.stats, row.tree, verdict.accepted)
                row.stats.time_verify += seconds
                if self.keep_hidden:
                    row.hidden = out.hidden[b, verdict.accepted[-1] if verdict.accepted else 0]
                if self.max_positions is not None and len(row.tokens) > self.max_positions:
                    row.stop.finish_reason = row.stop.finish_reason or "length"
            accepted = [verdict.accepted for verdict in verdicts]
            self.drafting.observe(self.rows, accepted, seconds)
            if self.controller is not None:
                self.controller.update([len(nodes) for nodes in accepted], seconds)
            now = time.perf_counter()
            for b, row in enumerate(self.rows):
                if row.finish_reason is not None:
                    self._close(b, row, now)
            return self.retain(lambda row: row.finish_reason is None)

    def _read_prompts(self) -> None:
        """Put the prompts of the new rows (all but their last token, the first root) into the
        LLM cache, in one ragged pass."""
        if not self._unread:
            return
        prefixes = [row.tokens[:-1] for row in self.rows[len(self.rows) - self._unread :]]
        fresh = RaggedCache(len(prefixes))
        if any(prefixes):
            fresh.forward(self.llm, chain_batch(prefixes))
            fresh.keep([list(range(len(prefix))) for prefix in prefixes])
        self.target.extend(fresh)
        self._unread = 0

    @staticmethod
    def _judge(row: SequenceState, logits: torch.Tensor) -> Verdict:
        """The row's verification rule on its tree (ALGORITHMS.md section 2)."""
        return apply_rule(row.rule, row.tree, logits, row.probs, row.tokens, row.generator)

    def _close(self, index: int, row: SequenceState, now: float) -> None:
        row.finished = now
        s = row.stats
        s.new_tokens = len(row.new_tokens)
        s.time_total = now - row.started
        s.time_other = max(0.0, s.time_total - s.time_draft - s.time_verify)
        s.strategy = self.drafting.report(index)


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

    def __init__(self, decoder: SpeculativeDecoder, config: BatchConfig | None = None) -> None:
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
        group = SequenceGroup(decoder, self.config)
        group.admit(rows)
        while len(group):
            group.draft()
            group.verify()
        seconds = group.timer.seconds
        stats = BatchStats(
            sequences=[row.stats for row in rows],
            latencies=[row.finished - start for row in rows],
            llm_steps=group.llm_steps,
            lengths=group.lengths,
            time_draft=seconds["draft"],
            time_verify=seconds["verify"],
            time_other=seconds["other"],
            time_total=time.perf_counter() - start,
        )
        pad = pad_token_id(decoder, rows[0].stop.eos_token_ids)
        sequences = _pad_right([row.new_tokens for row in rows], pad, input_ids.device)
        return BatchedOutput(
            torch.cat([input_ids, sequences], dim=1), stats, [row.finish_reason for row in rows]
        )


def row_seeds(seed: int | None, rows: int) -> list[int | None]:
    """One seed per row, derived from `seed` (independent streams, reproducible)."""
    if seed is None:
        return [None] * rows
    return torch.randint(2**62, (rows,), generator=torch.Generator().manual_seed(seed)).tolist()


def pad_token_id(decoder: SpeculativeDecoder, eos_ids: frozenset[int]) -> int:
    """What `generate` pads finished rows with: the pad token, else the (smallest) EOS token, else 0."""
    pad = decoder.llm.generation_config.pad_token_id
    if pad is None:
        pad = getattr(decoder.llm.config, "pad_token_id", None)
    if pad is None:
        pad = min(eos_ids, default=0)
    return int(pad[0] if isinstance(pad, list) else pad)


def _pad_right(rows: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    width = max(len(row) for row in rows)
    out = torch.full((len(rows), width), pad, dtype=torch.long, device=device)
    for b, row in enumerate(rows):
        out[b, : len(row)] = torch.tensor(row, dtype=torch.long)
    return out
