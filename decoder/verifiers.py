"""How the LLM checks the drafted trees of a group: one tree-attention pass, or Stairs' batch of
prefixes (one sequence).

A verifier runs the LLM over its `TreeCache`, applies each row's verification rule, and leaves the
cache holding exactly every row's previous text, its old root and its accepted nodes.
"""

from __future__ import annotations

from typing import Protocol

import torch

from specboost.decoder.sequence import SequenceState
from specboost.decoder.verify import DEFAULT_SAMPLING_RULE, Rule, Verdict, apply_rule, check_rule, walk
from specboost.speculator.kv_cache import TreeCache
from specboost.speculator.tree import ChainDraft, DraftKind, TokenTree, TreeBatch

# per row: the LLM's last hidden state [H] before the new root (the estimates [S * D] of its call's head)
Hidden = list[torch.Tensor] | None


class Verifier(Protocol):
    def check(self, kind: DraftKind, do_sample: bool, num_ssms: int) -> Rule:
        """Called for every sequence: the rule for these trees, or a ValueError if this verifier
        cannot verify them losslessly."""

    def verify(
        self, cache: TreeCache, rows: list[SequenceState], keep_hidden: bool, chains: ChainDraft | None = None
    ) -> tuple[list[Verdict], Hidden]:
        """Verify every row's tree (`row.tree`; or `chains`, drafted on the device: then each row's
        tree is set from them) and commit the accepted nodes to `cache`."""


class TreeVerifier:
    """Every row's tree in ONE LLM forward pass with tree attention (ALGORITHMS.md sections 1-2)."""

    def __init__(self, rule: Rule | str | None = None) -> None:
        self.rule = None if rule is None else Rule(rule)

    def rule_for(self, kind: DraftKind, do_sample: bool, num_ssms: int = 1) -> Rule:
        """The user's rule, else greedy, else the default lossless rule for the tree kind; a pool
        drafting without replacement has one q per SSM at a node, which only 'target' handles."""
        if self.rule is not None:
            return self.rule
        if not do_sample:
            return Rule.GREEDY
        rule = DEFAULT_SAMPLING_RULE[kind]
        return Rule.TARGET if rule is Rule.WITHOUT_REPLACEMENT and num_ssms > 1 else rule

    def check(self, kind: DraftKind, do_sample: bool, num_ssms: int) -> Rule:
        rule = self.rule_for(kind, do_sample, num_ssms)
        check_rule(rule, kind, do_sample)
        if rule is Rule.WITHOUT_REPLACEMENT and num_ssms > 1:
            raise ValueError(
                "rule='without_replacement' needs all children of a node drawn from one q, "
                "so it works with a single SSM; use rule='target' for a pool (rule='mss' and "
                "'k_sequential' need chains sampled with replacement, i.e. ChainShape)"
            )
        return rule

    @torch.no_grad()
    def verify(
        self, cache: TreeCache, rows: list[SequenceState], keep_hidden: bool, chains: ChainDraft | None = None
    ) -> tuple[list[Verdict], Hidden]:
        if chains is not None:
            return self._verify_chains(cache, rows, keep_hidden, chains)
        trees = [row.tree for row in rows]
        batch = TreeBatch.pack(trees, device=cache.device)
        lengths = torch.tensor(cache.lengths, device=cache.device)
        out = cache.feed(batch.tokens, lengths[:, None] + batch.depths, batch.ancestors, keep_hidden)
        # Greedy rows without logits processing: one argmax for all of them, read back at once.
        plain = [row.rule is Rule.GREEDY and not row.probs.processors for row in rows]
        choices = out.logits.float().argmax(-1).tolist() if any(plain) else None  # [B, N], as generate
        verdicts = [
            walk(row.tree, choices[b].__getitem__)
            if plain[b]
            else apply_rule(
                row.rule, row.tree, out.logits[b, : len(row.tree)], row.probs, row.tokens, row.generator
            )
            for b, row in enumerate(rows)
        ]
        cache.commit([[0, *verdict.accepted] for verdict in verdicts])
        hidden = None
        if keep_hidden:
            hidden = [out.hidden[b, v.accepted[-1] if v.accepted else 0] for b, v in enumerate(verdicts)]
        return verdicts, hidden

    def _verify_chains(
        self, cache: TreeCache, rows: list[SequenceState], keep_hidden: bool, chains: ChainDraft
    ) -> tuple[list[Verdict], Hidden]:
        """Greedy chains on the device: accepted lengths, next tokens and the drafts themselves come
        back in ONE host read (ALGORITHMS.md section 2, greedy: the longest prefix of the chain
        equal to the LLM's argmax continuation). A row with logits processors (`min_new_tokens`,
        `repetition_penalty`, ...) takes the argmax of the scores `generate` would process at each
        position, with that position's own history (the text, then the chain before it): its
        chain was drafted as any greedy row's, from the SSM's raw argmaxes, which only decides how
        much of it is accepted, never what is emitted."""
        if not chains.tokens.shape[1]:
            return self._verify_roots(cache, rows, keep_hidden, chains.roots)
        batch = chains.batch()
        lengths = torch.tensor(cache.lengths, device=cache.device)
        out = cache.feed(batch.tokens, lengths[:, None] + batch.depths, batch.ancestors, keep_hidden)
        choices = out.logits.float().argmax(-1)  # [B, N], as generate: argmax of float32 scores
        for b, row in enumerate(rows):
            if row.probs.processors:  # drafted as raw argmaxes; what the LLM chooses is processed
                n = chains.lengths[b] + 1  # the root and the chain
                choices[b, :n] = processed_argmax(row, out.logits[b, :n], batch.tokens[b, 1:n])
        matches = (batch.tokens[:, 1:] == choices[:, :-1]) & batch.valid[:, 1:]
        accepted = matches.long().cumprod(-1).sum(-1)  # [B]
        following = choices.gather(1, accepted[:, None])  # [B, 1]
        host = torch.cat([chains.tokens, accepted[:, None], following], 1).tolist()  # the one read
        width = chains.tokens.shape[1]
        for row, tree in zip(rows, chains.trees([r[:width] for r in host]), strict=True):
            row.tree = tree
        verdicts = [Verdict(list(range(1, r[width] + 1)), r[width + 1]) for r in host]
        cache.commit([range(r[width] + 1) for r in host])
        hidden = [out.hidden[b, r[width]] for b, r in enumerate(host)] if keep_hidden else None
        return verdicts, hidden

    @staticmethod
    def _verify_roots(
        cache: TreeCache, rows: list[SequenceState], keep_hidden: bool, roots: list[int]
    ) -> tuple[list[Verdict], Hidden]:
        """Greedy rows that drafted nothing (the routed scheduler declined): one plain decoding
        step, with no more host work than `generate`'s, so that declining costs what plain
        decoding costs (ALGORITHMS.md 5.3); a row with logits processors takes the argmax of its
        processed scores, as `generate` does."""
        device = cache.device
        tokens = torch.tensor(roots, device=device)[:, None]
        positions = torch.tensor(cache.lengths, device=device)[:, None]
        visible = torch.ones(len(roots), 1, 1, dtype=torch.bool, device=device)
        out = cache.feed(tokens, positions, visible, keep_hidden)
        logits = out.logits[:, 0]
        following = logits.float().argmax(-1).tolist()  # as generate: float32 scores
        for b, row in enumerate(rows):
            if row.probs.processors:
                following[b] = int(processed_argmax(row, logits[b : b + 1])[0])
        for row, root in zip(rows, roots, strict=True):
            row.tree = TokenTree.root_only(root, DraftKind.GREEDY)
        cache.commit([[0]] * len(roots))
        hidden = list(out.hidden[:, 0]) if keep_hidden else None
        return [Verdict([], token) for token in following], hidden


