"""A pool of SSMs of one architecture run as one stacked model: every member's rows get exactly
that member's logits, on the whole architecture matrix, through the decoder's own tree passes;
pools that cannot be stacked say why."""

from __future__ import annotations

import pytest
import torch
from conftest import noisy_copy, tiny_gpt2, tiny_llama
from test_architectures import ARCHS, models

from specboost.decoder import ChainShape, SpeculativeDecoder
from specboost.speculator.drafter import PoolDrafter
from specboost.speculator.kv_cache import TreeCache
from specboost.speculator.sampling import LogitsToProbs, SamplingConfig
from specboost.speculator.speculation import pool_drafters
from specboost.speculator.stacked_pool import StackedLeaf, stack_pool, why_not_stackable
from specboost.speculator.tree import DraftKind


def pool_of(arch: str, members: int = 3) -> list[torch.nn.Module]:
    llm, _ = models(arch)
    return [noisy_copy(llm, scale=0.3, seed=10 + i) for i in range(members)]


@pytest.mark.parametrize("arch", ARCHS)
def test_stacked_rows_equal_each_members_own_tree_passes(arch: str) -> None:
    """A prompt, then a tree level fed as pending nodes, over 2 sequences x 3 members: every row's
    logits equal its member's own cache's (float64)."""
    ssms = pool_of(arch)
    pooled = stack_pool(ssms)
    prompts = [[3, 9, 4, 1, 7, 2, 8, 5, 6], [11, 12, 13, 14]]
    rows = [prompt for _ in ssms for prompt in prompts]  # member-major
    stacked = TreeCache(pooled, len(rows), 128)
    got = stacked.feed_chains(rows).logits
    singles = [TreeCache(ssm, len(prompts), 128) for ssm in ssms]
    want = torch.cat([cache.feed_chains(prompts).logits for cache in singles])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    tokens = torch.tensor([[20, 21, 22]] * len(rows))
    visible = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool).expand(len(rows), 3, 3)
    lengths = torch.tensor(stacked.lengths)[:, None]
    depths = torch.tensor([0, 1, 1])
    got = stacked.feed(tokens, lengths + depths, visible).logits
    want = torch.cat(
        [
            cache.feed(
                tokens[: len(prompts)], torch.tensor(cache.lengths)[:, None] + depths, visible[:2]
            ).logits
            for cache in singles
        ]
    )
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


def test_norms_that_scale_elementwise_run_once_for_the_whole_pool() -> None:
    """Llama's RMS norms broadcast their stacked weights (no vmap); GPT-2's layer norms need vmap."""
    llama = stack_pool(pool_of("llama"))
    leaves = [m for m in llama.modules() if isinstance(m, StackedLeaf)]
    assert leaves and all(leaf.broadcasts for leaf in leaves)
    gpt2 = stack_pool(pool_of("gpt2"))
    assert not any(m.broadcasts for m in gpt2.modules() if isinstance(m, StackedLeaf))


def test_pools_that_cannot_be_stacked_say_why() -> None:
    llama, gpt2 = tiny_llama(seed=1), tiny_gpt2(seed=1)
    assert why_not_stackable([llama]) == "a single SSM"
    assert "GPT2LMHeadModel" in why_not_stackable([llama, gpt2])
    assert "float32" in why_not_stackable([llama, tiny_llama(seed=2).float()])
    assert "configuration" in why_not_stackable([llama, tiny_llama(layers=3)])
    assert why_not_stackable([llama, tiny_llama(seed=2)]) is None
    with pytest.raises(ValueError, match="cannot be stacked: SSM 1 is a GPT2LMHeadModel"):
        stack_pool([llama, gpt2])


@pytest.mark.parametrize("strategy", ["pool", "majority"])
def test_the_decoder_drafts_every_level_of_a_stacked_pool_in_one_pass(strategy: str) -> None:
    """Three SSMs of one architecture: greedy output equals generate, and a step's chains of 4 take
    4 drafting levels (the catch-up pass and 3 more), whatever the number of SSMs."""
    llm, _ = models("llama")
    ssms = pool_of("llama")
    decoder = SpeculativeDecoder(llm, ssms, shape=ChainShape(4), strategy=strategy)
    assert all(drafter.stacked for drafter in pool_drafters(decoder.speculator))
    ids = torch.tensor([[3, 9, 4, 1, 7]])
    out = decoder.generate(ids, max_new_tokens=24)
    assert out.sequences.tolist() == llm.generate(ids, do_sample=False, max_new_tokens=24).tolist()
    assert out.stats.draft_levels <= 4 * out.stats.llm_steps
    assert out.stats.draft_levels >= 4 * (out.stats.llm_steps - 2)  # shorter chains near the end only


@pytest.mark.parametrize("stack", [True, False], ids=["stacked", "one_by_one"])
def test_several_sampled_chains_per_ssm_draw_from_their_own_q(stack: bool) -> None:
    """ChainShape(3, samples=3) for a pool of 3: every SSM's tree holds its 3 chains of 3 (chain j's
    proposals carry draw index j along one root-to-leaf path), every proposal's q is that SSM's
    own distribution after the node's text (a plain forward pass), and the pool drafts in 3
    levels however many chains it draws (chains through one node share its scores)."""
    ssms = pool_of("llama")
    drafter = PoolDrafter(ssms, stack=stack)
    assert drafter.stacked == stack
    probs = LogitsToProbs(SamplingConfig(do_sample=True, temperature=1.5))
    verified = [3, 9, 4, 1, 7]
    generators = [torch.Generator().manual_seed(i + 2) for i in range(len(ssms))]
    trees = drafter.draft(verified, [ChainShape(3, samples=3)] * len(ssms), probs, 8, generators)
    assert drafter.levels == 3
    assert min(len(tree) for tree in trees) < 1 + 3 * 3  # some chains share a node (these seeds)
    for i, (model, tree) in enumerate(zip(ssms, trees, strict=True)):
        assert tree.kind is DraftKind.SAMPLED and len(tree) <= 1 + 3 * 3
        for draw in range(3):
            path = [u for u in range(1, len(tree)) if any(prop.draw == draw for prop in tree.proposals[u])]
            assert [tree.depths[u] for u in path] == [1, 2, 3] and tree.path_to(path[-1]) == path
        for u in range(1, len(tree)):
            text = verified + [tree.tokens[v] for v in tree.path_to(tree.parents[u])]
            with torch.no_grad():
                want = torch.softmax(model(torch.tensor([text])).logits[0, -1].double() / 1.5, -1)
            for proposal in tree.proposals[u]:
                assert proposal.ssm == i
                torch.testing.assert_close(proposal.q.double(), want, rtol=0, atol=1e-6)
