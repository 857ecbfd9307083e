"""One SSM that drafts token trees over the verified prefix (ALGORITHMS.md section 3).

The drafter owns the SSM's KV cache (a one-row `TreeCache`) and keeps it synced to the verified
prefix: after a verification it commits the K/V of the accepted tokens it drafted itself (they
are pending nodes of its cache, as in the LLM's) and feeds only the tokens it has not seen (at
least the LLM's correction or bonus token). Trees are expanded level by level, each level in one
SSM pass with tree attention.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from specboost.speculator.kv_cache import ModelCall, TreeCache, capacity_for
from specboost.speculator.model_info import context_length
from specboost.speculator.sampling import LogitsToProbs
from specboost.speculator.shapes import BeamShape, ChainShape, DraftShape, TopologyShape
from specboost.speculator.tree import TokenTree, TreeBatch

HEADROOM = 256  # positions a new cache holds beyond the text it starts with


class SSMDrafter:
    """Drafts with SSM number `index` of a pool; `index` is what tree nodes record as proposer.
    `compiled` is the model's compiled call for its drafting passes (None: eager)."""

    def __init__(self, model: PreTrainedModel, index: int, compiled: ModelCall | None = None) -> None:
        self.model = model
        self.index = index
        self.compiled = compiled
        self.max_positions = context_length(model)
        self.reset()

    def reset(self) -> None:
        self.cache: TreeCache | None = None
        self.cached_tokens: list[int] = []  # verified tokens committed to the cache, in order
        self._expansion = TokenTree.root_only(-1)  # every node drafted last step (root = last verified)
        self._slots: dict[int, int] = {}  # expansion node -> its pending index in the cache

    @torch.no_grad()
    def draft(
        self,
        verified: list[int],
        shape: DraftShape,
        probs: LogitsToProbs,
        max_depth: int,
        generator: torch.Generator | None = None,
    ) -> TokenTree:
        """Draft a tree of `shape` (no deeper than `max_depth`) after `verified` (prompt + accepted).

        Past the end of the SSM's own context it drafts nothing (a root-only tree)."""
        if self.max_positions is not None:
            max_depth = min(max_depth, self.max_positions - len(verified))
        if max_depth < 1:
            return TokenTree.root_only(verified[-1], shape.kind(probs.config.do_sample))
        root_logits = self._sync(verified)
        self._expansion = TokenTree.root_only(verified[-1], shape.kind(probs.config.do_sample))
        if isinstance(shape, ChainShape):
            return self._draft_chain(root_logits, min(shape.length, max_depth), probs, generator)
        if isinstance(shape, BeamShape):
            return self._draft_beam(root_logits, shape.width, min(shape.depth, max_depth), probs)
        if isinstance(shape, TopologyShape):
            return self._draft_topology(root_logits, shape, max_depth, probs, generator)
        raise TypeError(f"unknown draft shape {shape!r}")

    # 1. Cache sync -------------------------------------------------------------------------
    def _sync(self, verified: list[int]) -> torch.Tensor:
        """Bring the cache to exactly `verified`; return the SSM's logits after it ([V])."""
        if self.cache is None:
            self.cache = TreeCache(self.model, 1, capacity_for(len(verified) + HEADROOM), self.compiled)
        n, kept = len(self.cached_tokens), []
        if verified[:n] == self.cached_tokens:
            common, node = n, 0
            for token in verified[n:]:
                child = self._expansion.child_with_token(node, token)
                if child is None or child not in self._slots:
                    break
                kept.append(self._slots[child])
                node = child
        else:
            common = 0
            while common < min(n, len(verified)) and verified[common] == self.cached_tokens[common]:
                common += 1
        self.cache.commit([kept if common == n else []])
        if common < n:
            self.cache.truncate(0, common)
        seen = self.cache.lengths[0]
        if seen == len(verified):  # the SSM has seen everything: recompute the last position
            self.cache.truncate(0, seen - 1)
            seen -= 1
        self.cached_tokens = list(verified)
        self._slots = {}
        return self.cache.feed_chains([verified[seen:]]).logits[0]

    # 2. Drafting modes ----------------------------------------------------------------------
    def _expand(self, nodes: range) -> torch.Tensor:
        """Feed expansion nodes `nodes` (one level, after every earlier node) in one pass; returns
        their logits [len, V]."""
        tree, cache = self._expansion, self.cache
        device = cache.device
        new = list(nodes)
        root_position = len(self.cached_tokens) - 1
        ancestors = TreeBatch.pack([tree], device=device).ancestors[0]  # [T, T]
        visible = torch.zeros(1, len(new), cache.pending + len(new), dtype=torch.bool, device=device)
        fed = sorted(self._slots)
        if fed:
            columns = torch.tensor([self._slots[v] for v in fed], device=device)
            visible[0][:, columns] = ancestors[new][:, fed]
        visible[0, :, cache.pending :] = ancestors[new][:, new]
        tokens = torch.tensor([[tree.tokens[u] for u in new]], device=device)
        positions = torch.tensor([[root_position + tree.depths[u] for u in new]], device=device)
        start = cache.pending
        logits = cache.feed(tokens, positions, visible).logits[0]
        self._slots.update({u: start + i for i, u in enumerate(new)})
        return logits

    def _draft_chain(
        self, logits: torch.Tensor, length: int, probs: LogitsToProbs, generator: torch.Generator | None
    ) -> TokenTree:
        tree, node = self._expansion, 0
        for step in range(length):
            if step > 0:
                logits = self._expand(range(node, node + 1))[0]
            scores = probs.tree_scores(logits[None], tree, self.cached_tokens, [node])[0]
            if probs.config.do_sample:
                q = torch.softmax(scores, dim=-1)
                token = int(torch.multinomial(q, 1, generator=generator))
            else:
                q, token = None, int(scores.argmax())
            node = tree.add_child(node, token, self.index, q)
        return tree

    def _draft_beam(self, logits: torch.Tensor, width: int, depth: int, probs: LogitsToProbs) -> TokenTree:
        """SpecInfer beam search on the greedy-processed scores; returns the merge of the final
        beams (kind BEAM)."""
        tree, greedy = self._expansion, probs.greedy()
        beams = [0]
        scores = torch.zeros(1, dtype=torch.float64, device=logits.device)
        level_logits = logits[None]  # [beams, V]
        for level in range(depth):
            if level > 0:
                level_logits = self._expand(range(beams[0], beams[-1] + 1))
            level_scores = greedy.tree_scores(level_logits, tree, self.cached_tokens, beams)
            logp = torch.log_softmax(level_scores.double(), dim=-1) + scores[:, None]  # [beams, V]
            top = torch.topk(logp.flatten(), min(width, logp.numel()))
            vocab = logp.shape[1]
            new_beams = []
            for flat in top.indices.tolist():
                new_beams.append(tree.insert(beams[flat // vocab], flat % vocab))
            beams, scores = new_beams, top.values
        result = TokenTree.root_only(tree.tokens[0], tree.kind)
        for leaf in beams:
            result.add_sequence([tree.tokens[v] for v in tree.path_to(leaf)], self.index)
        return result

    def _draft_topology(
        self,
        logits: torch.Tensor,
        shape: TopologyShape,
        max_depth: int,
        probs: LogitsToProbs,
        generator: torch.Generator | None,
    ) -> TokenTree:
        """Fill a fixed topology: top-k children, or children sampled without replacement from q."""
        tree, shape_children = self._expansion, shape.children()
        frontier = [(0, 0)]  # (topology node, tree node)
        level_logits = logits[None]
        while frontier and tree.depths[frontier[0][1]] < max_depth:
            if frontier[0][1] > 0:
                level_logits = self._expand(range(frontier[0][1], frontier[-1][1] + 1))
            nodes = [node for _, node in frontier]
            level_scores = probs.tree_scores(level_logits, tree, self.cached_tokens, nodes)
            next_frontier = []
            for (shape_node, node), scores in zip(frontier, level_scores, strict=True):
                wanted = shape_children[shape_node]
                if not wanted:
                    continue
                tokens, q = self.sample_children(scores, len(wanted), probs.config.do_sample, generator)
                for shape_child, token in zip(wanted, tokens, strict=False):
                    next_frontier.append((shape_child, tree.add_child(node, token, self.index, q)))
            frontier = next_frontier
        return tree

    @staticmethod
    def sample_children(
        scores: torch.Tensor, k: int, do_sample: bool, generator: torch.Generator | None
    ) -> tuple[list[int], torch.Tensor | None]:
        """k children from processed scores [V]: the top k (greedy), or k drawn without replacement
        from q = softmax(scores), returned with q."""
        if not do_sample:
            return torch.topk(scores, min(k, scores.numel())).indices.tolist(), None
        q = torch.softmax(scores, dim=-1)
        k = min(k, int((q > 0).sum()))
        return torch.multinomial(q, k, replacement=False, generator=generator).tolist(), q
