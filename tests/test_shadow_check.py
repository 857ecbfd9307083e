"""Shadow checks (ALGORITHMS.md 5.4, "Shadow checks"): before a trial of the router, the gate has the
SSM a hold drafts walk its greedy chains along the text plain decoding produced, and tries the
router only where that walk says it would now beat plain decoding."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import VOCAB, tiny_llama
from hypothesis import given, settings
from hypothesis import strategies as st
from test_speculation_gate import drafting_exactly, drafting_in_vain, run, simulate

from specboost.speculator.batched_drafter import BatchedChainDrafter
from specboost.speculator.chain_router import PreferredAction, held_run
from specboost.speculator.hindsight_walk import Walk, run_lengths, walk
from specboost.speculator.routed_scheduler import GREEDY, SAMPLED
from specboost.speculator.speculation_gate import (
    CHECK_MARGIN,
    CHECK_SHARE,
    MAX_STREAK,
    SpeculationGate,
    Throughput,
)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.booleans(), max_size=40), max_size=4), st.integers(1, 9))
def test_a_walk_is_chain_decoding_along_the_text(agreements: list[list[bool]], length: int) -> None:
    """Each step accepts the run of agreements from its position, at most `length`, then takes the
    LLM's token: steps and accepted tokens cover every position (one past the end where the last
    chain ran into it), a stop is a run a mismatch cut, and agreeing everywhere stops nothing."""
    walked = walk(agreements, length)
    for agrees in agreements:
        runs = run_lengths(agrees)  # from each position, the agreements in a row
        assert [int(r) for r in runs] == [
            next((k for k, a in enumerate([*agrees[p:], False]) if not a)) for p in range(len(agrees))
        ]
        alone = walk([agrees], length)
        assert len(agrees) <= alone.accepted + alone.steps <= len(agrees) + 1
        assert alone.steps == 0 or alone.accepted <= length * alone.steps
        position, stops = 0, 0
        while position < len(agrees):  # the same walk, position by position
            run = next(
                (k for k in range(length) if position + k >= len(agrees) or not agrees[position + k]), length
            )
            stops += run < length and position + run < len(agrees)
            position += run + 1
        assert alone.stops == stops
    assert walked.accepted == sum(walk([a], length).accepted for a in agreements)
    assert walk([[True] * 30], length).stops == 0 and walk([[True] * 30], length).rate == 1.0
    assert walk([[False] * 5], length) == Walk(0, 5, 5) and Walk().rate is None


def test_agreement_is_the_ssm_s_teacher_forced_argmax_and_catches_it_up() -> None:
    """`BatchedChainDrafter.agreement` over rows of different lengths: per row, from its start on,
    whether the SSM's argmax after each token (one full forward pass, float64) is the next token;
    a second call covers only the tokens added since; and the SSM is caught up: its next chains are
    its own greedy continuation."""
    llm, ssm = tiny_llama(layers=2, seed=0), tiny_llama(layers=1, seed=5)
    generator = torch.Generator().manual_seed(0)
    texts = [torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in (11, 7)]
    texts = [llm.generate(torch.tensor([t]), max_new_tokens=12, do_sample=False)[0].tolist() for t in texts]
    drafter = BatchedChainDrafter(ssm)
    drafter.add_sequences(2)
    starts = [11, 7]
    half = [t[: len(t) - 5] for t in texts]

    def reference(text: list[int], start: int, end: int) -> list[bool]:
        argmax = ssm(torch.tensor([text])).logits[0].argmax(-1).tolist()
        return [argmax[j] == text[j + 1] for j in range(start, end - 1)]

    assert drafter.agreement(half, starts) == [
        reference(t, s, len(t)) for t, s in zip(half, starts, strict=True)
    ]
    again = drafter.agreement(texts, starts)
    assert again == [reference(t, len(h) - 1, len(t)) for t, h in zip(texts, half, strict=True)]
    chains, _ = drafter.draft_greedy(texts, [3, 3])
    for text, chain in zip(texts, chains.tolist(), strict=True):
        expected = ssm.generate(torch.tensor([text]), max_new_tokens=3, do_sample=False)[0, len(text) :]
        assert chain == expected.tolist()
    # Rows whose prompts are read without logits beside a row judged from its first token, and a
    # row whose start is past its text (nothing judged): the same answers as one full pass.
    mixed = BatchedChainDrafter(ssm)
    mixed.add_sequences(3)
    ragged = [*texts, texts[1][:5]]
    assert mixed.agreement(ragged, [11, 0, 9]) == [
        reference(t, s, len(t)) for t, s in zip(ragged, [11, 0, 9], strict=True)
    ]


def off_after_measuring(gate: SpeculationGate, on: float, off: float, windows: float = 1) -> None:
    """`gate` off, not on trial, nothing owed, each regime measured over `windows` windows at `on`
    and `off` tokens per second: so many, where a real decoder runs, that its few windows barely
    move the rates."""
    tokens = windows * gate.window
    gate.measured[True] = Throughput(tokens, tokens / on)
    gate.measured[False] = Throughput(tokens, tokens / off)
    gate.on, gate.trial, gate.owed, gate.since = False, False, 0.0, 0


def test_off_the_gate_checks_the_router_on_a_clock_of_its_own() -> None:
    """Off, between trials (what the last lost trial owes not yet paid), a gate that shadows asks
    for a check once plain decoding has run for what the last one owes: one that reads the router's
    measured rate times its factor at CHECK_MARGIN x plain decoding's or more starts a trial now
    (settling first, off's window so far kept as off's); one below waits for its seconds over
    CHECK_SHARE, times the checks failed in a row (at most MAX_STREAK); nothing checked waits its
    seconds over CHECK_SHARE. The trials' own clock is untouched. A gate that does not shadow
    (sampled rows), or never measured the router, asks for none."""
    gate = SpeculationGate(shadows=True)
    off_after_measuring(gate, on=800.0, off=1000.0)
    gate.owed = 10.0
    run(gate, 1, {True: 800.0, False: 1000.0})
    assert gate.shadow_due and not gate.on and gate.owed == pytest.approx(10.0 - gate.window / 1000)
    gate.shadowed(CHECK_MARGIN * 1000 / 800 * 0.99, 0.002)
    assert not gate.on and not gate.shadow_due and (gate.checks, gate.checks_passed) == (1, 0)
    assert gate.check_owed == pytest.approx(0.002 / CHECK_SHARE) and gate.streak == 0
    gate.check_owed = 0.0
    run(gate, 1, {True: 800.0, False: 1000.0})
    gate.shadowed(0.5, 0.002)
    assert gate.check_owed == pytest.approx(0.002 * 2 / CHECK_SHARE)
    gate.checks_failed = MAX_STREAK + 3
    gate.shadowed(0.5, 0.002)
    assert gate.check_owed == pytest.approx(0.002 * MAX_STREAK / CHECK_SHARE)
    gate.shadowed(None, 0.004)
    assert not gate.on and gate.check_owed == pytest.approx(0.004 / CHECK_SHARE) and gate.checks == 3
    kept = gate.measured[False].tokens
    for _ in range(gate.settle + 1):
        gate.step(1, 1 / 1000)
    gate.shadowed(CHECK_MARGIN * 1000 / 800 * 1.01, 0.002)
    assert gate.on and gate.trial and gate._settling == gate.settle and gate.trials[True] == 1
    assert gate.measured[False].tokens == pytest.approx(kept + gate.settle + 1) and gate.checks_failed == 0
    assert gate.report()["shadow_checks"] == 4 and gate.report()["shadow_checks_passed"] == 1
    for shadowless in (SpeculationGate(), SpeculationGate(shadows=True)):
        off_after_measuring(shadowless, on=800.0, off=1000.0)
        shadowless.owed = 10.0
        if shadowless.shadows:
            shadowless.measured[True] = Throughput()  # the router never measured
        run(shadowless, 3, {True: 800.0, False: 1000.0})
        assert not shadowless.shadow_due and shadowless.checks == 0


@pytest.mark.parametrize(
    ("ratios", "gain"), [([1.1, 0.8, 1.4, 1.2], 0.01), ([1.3, 0.5, 1.4, 1.5], 0.06), ([0.7, 0.9], -0.015)]
)
def test_checks_find_where_the_router_pays(ratios: list[float], gain: float) -> None:
    """Categories of calls where the router loses or pays (`simulate`): checks that read the call's
    speedup with a log-normal error of sigma 0.2, for the SSM's catch-up, find the categories where
    it pays, and cost little where it never does. Of the better fixed regime's rate, here 12 seeds
    (over 40 in brackets): 0.975 against trials alone 0.956 (0.983, 0.965); 1.079 against 0.995
    (1.091, 1.003); where the router always loses, 0.965 against 0.975 (0.960, 0.966)."""
    seeds = range(12)
    best = [max(simulate(ratios, s, None, on, cold=(1.3, 1.36)) for on in (True, False)) for s in seeds]

    def kept(shadow: float | None) -> float:
        gates = [SpeculationGate(shadows=shadow is not None) for _ in seeds]
        rates = [
            simulate(ratios, s, g, cold=(1.3, 1.36), shadow=shadow) for s, g in zip(seeds, gates, strict=True)
        ]
        return sum(k / b for k, b in zip(rates, best, strict=True)) / len(rates)

    assert kept(0.2) >= kept(None) + gain


def checked_decode(
    matching: bool, on: float, acceptance: tuple[float, float]
) -> tuple[dict, int, PreferredAction]:
    """A real gated decoder of one SSM (the LLM itself where `matching`, else one that matches
    nothing) after one short call: its gate off, the router measured at `on` tokens/s against plain
    decoding's 1000 (over so many windows that the real ones barely move them), no trial due, none
    by a call's context; its preferred action SSM 0's chain of 4, that SSM's drafted chains
    measured at (accepted, stops). Decodes 96 tokens, checks the output is the LLM's, and returns
    the gate's report, its steps on before the call, and the preference."""
    llm, decoder = drafting_exactly() if matching else drafting_in_vain()
    prompt = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(3))
    decoder.generate(prompt, max_new_tokens=8)
    scheduler = decoder.speculator
    gate = scheduler.gate(1)
    off_after_measuring(gate, on=on, off=1000.0, windows=1e6)
    gate.owed, gate.lost_context = 1e9, None
    preferred = scheduler.preferred_action(GREEDY)
    preferred.weights = {(0, 1): 1.0}
    preferred.accepted, preferred.stops = {0: acceptance[0]}, {0: acceptance[1]}
    steps_on = gate.steps[True]
    out = decoder.generate(prompt, max_new_tokens=96)
    assert torch.equal(out.sequences, llm.generate(prompt, max_new_tokens=96, do_sample=False))
    return out.stats.strategy["gate"], steps_on, preferred


