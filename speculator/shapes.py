"""Speculation shapes: what one SSM drafts in one step (ALGORITHMS.md section 3)."""

from __future__ import annotations

from dataclasses import dataclass

from specboost.speculator.tree import DraftKind


@dataclass(frozen=True)
class ChainShape:
    """A chain of `length` tokens, greedy or sampled.

    `samples` > 1 (sampling only): the SSM draws that many chains independently from its q,
    each along its own path, merged into one tree (SpecTr's setting: k i.i.d. drafts from one q;
    chains through the same node share its scores, the node is fed once, but draw their next
    tokens independently). Verify them with rule="k_sequential" (SpecTr's k-sequential selection,
    ALGORITHMS.md section 15) or "mss". Greedy chains are all the argmax chain, so under
    do_sample=False the SSM drafts one chain whatever `samples` says."""

    length: int = 4
    samples: int = 1

    def __post_init__(self) -> None:
        if self.length < 1:
            raise ValueError(f"chain length must be >= 1, got {self.length}")
        if self.samples < 1:
            raise ValueError(f"chain samples must be >= 1 (sampled chains per SSM), got {self.samples}")

    def __repr__(self) -> str:  # one chain reads as it always did (reports and benchmark labels)
        samples = f", samples={self.samples}" if self.samples != 1 else ""
        return f"ChainShape(length={self.length}{samples})"

    def kind(self, do_sample: bool) -> DraftKind:
        return DraftKind.SAMPLED if do_sample else DraftKind.GREEDY


@dataclass(frozen=True)
class BeamShape:
    """SpecInfer beam search of width `width` and depth `depth`; its beams are merged into a tree."""

    width: int = 2
    depth: int = 4

    def __post_init__(self) -> None:
        if self.width < 1 or self.depth < 1:
            raise ValueError(f"beam width and depth must be >= 1, got width={self.width}, depth={self.depth}")

    def kind(self, do_sample: bool) -> DraftKind:
        return DraftKind.BEAM


@dataclass(frozen=True)
class TopologyShape:
    """A fixed tree shape (Sequoia): `parents[u]` is the parent of node u, node 0 is the root
    (parent -1) and parents precede children. Filled with top-k children (greedy) or children
    sampled without replacement (sampling)."""

    parents: tuple[int, ...] = (-1, 0, 0, 1)

    def __post_init__(self) -> None:
        if not self.parents or self.parents[0] != -1:
            raise ValueError("a topology starts with the root, whose parent is -1")
        for u, parent in enumerate(self.parents[1:], start=1):
            if not 0 <= parent < u:
                raise ValueError(f"topology node {u} has parent {parent}; parents must precede children")

    @classmethod
    def from_children_counts(cls, counts: list[list[int]]) -> TopologyShape:
        """Build from children counts per level, e.g. [[3], [2, 1, 0]]: the root has 3 children,
        whose children counts are 2, 1 and 0."""
        parents, frontier = [-1], [0]
        for level in counts:
            if len(level) != len(frontier):
                raise ValueError(
                    f"level {level} gives children counts for {len(level)} nodes, "
                    f"but the previous level has {len(frontier)}"
                )
            next_frontier = []
            for node, count in zip(frontier, level, strict=True):
                for _ in range(count):
                    next_frontier.append(len(parents))
                    parents.append(node)
            frontier = next_frontier
        return cls(tuple(parents))

    def children(self) -> list[list[int]]:
        children: list[list[int]] = [[] for _ in self.parents]
        for u, parent in enumerate(self.parents[1:], start=1):
            children[parent].append(u)
        return children

    def kind(self, do_sample: bool) -> DraftKind:
        return DraftKind.SAMPLED_WITHOUT_REPLACEMENT if do_sample else DraftKind.TOP_K


DraftShape = ChainShape | BeamShape | TopologyShape
