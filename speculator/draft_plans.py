"""How one SSM's drafted tree grows, level by level, for each speculation shape (ALGORITHMS.md
section 3): a chain, SpecInfer's beam search, or a fixed (Sequoia) topology.

A plan owns one SSM's tree for one step. `frontier` names the nodes whose next-token scores it
needs (the root first; empty once the plan is complete), `probs` says how those scores are made
from logits, and `grow(scores)` takes them and adds the chosen children. Plans never run a model:
the drafter (`speculator/drafter.py`) feeds every plan's frontier of a pool in one pass.
"""

from __future__ import annotations

from typing import Protocol

import torch

from specboost.speculator.sampling import LogitsToProbs, draw
from specboost.speculator.shapes import BeamShape, ChainShape, DraftShape, TopologyShape
from specboost.speculator.tree import TokenTree


class DraftPlan(Protocol):
    tree: TokenTree  # every node drafted so far; node 0 is the root (the last verified token)
    frontier: list[int]  # nodes whose scores `grow` needs next; empty: the plan is complete
    probs: LogitsToProbs  # logits -> the scores the plan chooses from

    def grow(self, scores: torch.Tensor) -> None:
        """Processed scores [len(frontier), V] of the frontier nodes: add their children."""

    def result(self) -> TokenTree:
        """The tree to verify."""


def make_plan(
    shape: DraftShape,
    root: int,
    ssm: int,
    probs: LogitsToProbs,
    max_depth: int,
    generator: torch.Generator | None,
) -> DraftPlan:
    """The plan for `shape` under `root`, drafted by SSM `ssm`, no deeper than `max_depth` (>= 1)."""
    tree = TokenTree.root_only(root, shape.kind(probs.config.do_sample))
    if isinstance(shape, ChainShape):
        return ChainPlan(tree, min(shape.length, max_depth), ssm, probs, generator, shape.samples)
    if isinstance(shape, BeamShape):
        return BeamPlan(tree, shape.width, min(shape.depth, max_depth), ssm, probs.greedy())
    if isinstance(shape, TopologyShape):
        return TopologyPlan(tree, shape, max_depth, ssm, probs, generator)
    raise TypeError(f"unknown draft shape {shape!r}")


def choose_children(
    scores: torch.Tensor, k: int, do_sample: bool, generator: torch.Generator | None
) -> tuple[list[int], torch.Tensor | None, list[float]]:
    """k children from processed scores [V]: the top k (greedy), or k drawn without replacement
    from q = softmax(scores), returned with q (sampling only; k = 1 with replacement is the same
    draw) and their probabilities under softmax(scores)."""
    q = torch.softmax(scores, dim=-1)
    if not do_sample:  # the argmax as `generate` takes it (first of equal scores), or the top k
        tokens = (
            scores.argmax(-1, keepdim=True) if k == 1 else torch.topk(scores, min(k, scores.numel())).indices
        )
        return tokens.tolist(), None, q[tokens].tolist()
    k = min(k, int((q > 0).sum()))
    tokens = (
        draw(q, 1, generator) if k == 1 else torch.multinomial(q, k, replacement=False, generator=generator)
    )
    return tokens.tolist(), q, q[tokens].tolist()