def test_a_check_turns_the_router_on_where_its_ssm_now_matches() -> None:
    """Its SSM the LLM itself (every draft matches), the router measured at 0.8x plain decoding and
    its held SSM's acceptance at 0.2: the check that comes due walks chains that match whole, so
    the router runs again, and the hold drafts long chains (the walk counted as drafted)."""
    report, steps_on, preferred = checked_decode(True, on=800.0, acceptance=(1.0, 4.0))
    assert report["shadow_checks_passed"] >= 1 and report["steps_on"] > steps_on
    assert preferred.rate(0) > 0.9


def test_a_check_keeps_the_router_off_where_its_ssm_matches_nothing() -> None:
    """An SSM that matches nothing, the router measured at 0.9x plain decoding with its held SSM's
    acceptance at 0.9: the checks fail, on their clock, and the router never runs."""
    report, steps_on, _ = checked_decode(False, on=900.0, acceptance=(9.0, 1.0))
    assert report["shadow_checks"] >= 1 and report["shadow_checks_passed"] == 0
    assert report["steps_on"] == steps_on


def test_only_greedy_gates_check() -> None:
    """Sampled rows' chains are not the SSM's argmax: their gates try the router as before."""
    _, decoder = drafting_in_vain()
    scheduler = decoder.speculator
    assert scheduler.gate(1, GREEDY).shadows and not scheduler.gate(1, SAMPLED).shadows
    assert not scheduler.hold(4, GREEDY).shadows


def test_a_held_chain_s_expected_run_is_geometric() -> None:
    """A check's factor compares held chains of one length at two rates (`held_run`): each token
    accepted with probability `rate` once the ones before it were; every one at rate 1."""
    now, then = 1 + held_run(0.9, 4), 1 + held_run(0.6, 4)
    assert now == pytest.approx(1 + 0.9 + 0.81 + 0.729 + 0.6561) and then < now
    assert math.isclose(held_run(1.0, 4), 4)
