"""One SSM drafting chains for a whole batch at once (ALGORITHMS.md sections 3 and 11).

`PoolDrafter` drafts for one sequence; in a batch that costs one SSM call per sequence and chain
position. `BatchedChainDrafter` keeps one `TreeCache` over the rows of a batch (BASS-PAD, as the
LLM does) and drafts every row's chain with one SSM pass per chain position: first a pass that
catches each row up on the tokens verified since its last draft (it keeps the K/V of the drafted
tokens the LLM accepted), then one [B, 1] pass per further token. Its model may be a stacked pool
(`speculator/stacked_pool.py`) of `members` SSMs: then every sequence has one row per SSM, laid
out member-major (row p * S + b: SSM p drafting for sequence b), and the whole pool drafts every
sequence's chains in those same passes.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from specboost.speculator.kv_cache import CompiledPass, TreeCache
from specboost.speculator.model_info import context_length
from specboost.speculator.sampling import ChainWarp, LogitsToProbs, draw

Chain = list[tuple[int, torch.Tensor | None]]  # drafted tokens, each with its q (None when greedy)
CAPACITY = 256  # the cache's first capacity; it grows when a row needs more


class BatchedChainDrafter:
    """`members` SSMs (one model, or a stacked pool of them) drafting a chain per sequence of a
    batch; `compiled` is the model's compiled tree pass (None: eager). Its methods take and return
    one entry per row: `members` blocks of the batch's sequences, member-major."""

    def __init__(
        self, model: PreTrainedModel, compiled: CompiledPass | None = None, members: int = 1
    ) -> None:
        self.model = model
        self.members = members
        self.max_positions = context_length(model)
        self.cache = TreeCache(model, 0, CAPACITY, compiled)
        self.seen: list[list[int]] = []  # per row: the tokens whose K/V the cache holds, in order
        # Tokens fed by `draft_greedy` and not read back yet: [B, L] on the device, count per row.
        self._unread: tuple[torch.Tensor, list[int]] | None = None

    @property
    def sequences(self) -> int:
        return len(self.seen) // self.members

    def add_sequences(self, count: int) -> None:
        """New sequences at the end of the batch (with empty caches)."""
        self._read_back()
        old, new = self.sequences, count
        self.cache.extend(TreeCache(self.model, new * self.members, CAPACITY, self.cache.compiled))
        self.seen += [[] for _ in range(new * self.members)]
        if self.members > 1:  # appended member-major after the old rows: interleave the blocks
            first_new = old * self.members
            self._select_rows(
                [
                    row
                    for p in range(self.members)
                    for row in [
                        *range(p * old, (p + 1) * old),
                        *range(first_new + p * new, first_new + (p + 1) * new),
                    ]
                ]
            )

    def select(self, sequences: list[int]) -> None:
        """Keep only the sequences `sequences`, in that order."""
        self._read_back()
        total = self.sequences
        self._select_rows([p * total + b for p in range(self.members) for b in sequences])

    def _select_rows(self, rows: list[int]) -> None:
        self.cache.select(rows)
        self.seen = [self.seen[r] for r in rows]

    def _read_back(self) -> None:
        """Record the tokens `draft_greedy` fed (one host read, after the step that used them)."""
        if self._unread is None:
            return
        tokens, counts = self._unread
        for seen, row, count in zip(self.seen, tokens.tolist(), counts, strict=True):
            seen.extend(row[:count])
        self._unread = None

    def behind(self, verified: list[list[int]]) -> list[int]:
        """Per row, about how many tokens its next draft must catch up on first (at least 1): the
        verified tokens past those its cache holds, counting the drafted tokens it fed last time as
        held (exact after a step whose draft the LLM accepted whole; fewer than the truth after a
        rejection), without reading anything back from the device."""
        unread = [0] * len(self.seen) if self._unread is None else self._unread[1]
        return [
            max(1, len(v) - len(seen) - fed) for v, seen, fed in zip(verified, self.seen, unread, strict=True)
        ]

    @torch.no_grad()
    def draft_greedy(self, verified: list[list[int]], lengths: list[int]) -> tuple[torch.Tensor, list[int]]:
        """Greedy chains without logits processing, kept on the device: [B, L] tokens and each row's
        count (lengths[b], fewer past the SSM's context). Nothing is read back to the host."""
        self._read_back()
        if self.max_positions is not None:
            lengths = [
                max(0, min(n, self.max_positions - len(v))) for n, v in zip(lengths, verified, strict=True)
            ]
        width = max(lengths, default=0)
        chains = torch.zeros(len(verified), width, dtype=torch.long, device=self.cache.device)
        if width < 1:
            return chains, lengths
        catch_up = [
            self._catch_up(b, v) if n > 0 else []
            for b, (v, n) in enumerate(zip(verified, lengths, strict=True))
        ]
        logits = self._feed(catch_up)
        chains[:, 0] = logits.float().argmax(-1)  # as `generate`: argmax of float32 scores
        # The last token of a chain is never fed. Where every row drafts the whole width, the
        # cache feeds the rest in its compiled blocks where it has them (`TreeCache.feed_argmax`).
        if all(n == width for n in lengths):
            if width > 1:
                chains[:, 1:] = self.cache.feed_argmax(chains[:, 0], width - 1)
        else:
            for step in range(1, width):
                logits = self.cache.feed_column(chains[:, step - 1], [step < n for n in lengths])
                chains[:, step] = logits.float().argmax(-1)
        self._unread = (chains, [max(0, n - 1) for n in lengths])
        return chains, lengths

    @torch.no_grad()
    def draft(
        self,
        verified: list[list[int]],
        lengths: list[int],
        probs: list[LogitsToProbs],
        generators: list[torch.Generator | None],
        sample: list[bool] | None = None,
        coupled: list[torch.Generator | None] | None = None,
    ) -> list[Chain]:
        """A chain of `lengths[b]` tokens after `verified[b]` for every row b (fewer past the SSM's
        context; a row with length 0 drafts nothing and keeps its cache as it is), sampled where
        `sample[b]` (default: where row b samples), else coupled to the target rule's draws where
        `coupled[b]` (the row's random stream, not advanced: `coupled_choice`), else the argmax of
        its processed scores.

        The chains are drawn on the device, one [B, 1] pass per position as `draft_greedy` feeds
        them, and read back once at the end (each row's processors read the history only where they
        need it: then the drawn tokens are read back every position). Feeding host lists and drawing
        each token on the host had cost a sampled chain 1.7x a greedy one of the same length on the
        tiny fixture's SSM (3.2 against 1.8 ms for 4 tokens, compiled, 2-core EPYC); drawn on the
        device it took 2.9 ms, and 2.4 ms without `torch.multinomial` (see `draw`)."""
        self._read_back()
        if sample is None:
            sample = [p.config.do_sample for p in probs]
        if self.max_positions is not None:
            lengths = [
                max(0, min(n, self.max_positions - len(v))) for n, v in zip(lengths, verified, strict=True)
            ]
        width = max(lengths, default=0)
        if width < 1:
            return [[] for _ in verified]
        logits = self._feed(
            [
                self._catch_up(b, v) if n > 0 else []
                for b, (v, n) in enumerate(zip(verified, lengths, strict=True))
            ]
        )
        tokens = torch.zeros(len(verified), width, dtype=torch.long, device=self.cache.device)
        # Rows without a generator of their own draw together; a seeded row draws from its own.
        pooled = [s and g is None for s, g in zip(sample, generators, strict=True)]
        own = [b for b, (s, g) in enumerate(zip(sample, generators, strict=True)) if s and g is not None]
        together = torch.tensor(pooled, device=tokens.device) if any(pooled) else None
        streams = {  # the target rule's future draws, each coupled row's own
            b: _copy(g) for b, g in enumerate(coupled or []) if g is not None and not sample[b]
        }
        qs: list[torch.Tensor] = []
        warp = self._block_warp(lengths, probs, pooled, streams)
        for step in range(1 if warp else width):
            scores = _row_scores(logits, verified, tokens[:, :step], probs)  # [B, V]
            chosen = scores.argmax(-1)
            if any(sample) or streams:
                q = torch.softmax(scores, dim=-1)
                if together is not None:
                    chosen = torch.where(together, draw(q)[:, 0], chosen)
                for b in own:  # in a fixed order, only while the row drafts: its stream is its own
                    if step < lengths[b]:
                        chosen[b] = draw(q[b], 1, generators[b])[0]
                for b, stream in streams.items():
                    if step < lengths[b]:
                        chosen[b] = coupled_choice(q[b], stream)
                qs.append(q)
            tokens[:, step] = chosen
            active = [step + 1 < n for n in lengths]  # the last token of a chain is never fed
            if any(active) and not warp:
                logits = self.cache.feed_column(tokens[:, step], active)
        if warp:  # the rest in the cache's compiled sampled blocks (`TreeCache.feed_sampled`)
            uniform = torch.rand(len(verified), width - 1, dtype=torch.float32, device=tokens.device)
            tokens[:, 1:], rest = self.cache.feed_sampled(tokens[:, 0], warp, uniform)
            qs += rest.unbind(1)
        host = tokens.tolist()
        for seen, row, n in zip(self.seen, host, lengths, strict=True):
            seen.extend(row[: max(0, n - 1)])
        return [
            [(host[b][step], qs[step][b] if sample[b] else None) for step in range(n)]
            for b, n in enumerate(lengths)
        ]

    def expect_sampling(self, probs: list[LogitsToProbs]) -> None:
        """Have the compiled call make the sampled blocks chains sampled under `probs` will draw in
        (`CompiledPass.expect_draws`), compiled where its caches next warm: call it when such rows
        join, before they draft."""
        call = self.cache.compiled
        if call is not None:
            for warp in {ChainWarp.of(p) for p in probs} - {None}:
                call.expect_draws(warp.key)

    def _block_warp(
        self, lengths: list[int], probs: list[LogitsToProbs], pooled: list[bool], streams: dict
    ) -> ChainWarp | None:
        """The `ChainWarp` of a chain whose tokens after its first the cache may draw in compiled
        sampled blocks (speculator/chain_block.py): a compiled cache that makes them, of one row
        (blocks serve one-row caches only: a batch keeps drawing on the host), drafting 2 tokens or
        more, sampled from torch's global stream (no generator, coupled stream or processor of its
        own); else None (the cache draws the tokens in blocks where its call expects the warp:
        `expect_sampling`)."""
        call = self.cache.compiled
        if call is None or call.make_sampled is None or len(lengths) != 1 or lengths[0] < 2:
            return None
        if streams or not pooled[0]:
            return None
        return ChainWarp.of(probs[0])

    @torch.no_grad()
    def agreement(self, verified: list[list[int]], starts: list[int]) -> list[list[bool]] | None:
        """Catch every row up on `verified` (the pass a draft starts with, after one without logits
        over the tokens before each row's start where there are any) and return, per row,
        whether the SSM's argmax after each token from position `starts[b]` on is the token that
        follows it there: what its greedy chains would have matched along that text, teacher-forced
        (ALGORITHMS.md 5.4, "Shadow checks"). None where the rows do not fit the SSM's context or
        the cache in one pass; then nothing is fed."""
        self._read_back()
        if self.max_positions is not None and max(map(len, verified)) > self.max_positions:
            return None
        # What a draft would drop, dropped; the last token kept re-fed: its argmax was not judged.
        feeds = [self._catch_up(b, v, back=1) for b, v in enumerate(verified)]
        if self.cache.in_parts(max(map(len, feeds))):
            return None
        # The tokens before a row's start (its prompt, at a call's first check) are read in a pass
        # of their own that projects no logits: the vocabulary's projection is most of a small SSM's
        # work (the quick fixture's: 84%), and one pass with every position's logits had spent most
        # of a check on the prompt (8 rows of 100-token prompts, 48 tokens decoded: 37 ms, 16 ms now).
        firsts = [len(v) - len(fed) for v, fed in zip(verified, feeds, strict=True)]
        skips = [
            min(max(0, s - first), len(fed) - 1) for s, first, fed in zip(starts, firsts, feeds, strict=True)
        ]
        if any(skips):
            self._feed([fed[:skip] for fed, skip in zip(feeds, skips, strict=True)])
        judged = [fed[skip:] for fed, skip in zip(feeds, skips, strict=True)]
        predicted = self._feed(judged, every=True).float().argmax(-1).tolist()  # [B, N]
        agrees = []
        for v, fed, first, skip, argmax in zip(verified, judged, firsts, skips, predicted, strict=True):
            # argmax[j]: the token after v[first + skip + j]
            agrees.append([argmax[j] == v[first + skip + j + 1] for j in range(len(fed) - 1)])
        return agrees

    def _catch_up(self, row: int, verified: list[int], back: int = 0) -> list[int]:
        """Drop the cached tokens that are not a prefix of `verified`, and `back` more; return what
        must be fed (at least the last token, whose logits start the chain)."""
        seen, common = self.seen[row], 0
        limit = min(len(seen) - back, len(verified) - 1)
        while common < limit and seen[common] == verified[common]:
            common += 1
        self.cache.truncate(row, common)
        self.seen[row] = seen[:common]
        return verified[common:]

    def _feed(self, feeds: list[list[int]], every: bool = False) -> torch.Tensor:
        """Feed chain `feeds[b]` to row b in one pass and keep it all; [B, V] logits after each
        row's last fed token (garbage for rows fed nothing), [B, N, V] after each with `every`."""
        logits = self.cache.feed_chains(feeds, every=every).logits
        for seen, fed in zip(self.seen, feeds, strict=True):
            seen.extend(fed)
        return logits


