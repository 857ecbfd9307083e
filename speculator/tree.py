"""Token trees and the SpecInfer tree merge (ALGORITHMS.md section 1).

A `TokenTree` holds candidate continuations of one verified prefix. Node 0 is the root: the
last verified token, which the LLM has not yet consumed. Every other node u carries a token,
a parent index (always smaller than u, so index order is a topological order) and a depth
(root = 0). Each node also records which SSMs proposed it and, for stochastic verification,
every proposal that reached it with the draft distribution q it was drawn from.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from enum import Enum

import torch


class DraftKind(str, Enum):
    """How the children of every node were produced; decides which verification rules are lossless."""

    GREEDY = "greedy"  # argmax chains
    BEAM = "beam"  # beam search (SpecInfer)
    TOP_K = "top_k"  # fixed topology filled with top-k children
    SAMPLED = "sampled"  # children drawn independently (with replacement) from the recorded q's
    SAMPLED_WITHOUT_REPLACEMENT = "sampled_without_replacement"  # one q per node, drawn w/o replacement
    SELECTED = "selected"  # nodes kept by looking at several SSMs' drafts: greedy/target only


@dataclass
class Proposal:
    """One SSM's proposal of a child token, with the distribution it was sampled from (or None).

    (`ssm`, `draw`) orders the proposals at a node for sampled verification: the order must not
    depend on the drawn tokens, so several chains of one SSM (`ChainShape(samples=k)`) are taken
    in the order they were drawn, not grouped by the token they drew."""

    ssm: int
    q: torch.Tensor | None  # [V] draft distribution at the parent, after logits processing
    p: float | None = None  # the SSM's own probability of the token there (None: not recorded)
    draw: int = 0  # which of the SSM's chains drew it (0 for an SSM drafting one)


@dataclass
class TokenTree:
    """A token tree over one prefix; parents precede children in index order."""

    tokens: list[int]
    parents: list[int]
    depths: list[int]
    kind: DraftKind
    ssms: list[set[int]] = field(default_factory=list)  # per node: SSMs whose sequence passes through it
    proposals: list[list[Proposal]] = field(default_factory=list)  # per node: proposals that reached it
    children: list[list[int]] = field(default_factory=list)  # per node: child indices, in insertion order

    @classmethod
    def root_only(cls, root_token: int, kind: DraftKind = DraftKind.GREEDY) -> TokenTree:
        return cls([root_token], [-1], [0], kind, [set()], [[]], [[]])

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def num_draft_tokens(self) -> int:
        """Drafted nodes (everything but the root)."""
        return len(self.tokens) - 1

    @property
    def depth(self) -> int:
        return max(self.depths)

    def child_with_token(self, node: int, token: int) -> int | None:
        for child in self.children[node]:
            if self.tokens[child] == token:
                return child
        return None

    def insert(self, parent: int, token: int) -> int:
        """Trie insert of `token` under `parent`: an existing equal child is reused. Returns its index."""
        child = self.child_with_token(parent, token)
        if child is None:
            child = len(self.tokens)
            self.tokens.append(token)
            self.parents.append(parent)
            self.depths.append(self.depths[parent] + 1)
            self.ssms.append(set())
            self.proposals.append([])
            self.children.append([])
            self.children[parent].append(child)
        return child

    def add_child(
        self,
        parent: int,
        token: int,
        ssm: int,
        q: torch.Tensor | None = None,
        p: float | None = None,
        draw: int = 0,
    ) -> int:
        """Insert `token` under `parent` and record SSM `ssm`'s proposal of it (with the distribution
        `q` it was drawn from and the SSM's probability `p` of it, when known; `draw`: which of the
        SSM's chains drew it)."""
        child = self.insert(parent, token)
        self.ssms[child].add(ssm)
        self.ssms[parent].add(ssm)
        self.proposals[child].append(Proposal(ssm, q, p, draw))
        return child

    def add_sequence(
        self,
        tokens: list[int],
        ssm: int,
        qs: list[torch.Tensor | None] | None = None,
        ps: list[float | None] | None = None,
    ) -> list[int]:
        """Insert one drafted sequence below the root; returns the node index of each token."""
        node, path = 0, []
        for i, token in enumerate(tokens):
            node = self.add_child(
                node, token, ssm, None if qs is None else qs[i], None if ps is None else ps[i]
            )
            path.append(node)
        return path

    def ancestors(self, node: int) -> set[int]:
        """`node` and every node above it, root included."""
        out = {node}
        while self.parents[node] >= 0:
            node = self.parents[node]
            out.add(node)
        return out

    def path_to(self, node: int) -> list[int]:
        """Node indices from the first drafted node down to `node` (root excluded)."""
        path = []
        while node > 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def ancestor_matrix(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """[N, N] bool: entry (u, v) is True iff v is u or an ancestor of u."""
        n = len(self.tokens)
        mat = torch.zeros(n, n, dtype=torch.bool, device=device)
        for u, parent in enumerate(self.parents):
            if parent >= 0:
                mat[u] = mat[parent]
            mat[u, u] = True
        return mat

    def topological_order(self) -> list[int]:
        """Parents before children. Index order already is one; checked here as an invariant."""
        assert all(p < u for u, p in enumerate(self.parents) if u > 0), "parents must precede children"
        return list(range(len(self.tokens)))

    def sequences(self) -> list[list[int]]:
        """The root-to-leaf token sequences (root excluded)."""
        leaves = [u for u in range(1, len(self)) if not self.children[u]]
        return [[self.tokens[v] for v in self.path_to(leaf)] for leaf in leaves]


def merge_trees(trees: list[TokenTree]) -> TokenTree:
    """SpecInfer tree merge (ALGORITHMS.md section 1, Def. 4.1): one trie holding every sequence of
    every input tree, keeping per node the proposing SSMs and every proposal with its q."""
    if not trees:
        raise ValueError("merge_trees needs at least one tree")
    root = trees[0].tokens[0]
    if any(t.tokens[0] != root for t in trees):
        raise ValueError("trees to merge must share the same root token")
    kinds = {t.kind for t in trees}
    if len(kinds) > 1:
        raise ValueError(f"cannot merge trees drafted in different ways: {sorted(k.value for k in kinds)}")
    merged = TokenTree.root_only(root, trees[0].kind)
    for tree in trees:
        mapping = {0: 0}
        for u in range(1, len(tree)):
            parent = mapping[tree.parents[u]]
            child = merged.insert(parent, tree.tokens[u])
            merged.proposals[child].extend(tree.proposals[u])
            merged.ssms[child] |= tree.ssms[u]
            merged.ssms[parent] |= tree.ssms[u]
            mapping[u] = child
    return merged


def ancestor_masks(parents: torch.Tensor, depth: int) -> torch.Tensor:
    """[B, N, N] bool from parents [B, N] (-1 for roots and padding): entry (b, u, v) is True iff v
    is u or an ancestor of u. Each round adds one more generation of ancestors."""
    b, n = parents.shape
    eye = torch.eye(n, dtype=torch.bool, device=parents.device).expand(b, n, n)
    has_parent = (parents >= 0)[:, :, None]
    index = parents.clamp(min=0)[:, :, None].expand(b, n, n)
    ancestors = eye
    for _ in range(depth):
        ancestors = eye | (has_parent & ancestors.gather(1, index))
    return ancestors


@dataclass
class TreeBatch:
    """Trees of a batch as padded tensors, one row per sequence (padding nodes have `valid=False`,
    parent -1 and depth 0, and see only themselves in `ancestors`)."""

    tokens: torch.Tensor  # [B, N] long
    parents: torch.Tensor  # [B, N] long, -1 for roots and padding
    depths: torch.Tensor  # [B, N] long
    valid: torch.Tensor  # [B, N] bool
    ancestors: torch.Tensor  # [B, N, N] bool, (b, u, v): v is u or an ancestor of u

    @classmethod
    def pack(
        cls, trees: list[TokenTree], pad_token: int = 0, device: torch.device | str = "cpu"
    ) -> TreeBatch:
        """The trees as padded tensors on `device`, built there (ancestors by following parents)."""
        if not trees:
            raise ValueError("TreeBatch.pack needs at least one tree")
        n = max(len(t) for t in trees)
        if n == 1:  # roots only (a plain step): nothing to pad, every node sees itself
            tokens = torch.tensor([t.tokens for t in trees], device=device)
            ones = torch.ones_like(tokens, dtype=torch.bool)
            return cls(tokens, torch.full_like(tokens, -1), torch.zeros_like(tokens), ones, ones[:, :, None])
        pad = [n - len(t) for t in trees]
        tokens = torch.tensor(
            [t.tokens + [pad_token] * p for t, p in zip(trees, pad, strict=True)], device=device
        )
        parents = torch.tensor([t.parents + [-1] * p for t, p in zip(trees, pad, strict=True)], device=device)
        depths = torch.tensor([t.depths + [0] * p for t, p in zip(trees, pad, strict=True)], device=device)
        sizes = torch.tensor([len(t) for t in trees], device=device)
        valid = torch.arange(n, device=device)[None] < sizes[:, None]
        return cls(tokens, parents, depths, valid, ancestor_masks(parents, max(max(t.depths) for t in trees)))

    def to(self, device: torch.device | str) -> TreeBatch:
        return TreeBatch(*(getattr(self, f.name).to(device) for f in fields(self)))


@dataclass
class ChainDraft:
    """Greedy chains drafted for a batch, still on the models' device: the verifier reads them back
    together with its verdicts (one host read per step) and only then builds the rows' `TokenTree`s."""

    roots: list[int]  # [B] each row's root (its last verified token)
    tokens: torch.Tensor  # [B, L] drafted tokens; row b's first lengths[b] are real
    lengths: list[int]  # [B] drafted tokens per row
    ssm: int | list[int]  # the SSM that drafted them, or per row (the routed scheduler's rows)

    def batch(self) -> TreeBatch:
        """The chains (root first) as a `TreeBatch` on the tokens' device."""
        b, n = len(self.roots), self.tokens.shape[1] + 1
        device = self.tokens.device
        step = torch.arange(n, device=device)
        sizes = torch.tensor(self.lengths, device=device) + 1
        valid = step[None] < sizes[:, None]
        tokens = torch.cat([torch.tensor(self.roots, device=device)[:, None], self.tokens], 1) * valid
        causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
        eye = torch.eye(n, dtype=torch.bool, device=device)
        ancestors = torch.where(valid[:, :, None], causal & valid[:, None, :], eye)  # padding: itself
        parents = torch.where(valid, step - 1, -1).expand(b, n)
        return TreeBatch(tokens, parents, (step * valid).expand(b, n).clone(), valid, ancestors)

    def trees(self, drafted: list[list[int]]) -> list[TokenTree]:
        """The rows' trees, from the drafted tokens read back to the host ([B][L])."""
        out = []
        ssms = [self.ssm] * len(self.roots) if isinstance(self.ssm, int) else self.ssm
        for root, tokens, length, ssm in zip(self.roots, drafted, self.lengths, ssms, strict=True):
            tree = TokenTree.root_only(root, DraftKind.GREEDY)
            tree.add_sequence(tokens[:length], ssm)
            out.append(tree)
        return out
