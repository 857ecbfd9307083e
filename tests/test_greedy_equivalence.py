"""Greedy speculative decoding reproduces `llm.generate(do_sample=False)` token for token.

Everything runs in float64 on tiny random models (conftest), for every architecture in
`conftest.ARCHITECTURES` and every way of drafting: chains, beam trees, merged trees of an SSM
pool, fixed topologies and Stairs validation (ALGORITHMS.md sections 1-3 and 12).

SSMs are mostly noisy copies of the LLM, so that drafts are partly accepted and the tree walk,
the KV compaction and the SSM cache sync are all exercised (a random SSM next to a random LLM
almost never agrees with it).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch
from conftest import ARCHITECTURES, VOCAB, noisy_copy
from transformers import PreTrainedModel

from specboost.decoder import BeamShape, ChainShape, SpeculativeDecoder, SpeculativeOutput, TopologyShape

ARCHS = sorted(ARCHITECTURES)

# (LLM seed, prompt seed, prompt length, max_new_tokens): prompt length 1 means an empty LLM
# cache at the first step; max_new_tokens not a multiple of the draft length exercises the
# depth clamp of the last step.
CASES = [(0, 0, 1, 24), (1, 1, 3, 19), (0, 2, 8, 24), (1, 3, 17, 21)]


# Models and references (cached: building and generating dominate the runtime) --------------------
@functools.cache
def llm_for(arch: str, seed: int) -> PreTrainedModel:
    return ARCHITECTURES[arch](layers=2, seed=seed)


@functools.cache
def independent_ssm(arch: str, seed: int) -> PreTrainedModel:
    """A separately initialised one-layer model of the same architecture and vocabulary."""
    return ARCHITECTURES[arch](layers=1, seed=1000 + seed)


@functools.cache
def noisy_ssm(arch: str, llm_seed: int, scale: float, seed: int) -> PreTrainedModel:
    """The LLM with Gaussian noise (relative to each tensor's spread) added to every weight."""
    return noisy_copy(llm_for(arch, llm_seed), scale, seed)


def prompt_ids(seed: int, length: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (1, length), generator=gen)


@functools.cache
def _reference(arch: str, llm_seed: int, prompt: tuple[int, ...], max_new_tokens: int, eos: int | None):
    ids = torch.tensor([prompt])
    # An explicit all-ones mask: without it generate() masks prompt tokens equal to the pad id (OPT).
    return llm_for(arch, llm_seed).generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos,
        pad_token_id=0,
    )


def reference(
    arch: str, llm_seed: int, ids: torch.Tensor, max_new_tokens: int, eos: int | None = None
) -> torch.Tensor:
    return _reference(arch, llm_seed, tuple(ids[0].tolist()), max_new_tokens, eos)


def check_stats(out: SpeculativeOutput, prompt_length: int, num_ssms: int) -> None:
    """Internal consistency of DecodeStats (ALGORITHMS.md section 13)."""
    s = out.stats
    assert s.new_tokens == out.sequences.shape[1] - prompt_length
    assert s.llm_steps == len(s.match_lengths) >= 1
    assert s.accepted_tokens == sum(s.match_lengths) <= s.draft_tokens
    # Every step emits its accepted drafts plus one LLM token, unless a stop truncates the last one.
    if out.finish_reason == "length":
        assert s.new_tokens == s.accepted_tokens + s.llm_steps
    else:
        assert s.llm_steps <= s.new_tokens <= s.accepted_tokens + s.llm_steps
    assert s.tokens_per_step == pytest.approx(s.new_tokens / s.llm_steps)
    assert 0.0 <= s.acceptance_rate <= 1.0
    assert set(s.proposed_per_ssm) <= set(range(num_ssms))
    assert set(s.accepted_per_ssm) <= set(s.proposed_per_ssm)
    # Every drafted node was proposed by at least one SSM; every accepted node too.
    assert sum(s.proposed_per_ssm.values()) >= s.draft_tokens
    assert sum(s.accepted_per_ssm.values()) >= s.accepted_tokens
    for i, rate in s.acceptance_rate_per_ssm.items():
        assert 0.0 <= rate <= 1.0
        assert s.accepted_per_ssm.get(i, 0) <= s.proposed_per_ssm[i] <= s.draft_tokens
        assert s.accepted_per_ssm.get(i, 0) <= s.accepted_tokens
    if num_ssms == 1:
        assert s.proposed_per_ssm.get(0, 0) == s.draft_tokens
        assert s.accepted_per_ssm.get(0, 0) == s.accepted_tokens
    assert s.time_total >= 0 and s.time_draft >= 0 and s.time_verify >= 0


