"""Fixed-capacity tree caches (ALGORITHMS.md sections 1 and 11): after any sequence of tree passes,
commits, truncations, row selections and growth, every row of a `TreeCache` holds exactly what a
plain forward over its text would build, and a pass over it gives the same logits. The LLM side
(the verifiers) and the SSM side (`PoolDrafter` sync, one SSM and a pool, stacked or not) are
checked on real models."""

from __future__ import annotations

import functools
import gc
import logging
import weakref
from collections.abc import Callable

import pytest
import torch
from conftest import ARCHITECTURES, VOCAB, tiny_llama
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import DynamicCache, PreTrainedModel

from specboost.decoder.sequence import SequenceState
from specboost.decoder.stopping import StopCriteria
from specboost.decoder.verifiers import StairsVerifier, TreeVerifier
from specboost.decoder.verify import Rule
from specboost.speculator import BeamShape, ChainShape, PoolDrafter, TopologyShape, kv_cache
from specboost.speculator.batched_drafter import BatchedChainDrafter
from specboost.speculator.chain_block import chain_block
from specboost.speculator.kv_cache import (
    CAPACITY_STEP,
    CompiledFunctions,
    CompiledPass,
    PassShape,
    TreeCache,
    bucket,
    setup_count,
    tree_pass,
)
from specboost.speculator.sampling import LogitsToProbs, SamplingConfig
from specboost.speculator.tree import DraftKind, TokenTree, TreeBatch

ARCHS = sorted(ARCHITECTURES)
MODEL_SETTINGS = settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
GREEDY = LogitsToProbs(SamplingConfig())
SHAPES = {
    "chain": ChainShape(4),
    "beam": BeamShape(width=3, depth=3),
    "topology": TopologyShape.from_children_counts([[3], [2, 1, 1], [1, 1, 0, 1]]),
}
tokens = st.integers(0, VOCAB - 1)


@functools.cache
def llm_for(arch: str) -> PreTrainedModel:
    return ARCHITECTURES[arch](layers=2, seed=4)


@functools.cache
def ssm_for(arch: str) -> PreTrainedModel:
    return ARCHITECTURES[arch](layers=1, seed=5)


def reference(model: PreTrainedModel, text: list[int]) -> DynamicCache:
    """A new cache filled by one plain causal forward over `text`."""
    cache = DynamicCache()
    if text:
        with torch.no_grad():
            model(input_ids=torch.tensor([text]), past_key_values=cache, use_cache=True)
    return cache


def assert_row_holds(cache: TreeCache, row: int, model: PreTrainedModel, text: list[int]) -> None:
    """Row `row` of `cache` commits exactly `text`: its K/V equal a fresh forward's."""
    assert cache.lengths[row] == len(text)
    if not text:
        return
    expected = reference(model, text)
    for layer, ref in zip(cache.cache.layers, expected.layers, strict=True):
        n = len(text)
        torch.testing.assert_close(layer.keys[row : row + 1, :, :n], ref.keys, atol=1e-10, rtol=0)
        torch.testing.assert_close(layer.values[row : row + 1, :, :n], ref.values, atol=1e-10, rtol=0)


@st.composite
def trees(draw: st.DrawFn, root: int, max_nodes: int = 10) -> TokenTree:
    """A random trie below `root` (siblings carry distinct tokens, as in drafted trees)."""
    tree = TokenTree.root_only(root, DraftKind.GREEDY)
    for _ in range(draw(st.integers(0, max_nodes - 1))):
        parent = draw(st.integers(0, len(tree) - 1))
        tree.add_child(parent, draw(tokens), ssm=0)
    return tree


def feed_trees(cache: TreeCache, trees_: list[TokenTree]) -> torch.Tensor:
    batch = TreeBatch.pack(trees_)
    lengths = torch.tensor(cache.lengths)[:, None]
    return cache.feed(batch.tokens, lengths + batch.depths, batch.ancestors).logits


