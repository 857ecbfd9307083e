"""Ragged batched speculative decoding (BASS, ALGORITHMS.md section 11) is lossless per sequence.

Greedy: every row of a left-padded batch of prompts of different lengths gets exactly the tokens
`llm.generate` gives that prompt alone (float64 tiny models, Llama / GPT-2 / OPT, whose position
ids and masks differ), for every strategy that makes sense in a batch, with sequences that stop
at EOS at different steps. Sampling: every row's output has the LLM's distribution (chi-square,
the harness of tests/test_sampling_lossless.py). And the padded KV cache itself: logits and
compaction match per-sequence forward passes.
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch
from conftest import ARCHITECTURES, VOCAB
from test_greedy_equivalence import _noisy, check_stats, independent_ssm, llm_for, reference
from test_sampling_lossless import assert_lossless, exact_joint, models  # noqa: F401 (a fixture)

from specboost.decoder import BeamShape, ChainShape, SpeculativeDecoder, SpeculativeOutput, TopologyShape
from specboost.decoder.batched import BatchedDecoder, BatchedOutput, pad_token_id
from specboost.decoder.loop import CAPACITY_HEADROOM, TARGET_CAPACITY_STEP, BatchConfig, decode
from specboost.decoder.sequence import new_sequence
from specboost.speculator.beam_search import left_pad
from specboost.speculator.kv_cache import capacity_for
from specboost.speculator.majority import MajoritySpeculator
from specboost.speculator.sampling import SamplingConfig
from specboost.speculator.sequoia import SequoiaSpeculator
from specboost.speculator.sequoia_acceptance import AcceptanceVector
from specboost.speculator.speculation import DraftRequest, PoolSpeculator
from specboost.speculator.tree import TokenTree

ARCHS = sorted(ARCHITECTURES)
PROMPT_LENGTHS = (1, 6, 3, 17)  # one-token prompt: that row's LLM cache is empty at its first step


def prompts(seed: int, lengths: tuple[int, ...] = PROMPT_LENGTHS) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def new_tokens(out: BatchedOutput, width: int, row: int) -> list[int]:
    return out.sequences[row, width : width + out.stats.sequences[row].new_tokens].tolist()


# Greedy: identical to llm.generate, row by row -------------------------------------------------------
def _sequoia(arch: str, seed: int) -> dict:
    acceptance = AcceptanceVector((0.6, 0.2, 0.1), "greedy", 100)
    return dict(speculator=SequoiaSpeculator(_noisy(0.1)(arch, seed)[0], acceptance, nodes=6))


CONFIGS = {
    "chain-batched-drafting": lambda arch, seed: dict(shape=ChainShape(3)),
    "chain-per-sequence": lambda arch, seed: dict(
        shape=ChainShape(3), batch=BatchConfig(batched_drafting=False)
    ),
    "chain-fixed-length": lambda arch, seed: dict(
        shape=ChainShape(2), batch=BatchConfig(length_controller=None)
    ),
    "pool-beam": lambda arch, seed: dict(shape=BeamShape(width=2, depth=3)),
    "pool-topology": lambda arch, seed: dict(shape=TopologyShape.from_children_counts([[2], [2, 1]])),
    "majority": lambda arch, seed: dict(
        speculator=MajoritySpeculator(_noisy(0.1, 0.3)(arch, seed), length=3)
    ),
    "sequoia": _sequoia,
}


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("arch", ARCHS)
def test_batched_greedy_equals_generate_per_sequence(arch: str, config: str) -> None:
    kwargs = CONFIGS[config](arch, 0)
    batch_config = kwargs.pop("batch", None)
    decoder = SpeculativeDecoder(llm_for(arch, 0), _noisy(0.1, 0.3)(arch, 0), **kwargs)
    rows = prompts(1)
    ids, mask = left_pad(rows, pad_id=0)
    out = BatchedDecoder(decoder, batch_config).generate(ids, mask, max_new_tokens=19, do_sample=False)
    for b, prompt in enumerate(rows):
        expected = reference(arch, 0, torch.tensor([prompt]), 19)[0, len(prompt) :].tolist()
        assert new_tokens(out, ids.shape[1], b) == expected, (arch, config, b)
        assert out.stats.sequences[b].new_tokens == 19
        check_stats(_single(out, b, ids.shape[1]), ids.shape[1], len(decoder.ssms))
    assert out.finish_reasons == ["length"] * len(rows)
    assert torch.equal(out.sequences[:, : ids.shape[1]], ids)
    assert sum(s.accepted_tokens for s in out.stats.sequences) > 0  # the tree walk goes below the root
    assert out.stats.llm_steps == max(s.llm_steps for s in out.stats.sequences)


def _single(out: BatchedOutput, row: int, width: int) -> SpeculativeOutput:
    """Row `row` as a one-sequence output, for `check_stats`."""
    sequences = out.sequences[row : row + 1, : width + out.stats.sequences[row].new_tokens]
    return SpeculativeOutput(sequences, out.stats.sequences[row], out.finish_reasons[row])


def eos_ids_for_ragged_stops(continuations: list[list[int]]) -> list[int]:
    """One or two EOS ids that stop the rows' greedy continuations at as many different steps as
    possible (a row that never meets one runs to max_new_tokens)."""

    def stops(eos: tuple[int, ...]) -> list[int | None]:
        return [next((k for k, t in enumerate(c) if t in eos), None) for c in continuations]

    tokens = sorted({t for c in continuations for t in c})
    candidates = [(t,) for t in tokens] + list(itertools.combinations(tokens, 2))
    best = max(candidates, key=lambda eos: (len(set(stops(eos))), -len(eos)))
    assert len(set(stops(best)) - {None}) >= 2, "no EOS ids end the rows at different steps"
    return list(best)


@pytest.mark.parametrize("arch", ARCHS)
def test_sequences_stop_at_eos_at_different_steps(arch: str) -> None:
    """EOS ids that the rows reach at different steps: every row equals its own `generate`,
    finished rows are padded, and the whole tensor equals `llm.generate` on the same left-padded
    batch."""
    llm = llm_for(arch, 0)
    rows = prompts(7, (4, 2, 9, 5))
    continuations = [reference(arch, 0, torch.tensor([p]), 30)[0, len(p) :].tolist() for p in rows]
    eos = eos_ids_for_ragged_stops(continuations)
    decoder = SpeculativeDecoder(llm, _noisy(0.05, 0.2)(arch, 0), shape=ChainShape(4))
    ids, mask = left_pad(rows, pad_id=0)
    out = decoder.generate(ids, attention_mask=mask, max_new_tokens=30, eos_token_id=eos, do_sample=False)
    for b, prompt in enumerate(rows):
        expected = reference(arch, 0, torch.tensor([prompt]), 30, tuple(eos))[0, len(prompt) :].tolist()
        assert new_tokens(out, ids.shape[1], b) == expected
        assert out.finish_reasons[b] == ("eos" if expected[-1] in eos else "length")
    pad = pad_token_id(decoder, frozenset(eos))
    whole = llm.generate(
        ids, attention_mask=mask, max_new_tokens=30, eos_token_id=eos, pad_token_id=pad, do_sample=False
    )
    assert out.sequences.tolist() == whole.tolist()
    assert len({s.llm_steps for s in out.stats.sequences}) > 1  # ragged finishes
    # BASS's per-token latencies: of the first and the last sequence to finish, and the mean.
    latencies, per_token = out.stats.latencies, out.stats.per_token_latencies
    at = {t: {p for t2, p in zip(latencies, per_token, strict=True) if t2 == t} for t in latencies}
    assert out.stats.per_token_latency["first"] in at[min(latencies)]
    assert out.stats.per_token_latency["last"] in at[max(latencies)]
    assert min(per_token) <= out.stats.per_token_latency["mean"] <= max(per_token)


def test_finished_rows_are_padded_with_the_requested_pad_token() -> None:
    """A `pad_token_id` option pads the finished rows, as `generate` pads them. Before, the batch
    was padded with the model's pad token or its EOS token whatever the call asked for."""
    arch = "llama"
    llm = llm_for(arch, 0)
    rows = prompts(7, (4, 2, 9, 5))
    continuations = [reference(arch, 0, torch.tensor([p]), 30)[0, len(p) :].tolist() for p in rows]
    eos = eos_ids_for_ragged_stops(continuations)
    pad = max(set(range(VOCAB)) - set(eos))
    decoder = SpeculativeDecoder(llm, _noisy(0.05, 0.2)(arch, 0), shape=ChainShape(4))
    ids, mask = left_pad(rows, pad_id=pad)
    options = {"max_new_tokens": 30, "eos_token_id": eos, "pad_token_id": pad, "do_sample": False}
    out = decoder.generate(ids, attention_mask=mask, **options)
    assert out.sequences.tolist() == llm.generate(ids, attention_mask=mask, **options).tolist()
    assert "length" in out.finish_reasons and "eos" in out.finish_reasons


