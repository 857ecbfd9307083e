"""Tree attention (ALGORITHMS.md section 1): the mask, the position ids, and the key property that
one tree-attention pass gives the same logits as running every root-to-leaf path on its own."""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import ARCHITECTURES, VOCAB
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import PreTrainedModel

from specboost.speculator.attention_layout import AttentionLayout
from specboost.speculator.kv_cache import TreeCache
from specboost.speculator.tree import DraftKind, TokenTree, TreeBatch
from specboost.speculator.tree_attention import tree_attention_mask

ARCHS = sorted(ARCHITECTURES)
MODEL_SETTINGS = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def make_tree(tokens: list[int], parents: list[int]) -> TokenTree:
    """A TokenTree from raw tokens/parents (siblings may repeat a token: attention does not care)."""
    n = len(tokens)
    depths = [0] * n
    children: list[list[int]] = [[] for _ in range(n)]
    for u in range(1, n):
        depths[u] = depths[parents[u]] + 1
        children[parents[u]].append(u)
    return TokenTree(
        list(tokens),
        list(parents),
        depths,
        DraftKind.GREEDY,
        [set() for _ in range(n)],
        [[] for _ in range(n)],
        children,
    )


@st.composite
def trees(draw: st.DrawFn, max_nodes: int = 10) -> TokenTree:
    n = draw(st.integers(1, max_nodes))
    parents = [-1] + [draw(st.integers(0, u - 1)) for u in range(1, n)]
    tokens = draw(st.lists(st.integers(0, VOCAB - 1), min_size=n, max_size=n))
    return make_tree(tokens, parents)


# The mask ------------------------------------------------------------------------------------------
DTYPES = st.sampled_from([torch.float64, torch.float32, torch.float16])


@given(
    st.lists(trees(max_nodes=12), min_size=1, max_size=3),
    st.lists(st.integers(0, 9), min_size=3, max_size=3),
    st.integers(0, 4),
    DTYPES,
)
def test_mask_shows_each_node_its_rows_text_itself_and_its_ancestors(
    batch_trees: list[TokenTree], row_lengths: list[int], slack: int, dtype: torch.dtype
) -> None:
    """Ragged rows: row b's committed keys 0 .. lengths[b] - 1, then the fed nodes at `width`."""
    batch = TreeBatch.pack(batch_trees)
    b, n = len(batch_trees), max(len(t) for t in batch_trees)
    lengths = torch.tensor(row_lengths[:b])
    width = int(lengths.max())
    capacity = width + n + slack
    positions = lengths[:, None] + batch.depths
    mask = tree_attention_mask(batch.ancestors, lengths, width, positions, positions, capacity, dtype)
    assert mask.shape == (b, 1, n, capacity) and mask.dtype == dtype
    assert set(mask.unique().tolist()) <= {0.0, torch.finfo(dtype).min}
    visible = mask[:, 0] == 0
    for i, tree in enumerate(batch_trees):
        for u in range(n):
            # A padding node (past the end of a smaller tree) sees the text and only itself.
            mine = tree.ancestors(u) if u < len(tree) else {u}
            expected = set(range(row_lengths[i])) | {width + v for v in mine}
            assert set(torch.nonzero(visible[i, u]).flatten().tolist()) == expected


@given(trees(max_nodes=12), st.integers(0, 12), st.integers(1, 8))
def test_sliding_window_hides_keys_a_window_or_more_positions_back(
    tree: TokenTree, prefix: int, window: int
) -> None:
    """A sliding-window layer sees what a full layer sees, minus keys whose position is <= the
    query's position - window (positions: prefix + depth, not indices); a model mixing layer
    types gets one mask per type."""
    batch = TreeBatch.pack([tree])
    positions = prefix + batch.depths  # [1, N]
    lengths, capacity = torch.tensor([prefix]), prefix + len(tree)
    layout = AttentionLayout(window, ("full_attention", "sliding_attention"), per_type=True)
    args = (batch.ancestors, lengths, prefix, positions, positions, capacity, torch.float32)
    masks = tree_attention_mask(*args, layout)
    assert set(masks) == {"full_attention", "sliding_attention"}
    full, sliding = (masks[kind][0, 0] == 0 for kind in ("full_attention", "sliding_attention"))
    keys = [*range(prefix), *positions[0].tolist()]
    for u in range(len(tree)):
        query = prefix + tree.depths[u]
        for key in range(capacity):
            assert bool(sliding[u, key]) == (bool(full[u, key]) and keys[key] > query - window)
    single = tree_attention_mask(*args, AttentionLayout(window, ("sliding_attention",)))
    assert torch.equal(single, masks["sliding_attention"])


# One tree pass == every path on its own ---------------------------------------------------------
@functools.cache
def model_for(arch: str) -> PreTrainedModel:
    return ARCHITECTURES[arch](layers=2, seed=3)


