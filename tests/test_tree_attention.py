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
from specboost.speculator.kv_cache import new_cache
from specboost.speculator.tree import DraftKind, TokenTree, TreeBatch
from specboost.speculator.tree_attention import (
    causal_forward,
    tree_attention_mask,
    tree_forward,
    tree_position_ids,
)

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


def ancestors_of(tree: TokenTree, u: int) -> set[int]:
    """u itself and every node above it, root included."""
    out = {u}
    while tree.parents[u] >= 0:
        u = tree.parents[u]
        out.add(u)
    return out


# The mask and the position ids ------------------------------------------------------------------
DTYPES = st.sampled_from([torch.float64, torch.float32, torch.float16])


def single_tree_mask(
    ancestors: torch.Tensor, prefix: int, dtype: torch.dtype, layout: AttentionLayout | None = None
) -> torch.Tensor | dict[str, torch.Tensor]:
    """The mask of trees after a fully visible prefix, nodes at position prefix + index (a chain
    layout of positions is enough for the structural checks)."""
    b, q, k = ancestors.shape
    keys = torch.arange(prefix + k).expand(b, -1)
    return tree_attention_mask(
        ancestors, torch.ones(b, prefix, dtype=torch.bool), keys[:, prefix + k - q :], keys, dtype, layout
    )


@given(st.lists(trees(max_nodes=12), min_size=1, max_size=3), st.integers(0, 9), DTYPES)
def test_mask_shows_each_node_the_prefix_itself_and_its_ancestors(
    batch_trees: list[TokenTree], prefix: int, dtype: torch.dtype
) -> None:
    batch = TreeBatch.pack(batch_trees)
    mask = single_tree_mask(batch.ancestors, prefix, dtype)
    b, n = len(batch_trees), max(len(t) for t in batch_trees)
    assert mask.shape == (b, 1, n, prefix + n) and mask.dtype == dtype
    assert set(mask.unique().tolist()) <= {0.0, torch.finfo(dtype).min}
    visible = mask[:, 0] == 0
    for i, tree in enumerate(batch_trees):
        for u in range(n):
            # A padding node (past the end of a smaller tree) sees the prefix and only itself.
            mine = ancestors_of(tree, u) if u < len(tree) else {u}
            expected = set(range(prefix)) | {prefix + v for v in mine}
            assert set(torch.nonzero(visible[i, u]).flatten().tolist()) == expected
            assert (mask[i, 0, u][~visible[i, u]] == torch.finfo(dtype).min).all()


@given(trees(max_nodes=14), st.integers(0, 9), st.data())
def test_mask_for_a_slice_of_nodes_with_cached_tree_nodes(
    tree: TokenTree, prefix: int, data: st.DataObject
) -> None:
    """The slicing tree_forward does when part of the tree is already cached (SSM expansion)."""
    n = len(tree)
    first_cached = data.draw(st.integers(0, min(1, n - 1)))
    start = data.draw(st.integers(first_cached, n - 1))
    stop = data.draw(st.integers(start + 1, n))
    ancestors = TreeBatch.pack([tree]).ancestors[:, start:stop, first_cached:stop]
    visible = single_tree_mask(ancestors, prefix, torch.float64)[0, 0] == 0
    assert visible.shape == (stop - start, prefix + stop - first_cached)
    for row, u in enumerate(range(start, stop)):
        expected = set(range(prefix)) | {
            prefix + v - first_cached for v in ancestors_of(tree, u) if v >= first_cached
        }
        assert set(torch.nonzero(visible[row]).flatten().tolist()) == expected


@given(trees(max_nodes=12), st.integers(0, 12), st.integers(1, 8))
def test_sliding_window_hides_keys_a_window_or_more_positions_back(
    tree: TokenTree, prefix: int, window: int
) -> None:
    """A sliding-window layer sees what a full layer sees, minus keys whose position is <= the
    query's position - window (positions: prefix + depth, not indices); a model mixing layer
    types gets one mask per type."""
    batch = TreeBatch.pack([tree])
    positions = tree_position_ids(batch.depths, prefix)  # [1, N]
    keys = torch.cat([torch.arange(prefix)[None], positions], dim=-1)
    cached = torch.ones(1, prefix, dtype=torch.bool)
    layout = AttentionLayout(window, ("full_attention", "sliding_attention"), per_type=True)
    masks = tree_attention_mask(batch.ancestors, cached, positions, keys, torch.float32, layout)
    assert set(masks) == {"full_attention", "sliding_attention"}
    full, sliding = (masks[kind][0, 0] == 0 for kind in ("full_attention", "sliding_attention"))
    for u in range(len(tree)):
        query = prefix + tree.depths[u]
        for key in range(prefix + len(tree)):
            near = int(keys[0, key]) > query - window
            assert bool(sliding[u, key]) == (bool(full[u, key]) and near)
    only = AttentionLayout(window, ("sliding_attention",))
    single = tree_attention_mask(batch.ancestors, cached, positions, keys, torch.float32, only)
    assert torch.equal(single, masks["sliding_attention"])