def processed_argmax(
    row: SequenceState, logits: torch.Tensor, drafted: torch.Tensor | None = None
) -> torch.Tensor:
    """A greedy row with logits processors: [n] the argmax of the scores `generate` would process at
    each of the n positions of `logits` [n, V] (the root's, then each drafted token's), position t
    with the row's text and drafted[:t] as its history."""
    text = torch.tensor(row.tokens, device=logits.device)
    ids = text if drafted is None else torch.cat([text, drafted])
    return row.probs.scores_along(logits[None], ids[None], len(row.tokens))[0].argmax(-1)


class StairsVerifier:
    """Stairs validation (ALGORITHMS.md section 12): the LLM runs a batch of d+1 growing prefixes
    [S], [S, x1], ..., [S, x1..xd] and keeps x_i while it equals the previous row's argmax."""

    def check(self, kind: DraftKind, do_sample: bool, num_ssms: int) -> Rule:
        if do_sample:
            raise ValueError("verification='stairs' is a greedy baseline; use do_sample=False")
        if kind is not DraftKind.GREEDY or num_ssms != 1:
            raise ValueError(
                "verification='stairs' validates one greedy chain: use a single SSM with ChainShape"
            )
        return Rule.GREEDY

    @torch.no_grad()
    def verify(
        self, cache: TreeCache, rows: list[SequenceState], keep_hidden: bool, chains: ChainDraft | None = None
    ) -> tuple[list[Verdict], Hidden]:
        if chains is not None:
            rows[0].tree = chains.trees(chains.tokens.tolist())[0]
        if len(rows) != 1:
            raise ValueError("verification='stairs' validates one sequence at a time; decode rows one by one")
        row = rows[0]
        chain = row.tree.tokens  # root, x1..xd (a chain: node i is at depth i)
        size = len(chain)
        cache.select([0] * size)  # row i: the text so far, then the prefix [root, x1..xi]
        out = cache.feed_chains([chain[: i + 1] for i in range(size)], True, False, keep_hidden)
        # Row i: the LLM's choice after x1..xi (node i of the chain), after logits processing.
        choices = row.probs.tree_scores(out.logits, row.tree, row.tokens).argmax(-1).tolist()
        accepted = 0
        while accepted < size - 1 and chain[accepted + 1] == choices[accepted]:
            accepted += 1
        cache.select([size - 1])  # the row that read the whole chain, its nodes pending
        cache.commit([range(accepted + 1)])
        hidden = [out.hidden[accepted]] if out.hidden is not None else None
        return [Verdict(list(range(1, accepted + 1)), choices[accepted])], hidden