# The cache itself --------------------------------------------------------------------------------------
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("arch", ARCHS)
@MODEL_SETTINGS
@given(prompts=st.lists(st.lists(tokens, min_size=1, max_size=6), min_size=1, max_size=3), data=st.data())
def test_rows_after_tree_passes_equal_recomputed_texts(
    arch: str, padded: bool, prompts: list[list[int]], data: st.DataObject
) -> None:
    """Ragged rows: each step feeds a tree per row and commits the root and a random path. With
    `padded`, the cache pads rows and nodes to their buckets as it does for a compiled model (the
    "compiled" pass here is the eager `tree_pass`)."""
    llm = llm_for(arch)
    cache = TreeCache(
        llm, len(prompts), CAPACITY_STEP, compiled=CompiledPass(lambda: tree_pass) if padded else None
    )
    assert cache.physical_rows == (bucket(len(prompts)) if padded else len(prompts))
    texts = [p[:-1] for p in prompts]  # the LLM caches every verified token but the root
    roots = [p[-1] for p in prompts]
    cache.feed_chains(texts)
    for row, text in enumerate(texts):
        assert_row_holds(cache, row, llm, text)
    for _ in range(2):
        step = [data.draw(trees(root=root), label="tree") for root in roots]
        logits = feed_trees(cache, step)
        for row, tree in enumerate(step):  # tree logits equal plain passes over each path
            node = data.draw(st.integers(0, len(tree) - 1), label="node")
            path = texts[row] + [tree.tokens[v] for v in [0, *tree.path_to(node)]]
            with torch.no_grad():
                expected = llm(input_ids=torch.tensor([path])).logits[0, -1]
            torch.testing.assert_close(logits[row, node], expected, atol=1e-9, rtol=0)
        kept = [tree.path_to(data.draw(st.integers(0, len(tree) - 1), label="accepted")) for tree in step]
        cache.commit([[0, *path] for path in kept])
        for row, (tree, path) in enumerate(zip(step, kept, strict=True)):
            texts[row] += [tree.tokens[v] for v in [0, *path]]
            roots[row] = data.draw(tokens, label="next root")
            assert_row_holds(cache, row, llm, texts[row])


