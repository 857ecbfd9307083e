"""Verification rules: which drafted tokens the LLM accepts (ALGORITHMS.md section 2).

Notation, as in ALGORITHMS.md: p = the LLM's (target) distribution at a node after logits
processing, q = the distribution an SSM (draft) token was sampled from, R = the residual.
Every rule walks down from the root; at each node it accepts one child and continues, or
stops and emits one token of its own (correction or bonus), so one LLM pass always yields at
least one new token. Each rule is lossless only for trees drafted in a matching way
(`RULE_TREE_KINDS`); the decoder refuses other combinations.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

import torch

from specboost.decoder.multi_draft import best_plan, residual
from specboost.speculator.sampling import LogitsToProbs, draw
from specboost.speculator.tree import DraftKind, Proposal, TokenTree


class Rule(str, Enum):
    GREEDY = "greedy"
    MSS = "mss"  # multi-step speculative sampling (SpecInfer)
    WITHOUT_REPLACEMENT = "without_replacement"  # Sequoia
    TARGET = "target"  # sample from p, accept the equal child
    K_SEQUENTIAL = "k_sequential"  # SpecTr's k-sequential selection, generalised; MSS where better


ALL_KINDS = frozenset(DraftKind)
RULE_TREE_KINDS: dict[Rule, frozenset[DraftKind]] = {
    Rule.GREEDY: ALL_KINDS,
    Rule.TARGET: ALL_KINDS,
    Rule.MSS: frozenset({DraftKind.SAMPLED}),
    Rule.K_SEQUENTIAL: frozenset({DraftKind.SAMPLED}),
    Rule.WITHOUT_REPLACEMENT: frozenset({DraftKind.SAMPLED_WITHOUT_REPLACEMENT}),
}
# The rule used when the user leaves it to us, per tree kind, under do_sample=True.
DEFAULT_SAMPLING_RULE: dict[DraftKind, Rule] = {
    DraftKind.SAMPLED: Rule.MSS,
    DraftKind.SAMPLED_WITHOUT_REPLACEMENT: Rule.WITHOUT_REPLACEMENT,
    DraftKind.BEAM: Rule.TARGET,
    DraftKind.TOP_K: Rule.TARGET,
    DraftKind.GREEDY: Rule.TARGET,
    DraftKind.SELECTED: Rule.TARGET,  # which drafts were kept depends on other SSMs' drafts, not on q
}


def check_rule(rule: Rule, kind: DraftKind, do_sample: bool) -> None:
    """Raise a ValueError that says what to change if `rule` is not lossless for `kind` trees."""
    if rule is Rule.GREEDY and do_sample:
        raise ValueError(
            "rule='greedy' verifies greedy decoding; with do_sample=True use 'mss', 'k_sequential', "
            "'without_replacement' or 'target' (or leave rule=None)"
        )
    if rule is not Rule.GREEDY and not do_sample:
        raise ValueError(f"rule={rule.value!r} is a sampling rule; set do_sample=True or use rule='greedy'")
    if kind not in RULE_TREE_KINDS[rule]:
        allowed = sorted(k.value for k in RULE_TREE_KINDS[rule])
        raise ValueError(
            f"rule={rule.value!r} is only lossless on trees drafted as {allowed}, but these SSMs draft "
            f"{kind.value!r} trees; use rule='target' (lossless for any tree) or change the draft shape"
        )


@dataclass
class Verdict:
    accepted: list[int]  # accepted tree nodes, root excluded, root->leaf order
    next_token: int  # the LLM's own token after the accepted path (correction or bonus)


def _normalize(x: torch.Tensor) -> torch.Tensor:
    return x / x.sum()


def _uniform(generator: torch.Generator | None, device: torch.device) -> float:
    return float(torch.rand((), generator=generator, device=device))


def apply_rule(
    rule: Rule,
    tree: TokenTree,
    logits: torch.Tensor,  # [N, V] the LLM's raw logits at every node
    probs: LogitsToProbs,
    verified: list[int],  # prompt + verified tokens; the last one is the tree's root
    generator: torch.Generator | None,
) -> Verdict:
    """`rule` on `tree`, with p the LLM's distribution after the logits processing `generate` would
    apply at each node, given that node's own history."""
    scores = probs.tree_scores(logits, tree, verified)  # [N, V]
    if rule is Rule.GREEDY:
        return verify_greedy(tree, scores)
    return RULES[rule](tree, torch.softmax(scores, dim=-1), generator)


