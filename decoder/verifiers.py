"""How the LLM checks a drafted tree: one tree-attention pass, or Stairs' batch of prefixes.

A verifier runs the LLM, applies a verification rule, and leaves the LLM cache holding exactly
the prefix, the old root and the accepted nodes.
"""

from __future__ import annotations

from typing import Protocol

import torch

from specboost.decoder.target import TargetState
from specboost.decoder.verify import DEFAULT_SAMPLING_RULE, Rule, Verdict, apply_rule, check_rule
from specboost.speculator.kv_cache import compact_cache
from specboost.speculator.sampling import LogitsToProbs
from specboost.speculator.tree import DraftKind, TokenTree


class Verifier(Protocol):
    def check(self, kind: DraftKind, do_sample: bool, num_ssms: int) -> Rule:
        """Called for every sequence: the rule for these trees, or a ValueError if this verifier
        cannot verify them losslessly."""

    def verify(
        self,
        target: TargetState,
        tree: TokenTree,
        probs: LogitsToProbs,
        generator: torch.Generator | None,
        rule: Rule,
    ) -> Verdict: ...


class TreeVerifier:
    """The whole tree in ONE LLM forward pass with tree attention (ALGORITHMS.md sections 1-2)."""

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
                "so it works with a single SSM; use rule='target' for a pool (rule='mss' needs chains "
                "sampled with replacement, i.e. ChainShape)"
            )
        return rule

    @torch.no_grad()
    def verify(
        self,
        target: TargetState,
        tree: TokenTree,
        probs: LogitsToProbs,
        generator: torch.Generator | None,
        rule: Rule,
    ) -> Verdict:
        logits = target.tree_logits(tree)  # [N, V]
        verdict = apply_rule(rule, tree, logits, probs, target.tokens, generator)
        target.keep_accepted(verdict.accepted)
        return verdict


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
        self,
        target: TargetState,
        tree: TokenTree,
        probs: LogitsToProbs,
        generator: torch.Generator | None,
        rule: Rule,
    ) -> Verdict:
        chain = tree.tokens  # root, x1..xd (a chain: node i is at depth i)
        rows = len(chain)
        p, llm = target.prefix_length, target.llm
        input_ids = torch.zeros(rows, rows, dtype=torch.long, device=llm.device)  # [d+1, d+1], right-padded
        mask = torch.zeros(rows, p + rows, dtype=torch.long, device=llm.device)
        mask[:, :p] = 1
        for i in range(rows):
            input_ids[i, : i + 1] = torch.tensor(chain[: i + 1])
            mask[i, p : p + i + 1] = 1
        target.cache.batch_repeat_interleave(rows)
        out = llm(
            input_ids=input_ids,
            attention_mask=mask,
            past_key_values=target.cache,
            use_cache=True,
            output_hidden_states=target.keep_hidden,
        )
        # Row i: the LLM's choice after x1..xi (node i of the chain), after logits processing.
        logits = out.logits[torch.arange(rows), torch.arange(rows)]  # [d+1, V]
        choices = probs.tree_scores(logits, tree, target.tokens).argmax(-1).tolist()
        target.cache.batch_select_indices(torch.tensor([rows - 1], device=llm.device))
        accepted = 0
        while accepted < rows - 1 and chain[accepted + 1] == choices[accepted]:
            accepted += 1
        if target.keep_hidden:
            target.hidden = out.hidden_states[-1][accepted, accepted]
        compact_cache(target.cache, list(range(p + 1 + accepted)))
        return Verdict(list(range(1, accepted + 1)), choices[accepted])