@pytest.mark.parametrize("arch", ["gpt2", "opt"])  # 128 positions
def test_rows_stop_at_the_context_limit(arch: str) -> None:
    """A long prompt reaches the context limit while a short one keeps going."""
    rows = prompts(6, (118, 4))
    decoder = SpeculativeDecoder(llm_for(arch, 0), [independent_ssm(arch, 0)], shape=ChainShape(4))
    ids, mask = left_pad(rows, pad_id=0)
    out = decoder.generate(ids, attention_mask=mask, max_new_tokens=20)
    for b, (prompt, wanted) in enumerate(zip(rows, (11, 20), strict=True)):  # 118 + 11 = 129 tokens in all
        expected = reference(arch, 0, torch.tensor([prompt]), wanted)[0, len(prompt) :].tolist()
        assert new_tokens(out, ids.shape[1], b) == expected
        assert out.stats.sequences[b].new_tokens == wanted
    assert out.finish_reasons == ["length", "length"]


@pytest.mark.parametrize(("ssms", "headroom"), [(0, 0), (1, 0), (2, CAPACITY_HEADROOM)])
def test_a_groups_cache_holds_headroom_only_for_trees(ssms: int, headroom: int) -> None:
    """Every pass attends over the group cache's whole capacity: plain steps and one SSM's chains
    (never deeper than the tokens still wanted) get the rows' final length, rounded; the merged
    chains of two SSMs (a tree) get `CAPACITY_HEADROOM` more."""
    llm = llm_for("llama", 0)
    decoder = (
        SpeculativeDecoder(llm, _noisy(0.1, 0.3)("llama", 0)[:ssms], shape=ChainShape(3))
        if ssms
        else SpeculativeDecoder(llm, [], strategy="plain")
    )
    options = {"max_new_tokens": 40, "do_sample": False}
    rows = [new_sequence(decoder, torch.tensor(p), None, None, options, None) for p in prompts(3, (30, 50))]
    group = decode(decoder, rows)
    assert [len(row.new_tokens) for row in rows] == [40, 40]
    assert group.target.capacity == capacity_for(50 + 40 + headroom, TARGET_CAPACITY_STEP)