# The drafting configurations ----------------------------------------------------------------------
SSMFactory = Callable[[str, int], list[PreTrainedModel]]


def _noisy(*scales: float) -> SSMFactory:
    return lambda arch, seed: [noisy_ssm(arch, seed, s, i) for i, s in enumerate(scales)]


CONFIGS: dict[str, tuple[SSMFactory, dict]] = {
    "chain": (_noisy(0.1), dict(shape=ChainShape(4))),
    "chain-independent-ssm": (lambda arch, seed: [independent_ssm(arch, seed)], dict(shape=ChainShape(3))),
    "chain-length-1": (_noisy(0.2), dict(shape=ChainShape(1))),
    "beam": (_noisy(0.1), dict(shape=BeamShape(width=2, depth=3))),
    "pool-chain-3-ssms": (
        lambda arch, seed: [*_noisy(0.05, 0.3)(arch, seed), independent_ssm(arch, seed)],
        dict(shape=ChainShape(3)),
    ),
    "pool-beam-2-ssms": (_noisy(0.1, 0.3), dict(shape=BeamShape(width=3, depth=2))),
    "topology": (_noisy(0.1), dict(shape=TopologyShape.from_children_counts([[3], [2, 1, 0], [1, 1, 0]]))),
    "pool-topology-2-ssms": (
        _noisy(0.1, 0.3),
        dict(shape=TopologyShape.from_children_counts([[2], [2, 1], [1, 0, 1]])),
    ),
    "stairs": (_noisy(0.1), dict(shape=ChainShape(4), verification="stairs")),
    "stairs-default-shape": (_noisy(0.3), dict(verification="stairs")),
}


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_output_identical_to_generate(arch: str, config: str) -> None:
    make_ssms, kwargs = CONFIGS[config]
    accepted_somewhere = False
    for llm_seed, prompt_seed, length, max_new in CASES:
        ssms = make_ssms(arch, llm_seed)
        decoder = SpeculativeDecoder(llm_for(arch, llm_seed), ssms, **kwargs)
        ids = prompt_ids(prompt_seed, length)
        out = decoder.generate(ids, max_new_tokens=max_new, do_sample=False)
        expected = reference(arch, llm_seed, ids, max_new)
        assert out.sequences.tolist() == expected.tolist(), (arch, config, llm_seed, length)
        assert out.finish_reason == "length"
        assert out.stats.new_tokens == max_new
        check_stats(out, length, len(ssms))
        accepted_somewhere |= out.stats.accepted_tokens > 0
    if config != "chain-independent-ssm":
        # Noisy copies of the LLM: the verification walk really goes below the root.
        assert accepted_somewhere