@given(st.lists(trees(max_nodes=14), min_size=1, max_size=3), st.integers(0, 50))
def test_position_ids_are_prefix_plus_depth(batch_trees: list[TokenTree], prefix: int) -> None:
    batch = TreeBatch.pack(batch_trees)
    ids = tree_position_ids(batch.depths, prefix)
    assert ids.shape == batch.tokens.shape and ids.dtype == torch.long
    for i, tree in enumerate(batch_trees):
        assert ids[i, : len(tree)].tolist() == [prefix + d for d in tree.depths]
        for u in range(len(tree)):
            assert ids[i, u] == prefix + len(tree.path_to(u))


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


@pytest.mark.parametrize("arch", ARCHS)
@MODEL_SETTINGS
@given(tree=trees(), prefix=st.lists(st.integers(0, VOCAB - 1), max_size=6))
def test_one_tree_pass_equals_every_path_separately(arch: str, tree: TokenTree, prefix: list[int]) -> None:
    """The LLM's verification pass: cache = prefix, the root is node 0 of the tree."""
    model = model_for(arch)
    cache = new_cache()
    with torch.no_grad():
        if prefix:
            causal_forward(model, cache, prefix)
        out = tree_forward(model, cache, tree, range(len(tree)), len(prefix))
    assert out.logits.shape == (len(tree), VOCAB)
    assert cache.get_seq_length() == len(prefix) + len(tree)
    expected = path_logits(model, prefix, tree)
    check_close(out.logits, torch.stack([expected[u] for u in range(len(tree))]))


@pytest.mark.parametrize("arch", ARCHS)
@MODEL_SETTINGS
@given(tree=trees(), prefix=st.lists(st.integers(0, VOCAB - 1), max_size=6), data=st.data())
def test_tree_fed_in_chunks_after_a_cached_root(
    arch: str, tree: TokenTree, prefix: list[int], data: st.DataObject
) -> None:
    """The SSM expansion: the cache already holds the root, the tree is fed in consecutive chunks of
    nodes (first_cached_node=1), attending to the earlier chunks through the cache."""
    model = model_for(arch)
    cache = new_cache()
    verified = [*prefix, tree.tokens[0]]
    logits = {}
    with torch.no_grad():
        root = causal_forward(model, cache, verified).logits[-1]
        logits[0] = root
        start = 1
        while start < len(tree):
            stop = data.draw(st.integers(start + 1, len(tree)), label="chunk end")
            chunk = tree_forward(model, cache, tree, range(start, stop), len(verified), first_cached_node=1)
            logits.update(zip(range(start, stop), chunk.logits, strict=True))
            start = stop
    assert cache.get_seq_length() == len(verified) + len(tree) - 1
    expected = path_logits(model, prefix, tree)
    for u in range(len(tree)):
        check_close(logits[u], expected[u])


@pytest.mark.parametrize("arch", ARCHS)
def test_hidden_states_match_too(arch: str) -> None:
    model = model_for(arch)
    tree = make_tree([5, 6, 7, 8, 9, 10], [-1, 0, 0, 1, 1, 2])
    prefix = [1, 2, 3]
    cache = new_cache()
    with torch.no_grad():
        causal_forward(model, cache, prefix)
        out = tree_forward(model, cache, tree, range(len(tree)), len(prefix), output_hidden=True)
        assert out.hidden is not None and out.hidden.shape[0] == len(tree)
        for leaf in (3, 4, 5):
            nodes = [0, *tree.path_to(leaf)]
            ids = torch.tensor([prefix + [tree.tokens[v] for v in nodes]])
            hidden = model(input_ids=ids, output_hidden_states=True).hidden_states[-1][0]
            for i, v in enumerate(nodes):
                check_close(out.hidden[v], hidden[len(prefix) + i])


def test_tree_forward_checks_the_cache_length() -> None:
    model = model_for("llama")
    cache = new_cache()
    with torch.no_grad():
        causal_forward(model, cache, [1, 2, 3])
        with pytest.raises(AssertionError, match="cache out of sync"):
            tree_forward(model, cache, make_tree([4, 5], [-1, 0]), range(2), prefix_length=2)