def test_batch_length_follows_bass_algorithm_1() -> None:
    """One chain length per step for the whole batch: BASS Algorithm 1 (from the chain length),
    fed with the accepted counts of every row."""
    llm = llm_for("llama", 0)
    decoder = SpeculativeDecoder(llm, [llm], shape=ChainShape(3))  # the LLM itself: all accepted
    ids, mask = left_pad(prompts(2, (3, 5)), pad_id=0)
    out = decoder.generate(ids, attention_mask=mask, max_new_tokens=30)
    assert out.stats.lengths[:3] == [3, 5, 7]  # every draft accepted: l <- l + 2
    for b in range(2):
        assert out.stats.sequences[b].acceptance_rate == 1.0


def test_batch_of_one_row_and_reuse() -> None:
    """`BatchedDecoder` with one row equals the one-sequence decoder; a decoder serves a batch,
    then a single prompt, then the batch again with the same result."""
    llm = llm_for("llama", 1)
    decoder = SpeculativeDecoder(llm, _noisy(0.1)("llama", 1), shape=ChainShape(3))
    rows = prompts(4, (5, 2, 8))
    ids, mask = left_pad(rows, pad_id=0)
    first = decoder.generate(ids, attention_mask=mask, max_new_tokens=12)
    single = decoder.generate(torch.tensor([rows[1]]), max_new_tokens=12)
    again = decoder.generate(ids, attention_mask=mask, max_new_tokens=12)
    assert first.sequences.tolist() == again.sequences.tolist()
    assert new_tokens(first, ids.shape[1], 1) == single.sequences[0, 2:].tolist()
    one = BatchedDecoder(decoder).generate(torch.tensor([rows[1]]), max_new_tokens=12)
    assert one.sequences.tolist() == single.sequences.tolist()