@pytest.mark.parametrize("arch", ARCHS)
def test_decoder_is_reusable_and_deterministic(arch: str) -> None:
    """generate() resets all per-sequence state: two prompts in a row, then the first again."""
    decoder = SpeculativeDecoder(llm_for(arch, 0), _noisy(0.1, 0.2)(arch, 0), shape=BeamShape(2, 3))
    first, second = prompt_ids(10, 5), prompt_ids(11, 9)
    out1 = decoder.generate(first, max_new_tokens=20)
    out2 = decoder.generate(second, max_new_tokens=20)
    out3 = decoder.generate(first, max_new_tokens=20)
    assert out1.sequences.tolist() == reference(arch, 0, first, 20).tolist()
    assert out2.sequences.tolist() == reference(arch, 0, second, 20).tolist()
    assert out3.sequences.tolist() == out1.sequences.tolist()
    assert out3.stats.match_lengths == out1.stats.match_lengths


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("verification", ["tree", "stairs"])
def test_single_new_token(arch: str, verification: str) -> None:
    """max_new_tokens=1: nothing is drafted, the LLM's own token is the whole output."""
    decoder = SpeculativeDecoder(llm_for(arch, 0), _noisy(0.1)(arch, 0), verification=verification)
    ids = prompt_ids(5, 4)
    out = decoder.generate(ids, max_new_tokens=1)
    assert out.sequences.tolist() == reference(arch, 0, ids, 1).tolist()
    assert (out.stats.llm_steps, out.stats.draft_tokens, out.stats.new_tokens) == (1, 0, 1)
    assert out.finish_reason == "length"


@pytest.mark.parametrize("arch", ["gpt2", "opt"])  # both have 128 positions
def test_generation_stops_at_the_context_limit(arch: str) -> None:
    """Drafts never go past the model's context; the last token comes from the logits at the last
    position (129 tokens in all, as with generate), whatever the drafts."""
    llm = llm_for(arch, 0)
    ids = prompt_ids(6, 118)
    expected = reference(arch, 0, ids, 11)
    assert expected.shape[1] == 129
    for ssms in ([llm], _noisy(0.1)(arch, 0), [independent_ssm(arch, 0)]):
        decoder = SpeculativeDecoder(llm, ssms, shape=ChainShape(4))
        out = decoder.generate(ids, max_new_tokens=11)
        assert out.sequences.tolist() == expected.tolist()
        too_long = decoder.generate(ids, max_new_tokens=40)
        assert too_long.sequences.tolist() == expected.tolist()
        assert too_long.finish_reason == "length"
        check_stats(too_long, 118, 1)


# EOS in the middle of a speculation ---------------------------------------------------------------
def _eos_position(continuation: list[int]) -> int | None:
    """A position k >= 1 whose token first occurs at k, so generation with eos=continuation[k]
    stops exactly after k+1 tokens; prefers a position inside a 5-token (chain of 4 + 1) step."""
    candidates = [k for k in range(1, len(continuation)) if continuation[k] not in continuation[:k]]
    inside = [k for k in candidates if k % 5 != 4]
    return (inside or candidates or [None])[0]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("ssm_kind", ["llm-itself", "noisy", "pool"])
def test_eos_mid_speculation(arch: str, ssm_kind: str) -> None:
    llm = llm_for(arch, 0)
    ssms = {"llm-itself": [llm], "noisy": _noisy(0.1)(arch, 0), "pool": _noisy(0.05, 0.2)(arch, 0)}[ssm_kind]
    decoder = SpeculativeDecoder(llm, ssms, shape=ChainShape(4))
    checked = 0
    for prompt_seed in range(20, 40):
        ids = prompt_ids(prompt_seed, 3)
        continuation = reference(arch, 0, ids, 30)[0, 3:].tolist()
        k = _eos_position(continuation)
        if k is None:
            continue
        eos = continuation[k]
        expected = reference(arch, 0, ids, 30, eos)
        assert expected[0, -1].item() == eos and expected.shape[1] == 3 + k + 1
        out = decoder.generate(ids, max_new_tokens=30, eos_token_id=eos)
        assert out.sequences.tolist() == expected.tolist()
        assert out.finish_reason == "eos"
        assert out.stats.new_tokens == k + 1
        check_stats(out, 3, len(ssms))
        if ssm_kind == "llm-itself" and k % 5 != 4:
            # The EOS was an accepted draft with more accepted drafts after it: truncated.
            assert out.stats.accepted_tokens + out.stats.llm_steps > out.stats.new_tokens
        # A list of EOS ids, like generate's: the first one produced wins.
        unused = next(t for t in range(VOCAB) if t not in continuation[: k + 1])
        out_list = decoder.generate(ids, max_new_tokens=30, eos_token_id=[unused, eos])
        assert out_list.sequences.tolist() == expected.tolist()
        assert out_list.finish_reason == "eos"
        checked += 1
        if checked == 2:
            break
    assert checked >= 1, "no prompt produced a usable EOS position"