def coupled_choice(q: torch.Tensor, stream: torch.Generator) -> torch.Tensor:
    """The token q [V] names under the noise the target rule's next draw from `stream` will use
    (ALGORITHMS.md 5.3, "Seeded rows"): `torch.multinomial(p, 1)` draws E ~ Exp(1) per token of
    the vocabulary, `empty_like(p).exponential_(1)`, and returns argmax p / E (Gumbel-max), so
    argmax q / E on the same E is the SSM's guess at the LLM's token, equal to it whenever q and p
    agree enough (a coupling of the two draws). `stream` advances as the rule's own will, one draw
    of the vocabulary's size per position; the text stays the seed's whatever is drafted."""
    noise = torch.empty(q.shape[-1], dtype=torch.float32, device=stream.device).exponential_(
        1, generator=stream
    )
    return (q.float() / noise.to(q.device)).argmax()


def _copy(generator: torch.Generator) -> torch.Generator:
    """A generator at `generator`'s state, advancing on its own."""
    copy = torch.Generator(generator.device)
    copy.set_state(generator.get_state())
    return copy


def _row_scores(
    logits: torch.Tensor, verified: list[list[int]], drafted: torch.Tensor, probs: list[LogitsToProbs]
) -> torch.Tensor:
    """[B, V] logits -> each row's processed scores, with its own history (verified + the `drafted`
    [B, step] tokens so far) where its processors read it."""
    if not any(p.processors for p in probs):
        return logits.float()
    so_far = drafted.tolist() if any(p.needs_history for p in probs) else None
    rows = []
    for b, p in enumerate(probs):
        histories = (
            torch.tensor([[*verified[b], *so_far[b]]], device=logits.device)
            if so_far is not None and p.needs_history
            else None
        )
        rows.append(p.scores(logits[b : b + 1], histories))
    return torch.cat(rows)