def test_batched_options_are_checked() -> None:
    decoder = SpeculativeDecoder(llm_for("llama", 0), [independent_ssm("llama", 0)])
    with pytest.raises(TypeError, match="unknown generation options"):
        BatchedDecoder(decoder).generate(torch.ones(2, 3, dtype=torch.long), max_new_tokens=2, top_n=3)
    with pytest.raises(ValueError, match="num_beams"):
        BatchedDecoder(decoder).generate(torch.ones(2, 3, dtype=torch.long), num_beams=2)
    with pytest.raises(ValueError, match="the prompt is empty"):
        decoder.generate(
            torch.ones(2, 3, dtype=torch.long), torch.tensor([[0, 0, 0], [1, 1, 1]]), max_new_tokens=2
        )


# Sampling: every row has the LLM's distribution ---------------------------------------------------
SAMPLES = 500
BATCH_PROMPTS = [[0, 4, 2], [3], [1, 5, 5, 2, 0]]


def sample_rows(
    decoder: SpeculativeDecoder, max_new_tokens: int, seed0: int, **sampling
) -> tuple[list[Counter], float]:
    ids, mask = left_pad(BATCH_PROMPTS, pad_id=0)
    counts: list[Counter] = [Counter() for _ in BATCH_PROMPTS]
    accepted = 0
    for seed in range(seed0, seed0 + SAMPLES):
        out = decoder.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            do_sample=True,
            seed=seed,
            eos_token_id=None,
            **sampling,
        )
        for b, count in enumerate(counts):
            count[tuple(new_tokens(out, ids.shape[1], b))] += 1
        accepted += sum(s.accepted_tokens for s in out.stats.sequences)
    return counts, accepted / SAMPLES / len(BATCH_PROMPTS)


@pytest.mark.parametrize(
    ("name", "kwargs", "sampling"),
    [
        ("mss-chains-two-ssms", dict(shape=ChainShape(2)), dict(temperature=1.3, top_p=0.9)),
        (
            "target-beam",
            dict(shape=BeamShape(width=2, depth=2), rule="target"),
            dict(temperature=0.7, top_k=4),
        ),
    ],
)
def test_batched_sampling_is_lossless_per_row(models, name: str, kwargs: dict, sampling: dict) -> None:  # noqa: F811
    ssms = [models["ssm_a"], models["ssm_b"]] if name.startswith("mss") else [models["ssm_b"]]
    decoder = SpeculativeDecoder(models["llm"], ssms, **kwargs)
    counts, accepted = sample_rows(decoder, 3, seed0=70_000, **sampling)
    config = SamplingConfig(do_sample=True, **sampling)
    for b, prompt in enumerate(BATCH_PROMPTS):
        assert_lossless(counts[b], exact_joint(models["llm"], prompt, config, 3), f"{name} row {b}")
    assert accepted > 0.3, f"only {accepted:.3f} drafts accepted per row and call"


SEEN: list[tuple[list[int], torch.Tensor | None]] = []  # module level: shared by every row's copy


class HiddenRecorder(PoolSpeculator):
    """A pool that asks for the LLM's hidden state (as the learned scheduler does) and records it."""

    def __init__(self, ssms: list, shape: ChainShape) -> None:
        super().__init__(ssms, shape)
        self.wants_hidden = True

    def propose(self, request: DraftRequest) -> TokenTree:
        SEEN.append((list(request.verified), request.hidden))
        return super().propose(request)


def test_strategies_that_want_it_get_each_rows_llm_state() -> None:
    """Per row: the LLM's last-layer state at the token before the root, as in one-sequence
    decoding, from the first step on (the LLM reads the prompts before the first draft); None
    only for a one-token prompt's first step."""
    SEEN.clear()
    llm = llm_for("llama", 0)
    ssms = _noisy(0.1)("llama", 0)
    decoder = SpeculativeDecoder(llm, ssms, speculator=HiddenRecorder(ssms, ChainShape(3)))
    rows = [*prompts(9, (4, 7, 2)), [5]]
    ids, mask = left_pad(rows, pad_id=0)
    decoder.generate(ids, attention_mask=mask, max_new_tokens=10)
    assert [hidden is None for verified, hidden in SEEN if verified in rows] == [False, False, False, True]
    later = [(verified, hidden) for verified, hidden in SEEN if len(verified) > 1]
    assert len(later) >= len(rows)
    for verified, hidden in later:
        expected = llm(torch.tensor([verified[:-1]]), output_hidden_states=True).hidden_states[-1][0, -1]
        torch.testing.assert_close(hidden, expected)
