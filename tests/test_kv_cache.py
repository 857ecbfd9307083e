"""KV cache compaction (ALGORITHMS.md section 1): after a verification step the caches of the LLM
and of the SSMs hold exactly what a plain forward over the accepted sequence would build."""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import ARCHITECTURES, VOCAB
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import DynamicCache, PreTrainedModel, StaticCache

from specboost.decoder.target import TargetState
from specboost.decoder.verifiers import StairsVerifier, TreeVerifier
from specboost.decoder.verify import Rule
from specboost.speculator import BeamShape, ChainShape, SSMDrafter, TopologyShape
from specboost.speculator.kv_cache import compact_cache, crop_cache, new_cache
from specboost.speculator.sampling import LogitsToProbs, SamplingConfig
from specboost.speculator.tree import DraftKind, TokenTree
from specboost.speculator.tree_attention import causal_forward

ARCHS = sorted(ARCHITECTURES)
MODEL_SETTINGS = settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
GREEDY = LogitsToProbs(SamplingConfig())
SHAPES = {
    "chain": ChainShape(4),
    "beam": BeamShape(width=3, depth=3),
    "topology": TopologyShape.from_children_counts([[3], [2, 1, 1], [1, 1, 0, 1]]),
}


@functools.cache
def llm_for(arch: str) -> PreTrainedModel:
    return ARCHITECTURES[arch](layers=2, seed=4)


@functools.cache
def ssm_for(arch: str) -> PreTrainedModel:
    return ARCHITECTURES[arch](layers=1, seed=5)


def fresh_cache(model: PreTrainedModel, tokens: list[int]) -> DynamicCache:
    """The reference: a new cache filled by one plain causal forward over `tokens`."""
    cache = new_cache()
    if tokens:
        with torch.no_grad():
            causal_forward(model, cache, tokens)
    return cache


def assert_same_cache(cache: DynamicCache, expected: DynamicCache, length: int | None = None) -> None:
    """Every layer's keys and values equal (the first `length` positions of `cache`, if given)."""
    n = expected.get_seq_length()
    if length is None:
        assert cache.get_seq_length() == n
    else:
        assert n == length <= cache.get_seq_length()
    if n == 0:  # nothing to compare (an empty reference cache has no layers yet)
        assert all(not layer.is_initialized or layer.keys.shape[-2] == 0 for layer in cache.layers)
        return
    assert len(cache.layers) == len(expected.layers)
    for layer, ref in zip(cache.layers, expected.layers, strict=True):
        keys, values = layer.keys[..., :n, :], layer.values[..., :n, :]
        assert keys.shape == ref.keys.shape and values.shape == ref.values.shape
        torch.testing.assert_close(keys, ref.keys, atol=1e-10, rtol=0)
        torch.testing.assert_close(values, ref.values, atol=1e-10, rtol=0)


@st.composite
def trees(draw: st.DrawFn, root: int, max_nodes: int = 10) -> TokenTree:
    """A random trie below `root` (siblings carry distinct tokens, as in drafted trees)."""
    tree = TokenTree.root_only(root, DraftKind.GREEDY)
    for _ in range(draw(st.integers(0, max_nodes - 1))):
        parent = draw(st.integers(0, len(tree) - 1))
        tree.add_child(parent, draw(st.integers(0, VOCAB - 1)), ssm=0)
    return tree


tokens = st.integers(0, VOCAB - 1)


# The LLM side: TargetState -----------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
@MODEL_SETTINGS
@given(prompt=st.lists(tokens, min_size=1, max_size=6), data=st.data())
def test_llm_cache_after_verification_equals_recomputed_prefix(
    arch: str, prompt: list[int], data: st.DataObject
) -> None:
    llm = llm_for(arch)
    target = TargetState(llm, prompt)
    assert_same_cache(target.cache, fresh_cache(llm, prompt[:-1]))
    for _ in range(2):  # two verification steps in a row: the compacted cache is reused
        tree = data.draw(trees(root=target.tokens[-1]), label="tree")
        logits = target.tree_logits(tree)
        assert logits.shape == (len(tree), VOCAB)
        assert target.cache.get_seq_length() == target.prefix_length + len(tree)
        accepted = tree.path_to(data.draw(st.integers(0, len(tree) - 1), label="last accepted node"))
        next_token = data.draw(tokens, label="correction")
        target.keep_accepted(accepted)
        target.append([tree.tokens[u] for u in accepted] + [next_token])
        assert target.cache.get_seq_length() == target.prefix_length == len(target.tokens) - 1
        assert_same_cache(target.cache, fresh_cache(llm, target.tokens[:-1]))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("verifier", ["tree", "stairs"])
def test_verifiers_leave_the_llm_cache_at_the_accepted_sequence(arch: str, verifier: str) -> None:
    """With the real verifiers: chains whose first k drafts follow the LLM's greedy continuation."""
    llm = llm_for(arch)
    prompt = [3, 1, 4, 1, 5]
    greedy = llm.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, 5, dtype=torch.long),
        do_sample=False,
        max_new_tokens=8,
        pad_token_id=0,
    )[0, 5:].tolist()
    for k in range(5):
        target = TargetState(llm, prompt)
        draft = [*greedy[:k], (greedy[k] + 1) % VOCAB, *greedy[k + 1 :]][:4]  # wrong at position k
        tree = TokenTree.root_only(prompt[-1], DraftKind.GREEDY)
        tree.add_sequence(draft, ssm=0)
        if verifier == "stairs":
            verdict = StairsVerifier().verify(target, tree, GREEDY, None, Rule.GREEDY)
        else:
            verdict = TreeVerifier("greedy").verify(target, tree, GREEDY, None, Rule.GREEDY)
        assert verdict.accepted == list(range(1, k + 1))
        assert verdict.next_token == greedy[k]
        target.append([tree.tokens[u] for u in verdict.accepted] + [verdict.next_token])
        assert target.tokens == prompt + greedy[: k + 1]
        assert_same_cache(target.cache, fresh_cache(llm, target.tokens[:-1]))


