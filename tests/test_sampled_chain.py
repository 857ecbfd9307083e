"""Sampled chains drafted in compiled blocks (speculator/chain_block.py, `TreeCache.feed_sampled`):
the block's q is the SSM's distribution under the row's warpers, its tokens are exact draws from
that q (`sampling.inverse_cdf`, `draw`'s: tests/test_sampling_lossless.py), and the compiled block
draws what the uncompiled one does from the same uniform numbers. MSS verifies a draft by its own
(token, q) pairs (tests/test_sampling_lossless.py), so drafts that follow the q they carry keep
decoding lossless; the end-to-end check through a compiled decoder is there too."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from conftest import tiny_llama
from test_sampling_lossless import PROMPT, VOCAB, assert_lossless, check_decoder, exact_joint
from test_sampling_lossless import models as models  # the module's fixture
from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor

from specboost.decoder import ChainShape, SpeculativeDecoder, compilation
from specboost.speculator.batched_drafter import BatchedChainDrafter
from specboost.speculator.chain_block import chain_block
from specboost.speculator.kv_cache import MAX_SAMPLED_WARPS, CompiledPass, tree_pass
from specboost.speculator.routed_scheduler import RoutedChains
from specboost.speculator.sampling import ChainWarp, LogitsToProbs, SamplingConfig, warped_probs

CONFIGS = [
    SamplingConfig(True, 0.8),
    SamplingConfig(True, 0.8, top_k=50),
    SamplingConfig(True, 1.3, top_k=3),
    SamplingConfig(True, 0.7, top_p=0.6),
    SamplingConfig(True, 1.0, top_k=5, top_p=0.8),
]


@pytest.mark.parametrize("config", CONFIGS, ids=repr)
def test_the_warp_is_the_processors(config: SamplingConfig) -> None:
    """`warped_probs` under `ChainWarp.of(probs)` gives the probabilities `probs` (transformers'
    own warpers) gives, rows of a batch each their own."""
    probs = LogitsToProbs(config)
    warp = ChainWarp.of(probs)
    assert warp == ChainWarp(config.temperature, config.top_k, config.top_p)
    logits = torch.randn(3, 40) * 4
    got = warped_probs(logits, *warp.arguments(3, logits.device))
    torch.testing.assert_close(got, probs(logits))


def test_other_processing_has_no_warp() -> None:
    """Greedy rows, processors other than the three warpers, or the warpers out of `generate`'s
    order: no `ChainWarp` (the drafter draws those chains one pass at a time, as before)."""
    assert ChainWarp.of(LogitsToProbs(SamplingConfig(False))) is None
    penalty = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.2)])
    assert ChainWarp.of(LogitsToProbs(SamplingConfig(True, 0.8), processors=penalty)) is None
    reversed_order = LogitsProcessorList(SamplingConfig(True, 0.8, top_k=4).warpers()[::-1])
    assert ChainWarp.of(LogitsToProbs(SamplingConfig(True, 0.8), processors=reversed_order)) is None


def block_drafter(
    ssm: torch.nn.Module, probs: LogitsToProbs, rows: int = 1, ran: list[int] | None = None
) -> BatchedChainDrafter:
    """A drafter whose cache draws a chain's tokens after its first in sampled blocks of 3 where it
    has one row (uncompiled: the block's own code, on the compiled cache's padded shapes), one pass
    a token under the same warp and draws where it has more; `ran` gets the size of every sampled
    block run."""

    def sampled(*args: object) -> tuple[torch.Tensor, torch.Tensor]:
        (ran if ran is not None else []).append(args[8])
        return chain_block(*args)

    call = CompiledPass(lambda: tree_pass, make_chain=lambda: chain_block, make_sampled=lambda: sampled)
    call.expected_chains = {3}
    drafter = BatchedChainDrafter(ssm, call)
    drafter.add_sequences(rows)
    drafter.expect_sampling([probs])
    return drafter


@pytest.mark.parametrize("rows", [1, 2])
def test_sampled_chains_are_drawn_from_the_q_they_carry(models, rows: int) -> None:
    """Chains of 4 (the first token by the host, the other 3 in one block; with 2 rows, one pass a
    token drawn on the host, as before the blocks): every q a chain carries is the SSM's warped
    distribution after the chain so far, and the chains follow the SSM's exact joint distribution
    (chi-square on every prefix)."""
    ssm, config = models["ssm_a"], SamplingConfig(True, 1.3, top_k=4)
    probs, ran = LogitsToProbs(config), []
    drafter = block_drafter(ssm, probs, rows, ran)
    counts: Counter = Counter()
    torch.manual_seed(7)
    with torch.no_grad():
        for draw in range(600 // rows):
            for chain in drafter.draft([PROMPT] * rows, [4] * rows, [probs] * rows, [None] * rows):
                tokens = [t for t, _ in chain]
                counts[tuple(tokens)] += 1
                if draw < 3:
                    logits = ssm(torch.tensor([PROMPT + tokens[:-1]])).logits[0, len(PROMPT) - 1 :]
                    for (_, q), expected in zip(chain, probs(logits), strict=True):
                        torch.testing.assert_close(q, expected, atol=1e-5, rtol=1e-4)
    # Warming (at the cache's first compiled pass, in the first chain) ran the block once; one row
    # then drafts every later chain's last 3 tokens in it, 2 rows one pass a token.
    assert len(ran) == (600 if rows == 1 else 1)
    assert_lossless(counts, exact_joint(ssm, PROMPT, config, 4), f"sampled chains, {rows} rows")


def test_a_compiled_sampled_block_draws_what_the_uncompiled_one_does() -> None:
    """The compiled block (torch.compile on the CPU, as `ModelCalls` makes it) and the block's own
    code give the same tokens and q from the same uniform numbers; the blocks compile where the
    cache warms, and nothing compiles after that, whatever the chain's length (a block's slice of
    a longer chain's uniform numbers had the chain's stride, and recompiled the block)."""
    ssm = tiny_llama(layers=1, seed=3, vocab=VOCAB).float()
    probs = LogitsToProbs(SamplingConfig(True, 0.8, top_k=4))
    calls = compilation.ModelCalls(ssm.device, enabled=True)
    calls.expect_chains(ssm, 4)
    compiled = BatchedChainDrafter(ssm, calls.get(ssm))
    compiled.add_sequences(1)
    compiled.expect_sampling([probs])
    eager = block_drafter(ssm, probs)
    with torch.no_grad():
        for seed, (prompt, length) in enumerate([(PROMPT, 4), ([*PROMPT, 1, 5], 7), ([3], 4)]):
            chains = []
            for drafter in (compiled, eager):
                torch.manual_seed(seed)
                chains.append(drafter.draft([prompt], [length], [probs], [None])[0])
            assert [t for t, _ in chains[0]] == [t for t, _ in chains[1]]
            for (_, q), (_, expected) in zip(*chains, strict=True):
                torch.testing.assert_close(q, expected)
            if seed == 0:  # the first draft's catch-up warmed the cache: its blocks compiled there
                graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    assert any(key[0] == "sampled" for key in calls.get(ssm).store.functions)


@pytest.mark.slow
def test_compiled_sampled_chains_are_lossless(models) -> None:
    """A compiled decoder drafting sampled chains of 4 (3 tokens in a compiled block) keeps the
    LLM's distribution over 5 new tokens; T=1.3, top_k=4. Unseeded requests (torch's global
    stream): a seeded row draws from its own generator, one token a pass."""
    llm, ssm = (models[name].float() for name in ("llm", "ssm_a"))
    dec = SpeculativeDecoder(llm, [ssm], shape=ChainShape(4), compile=True)
    check_decoder(dec, 5, seed0=60_000, min_accepted=0.3, seeded=False, temperature=1.3, top_k=4)
    assert any(key[0] == "sampled" for key in dec.calls.get(ssm).store.functions)


def test_routed_drafters_make_their_sampled_blocks_when_rows_join() -> None:
    """Every routed drafter's sampled blocks are made where its cache warms for the rows that join,
    whether it drafts or not, so that a timed run routed otherwise than its warm-up compiles none
    (in a T = 0.8 run of the tiny fixture, `learned+compiled` with blocks compiled where a chain
    first needed them compiled 2 in timed runs: 0.09x plain decoding on one category)."""
    ssms = [tiny_llama(layers=1, seed=seed, vocab=VOCAB) for seed in (2, 3)]
    calls = {
        id(ssm): CompiledPass(
            lambda: tree_pass, make_chain=lambda: chain_block, make_sampled=lambda: chain_block
        )
        for ssm in ssms
    }
    for call in calls.values():
        call.expected_chains = {3, 7}
    chains = RoutedChains(ssms, lambda ssm: calls[id(ssm)])
    chains.add(1)
    chains.warm(40)  # greedy rows: argmax blocks only
    assert not any(key[0] == "sampled" for call in calls.values() for key in call.store.functions)
    chains.expect_sampling([LogitsToProbs(SamplingConfig(True, 0.8, top_k=4))])
    chains.warm(40)
    for call in calls.values():
        sampled = {key for key in call.store.functions if key[0] == "sampled"}
        assert {(steps, *warp) for _, _, steps, _, *warp in sampled} == {(3, 4, False), (7, 4, False)}


def test_a_call_makes_sampled_blocks_for_a_few_warps_only() -> None:
    """Each sampling setting a call expects compiles its own blocks where caches warm: past
    MAX_SAMPLED_WARPS of them, chains under a new one draw one pass a token (no compile)."""
    call = CompiledPass(lambda: tree_pass, make_chain=lambda: chain_block, make_sampled=lambda: chain_block)
    call.expected_chains = {3}
    call.met.add((1, 256))
    for top_k in range(1, MAX_SAMPLED_WARPS + 3):
        call.expect_draws(ChainWarp(0.8, top_k).key)
    assert call.expected_draws == {(top_k, False) for top_k in range(1, MAX_SAMPLED_WARPS + 1)}
    call.met.add((1, 256))
    call.expect_draws(ChainWarp(0.7, 1).key)  # an expected warp at another temperature: nothing new
    assert call.met == {(1, 256)}
