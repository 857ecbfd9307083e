"""The decode loop: sequences decoded together, one LLM pass per step (ALGORITHMS.md sections
1-3, 7 and 11). One `generate` call is a group of one row; a batch, or the requests the serving
engine (`decoder/engine.py`) gathers, is a group of several.

Each step:
1. draft: every row's strategy proposes a token tree (pool chains of a batch are drafted
   together, one SSM pass per chain position; `decoder/batch_drafting.py`);
2. verify: the LLM scores every row's tree in ONE forward pass over its fixed-capacity cache
   (`TreeCache`, BASS-PAD: rows of different lengths, each with its own positions);
3. accept: each row's verification rule picks the accepted path and the LLM's own next token;
   the LLM cache keeps the accepted nodes (in-place index copies), drops the rest;
4. feed back: the accepted tokens go through the row's stopping criteria, statistics and its
   strategy, and the tokens kept go to the row's streamer, if any (`TokenStream`); finished rows
   leave the group. Rows may join between steps (continuous batching).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from specboost.decoder.batch_drafting import batch_length_controller, make_drafting
from specboost.decoder.compilation import ModelCalls
from specboost.decoder.sequence import DecoderParts, SequenceState
from specboost.decoder.stats import DecodeStats, PhaseTimer
from specboost.decoder.verifiers import TreeVerifier, Verifier
from specboost.speculator.kv_cache import TreeCache, capacity_for
from specboost.speculator.tree import ChainDraft, TokenTree

# Positions a group's cache holds beyond its rows' final length (their text plus the tokens still
# wanted), where its drafts may be trees. A chain needs none (`GroupDrafting.one_chain`): it is
# never deeper than the tokens still wanted. A tree holds its nodes beside its depth, so a tree of
# more than this many extra nodes grows the cache once near the end of a text. Every pass attends
# over the whole capacity: at batch 8 on short texts a headroom of 64 (capacity 256 where 128 held
# the text) cost our plain step 0.77x `generate`'s compiled static-cache step, 0.91x without it;
# and 16 (224 where 189 held the text) cost the plain loop 0.89x, 0.96x without it (docs/results.md).
CAPACITY_HEADROOM = 16
# The group cache's capacity is rounded up to a multiple of this, finer than the drafters' caches'
# (`CAPACITY_STEP`): it is set once from the rows' final lengths, and every pass of the LLM attends
# over all of it. At batch 8 on prompts of up to 101 tokens, 256 positions where 176 held the text
# cost our plain step 0.81x transformers' `generate`, 0.96-1.0x at 192 (docs/results.md).
TARGET_CAPACITY_STEP = 32


class LoopParts(DecoderParts, Protocol):
    """What the loop takes from its `SpeculativeDecoder`: a sequence's parts, the verifier that
    runs the LLM, and the compiled model calls."""

    verifier: Verifier
    calls: ModelCalls


@dataclass(frozen=True)
class BatchConfig:
    """How a group drafts.

    length_controller: the batch's draft-length rule for chain strategies (ALGORITHMS.md section 7):
        "bass" (BASS Algorithm 1), "minions", or None for the speculator's fixed length. A
        speculator that has its own controller keeps a copy of it. A group of one row keeps the
        speculator's own length (and its controller, if any).
    length_settings: the controller's config fields; None starts it at the speculator's chain
        length with the rule's other defaults (BASS: l_incre=2, l_mod=10, l_limit=32).
    batched_drafting: the pool's chains are drafted for the whole group at once (one SSM pass per
        chain position); False drafts sequence by sequence, as every other strategy does.
    seeded_rows_keep_length: a row with a seed drafts the speculator's own chain length, not the
        controller's: the controller's length follows the whole group, and with it the row's
        random draws (SSM samples, acceptance tests) and so its text would depend on the rows
        beside it. The serving engine sets it, so that a seed gives one text whatever the batch.
    """

    length_controller: str | None = "bass"
    length_settings: Mapping[str, int] | None = None
    batched_drafting: bool = True
    seeded_rows_keep_length: bool = False


class SequenceGroup:
    """Sequences verified together, one LLM pass per step: the rows, the LLM's cache over them
    (every verified token of a row but its root, the last one), the rows' drafting state and the
    group's length controller. The LLM reads new rows' prompts at their first verification."""

    def __init__(self, decoder: LoopParts, config: BatchConfig | None = None, rows: int = 2) -> None:
        """`rows`: how many rows the group expects (a group of one row drafts with the decoder's
        own speculator, so that what it learns carries over to the next call)."""
        if rows > 1 and not isinstance(decoder.verifier, TreeVerifier):
            raise ValueError(
                "batched decoding verifies with tree attention; verification='stairs' is for one sequence"
            )
        config = config or BatchConfig()
        speculator = decoder.speculator
        self.decoder = decoder
        self.llm = decoder.llm
        self.max_positions = decoder.max_positions
        self.keep_hidden = speculator.wants_hidden
        self.drafting = make_drafting(speculator, config.batched_drafting, decoder.calls, rows)
        self.seeded_rows_keep_length = config.seeded_rows_keep_length
        self.controller = (  # one row keeps the speculator's own length (and controller)
            batch_length_controller(speculator, config.length_controller, config.length_settings)
            if rows > 1
            else None
        )
        self.rows: list[SequenceState] = []
        self.target = TreeCache(self.llm, 0, capacity_for(CAPACITY_HEADROOM), decoder.calls.get(self.llm))
        self._unread = 0  # the last rows, whose prompts the LLM has not read yet
        self.timer = PhaseTimer(self.llm.device)
        self.llm_steps = 0  # verification passes
        self.lengths: list[int] = []  # the group's chain length per step (chain strategies)
        self.chains: ChainDraft | None = None  # the step's drafts when they are still on the device

    def __len__(self) -> int:
        return len(self.rows)

    def admit(self, rows: list[SequenceState]) -> None:
        """Add `rows` after the current ones. None is nothing: the serving engine admits what its
        queue holds every round, and an empty admission had sized every drafter's cache anew and
        restarted the routed scheduler's decision pacing (16% of its rounds' time at batch 8)."""
        if not rows:
            return
        for row in rows:
            row.timer_mark = self.timer.mark()
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
        self.timer.forget_before(min((row.timer_mark for row in self.rows), default=self.timer.mark()))
        return removed

    # 1. Draft ----------------------------------------------------------------------------------------
    def draft(self) -> None:
        """Draft every row's tree; one chain length for all (ALGORITHMS.md section 7), but for
        seeded rows when `BatchConfig.seeded_rows_keep_length`."""
        if self.keep_hidden:  # the strategy drafts from the state that chose the root: read prompts first
            with self.timer.phase("verify"):
                self._read_prompts()
        depths = [row.max_depth(self.max_positions) for row in self.rows]
        length = self.controller.length() if self.controller is not None else None
        lengths = [
            None if self.seeded_rows_keep_length and row.seed is not None else length for row in self.rows
        ]
        with self.timer.phase("draft"):
            drafted = self.drafting.propose(self.rows, depths, lengths)
        self.chains = drafted if isinstance(drafted, ChainDraft) else None  # trees come with the verdicts
        for b, row in enumerate(self.rows):
            row.tree = None if self.chains is not None else drafted[b]
            row.stats.draft_levels += self.drafting.levels(b)
        if length is not None:
            self.lengths.append(length)

    # 2-4. Verify, accept, feed back -------------------------------------------------------------------
    @torch.no_grad()
    def verify(self) -> list[SequenceState]:
        """Verify every row's tree in ONE LLM pass, emit the accepted tokens and the LLM's own,
        apply each row's stopping criteria; returns the rows that finished (no longer in the group)."""
        start = time.perf_counter()
        with self.timer.phase("verify"):
            self._read_prompts()
            keep_hidden = self.keep_hidden and self.drafting.wants_hidden()
            verdicts, hidden = self.decoder.verifier.verify(self.target, self.rows, keep_hidden, self.chains)
        # Host time of the verification (on CUDA it also waits for the drafting queued before it: the
        # verdicts are read back here); what the length controllers and strategies learn from.
        seconds = time.perf_counter() - start
        self.llm_steps += 1
        with self.timer.phase("other"):
            for b, (row, verdict) in enumerate(zip(self.rows, verdicts, strict=True)):
                emitted = [row.tree.tokens[u] for u in verdict.accepted] + [verdict.next_token]
                kept = row.stop.extend(emitted)
                row.tokens.extend(kept)
                if row.stream is not None:
                    row.stream.put(kept)
                record_step(row.stats, row.tree, verdict.accepted)
                if self.keep_hidden:  # a state not computed is not left stale
                    row.hidden = None if hidden is None else hidden[b]
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
        new = self.rows[len(self.rows) - self._unread :]
        prefixes = [row.tokens[:-1] for row in new]
        longest = max(row.final_length for row in self.rows)
        headroom = 0 if self.drafting.one_chain else CAPACITY_HEADROOM
        fresh = TreeCache(
            self.llm,
            len(prefixes),
            capacity_for(longest + headroom, TARGET_CAPACITY_STEP),
            self.target.compiled,
        )
        if any(prefixes):  # prompts: shapes a compiled graph has not seen
            out = fresh.feed_chains(prefixes, eager=True, output_hidden=self.keep_hidden)
            if out.hidden is not None:  # the state that chose each row's root, for the scheduler
                for b, row in enumerate(new):
                    row.hidden = out.hidden[b] if prefixes[b] else None
        self.target.extend(fresh)
        self._unread = 0

    def _close(self, index: int, row: SequenceState, now: float) -> None:
        row.finished = now
        s = row.stats
        s.new_tokens = len(row.new_tokens)
        s.time_total = now - row.started
        phases = self.timer.seconds_since(row.timer_mark)  # the steps since the row joined
        s.time_draft, s.time_verify = phases["draft"], phases["verify"]
        s.time_other = max(0.0, s.time_total - s.time_draft - s.time_verify)
        s.strategy = self.drafting.report(index)