def path_logits(model: PreTrainedModel, prefix: list[int], tree: TokenTree) -> dict[int, torch.Tensor]:
    """Node -> logits after prefix + root..node, from plain causal forwards over each root-to-leaf
    path (no cache, no mask: the model's own causal attention)."""
    out: dict[int, torch.Tensor] = {}
    leaves = [u for u in range(len(tree)) if not tree.children[u]]
    for leaf in leaves:
        nodes = [0, *tree.path_to(leaf)]
        ids = torch.tensor([prefix + [tree.tokens[v] for v in nodes]])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0]
        for i, v in enumerate(nodes):
            out[v] = logits[len(prefix) + i]
    assert len(out) == len(tree)
    return out


def check_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == torch.float64
    torch.testing.assert_close(actual, expected, atol=1e-9, rtol=0)


def cache_after(model: PreTrainedModel, text: list[int]) -> TreeCache:
    cache = TreeCache(model, 1, 128)
    with torch.no_grad():
        cache.feed_chains([text])
    return cache


@pytest.mark.parametrize("arch", ARCHS)
@MODEL_SETTINGS
@given(tree=trees(), prefix=st.lists(st.integers(0, VOCAB - 1), max_size=6))
def test_one_tree_pass_equals_every_path_separately(arch: str, tree: TokenTree, prefix: list[int]) -> None:
    """The LLM's verification pass: the cache holds the prefix, the root is node 0 of the tree."""
    model = model_for(arch)
    cache = cache_after(model, prefix)
    batch = TreeBatch.pack([tree])
    with torch.no_grad():
        out = cache.feed(batch.tokens, len(prefix) + batch.depths, batch.ancestors)
    assert out.logits.shape == (1, len(tree), VOCAB)
    assert cache.pending == len(tree)  # eager passes are not padded
    expected = path_logits(model, prefix, tree)
    check_close(out.logits[0], torch.stack([expected[u] for u in range(len(tree))]))


@pytest.mark.parametrize("arch", ARCHS)
@MODEL_SETTINGS
@given(tree=trees(), prefix=st.lists(st.integers(0, VOCAB - 1), max_size=6), data=st.data())
def test_tree_fed_in_chunks_after_a_cached_root(
    arch: str, tree: TokenTree, prefix: list[int], data: st.DataObject
) -> None:
    """The SSM expansion: the cache already holds the root, the tree is fed in consecutive chunks of
    nodes, each attending to the earlier chunks' pending nodes through its ancestor columns."""
    model = model_for(arch)
    verified = [*prefix, tree.tokens[0]]
    cache = cache_after(model, verified[:-1])
    ancestors = tree.ancestor_matrix()
    slots: dict[int, int] = {}
    logits = {}
    with torch.no_grad():
        logits[0] = cache.feed_chains([verified[-1:]]).logits[0]
        start = 1
        while start < len(tree):
            stop = data.draw(st.integers(start + 1, len(tree)), label="chunk end")
            new = list(range(start, stop))
            visible = torch.zeros(1, len(new), cache.pending + len(new), dtype=torch.bool)
            for v, slot in slots.items():
                visible[0, :, slot] = ancestors[new, v]
            visible[0, :, cache.pending :] = ancestors[new][:, new]
            tokens = torch.tensor([[tree.tokens[u] for u in new]])
            positions = torch.tensor([[len(prefix) + tree.depths[u] for u in new]])
            first = cache.pending
            chunk = cache.feed(tokens, positions, visible).logits[0]
            slots.update({u: first + i for i, u in enumerate(new)})
            logits.update(zip(new, chunk, strict=True))
            start = stop
    expected = path_logits(model, prefix, tree)
    for u in range(len(tree)):
        check_close(logits[u], expected[u])


@pytest.mark.parametrize("arch", ARCHS)
def test_hidden_states_match_too(arch: str) -> None:
    model = model_for(arch)
    tree = make_tree([5, 6, 7, 8, 9, 10], [-1, 0, 0, 1, 1, 2])
    prefix = [1, 2, 3]
    cache = cache_after(model, prefix)
    batch = TreeBatch.pack([tree])
    with torch.no_grad():
        out = cache.feed(batch.tokens, len(prefix) + batch.depths, batch.ancestors, output_hidden=True)
        assert out.hidden is not None and out.hidden.shape[1] == len(tree)
        for leaf in (3, 4, 5):
            nodes = [0, *tree.path_to(leaf)]
            ids = torch.tensor([prefix + [tree.tokens[v] for v in nodes]])
            hidden = model(input_ids=ids, output_hidden_states=True).hidden_states[-1][0]
            for i, v in enumerate(nodes):
                check_close(out.hidden[0, v], hidden[len(prefix) + i])


def test_tree_batch_ancestors_follow_the_parents() -> None:
    tree = make_tree([5, 6, 7, 8, 9, 10], [-1, 0, 0, 1, 1, 2])
    batch = TreeBatch.pack([tree, make_tree([1, 2], [-1, 0])])
    assert torch.equal(batch.ancestors[0], tree.ancestor_matrix())
    assert batch.valid.tolist() == [[True] * 6, [True] * 2 + [False] * 4]
    assert torch.equal(batch.ancestors[1, 2:, 2:], torch.eye(4, dtype=torch.bool))  # padding: itself only