# Degenerate SSMs ----------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(("length", "verification"), [(1, "tree"), (3, "tree"), (5, "tree"), (3, "stairs")])
def test_ssm_identical_to_llm_accepts_every_draft(arch: str, length: int, verification: str) -> None:
    llm = llm_for(arch, 1)
    decoder = SpeculativeDecoder(llm, [llm], shape=ChainShape(length), verification=verification)
    for prompt_seed, prompt_length in [(7, 1), (8, 6)]:
        ids = prompt_ids(prompt_seed, prompt_length)
        steps = 4
        max_new = steps * (length + 1)
        out = decoder.generate(ids, max_new_tokens=max_new)
        assert out.sequences.tolist() == reference(arch, 1, ids, max_new).tolist()
        assert out.stats.acceptance_rate == 1.0
        assert out.stats.tokens_per_step == length + 1
        assert out.stats.llm_steps == steps
        assert out.stats.match_lengths == [length] * steps
        check_stats(out, prompt_length, 1)
        # Not a multiple: the last step drafts only what is still wanted, and all of it is accepted.
        out = decoder.generate(ids, max_new_tokens=max_new + 2)
        assert out.sequences.tolist() == reference(arch, 1, ids, max_new + 2).tolist()
        assert out.stats.acceptance_rate == 1.0
        assert out.stats.llm_steps == steps + 1
        assert out.stats.match_lengths == [length] * steps + [1]


def always_wrong_ssm(arch: str, avoid: set[int]) -> PreTrainedModel:
    """A real causal LM of `arch` whose logits are pinned (a hook on its output layer) so that its
    top tokens, in order, are tokens outside `avoid`; every other token ranks below them."""
    model = ARCHITECTURES[arch](layers=1, seed=77)
    allowed = [t for t in range(VOCAB) if t not in avoid]
    assert len(allowed) >= 3
    fixed = torch.full((VOCAB,), -1000.0, dtype=torch.float64)
    for rank, token in enumerate(allowed):
        fixed[token] = 100.0 - rank
    model.get_output_embeddings().register_forward_hook(lambda module, args, output: output * 0 + fixed)
    return model


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(
    "kwargs",
    [
        dict(shape=ChainShape(4)),
        dict(shape=BeamShape(width=3, depth=2)),
        dict(shape=TopologyShape.from_children_counts([[3], [1, 1, 1]])),
        dict(shape=ChainShape(3), verification="stairs"),
    ],
    ids=["chain", "beam", "topology", "stairs"],
)
def test_always_wrong_ssm_accepts_nothing(arch: str, kwargs: dict) -> None:
    llm = llm_for(arch, 0)
    for prompt_seed, length in [(12, 1), (13, 5)]:
        ids = prompt_ids(prompt_seed, length)
        expected = reference(arch, 0, ids, 20)
        greedy_tokens = set(expected[0, length:].tolist())  # the only tokens the LLM ever accepts here
        ssm = always_wrong_ssm(arch, greedy_tokens)
        ssms = [ssm] if kwargs.get("verification") == "stairs" else [ssm, ssm]
        out = SpeculativeDecoder(llm, ssms, **kwargs).generate(ids, max_new_tokens=20)
        assert out.sequences.tolist() == expected.tolist()
        assert out.stats.draft_tokens > 0
        assert out.stats.accepted_tokens == 0
        assert out.stats.acceptance_rate == 0.0
        assert out.stats.tokens_per_step == 1.0
        assert out.stats.llm_steps == 20
        assert all(rate == 0.0 for rate in out.stats.acceptance_rate_per_ssm.values())
        check_stats(out, length, len(ssms))
