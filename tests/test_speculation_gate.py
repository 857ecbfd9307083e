"""The speculation gate (ALGORITHMS.md section 5.4): the routed scheduler on or off by measured
throughput, its trials of the losing regime, and decoding through it (still the LLM's output)."""

from __future__ import annotations

import itertools
import time

import pytest
import torch
from conftest import VOCAB, tiny_llama
from test_routed_scheduler import routed_decoder
from test_scheduler import constant_predictor

from specboost.decoder import SpeculativeDecoder, StrategyOptions, routed_drafting, strategies
from specboost.decoder.batched import BatchedDecoder
from specboost.decoder.routed_drafting import RoutedDrafting
from specboost.speculator.speculation_gate import FIRST_WAIT, MAX_WAIT, WINDOW, SpeculationGate


def run(gate: SpeculationGate, windows: int, rate: dict[bool, float]) -> list[bool]:
    """`windows` windows of steps emitting one token each at `rate[regime]` tokens per second;
    returns the regime of every window."""
    regimes = []
    for _ in range(windows):
        regimes.append(gate.on)
        for _ in range(WINDOW):
            gate.step(1, 1 / rate[gate.on])
    return regimes


def test_the_gate_turns_speculation_off_where_plain_decoding_is_faster() -> None:
    """On first, then off measured; off wins and stays, the router tried again after 2, 4, 8, ...
    windows (at most MAX_WAIT apart), so the trials cost less and less."""
    gate = SpeculationGate()
    regimes = run(gate, 200, {True: 700.0, False: 1000.0})
    assert regimes[:2] == [True, False]
    trials = [w for w, on in enumerate(regimes) if on][1:]
    gaps = [b - a - 1 for a, b in itertools.pairwise(trials)]
    assert gaps[0] == 2 * FIRST_WAIT and gaps == sorted(gaps) and max(gaps) == MAX_WAIT
    assert sum(regimes) == 9  # the first window and 8 trials in 200 windows
    assert gate.report()["steps_off"] == WINDOW * (200 - sum(regimes))


def test_the_gate_keeps_speculation_where_it_pays_and_follows_a_change() -> None:
    """Speculation faster: on, with off tried after FIRST_WAIT, then growing waits. When the text
    turns and drafting stops paying, the next window's evidence turns the gate off."""
    gate = SpeculationGate()
    regimes = run(gate, 40, {True: 1500.0, False: 1000.0})
    assert regimes[:3] == [True, False, True] and sum(regimes) >= 34
    regimes = run(gate, 20, {True: 400.0, False: 1000.0})
    first_off = regimes.index(False)
    assert first_off <= 2 and sum(regimes[first_off:]) <= 1


def test_a_trial_that_wins_takes_over() -> None:
    """Off after two lost trials; the drafts start to pay: the next trial of the router wins on what
    it measures then (older windows weigh little), and from then on plain decoding is the trial."""
    gate = SpeculationGate()
    run(gate, 10, {True: 500.0, False: 1000.0})  # off, with a trial of on after 2 windows and 4
    assert not gate.on and gate.wait == 4 * FIRST_WAIT
    regimes = run(gate, 30, {True: 2000.0, False: 1000.0})
    assert regimes.index(True) == 4 * FIRST_WAIT  # the next trial
    assert gate.on and regimes[-20:].count(False) <= 3  # only plain decoding's trials
    assert gate.wait >= 2 * FIRST_WAIT  # halved by the win (8 -> 4), then doubled by each lost trial


def drafting_in_vain() -> tuple[torch.nn.Module, SpeculativeDecoder]:
    """An LLM and a gated routed decoder whose one SSM matches nothing while its predictor and
    profile say drafting pays (no online correction): the router drafts at every step it decides."""
    llm = tiny_llama(layers=2, seed=0)
    predictor = constant_predictor([[[1.0, 4.0]] * 2])
    decoder = routed_decoder(llm, [tiny_llama(layers=1, seed=5)], predictor, gate=True)
    router = decoder.speculator.router
    router.calibration = router.costs = router.plain_costs = None  # keep drafting on the made-up numbers
    return llm, decoder