@pytest.mark.parametrize("arch", ARCHS)
def test_truncate_select_extend_and_growth_keep_every_row(arch: str) -> None:
    llm = llm_for(arch)
    texts = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10]]
    cache = TreeCache(llm, 3, CAPACITY_STEP)
    cache.feed_chains(texts)
    cache.truncate(0, 2)
    texts[0] = texts[0][:2]
    cache.select([2, 0])
    texts = [texts[2], texts[0]]
    other = TreeCache(llm, 1, 2 * CAPACITY_STEP)
    other.feed_chains([[11, 12, 13, 14]])
    cache.extend(other)
    texts.append([11, 12, 13, 14])
    assert cache.capacity == 2 * CAPACITY_STEP and cache.physical_rows == 3
    for row, text in enumerate(texts):
        assert_row_holds(cache, row, llm, text)
    if arch != "llama":
        return  # the others' learned position embeddings end before a third capacity step
    long = list(range(1, 40)) * 4  # grows the capacity past 2 steps
    cache.feed_chains([long, [], [7]])
    texts[0] += long
    texts[2] += [7]
    assert cache.capacity >= len(texts[0]) and cache.capacity % CAPACITY_STEP == 0
    for row, text in enumerate(texts):
        assert_row_holds(cache, row, llm, text)


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("keeps", [False, True])
@pytest.mark.parametrize("arch", ARCHS)
def test_fed_chains_give_each_rows_last_logits_projecting_only_those(
    arch: str, keeps: bool, compiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`feed_chains` returns each row's logits after its last token (ragged rows, one fed nothing)
    as plain forward passes give them. An eager pass projects only the rows' distinct last
    positions onto the vocabulary (`logits_to_keep`) where the model takes it; a model that does
    not gets the same logits from its full output. `compiled`: padded rows and nodes (the
    "compiled" pass is the eager `tree_pass`), which keep every position and gather after."""
    monkeypatch.setattr(kv_cache, "keeps_logits", lambda model: keeps)
    llm = llm_for(arch)
    head_inputs: list[tuple[int, ...]] = []
    hook = llm.get_output_embeddings().register_forward_hook(
        lambda module, args, out: head_inputs.append(tuple(args[0].shape))
    )
    chains = [[1, 2, 3, 4, 5, 6], [7, 8], [9, 10, 11, 12, 13, 14], []]
    cache = TreeCache(llm, 4, CAPACITY_STEP, CompiledPass(lambda: tree_pass) if compiled else None)
    try:
        cache.feed_chains([[0]] * 4, eager=True)  # allocates the K/V: later passes may be compiled
        out = cache.feed_chains(chains, eager=not compiled, output_hidden=True)
    finally:
        hook.remove()
    with torch.no_grad():
        for row, chain in enumerate(chains[:3]):
            expected = llm(input_ids=torch.tensor([[0, *chain]]), output_hidden_states=True)
            torch.testing.assert_close(out.logits[row], expected.logits[0, -1], atol=1e-9, rtol=0)
            torch.testing.assert_close(out.hidden[row], expected.hidden_states[-1][0, -1], atol=1e-9, rtol=0)
    rows = 4 if compiled else len(chains)  # 4 rows: their own bucket
    assert head_inputs[-1][:2] == (rows, 6 if compiled or not keeps else 3)  # last nodes 5, 1, 0


def test_an_empty_cache_extended_takes_the_new_rows_capacity() -> None:
    """A group's cache before its first rows does not set the attention span of its later passes."""
    llm = llm_for("llama")
    cache = TreeCache(llm, 0, 2 * CAPACITY_STEP)
    rows = TreeCache(llm, 2, CAPACITY_STEP // 2)
    rows.feed_chains([[1, 2, 3], [4]])
    cache.extend(rows)
    assert cache.capacity == CAPACITY_STEP // 2
    assert_row_holds(cache, 0, llm, [1, 2, 3])
    assert_row_holds(cache, 1, llm, [4])


def test_capacity_limit_is_refused_with_the_numbers() -> None:
    llm = llm_for("gpt2")  # 128 positions
    cache = TreeCache(llm, 1, CAPACITY_STEP)
    with pytest.raises(ValueError, match=r"exceed the cache's capacity limit of \d+ positions"):
        cache.feed_chains([list(range(VOCAB)) * 20])


# The LLM side: the verifiers --------------------------------------------------------------------------
def row_state(prompt: list[int], tree: TokenTree) -> SequenceState:
    row = SequenceState(list(prompt), len(prompt), StopCriteria(16), GREEDY, Rule.GREEDY)
    row.tree = tree
    return row


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
        cache = TreeCache(llm, 1, CAPACITY_STEP)
        cache.feed_chains([prompt[:-1]])
        draft = [*greedy[:k], (greedy[k] + 1) % VOCAB, *greedy[k + 1 :]][:4]  # wrong at position k
        tree = TokenTree.root_only(prompt[-1], DraftKind.GREEDY)
        tree.add_sequence(draft, ssm=0)
        check = StairsVerifier() if verifier == "stairs" else TreeVerifier("greedy")
        [verdict], _ = check.verify(cache, [row_state(prompt, tree)], keep_hidden=False)
        assert verdict.accepted == list(range(1, k + 1))
        assert verdict.next_token == greedy[k]
        assert_row_holds(cache, 0, llm, prompt + greedy[:k])


# The SSM side: PoolDrafter sync -------------------------------------------------------------------
POOLS = {"one SSM": (1, True), "stacked pool": (2, True), "pool one by one": (2, False)}


def pool_for(arch: str, pool: str) -> tuple[PoolDrafter, list[PreTrainedModel]]:
    size, stack = POOLS[pool]
    ssms = [ARCHITECTURES[arch](layers=1, seed=5 + i) for i in range(size)]
    drafter = PoolDrafter(ssms, stack=stack)
    assert drafter.stacked == (stack and size > 1)
    return drafter, ssms


def assert_rows_hold(drafter: PoolDrafter, ssms: list[PreTrainedModel], verified: list[int]) -> None:
    """Every SSM's row commits exactly the verified tokens (drafted nodes are pending)."""
    for unit in drafter.units:
        for r, row in enumerate(unit.rows):
            assert row.cached == verified
            assert_row_holds(unit.cache, r, ssms[row.member], verified)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("pool", sorted(POOLS))
@MODEL_SETTINGS
@given(prompt=st.lists(tokens, min_size=1, max_size=6), data=st.data())
def test_ssm_caches_after_sync_equal_recomputed_prefix(
    arch: str, shape: str, pool: str, prompt: list[int], data: st.DataObject
) -> None:
    drafter, ssms = pool_for(arch, pool)
    shapes = [SHAPES[shape]] * len(ssms)
    verified = list(prompt)
    trees = drafter.draft(verified, shapes, GREEDY, max_depth=4)
    for _ in range(3):
        # The LLM accepts some path of one SSM's tree, then emits a token of its own: often one the
        # SSM also liked (a pruned beam or a sibling whose K/V the SSM cache holds), sometimes any.
        tree = trees[data.draw(st.integers(0, len(trees) - 1), label="SSM whose path is accepted")]
        node = data.draw(st.integers(0, len(tree) - 1), label="last accepted node")
        path = [tree.tokens[u] for u in tree.path_to(node)]
        with torch.no_grad():
            after = ssms[0](input_ids=torch.tensor([verified + path])).logits[0, -1]
        favourite = torch.topk(after, 3).indices.tolist()
        next_token = data.draw(st.sampled_from(favourite) | tokens, label="correction")
        verified = verified + path + [next_token]

        trees = drafter.draft(verified, shapes, GREEDY, max_depth=4)  # syncs, then drafts
        assert_rows_hold(drafter, ssms, verified)
        # Drafting does not depend on the history, nor on the other SSMs: each SSM alone and fresh
        # drafts the same tree.
        for ssm, tree in zip(ssms, trees, strict=True):
            fresh = PoolDrafter([ssm]).draft_one(verified, SHAPES[shape], GREEDY, max_depth=4)
            assert (tree.tokens, tree.parents) == (fresh.tokens, fresh.parents)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("pool", sorted(POOLS))
def test_ssm_sync_after_a_divergent_history_recomputes(arch: str, pool: str) -> None:
    """Verified tokens that disagree with what the SSMs cached (a new prompt sharing a prefix)."""
    drafter, ssms = pool_for(arch, pool)
    chains = [ChainShape(3)] * len(ssms)
    drafter.draft([1, 2, 3, 4, 5], chains, GREEDY, max_depth=3)
    drafter.draft([1, 2, 9, 9], chains, GREEDY, max_depth=3)
    assert_rows_hold(drafter, ssms, [1, 2, 9, 9])


def test_an_ssm_that_sits_out_catches_up_later() -> None:
    """A pool where SSM 1 drafts nothing for a step (the learned scheduler's choice) stays synced."""
    drafter, ssms = pool_for("llama", "stacked pool")
    trees = drafter.draft([1, 2, 3], [ChainShape(2), ChainShape(2)], GREEDY, max_depth=2)
    verified = [1, 2, 3, *(trees[0].tokens[u] for u in trees[0].path_to(2)), 7]
    trees = drafter.draft(verified, [ChainShape(3), None], GREEDY, max_depth=3)
    assert trees[1] is None
    verified += [trees[0].tokens[1], 9]
    drafter.draft(verified, [None, BeamShape(2, 2)], GREEDY, max_depth=2)
    assert_rows_hold(drafter, ssms, verified)


def test_a_compiled_pass_runs_its_expected_shapes_once_per_rows_and_capacity() -> None:
    """`CompiledPass.expected`: the first cache of a (rows, capacity) to meet the call runs every
    expected shape there, past its fed nodes, before its own pass, whose result is unchanged; a
    cache of the same rows and capacity runs none again (the "compiled" pass is the eager one)."""
    llm = llm_for("llama")
    shapes: list[tuple[int, int, bool]] = []

    def spy(*args: object) -> tuple[torch.Tensor, torch.Tensor | None]:
        shapes.append((args[2].shape[1], args[5].shape[1], args[9]))  # nodes, keys, hidden
        return tree_pass(*args)

    call = CompiledPass(lambda: spy)
    call.expected = {PassShape(2, 3, False), PassShape(4, 4, True)}
    eager, warmed, again = (TreeCache(llm, 1, CAPACITY_STEP, c) for c in (None, call, call))
    outputs = []
    for cache in (eager, warmed, again):
        cache.feed_chains([[3, 4, 5]], eager=True)  # allocates the K/V
        outputs.append(cache.feed_chains([[6, 7]]).logits)
    assert shapes == [(2, 3, False), (4, 4, True), (2, 2, False), (2, 2, False)]
    for logits in outputs[1:]:
        torch.testing.assert_close(logits, outputs[0])


@pytest.mark.parametrize("feeds", [1, 3, 6, 10])
def test_an_argmax_chain_fed_in_blocks_is_the_chain_fed_token_by_token(feeds: int) -> None:
    """`TreeCache.feed_argmax` on a one-row compiled cache feeds its call's expected argmax-chain
    blocks, made when the cache warmed (largest first: 10 = 7 + 3, 6 = 3 + 3, 3 = 3, 1 = one pass),
    the rest one `feed_column` each; the tokens, the row's length and what the cache then gives
    equal those of a cache fed token by token (the "compiled" functions are the eager ones). The
    blocks' tensors have strides of their own, whatever the chain's width (the graphs guard on
    them: a column of the chain had recompiled its block for every width the router drafted)."""
    llm = llm_for("llama")
    blocks: list[int] = []

    def spy(*args: object) -> torch.Tensor:
        assert all(a.stride() == torch.empty(a.shape).stride() for a in args[2:6])  # guarded on
        blocks.append(args[8])  # its steps
        return chain_block(*args)

    call = CompiledPass(lambda: tree_pass, make_chain=lambda: spy)
    call.expected_chains = {3, 7}
    fused, plain = TreeCache(llm, 1, CAPACITY_STEP, call), TreeCache(llm, 1, CAPACITY_STEP)
    for cache in (fused, plain):
        cache.feed_chains([[3, 4, 5, 6]], eager=True)
    fused.warm_for(64)  # compiles (here: makes) the blocks, each once
    assert sorted(blocks) == [3, 7]
    blocks.clear()
    first = torch.tensor([[9, 0, 0]])[:, 0]  # a chain's column: stride 3 (the chain's width)
    chosen = fused.feed_argmax(first, feeds)
    token, expected = first, []
    for _ in range(feeds):
        token = plain.feed_column(token, [True]).float().argmax(-1)
        expected.append(int(token))
    assert chosen.tolist() == [expected]
    assert blocks == {1: [], 3: [3], 6: [3, 3], 10: [7, 3]}[feeds]
    assert fused.lengths == plain.lengths == [4 + feeds]
    after = [cache.feed_column(chosen[:, -1], [True]) for cache in (fused, plain)]
    torch.testing.assert_close(after[0], after[1])


def test_a_drafter_drafts_its_chains_in_blocks_only_where_every_row_drafts_them_whole() -> None:
    """One SSM's greedy chains (`draft_greedy`): in blocks for a one-row cache, one pass a token for
    a batch (rows of other lengths: each row's own K/V place), the same chains either way."""
    ssm = ssm_for("llama")
    calls = []

    def spy(*args: object) -> torch.Tensor:
        calls.append(args[8])  # its steps
        return chain_block(*args)

    call = CompiledPass(lambda: tree_pass, make_chain=lambda: spy)
    call.expected_chains = {3}
    texts = [[3, 4, 5, 6, 7], [8, 9]]
    chains = {}
    for compiled in (call, None):
        for rows in ([0], [0, 1]):
            drafter = BatchedChainDrafter(ssm, compiled)
            drafter.add_sequences(len(rows))
            drafter.cache.warm_for(64)
            tokens, _ = drafter.draft_greedy([texts[r] for r in rows], [5] * len(rows))
            chains[compiled is not None, len(rows)] = tokens.tolist()
    assert calls == [3, 3]  # the warm-up's block, then the one-row chain's (1 + 3 + 1 tokens)
    assert chains[True, 1] == chains[False, 1] == chains[False, 2][:1]
    assert chains[True, 2] == chains[False, 2]


def test_a_pass_whose_padding_alone_would_not_fit_runs_eagerly() -> None:
    """A compiled pass pads its nodes to their bucket; where only the padding would overflow the
    cache (7 nodes, padded to 8, with 7 positions left) the pass runs eagerly at its own size and
    the cache keeps its capacity (growing it had met a capacity no warm-up had, and compiled every
    expected pass inside a timed run); where the padding fits, the compiled call runs."""
    llm = llm_for("llama")
    nodes: list[int] = []

    def spy(*args: object) -> tuple[torch.Tensor, torch.Tensor | None]:
        nodes.append(args[2].shape[1])
        return tree_pass(*args)

    call = CompiledPass(lambda: spy)
    outputs = []
    for prompt, compiled in ((9, None), (9, call), (8, call)):
        cache = TreeCache(llm, 1, 16, compiled)
        cache.feed_chains([list(range(3, 3 + prompt))], eager=True)
        outputs.append(cache.feed_chains([list(range(20, 27))]).logits)
        assert cache.capacity == 16
    assert nodes == [8]  # only the pass whose padding fits: 8 + 8 <= 16
    torch.testing.assert_close(outputs[1], outputs[0])


def test_a_compiled_cache_feeds_a_catch_up_past_its_room_in_parts() -> None:
    """Fed chains sit after the widest row until committed, so a row far behind (an SSM's catch-up
    after plain steps) needs about twice its text's room in one pass. A compiled cache feeds such
    chains in parts that fit and keeps its capacity (growing had met a capacity no warm-up had, and
    compiled every expected pass inside a timed run); every row holds its text, and each row's
    logits and hidden state are those after its last token, as one pass on a larger cache gives."""
    llm = llm_for("llama")
    texts = [list(range(3, 13)), [4, 5]]
    chains = [[20, 21], list(range(22, 34)), []]  # row 1: 12 tokens after the widest row's 10; row 2: none
    outputs, caches = [], []
    for capacity, compiled in ((64, None), (16, CompiledPass(lambda: tree_pass))):
        cache = TreeCache(llm, 3, capacity, compiled)
        cache.feed_chains([*texts, [6]], eager=True)
        outputs.append(cache.feed_chains(chains, output_hidden=True))
        assert cache.capacity == capacity
        caches.append(cache)
    for row, text in enumerate([texts[0] + chains[0], texts[1] + chains[1], [6]]):
        assert_row_holds(caches[1], row, llm, text)
    torch.testing.assert_close(outputs[1].logits[:2], outputs[0].logits[:2])
    torch.testing.assert_close(outputs[1].hidden[:2], outputs[0].hidden[:2])


def test_a_compiled_pass_is_warmed_at_every_smaller_row_bucket() -> None:
    """A group shrinks through the row buckets as its rows finish, but one step may finish several
    rows and skip a bucket: the first cache of (rows, capacity) to meet the call also runs every
    expected shape at each smaller bucket of that capacity, so a run that skips no bucket compiles
    nothing that a run skipping one did not (the quick suite had compiled graphs in timed runs)."""
    llm = llm_for("llama")
    rows: list[tuple[int, int]] = []

    def spy(*args: object) -> tuple[torch.Tensor, torch.Tensor | None]:
        rows.append((args[2].shape[0], args[2].shape[1]))  # rows, nodes
        return tree_pass(*args)

    call = CompiledPass(lambda: spy)
    call.expected = {PassShape(1, 1, False), PassShape(2, 2, True)}
    cache = TreeCache(llm, 3, CAPACITY_STEP, call)
    cache.feed_chains([[3, 4, 5], [6, 7], [8]], eager=True)
    cache.feed_chains([[9], [9], [9]])
    assert rows == [(4, 1), (4, 2), (2, 1), (2, 2), (1, 1), (1, 2), (4, 1)]
    assert call.met == {(4, CAPACITY_STEP), (2, CAPACITY_STEP), (1, CAPACITY_STEP)}
    cache.select([0])  # one row left: its bucket was met, nothing runs before its pass
    cache.feed_chains([[10]])
    assert rows[7:] == [(1, 1)]


def test_a_compiled_call_has_a_function_per_pass_key() -> None:
    """Each (rows, nodes, fed nodes seen, hidden, capacity) gets a function of its own, made once:
    its compiled graphs are never scanned by a pass of another key."""
    made: list[int] = []

    def make() -> Callable[..., tuple[torch.Tensor, torch.Tensor | None]]:
        made.append(len(made))
        return tree_pass

    call = CompiledPass(make)
    cache = TreeCache(llm_for("llama"), 1, CAPACITY_STEP, call)
    cache.feed_chains([[3, 4, 5]], eager=True)
    for chain in ([6], [7, 8], [9], [10, 11]):
        cache.feed_chains([chain])
    cache.feed_chains([[8] * CAPACITY_STEP], eager=True)  # grows: a new capacity
    cache.feed_chains([[12]])
    functions = call.store.functions
    capacities = [key[-1] for key in functions]
    assert len(made) == len(functions) == 3 and capacities == [CAPACITY_STEP] * 2 + [2 * CAPACITY_STEP]


@pytest.mark.parametrize("arch", ARCHS)
def test_a_first_compiled_pass_with_hidden_states_is_one_graph(arch: str) -> None:
    """A model's first pass that returns its hidden states, compiled (a one-token prompt has no
    eager prompt pass before it), must not trace transformers' installation of the hooks that
    collect them: that broke the graph and the broken function stayed for the process (on the CPU
    +0.47 ms an 8-node pass of the tiny fixture's LLM). The model returns them eagerly once first,
    and the compiled pass gives the eager pass's logits and states."""
    from torch._dynamo.utils import counters

    from specboost.decoder.compilation import own_code

    llm = ARCHITECTURES[arch](layers=1, seed=11)  # a model that never returned its hidden states
    call = CompiledPass(lambda: torch.compile(own_code(tree_pass), backend="eager", dynamic=False))
    cache, eager = TreeCache(llm, 1, CAPACITY_STEP, call), TreeCache(llm, 1, CAPACITY_STEP)
    for each in (cache, eager):
        each.feed_chains([[3, 4]], eager=True)  # allocates the K/V, returning no hidden states
    breaks = sum(counters["graph_break"].values())
    out = cache.feed_chains([[5]], output_hidden=True)
    assert sum(counters["graph_break"].values()) == breaks and call.store.hidden_ready
    expected = eager.feed_chains([[5]], output_hidden=True)
    torch.testing.assert_close(out.logits, expected.logits)
    torch.testing.assert_close(out.hidden, expected.hidden)


def test_a_compiled_call_past_its_function_limit_runs_new_keys_eagerly(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Each compiled function holds graphs (on the CPU, each its own frozen copy of the weights): past
    its limit a call runs new keys eagerly, and says so once."""
    made: list[int] = []
    call = CompiledPass(lambda: made.append(1) or tree_pass, CompiledFunctions(limit=1))
    cache = TreeCache(llm_for("llama"), 1, CAPACITY_STEP, call)
    cache.feed_chains([[3, 4, 5]], eager=True)
    with caplog.at_level(logging.WARNING, logger=kv_cache.__name__):
        for chain in ([6], [7, 8], [9, 10, 11], [12]):
            cache.feed_chains([chain])
    assert len(made) == len(call.store.functions) == 1 and call.store.full
    assert sum("run eagerly" in r.getMessage() for r in caplog.records) == 1


def test_a_small_model_keeps_more_compiled_functions() -> None:
    """A call keeps FUNCTION_WEIGHT_BYTES of frozen weights, between MIN_FUNCTIONS and MAX_FUNCTIONS
    functions: the quick fixture's learned LLM call met 132 keys at batch 8 (11 expected shapes at
    each of 4 row buckets and 3 capacities), and past a flat 64 its qa table ran eagerly."""
    tiny = torch.nn.Linear(10, 10)  # 440 bytes of weights
    assert kv_cache.function_limit(tiny) == kv_cache.MAX_FUNCTIONS
    fixture_llm = torch.nn.Embedding(600_000, 4)  # 9.6 MB, as the quick fixture's LLM
    assert kv_cache.function_limit(fixture_llm) == kv_cache.FUNCTION_WEIGHT_BYTES // 9_600_000 > 132
    large = torch.nn.Linear(1 << 15, 1 << 14, bias=False, device="meta")  # 2 GiB of float32, not allocated
    assert kv_cache.function_limit(large) == kv_cache.MIN_FUNCTIONS


def test_warm_ups_and_growths_count_as_setting_up() -> None:
    """`setup_count` moves when a cache warms the expected passes at a (rows, capacity) it had not
    met and when it grows, not on a pass that only decodes: the speculation gate and the cost
    corrections leave the steps it moved in unmeasured."""
    call = CompiledPass(lambda: tree_pass)
    call.expected = {PassShape(1, 1, False)}
    cache = TreeCache(llm_for("llama"), 1, CAPACITY_STEP, call)
    cache.feed_chains([[3, 4, 5]], eager=True)
    before = setup_count()
    cache.feed_chains([[6]])  # the first compiled pass at this capacity: a warm-up (1 row: one bucket)
    assert setup_count() == before + 1
    cache.feed_chains([[7]])  # met: decoding only
    assert setup_count() == before + 1
    cache.feed_chains([[8] * CAPACITY_STEP], eager=True)  # past the capacity: it grows
    assert cache.capacity == 2 * CAPACITY_STEP and setup_count() == before + 2


def test_a_models_cache_facts_are_read_once_and_go_with_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache is made at every call (a group's, each drafter's, each admission's): what it reads
    of the model's config is read on the model's first cache only, and not kept past the model."""
    reads: list[str] = []
    original = kv_cache.AttentionLayout.of
    monkeypatch.setattr(kv_cache.AttentionLayout, "of", lambda model: reads.append("x") or original(model))
    model = tiny_llama(layers=1, seed=3)
    caches = [TreeCache(model, rows, CAPACITY_STEP) for rows in (0, 1, 2)]
    assert len(reads) == 1 and {c.num_layers for c in caches} == {1}
    held = weakref.ref(model)
    del model, caches
    gc.collect()
    assert held() is None