# The SSM side: SSMDrafter sync --------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("shape", sorted(SHAPES))
@MODEL_SETTINGS
@given(prompt=st.lists(tokens, min_size=1, max_size=6), data=st.data())
def test_ssm_cache_after_sync_equals_recomputed_prefix(
    arch: str, shape: str, prompt: list[int], data: st.DataObject
) -> None:
    ssm = ssm_for(arch)
    drafter = SSMDrafter(ssm, 0)
    verified = list(prompt)
    tree = drafter.draft(verified, SHAPES[shape], GREEDY, max_depth=4)
    for _ in range(3):
        # The LLM accepts some path of the tree, then emits a token of its own: often one the SSM
        # also liked (a pruned beam or a sibling whose K/V the SSM cache holds), sometimes any token.
        node = data.draw(st.integers(0, len(tree) - 1), label="last accepted node")
        path = [tree.tokens[u] for u in tree.path_to(node)]
        with torch.no_grad():
            after = ssm(input_ids=torch.tensor([verified + path])).logits[0, -1]
        favourite = torch.topk(after, 3).indices.tolist()
        next_token = data.draw(st.sampled_from(favourite) | tokens, label="correction")
        verified = verified + path + [next_token]

        tree = drafter.draft(verified, SHAPES[shape], GREEDY, max_depth=4)  # syncs, then drafts
        assert drafter.cached_tokens == verified
        # The verified tokens come first in the SSM cache (drafted nodes may follow them).
        assert_same_cache(drafter.cache, fresh_cache(ssm, verified), length=len(verified))
        # Drafting does not depend on the history: a fresh drafter drafts the same tree.
        fresh = SSMDrafter(ssm, 0).draft(verified, SHAPES[shape], GREEDY, max_depth=4)
        assert (tree.tokens, tree.parents) == (fresh.tokens, fresh.parents)


@pytest.mark.parametrize("arch", ARCHS)
def test_ssm_sync_after_a_divergent_history_recomputes(arch: str) -> None:
    """Verified tokens that disagree with what the SSM cached (a new prompt sharing a prefix)."""
    ssm = ssm_for(arch)
    drafter = SSMDrafter(ssm, 0)
    drafter.draft([1, 2, 3, 4, 5], ChainShape(3), GREEDY, max_depth=3)
    drafter.draft([1, 2, 9, 9], ChainShape(3), GREEDY, max_depth=3)
    assert drafter.cached_tokens == [1, 2, 9, 9]
    assert_same_cache(drafter.cache, fresh_cache(ssm, [1, 2, 9, 9]), length=4)


# compact_cache and crop_cache ---------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
@given(seq=st.lists(tokens, min_size=1, max_size=12), data=st.data())
@settings(max_examples=15, deadline=None)
def test_crop_cache_equals_a_shorter_forward(arch: str, seq: list[int], data: st.DataObject) -> None:
    llm = llm_for(arch)
    cache = fresh_cache(llm, seq)
    length = data.draw(st.integers(0, len(seq) + 2))
    crop_cache(cache, length)
    assert cache.get_seq_length() == min(length, len(seq))
    assert_same_cache(cache, fresh_cache(llm, seq[:length]))
    # The cropped cache continues exactly like a fresh one.
    more = data.draw(st.lists(tokens, min_size=1, max_size=3))
    with torch.no_grad():
        cont = causal_forward(llm, cache, more).logits
        ref = llm(input_ids=torch.tensor([seq[:length] + more])).logits[0, -len(more) :]
    torch.testing.assert_close(cont, ref, atol=1e-9, rtol=0)


@given(st.integers(1, 10), st.data())
def test_compact_cache_keeps_the_given_positions_in_order(n: int, data: st.DataObject) -> None:
    cache = DynamicCache()
    keys = torch.randn(1, 2, n, 4, dtype=torch.float64)
    values = torch.randn(1, 2, n, 4, dtype=torch.float64)
    for layer in range(2):
        cache.update(keys + layer, values - layer, layer)
    keep = data.draw(st.lists(st.integers(0, n - 1), max_size=n, unique=True))
    compact_cache(cache, keep)
    compact_cache(cache, torch.arange(len(keep)))  # a tensor index works too, identity here
    for layer in range(2):
        assert torch.equal(cache.layers[layer].keys, (keys + layer)[:, :, keep])
        assert torch.equal(cache.layers[layer].values, (values - layer)[:, :, keep])
    assert cache.get_seq_length() == len(keep)


def test_compact_cache_leaves_an_empty_cache_alone_and_refuses_other_layer_types() -> None:
    cache = new_cache()
    compact_cache(cache, [])
    crop_cache(cache, 0)
    assert cache.get_seq_length() == 0
    static = StaticCache(config=llm_for("llama").config, max_cache_len=8)
    with pytest.raises(NotImplementedError, match="does not support cache layers of type"):
        compact_cache(static, [0, 1])