def test_declining_through_the_gate_is_lossless_and_mostly_off() -> None:
    """SSMs that match nothing, a predictor and a profile that say drafting pays: the router drafts
    every step it decides, measured slower than plain steps, so the gate keeps it off for most of
    the text; the output is the LLM's own greedy output."""
    llm, decoder = drafting_in_vain()
    prompt = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(3))
    out = decoder.generate(prompt, max_new_tokens=200)
    assert torch.equal(out.sequences, llm.generate(prompt, max_new_tokens=200, do_sample=False))
    gate = out.stats.strategy["gate"]
    assert gate["steps_off"] > 2 * gate["steps_on"]
    assert gate["tokens_per_second_off"] > gate["tokens_per_second_on"]
    assert out.stats.strategy["actions"]["off"] == gate["steps_off"]


def test_the_router_never_decides_on_stale_hidden_states(monkeypatch) -> None:
    """While the gate is off the LLM's passes skip the hidden states; the first step after it turns
    on has none and is a plain step, every later one reads the state of the text as it is (none is
    left over from an earlier pass), in a batch as in one sequence."""
    llm, decoder = drafting_in_vain()
    steps = []  # per step: the gate's regime, and which rows have a hidden state
    propose = RoutedDrafting.propose

    def recorded(self, rows, *args):
        drafted = propose(self, rows, *args)
        steps.append((self._gate.on, [row.hidden is not None for row in rows], self.levels(0)))
        return drafted

    monkeypatch.setattr(RoutedDrafting, "propose", recorded)
    for rows in (1, 3):
        prompts = torch.randint(0, VOCAB, (rows, 6), generator=torch.Generator().manual_seed(rows))
        out = BatchedDecoder(decoder).generate(prompts, max_new_tokens=120)
        for b in range(rows):
            alone = llm.generate(prompts[b : b + 1], max_new_tokens=120, do_sample=False)
            assert torch.equal(out.sequences[b], alone[0])
        after_off = False  # the prompt's pass returns the states
        for on, known, levels in steps:
            if on:
                assert known == [not after_off] * len(known)
                assert levels == 0 or not after_off  # no state: a plain step
            after_off = not on
        assert any(on and not known[0] for on, known, _ in steps)  # the gate did turn on again
        steps.clear()
    gates = decoder.speculator.gates
    assert all(gate.steps[False] > 0 for gate in gates.values()) and len(gates) == 2


def test_a_step_that_set_something_up_is_not_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step timed while a cache warmed up at a capacity it had not met (or grew, or compiled)
    measured setting up: the gate leaves it out. Before, one such step (0.2 s against steps of 2 ms,
    batch 8 on the quick suite's fixture) had made plain decoding look ten times slower than the
    router, and the gate kept the router on for the rest of the table."""
    llm, decoder = drafting_in_vain()
    setups, timed = [0], []
    monkeypatch.setattr(routed_drafting, "setup_count", lambda: setups[0])
    step = SpeculationGate.step

    def recorded(gate: SpeculationGate, tokens: int, seconds: float) -> None:
        timed.append(seconds)
        step(gate, tokens, seconds)

    monkeypatch.setattr(SpeculationGate, "step", recorded)
    propose = RoutedDrafting.propose

    def slow_setup(self, rows, *args):
        drafted = propose(self, rows, *args)
        if len(timed) % 10 == 3:  # now and then a step sets something up, slowly
            setups[0] += 1
            time.sleep(0.05)
        return drafted

    monkeypatch.setattr(RoutedDrafting, "propose", slow_setup)
    prompt = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(3))
    out = decoder.generate(prompt, max_new_tokens=60)
    assert torch.equal(out.sequences, llm.generate(prompt, max_new_tokens=60, do_sample=False))
    assert setups[0] >= 5 and len(timed) == out.stats.llm_steps - setups[0]
    assert max(timed) < 0.05


def test_the_gate_is_refused_for_the_beam_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """`StrategyOptions(gate=...)` sets the routed chains' gate: with actions="trees" it is refused
    before anything is profiled, with a message that says what to drop."""
    monkeypatch.setattr(strategies, "profile", lambda *_, **__: pytest.fail("profiled before refusing"))
    llm = tiny_llama(layers=2, seed=0)
    with pytest.raises(ValueError, match=r"gate=\.\.\.\) is for the routed chains"):
        SpeculativeDecoder(
            llm,
            [tiny_llama(layers=1, seed=5)],
            strategy="learned",
            predictor=constant_predictor([[[1.0, 4.0]] * 2]),
            strategy_options=StrategyOptions(actions="trees", gate=False),
        )