def verify_greedy(tree: TokenTree, scores: torch.Tensor, **_) -> Verdict:
    """Accept the child equal to argmax p (of the processed scores [N, V]): reproduces the LLM's
    greedy decoding exactly."""
    choices = scores.argmax(dim=-1).tolist()  # [N]
    return walk(tree, lambda node: choices[node])


def verify_target(tree: TokenTree, p: torch.Tensor, generator: torch.Generator | None = None) -> Verdict:
    """Sample y ~ p and accept the child equal to y; lossless for any tree. Drawn as `generate`
    draws (`torch.multinomial`), so that a seeded sequence decoded plainly reproduces it token for
    token; the other rules' own tokens (a residual's) come from the faster `sampling.draw`."""
    return walk(tree, lambda node: int(torch.multinomial(p[node], 1, generator=generator)))


def walk(tree: TokenTree, choose: Callable[[int], int]) -> Verdict:
    """From the root, accept the child whose token `choose(node)` names, until there is none."""
    node, accepted = 0, []
    while True:
        token = choose(node)
        child = tree.child_with_token(node, token)
        if child is None:
            return Verdict(accepted, token)
        accepted.append(child)
        node = child


def node_proposals(tree: TokenTree, node: int) -> list[tuple[int, Proposal]]:
    """(child, proposal) for every proposal at `node`'s children, in drawing order: by SSM, then
    by the SSM's chain (`Proposal.draw`). The order must not depend on the drawn tokens, so
    several draws of one SSM are never grouped by the child they landed on."""
    proposals = [(child, prop) for child in tree.children[node] for prop in tree.proposals[child]]
    proposals.sort(key=lambda cp: (cp[1].ssm, cp[1].draw))
    return proposals


def verify_mss(tree: TokenTree, p: torch.Tensor, generator: torch.Generator | None = None) -> Verdict:
    """Multi-step speculative sampling (SpecInfer; Sequoia appendix Alg. 3)."""
    node, accepted = 0, []
    while True:
        r = p[node]
        chosen = None
        for child, prop in node_proposals(tree, node):
            x = tree.tokens[child]
            if _uniform(generator, p.device) * prop.q[x] < r[x]:  # r < R(x) / q(x)
                chosen = child
                break
            r = residual(r, prop.q)
        if chosen is None:
            return Verdict(accepted, int(draw(r, 1, generator)[0]))
        accepted.append(chosen)
        node = chosen


def verify_k_sequential(
    tree: TokenTree, p: torch.Tensor, generator: torch.Generator | None = None
) -> Verdict:
    """SpecTr's k-sequential selection, generalised to proposals from different q's, or MSS where
    that accepts more (`decoder/multi_draft.py`, which proves both lossless): at each node, the
    plan of `best_plan` for p and the proposals' q's in drawing order."""
    node, accepted = 0, []
    while True:
        proposals = node_proposals(tree, node)
        plan = best_plan(p[node], [prop.q for _, prop in proposals])
        chosen = None
        for (child, _), accept in zip(proposals, plan.accept, strict=True):
            if _uniform(generator, p.device) < float(accept[tree.tokens[child]]):
                chosen = child
                break
        if chosen is None:
            return Verdict(accepted, int(draw(plan.residual, 1, generator)[0]))
        accepted.append(chosen)
        node = chosen


def verify_without_replacement(
    tree: TokenTree, p: torch.Tensor, generator: torch.Generator | None = None
) -> Verdict:
    """Sequoia's sampling without replacement (Alg. 1): children were drawn from one q without
    replacement, in index order."""
    node, accepted = 0, []
    while True:
        r = p[node]
        children = tree.children[node]
        d = tree.proposals[children[0]][0].q.clone() if children else None
        rejected = torch.zeros_like(r, dtype=torch.bool)
        chosen = None
        for child in children:
            x = tree.tokens[child]
            if _uniform(generator, p.device) * d[x] < r[x]:  # r < R(x) / D(x)
                chosen = child
                break
            r = residual(r, d)
            rejected[x] = True
            d[x] = 0
            if d.sum() <= 0:
                d = (~rejected).to(r.dtype)
            d = _normalize(d)
        if chosen is None:
            return Verdict(accepted, int(draw(r, 1, generator)[0]))
        accepted.append(chosen)
        node = chosen


RULES = {
    Rule.MSS: verify_mss,
    Rule.K_SEQUENTIAL: verify_k_sequential,
    Rule.WITHOUT_REPLACEMENT: verify_without_replacement,
    Rule.TARGET: verify_target,
}
