"""The decoder on CUDA (marker `gpu`; `pytest -m gpu` on a machine with a GPU, skipped elsewhere):
greedy output equals `llm.generate` in float32 for every draft shape, strategy, rule and batch
size, eager and compiled, and sampling keeps the LLM's distribution (chi-square against the
exact distribution of a tiny-vocabulary model, computed on the GPU)."""

from __future__ import annotations

import copy
import functools
from collections import Counter

import pytest
import torch
from conftest import noisy_copy, tiny_llama
from test_generation_options import generate_distribution
from test_sampling_lossless import ALPHA, gof_pvalue, marginal, spread
from test_scheduler import DEPTHS, FAVOURS_SSM_0, SPECULATE, VERIFY, WIDTHS, constant_predictor, cost_table

from specboost.decoder import BeamShape, ChainShape, SpeculativeDecoder, StrategyOptions, TopologyShape
from specboost.decoder.profiler import ProfileConfig, profile
from specboost.speculator.sequoia_acceptance import AcceptanceVector

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
DEVICE = "cuda"
TOPOLOGY = TopologyShape.from_children_counts([[2], [2, 1], [1, 0, 0]])
SEQUOIA = StrategyOptions(acceptance=AcceptanceVector((0.6, 0.2, 0.1), "greedy", 100), nodes=6)
CONFIGS = {
    "chain": dict(shape=ChainShape(4)),
    "beam": dict(shape=BeamShape(2, 3)),
    "topology": dict(shape=TOPOLOGY),
    "stairs": dict(shape=ChainShape(3), verification="stairs"),
    "majority": dict(shape=ChainShape(3), strategy="majority"),
    "pruned": dict(shape=BeamShape(2, 3), strategy="pruned"),
    "sequoia": dict(strategy="sequoia", strategy_options=SEQUOIA),
    "minions": dict(shape=ChainShape(3), length_controller="minions"),
    # The routed scheduler (ALGORITHMS.md 5.3) on a made-up profile that makes drafting pay.
    "learned": dict(
        strategy="learned",
        predictor=constant_predictor(FAVOURS_SSM_0),
        cost_model=cost_table(2, VERIFY, SPECULATE),
    ),
}
PROMPTS = [[3, 17, 42, 8, 8, 51, 23, 9, 30], [12, 5, 60]]


@functools.cache
def greedy_models() -> tuple[torch.nn.Module, list[torch.nn.Module]]:
    llm = tiny_llama(layers=2, seed=0).float()
    ssms = [noisy_copy(llm, 0.1, seed=1), noisy_copy(llm, 0.3, seed=2)]
    return llm.to(DEVICE), [ssm.to(DEVICE) for ssm in ssms]


def reference(prompt: list[int]) -> list[int]:
    llm, _ = greedy_models()
    ids = torch.tensor([prompt], device=DEVICE)
    out = llm.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=20)
    return out[0].tolist()


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_greedy_equals_generate_in_float32(config: str, compiled: bool) -> None:
    llm, ssms = greedy_models()
    pool = ssms[:1] if config in ("stairs", "sequoia") else ssms
    dec = SpeculativeDecoder(llm, pool, compile=compiled, **CONFIGS[config])
    for prompt in PROMPTS:
        out = dec.generate(torch.tensor([prompt], device=DEVICE), max_new_tokens=20)
        assert out.sequences.device.type == "cuda"
        assert out.sequences[0].tolist() == reference(prompt), f"{config} (compiled={compiled})"
    if config == "stairs":
        return
    width = max(map(len, PROMPTS))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS], device=DEVICE)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS], device=DEVICE)
    batch = dec.generate(ids, attention_mask=mask, max_new_tokens=20)
    for row, prompt in enumerate(PROMPTS):
        assert batch.sequences[row, width : width + 20].tolist() == reference(prompt)[len(prompt) :]


SAMPLE_VOCAB, SAMPLE_PROMPT, SAMPLES = 6, [0, 4, 2], 600
SAMPLED = {
    "mss-chain": (dict(shape=ChainShape(2)), 2, dict(temperature=0.8, top_k=4)),
    "without-replacement": (
        dict(shape=TopologyShape.from_children_counts([[3], [1, 1, 0]])),
        1,
        dict(top_p=0.9),
    ),
    "target-beam": (dict(shape=BeamShape(2, 2), rule="target"), 1, dict(temperature=1.3)),
}


@functools.cache
def sampling_models() -> tuple[torch.nn.Module, list[torch.nn.Module]]:
    llm = spread(tiny_llama(layers=2, seed=1, vocab=SAMPLE_VOCAB)).float().to(DEVICE)
    ssms = [spread(tiny_llama(layers=1, seed=s, vocab=SAMPLE_VOCAB)).float().to(DEVICE) for s in (2, 3)]
    return llm, ssms


@pytest.mark.parametrize("case", sorted(SAMPLED))
def test_sampling_keeps_the_distribution_on_cuda(case: str) -> None:
    kwargs, num_ssms, options = SAMPLED[case]
    llm, ssms = sampling_models()
    dec = SpeculativeDecoder(llm, ssms[:num_ssms], **kwargs)
    counts: Counter = Counter()
    for seed in range(SAMPLES):
        out = dec.generate(
            torch.tensor([SAMPLE_PROMPT], device=DEVICE),
            max_new_tokens=2,
            do_sample=True,
            seed=seed,
            **options,
        )
        counts[tuple(out.sequences[0, len(SAMPLE_PROMPT) :].tolist())] += 1
    exact = generate_distribution(options, 2, llm, SAMPLE_PROMPT)
    assert gof_pvalue(marginal(counts, 2), exact) >= ALPHA


@pytest.mark.parametrize("compiled", [False, True])
def test_profile_measures_the_chain_tables_on_cuda(compiled: bool) -> None:
    """The routed scheduler's chain tables (section 5.3) are measured with tensors on the models'
    device, eager and with CUDA graphs."""
    llm, ssms = greedy_models()
    config = ProfileConfig(
        WIDTHS, DEPTHS, (1, 4), prefix_length=8, repeats=1, batch_sizes=(1, 2), compile=compiled
    )
    cost = profile(llm, ssms, config, show_progress=False)
    assert cost.has_chain_costs and cost.has_compiled_chain_costs == compiled
    assert min(min(row) for row in cost.chain_verify_seconds) > 0


def test_seeded_chains_are_coupled_to_the_target_rule_on_cuda() -> None:
    """A seeded row's chains take the target rule's own exponential noise from a copy of the
    row's CUDA stream (ALGORITHMS.md 5.3, "Seeded rows"): drafted by a copy of the LLM, (nearly)
    every token is accepted, and the text is plain seeded decoding's."""
    llm, _ = greedy_models()
    decoder = SpeculativeDecoder(
        llm, [copy.deepcopy(llm), noisy_copy(llm, 0.3, seed=2)], **CONFIGS["learned"]
    )
    plain = SpeculativeDecoder(llm, [], strategy="plain")
    options = dict(max_new_tokens=24, do_sample=True, temperature=0.8)
    for seed, prompt in enumerate(PROMPTS):
        ids = torch.tensor([prompt], device=DEVICE)
        out = decoder.generate(ids, seed=seed, **options)
        assert out.sequences.tolist() == plain.generate(ids, seed=seed, **options).sequences.tolist()
        proposed, accepted = out.stats.proposed_per_ssm[0], out.stats.accepted_per_ssm[0]
        assert proposed >= 8 and accepted >= 0.9 * proposed
