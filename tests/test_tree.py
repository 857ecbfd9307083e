"""Property tests for TokenTree and the SpecInfer tree merge (ALGORITHMS.md section 1), and for the
draft shapes (section 3)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specboost.decoder.verify import node_proposals
from specboost.speculator import (
    BeamShape,
    ChainShape,
    DraftKind,
    Proposal,
    TokenTree,
    TopologyShape,
    merge_trees,
)
from specboost.speculator.tree import TreeBatch

ROOT = 7
SMALL_VOCAB = 4  # few tokens: sequences share prefixes often, so the merge really merges

sequences = st.lists(st.integers(0, SMALL_VOCAB - 1), min_size=0, max_size=5)
# One input tree: a list of (ssm, sequence) drafted into it.
tree_specs = st.lists(st.tuples(st.integers(0, 3), sequences), min_size=1, max_size=4)
forest_specs = st.lists(tree_specs, min_size=1, max_size=4)


def build(spec: list[tuple[int, list[int]]], kind: DraftKind = DraftKind.SAMPLED) -> TokenTree:
    """A tree holding the sequences of `spec`, each token with its own q (a distinct tensor)."""
    tree = TokenTree.root_only(ROOT, kind)
    for ssm, seq in spec:
        tree.add_sequence(seq, ssm, [torch.rand(SMALL_VOCAB) for _ in seq])
    return tree


def node_paths(tree: TokenTree) -> dict[tuple[int, ...], int]:
    """Token path (root excluded) of every node -> node index; the root is the empty path."""
    paths: dict[tuple[int, ...], int] = {}
    for u in range(len(tree)):
        path = tuple(tree.tokens[v] for v in tree.path_to(u))
        assert path not in paths, "a trie holds each sequence once"
        paths[path] = u
    return paths


def all_prefixes(spec: list[tuple[int, list[int]]]) -> set[tuple[int, ...]]:
    return {tuple(seq[:i]) for _, seq in spec for i in range(len(seq) + 1)}


def check_structure(tree: TokenTree) -> None:
    n = len(tree)
    assert len(tree.parents) == len(tree.depths) == len(tree.ssms) == len(tree.proposals) == n
    assert len(tree.children) == n
    assert tree.parents[0] == -1 and tree.depths[0] == 0
    assert tree.topological_order() == list(range(n))
    for u in range(1, n):
        parent = tree.parents[u]
        assert 0 <= parent < u, "parents precede children"
        assert tree.depths[u] == tree.depths[parent] + 1
        assert u in tree.children[parent]
        assert len(tree.path_to(u)) == tree.depths[u]
    for u in range(n):
        assert all(tree.parents[c] == u for c in tree.children[u])
        assert tree.children[u] == sorted(tree.children[u]), "children in insertion order"
        child_tokens = [tree.tokens[c] for c in tree.children[u]]
        assert len(child_tokens) == len(set(child_tokens)), "siblings carry distinct tokens"
    assert sum(len(c) for c in tree.children) == n - 1
    assert tree.num_draft_tokens == n - 1
    assert tree.depth == max(tree.depths)


def proposals_by_path(trees: list[TokenTree]) -> dict[tuple[int, ...], list[tuple[int, int]]]:
    """Path -> the (ssm, id(q)) of every proposal that reached it, over all `trees`."""
    out: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    for tree in trees:
        for path, u in node_paths(tree).items():
            out.setdefault(path, []).extend((p.ssm, id(p.q)) for p in tree.proposals[u])
    return {path: sorted(props) for path, props in out.items() if props}


@given(tree_specs)
def test_add_sequence_builds_a_trie_of_the_sequences(spec: list[tuple[int, list[int]]]) -> None:
    tree = build(spec)
    check_structure(tree)
    assert set(node_paths(tree)) == all_prefixes(spec)
    # Every leaf sequence is a drafted sequence, and every drafted sequence ends at a node.
    drafted = {tuple(seq) for _, seq in spec}
    assert {tuple(s) for s in tree.sequences()} <= drafted
    for _, seq in spec:
        assert any(tuple(s[: len(seq)]) == tuple(seq) for s in tree.sequences()) or not seq


@given(forest_specs)
def test_merge_holds_exactly_the_union_of_the_input_sequences(
    specs: list[list[tuple[int, list[int]]]],
) -> None:
    trees = [build(spec) for spec in specs]
    merged = merge_trees(trees)
    check_structure(merged)
    assert merged.tokens[0] == ROOT and merged.kind is DraftKind.SAMPLED
    union = set().union(*(node_paths(t) for t in trees))
    # Def. 4.1: every sequence of every input is a path of the merge, and nothing else is.
    assert set(node_paths(merged)) == union
    for tree in trees:
        for seq in tree.sequences():
            node = 0
            for token in seq:
                node = merged.child_with_token(node, token)
                assert node is not None
    # Leaves of the merge are leaves of some input.
    input_leaves = {tuple(s) for t in trees for s in t.sequences()}
    assert {tuple(s) for s in merged.sequences()} <= input_leaves


@given(forest_specs)
def test_merge_keeps_proposing_ssms_and_every_proposal(specs: list[list[tuple[int, list[int]]]]) -> None:
    trees = [build(spec) for spec in specs]
    merged = merge_trees(trees)
    paths = node_paths(merged)
    all_specs = [entry for spec in specs for entry in spec]
    for path, u in paths.items():
        if path:
            expected = {ssm for ssm, seq in all_specs if tuple(seq[: len(path)]) == path}
        else:  # the root: every SSM that drafted anything
            expected = {ssm for ssm, seq in all_specs if seq}
        assert merged.ssms[u] == expected, path
        assert {p.ssm for p in merged.proposals[u]} == (expected if path else set())
    # Proposals (with their very q tensors) are preserved, none lost or duplicated.
    assert sum(len(p) for p in merged.proposals) == sum(len(p) for t in trees for p in t.proposals)
    assert sum(len(p) for p in merged.proposals) == sum(len(seq) for _, seq in all_specs)
    assert proposals_by_path([merged]) == proposals_by_path(trees)
    for u in range(1, len(merged)):
        assert all(isinstance(p, Proposal) and p.q is not None for p in merged.proposals[u])


@given(forest_specs)
def test_merge_is_idempotent(specs: list[list[tuple[int, list[int]]]]) -> None:
    trees = [build(spec) for spec in specs]
    merged = merge_trees(trees)
    again = merge_trees(trees)
    remerged = merge_trees([merged])
    for other in (again, remerged):
        assert other.tokens == merged.tokens
        assert other.parents == merged.parents
        assert other.depths == merged.depths
        assert other.children == merged.children
        assert other.ssms == merged.ssms
        assert proposals_by_path([other]) == proposals_by_path([merged])
    # Merging a tree with itself adds no node and no SSM, only a second copy of each proposal.
    doubled = merge_trees([merged, merged])
    assert doubled.tokens == merged.tokens and doubled.parents == merged.parents
    assert doubled.ssms == merged.ssms
    assert [len(p) for p in doubled.proposals] == [2 * len(p) for p in merged.proposals]
    # The merge does not modify its inputs.
    assert [len(t) for t in trees] == [len(build(spec)) for spec in specs]


@given(st.lists(sequences, min_size=1, max_size=4))
def test_merge_order_changes_indices_not_content(seqs: list[list[int]]) -> None:
    trees = [build([(i, seq)], DraftKind.GREEDY) for i, seq in enumerate(seqs)]
    forward, backward = merge_trees(trees), merge_trees(trees[::-1])
    fwd, bwd = node_paths(forward), node_paths(backward)
    assert set(fwd) == set(bwd)
    assert all(forward.ssms[fwd[p]] == backward.ssms[bwd[p]] for p in fwd)


@given(tree_specs)
def test_ancestor_matrix_marks_self_and_ancestors(spec: list[tuple[int, list[int]]]) -> None:
    tree = build(spec)
    mat = tree.ancestor_matrix()
    assert mat.shape == (len(tree), len(tree)) and mat.dtype == torch.bool
    for u in range(len(tree)):
        expected = {0, *tree.path_to(u)}
        assert set(torch.nonzero(mat[u]).flatten().tolist()) == expected


def test_single_tree_merge_and_add_child() -> None:
    tree = TokenTree.root_only(3, DraftKind.GREEDY)
    a = tree.add_child(0, 10, ssm=0)
    b = tree.add_child(0, 10, ssm=1)  # same token under the same parent: same node
    c = tree.add_child(a, 11, ssm=1)
    assert a == b == 1 and c == 2
    assert tree.ssms == [{0, 1}, {0, 1}, {1}]
    assert [len(p) for p in tree.proposals] == [0, 2, 1]
    assert tree.sequences() == [[10, 11]]
    assert tree.child_with_token(0, 10) == 1 and tree.child_with_token(0, 11) is None


def test_merge_rejects_bad_inputs() -> None:
    with pytest.raises(ValueError, match="at least one tree"):
        merge_trees([])
    a = TokenTree.root_only(1, DraftKind.GREEDY)
    a.add_sequence([2, 3], 0)
    b = TokenTree.root_only(5, DraftKind.GREEDY)
    b.add_sequence([2, 3], 1)
    with pytest.raises(ValueError, match="same root token"):
        merge_trees([a, b])
    c = TokenTree.root_only(1, DraftKind.BEAM)
    c.add_sequence([2], 1)
    with pytest.raises(ValueError, match="different ways") as info:
        merge_trees([a, c])
    assert "beam" in str(info.value) and "greedy" in str(info.value)


def test_topological_order_catches_a_child_before_its_parent() -> None:
    tree = TokenTree(
        [0, 1, 2], [-1, 2, 0], [0, 2, 1], DraftKind.GREEDY, [set()] * 3, [[]] * 3, [[2], [], [1]]
    )
    with pytest.raises(AssertionError, match="parents must precede children"):
        tree.topological_order()


@given(st.lists(tree_specs, min_size=1, max_size=4), st.integers(0, 9))
def test_tree_batch_pads_trees_into_tensors(specs: list[list[tuple[int, list[int]]]], pad: int) -> None:
    trees = [build(spec) for spec in specs]
    batch = TreeBatch.pack(trees, pad_token=pad).to("cpu")
    b, n = len(trees), max(len(t) for t in trees)
    assert batch.tokens.shape == batch.parents.shape == batch.depths.shape == batch.valid.shape == (b, n)
    assert batch.ancestors.shape == (b, n, n)
    for i, tree in enumerate(trees):
        size = len(tree)
        assert batch.tokens[i, :size].tolist() == tree.tokens
        assert batch.parents[i, :size].tolist() == tree.parents
        assert batch.depths[i, :size].tolist() == tree.depths
        assert batch.valid[i].tolist() == [True] * size + [False] * (n - size)
        assert torch.equal(batch.ancestors[i, :size, :size], tree.ancestor_matrix())
        # Padding: pad token, parent -1, depth 0, sees only itself; real nodes never see padding.
        assert (batch.tokens[i, size:] == pad).all() and (batch.parents[i, size:] == -1).all()
        assert (batch.depths[i, size:] == 0).all()
        assert torch.equal(batch.ancestors[i, size:], torch.eye(n, dtype=torch.bool)[size:])
        assert not batch.ancestors[i, :size, size:].any()
    with pytest.raises(ValueError, match="at least one tree"):
        TreeBatch.pack([])


# Draft shapes -----------------------------------------------------------------------------------
def test_from_children_counts_example() -> None:
    shape = TopologyShape.from_children_counts([[3], [2, 1, 0]])
    assert shape.parents == (-1, 0, 0, 0, 1, 1, 2)
    assert shape.children() == [[1, 2, 3], [4, 5], [6], [], [], [], []]
    assert TopologyShape.from_children_counts([]).parents == (-1,)
    assert TopologyShape.from_children_counts([[1], [1], [1]]).parents == (-1, 0, 1, 2)  # a chain


@st.composite
def children_counts(draw: st.DrawFn) -> list[list[int]]:
    counts, width = [], 1
    for _ in range(draw(st.integers(0, 4))):
        level = draw(st.lists(st.integers(0, 3), min_size=width, max_size=width))
        counts.append(level)
        width = sum(level)
    return counts


@given(children_counts())
def test_from_children_counts_builds_the_described_levels(counts: list[list[int]]) -> None:
    shape = TopologyShape.from_children_counts(counts)
    parents, children = shape.parents, shape.children()
    assert parents[0] == -1 and all(0 <= p < u for u, p in enumerate(parents) if u > 0)
    assert len(parents) == 1 + sum(sum(level) for level in counts)
    # Walk level by level: each node has exactly the children count given for it.
    frontier = [0]
    for level in counts:
        assert [len(children[u]) for u in frontier] == level
        frontier = [c for u in frontier for c in children[u]]
    assert all(not children[u] for u in frontier)
    assert shape.kind(False) is DraftKind.TOP_K
    assert shape.kind(True) is DraftKind.SAMPLED_WITHOUT_REPLACEMENT


@given(children_counts(), st.integers(-1, 1).filter(lambda d: d != 0))
def test_from_children_counts_rejects_a_level_of_the_wrong_width(counts: list[list[int]], delta: int) -> None:
    width = sum(counts[-1]) if counts else 1
    if width + delta < 0:
        return
    with pytest.raises(ValueError, match="previous level has"):
        TopologyShape.from_children_counts([*counts, [1] * (width + delta)])


@settings(max_examples=50)
@given(st.lists(st.integers(-2, 8), min_size=0, max_size=8))
def test_topology_validation(parents: list[int]) -> None:
    valid = bool(parents) and parents[0] == -1 and all(0 <= p < u for u, p in enumerate(parents) if u > 0)
    if valid:
        assert TopologyShape(tuple(parents)).parents == tuple(parents)
    else:
        with pytest.raises(ValueError, match=r"root|parents must precede children"):
            TopologyShape(tuple(parents))


def test_shape_validation_and_kinds() -> None:
    for bad in (0, -1):
        with pytest.raises(ValueError, match="chain length must be >= 1"):
            ChainShape(bad)
    with pytest.raises(ValueError, match="beam width and depth must be >= 1"):
        BeamShape(width=0, depth=2)
    with pytest.raises(ValueError, match="beam width and depth must be >= 1"):
        BeamShape(width=2, depth=0)
    with pytest.raises(ValueError, match="starts with the root"):
        TopologyShape((0, 0))
    with pytest.raises(ValueError, match="parents must precede children"):
        TopologyShape((-1, 0, 3, 1))
    assert ChainShape(3).kind(False) is DraftKind.GREEDY
    assert ChainShape(3).kind(True) is DraftKind.SAMPLED
    assert BeamShape().kind(False) is BeamShape().kind(True) is DraftKind.BEAM
    with pytest.raises(ValueError, match="chain samples must be >= 1"):
        ChainShape(3, samples=0)
    assert ChainShape(3, samples=4).kind(True) is DraftKind.SAMPLED
    assert repr(ChainShape(3)) == "ChainShape(length=3)"  # one chain reads as it always did
    assert repr(ChainShape(3, samples=4)) == "ChainShape(length=3, samples=4)"


def test_proposals_keep_their_draw_through_merges_and_verify_takes_them_in_drawing_order() -> None:
    """Several draws of one SSM at a node: verification orders them by (SSM, draw), never by the
    child (token) they landed on, and a merge keeps every draw index."""
    q = torch.full((SMALL_VOCAB,), 1 / SMALL_VOCAB)
    mine = TokenTree.root_only(ROOT, DraftKind.SAMPLED)
    for draw, token in enumerate([2, 1, 2]):  # draws 0 and 2 share a child, created before draw 1's
        mine.add_child(0, token, 1, q, draw=draw)
    other = TokenTree.root_only(ROOT, DraftKind.SAMPLED)
    other.add_child(0, 1, 0, q)
    merged = merge_trees([mine, other])
    order = [(prop.ssm, prop.draw, merged.tokens[child]) for child, prop in node_proposals(merged, 0)]
    assert order == [(0, 0, 1), (1, 0, 2), (1, 1, 1), (1, 2, 2)]
    assert sorted(p.draw for p in merged.proposals[merged.child_with_token(0, 2)]) == [0, 2]


def test_packing_roots_only_is_a_plain_step() -> None:
    """Root-only trees (a step that drafted nothing) pack to one node per row that sees itself,
    as the general path would pack them."""
    batch = TreeBatch.pack([TokenTree.root_only(7), TokenTree.root_only(3)])
    assert batch.tokens.tolist() == [[7], [3]] and batch.parents.tolist() == [[-1], [-1]]
    assert batch.depths.tolist() == [[0], [0]] and batch.valid.all() and batch.ancestors.shape == (2, 1, 1)
    assert batch.ancestors.all()
    with_child = TokenTree.root_only(7)
    with_child.add_child(0, 5, 0)
    general = TreeBatch.pack([with_child, TokenTree.root_only(3)])
    assert general.ancestors[:, :1, :1].tolist() == batch.ancestors.tolist()