class ChainPlan:
    """`samples` chains of `length` tokens (one under greedy decoding: every chain would be the
    argmax chain), each token the argmax of the scores or a sample from q = softmax(scores),
    kept with q for the sampled verification rules. Every chain draws from q at its own last
    node, independently of the others; chains through one node share its scores (it is fed
    once) and the tree records chain j's proposals with draw index j, so verification takes
    them in drawing order. The last tokens' scores are never needed, so they are never fed."""

    def __init__(
        self,
        tree: TokenTree,
        length: int,
        ssm: int,
        probs: LogitsToProbs,
        generator: torch.Generator | None,
        samples: int = 1,
    ) -> None:
        self.tree, self.length, self.ssm, self.probs, self.generator = tree, length, ssm, probs, generator
        self.ends = [0] * (samples if probs.config.do_sample else 1)  # per chain: its last node
        self.frontier = [0]

    def grow(self, scores: torch.Tensor) -> None:
        do_sample = self.probs.config.do_sample
        for node, node_scores in zip(self.frontier, scores, strict=True):
            chains = [j for j, end in enumerate(self.ends) if end == node]
            if len(chains) == 1:  # one draw (the stream of a single chain, as it always was)
                tokens, q, ps = choose_children(node_scores, 1, do_sample, self.generator)
            else:  # independent draws, with replacement, one per chain through this node
                q = torch.softmax(node_scores, dim=-1)
                drawn = draw(q, len(chains), self.generator)
                tokens, ps = drawn.tolist(), q[drawn].tolist()
            for j, token, p in zip(chains, tokens, ps, strict=True):
                self.ends[j] = self.tree.add_child(node, token, self.ssm, q, p, draw=j)
        depth = self.tree.depths[self.ends[0]]  # the chains grow in step
        self.frontier = list(dict.fromkeys(self.ends)) if depth < self.length else []

    def result(self) -> TokenTree:
        return self.tree


class BeamPlan:
    """SpecInfer beam search on the greedy-processed scores: every level keeps the `width` best
    sequences by summed log-probability; the result merges the final beams (kind BEAM)."""

    def __init__(self, tree: TokenTree, width: int, depth: int, ssm: int, probs: LogitsToProbs) -> None:
        self.tree, self.width, self.depth, self.ssm, self.probs = tree, width, depth, ssm, probs
        self.frontier = [0]
        self.beams = [0]
        self.log_probs: torch.Tensor | None = None  # [beams] summed log-probabilities (None at the root)
        self.p: dict[int, float] = {}  # node -> the SSM's probability of its token after its parent

    def grow(self, scores: torch.Tensor) -> None:
        local = torch.log_softmax(scores.double(), dim=-1)
        logp = local if self.log_probs is None else local + self.log_probs[:, None]
        top = torch.topk(logp.flatten(), min(self.width, logp.numel()))
        vocab = logp.shape[1]
        flats, ps = top.indices.tolist(), local.flatten()[top.indices].exp().tolist()
        self.beams = [self.tree.insert(self.beams[flat // vocab], flat % vocab) for flat in flats]
        self.p.update(zip(self.beams, ps, strict=True))
        self.log_probs = top.values
        self.frontier = self.beams if self.tree.depths[self.beams[0]] < self.depth else []

    def result(self) -> TokenTree:
        result = TokenTree.root_only(self.tree.tokens[0], self.tree.kind)
        for leaf in self.beams:
            path = self.tree.path_to(leaf)
            result.add_sequence([self.tree.tokens[v] for v in path], self.ssm, ps=[self.p[v] for v in path])
        return result


class TopologyPlan:
    """A fixed topology: each node gets as many children as the shape gives it, the top k of the
    scores (greedy) or k drawn without replacement from q (sampling), down to `max_depth`."""

    def __init__(
        self,
        tree: TokenTree,
        shape: TopologyShape,
        max_depth: int,
        ssm: int,
        probs: LogitsToProbs,
        generator: torch.Generator | None,
    ) -> None:
        self.tree, self.max_depth, self.ssm, self.probs, self.generator = (
            tree,
            max_depth,
            ssm,
            probs,
            generator,
        )
        self.children = shape.children()
        self.place = {0: 0}  # tree node -> its topology node
        self.frontier = [0] if self.children[0] else []

    def grow(self, scores: torch.Tensor) -> None:
        grown = []
        for node, node_scores in zip(self.frontier, scores, strict=True):
            wanted = self.children[self.place[node]]
            do_sample = self.probs.config.do_sample
            tokens, q, ps = choose_children(node_scores, len(wanted), do_sample, self.generator)
            for place, token, p in zip(wanted, tokens, ps, strict=False):
                child = self.tree.add_child(node, token, self.ssm, q, p)
                self.place[child] = place
                if self.children[place] and self.tree.depths[child] < self.max_depth:
                    grown.append(child)
        self.frontier = grown

    def result(self) -> TokenTree:
        return self.tree