def decode(decoder: LoopParts, rows: list[SequenceState], config: BatchConfig | None = None) -> SequenceGroup:
    """Decode `rows` to the end as one group; returns the group (its timer and step counts). A
    row's stream ends when the row finishes, and every stream ends if decoding raises.

    Decoding runs under `torch.inference_mode` whoever calls it (so do the serving engine's workers):
    a compiled graph guards on whether its caches are inference tensors, so a decoder used both
    inside and outside the mode (the benchmark suite times under it; an engine's worker thread does
    not inherit it) compiled its graphs twice, the second set in timed runs: the learned scheduler
    in an engine ran at 0.09x its own batched loop. What the user gets back is built outside it."""
    try:
        with torch.inference_mode():
            group = SequenceGroup(decoder, config, rows=len(rows))
            group.admit(rows)
            while len(group):
                group.draft()
                end_streams(group.verify())
    finally:
        end_streams(rows)  # a no-op for the streams that ended
    return group


def end_streams(rows: list[SequenceState]) -> None:
    for row in rows:
        if row.stream is not None:
            row.stream.end()


def record_step(stats: DecodeStats, tree: TokenTree, accepted: list[int]) -> None:
    """Count one verification step of `tree` in `stats` (ALGORITHMS.md section 13)."""
    stats.llm_steps += 1
    stats.draft_tokens += tree.num_draft_tokens
    stats.accepted_tokens += len(accepted)
    stats.match_lengths.append(len(accepted))
    for u in range(1, len(tree)):
        for ssm in tree.ssms[u]:
            stats.proposed_per_ssm[ssm] += 1
    for u in accepted:
        for ssm in tree.ssms[u]:
            stats.accepted_per_ssm[ssm] += 1
