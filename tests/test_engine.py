"""The serving engine returns every request exactly once, with the LLM's own greedy output, under
concurrent submission, cancellation, worker errors and a full result pool; nothing hangs (every
wait has a timeout; ALGORITHMS.md sections 10 and 11). A bounded queue refuses requests beyond
`max_queue`; the live metrics (queue depth, active rows, running totals) add up."""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError

import pytest
import torch
from conftest import tiny_llama
from test_batched import prompts
from test_greedy_equivalence import _noisy, llm_for, reference
from transformers.generation.streamers import BaseStreamer

from specboost.decoder import BeamShape, ChainShape, SpeculativeDecoder, loop
from specboost.decoder.engine import Engine, EngineConfig, QueueFull, Request, RequestHandle
from specboost.decoder.stats import merged_stats

TIMEOUT = 60.0  # seconds; a deadlock fails the test instead of hanging it
MAX_NEW = 12
LENGTHS = (1, 6, 3, 17, 5, 2, 9, 4)


def expected(prompt: list[int], max_new: int = MAX_NEW) -> list[int]:
    return reference("llama", 0, torch.tensor([prompt]), max_new)[0, len(prompt) :].tolist()


def decoder(**kwargs: object) -> SpeculativeDecoder:
    return SpeculativeDecoder(llm_for("llama", 0), _noisy(0.1, 0.3)("llama", 0), **kwargs)


def fresh_decoder() -> SpeculativeDecoder:
    """The weights of `decoder()`'s LLM and first SSM, in models of its own (safe to patch)."""
    ssm = copy.deepcopy(_noisy(0.1)("llama", 0)[0])
    return SpeculativeDecoder(tiny_llama(layers=2, seed=0), [ssm], shape=ChainShape(3))


@pytest.fixture
def count_resolutions(monkeypatch: pytest.MonkeyPatch) -> dict[int, int]:
    """How often each handle was resolved (a result, an error or a cancellation)."""
    counts: dict[int, int] = {}
    original = RequestHandle._resolve

    def counting(self: RequestHandle, *args: object, **kwargs: object) -> bool:
        won = original(self, *args, **kwargs)
        counts[id(self)] = counts.get(id(self), 0) + won
        return won

    monkeypatch.setattr(RequestHandle, "_resolve", counting)
    return counts


@pytest.mark.parametrize("pipeline", [True, False], ids=["pipelined", "sequential"])
@pytest.mark.parametrize(
    "kwargs", [dict(shape=ChainShape(3)), dict(shape=BeamShape(2, 2))], ids=["chain", "beam"]
)
def test_engine_output_equals_generate(pipeline: bool, kwargs: dict) -> None:
    """More requests than slots (3 groups of 2): slots are refilled as sequences finish."""
    rows = prompts(1, LENGTHS)
    config = EngineConfig(batch_size=2, num_groups=3, pipeline=pipeline)
    with Engine(decoder(**kwargs), config) as engine:
        results = engine.run(rows, timeout=TIMEOUT, max_new_tokens=MAX_NEW)
        steps = engine.stats.llm_steps
        requests = [Request(row, dict(max_new_tokens=5)) for row in rows[:2]]
        short = engine.run(requests, timeout=TIMEOUT)
    for row, result in zip(rows, results, strict=True):
        assert result.new_tokens == expected(row)
        assert result.sequences[0, : len(row)].tolist() == row
        assert result.finish_reason == "length" and result.stats.new_tokens == MAX_NEW
        assert 0 <= result.queued <= result.latency
        assert result.normalized_latency == pytest.approx(result.latency / MAX_NEW)
    assert [r.new_tokens for r in short] == [expected(row)[:5] for row in rows[:2]]
    stats = engine.stats
    assert stats.completed == len(rows) + 2 and stats.failed == 0
    assert steps < sum(r.stats.llm_steps for r in results)  # one pass verifies several requests
    with pytest.raises(RuntimeError, match="closed"):
        engine.submit(rows[0], max_new_tokens=2)


def test_requests_given_to_run_join_a_group_together() -> None:
    """`run` queues its requests at once, so a group with room for all of them takes all of them
    at its first round (a group's rows and cache shapes, which a compiled decoder compiles for, do
    not depend on how fast a worker took the first requests): one pass per step verifies every
    request; and a request `run` cannot queue fails with the rest after it, the refusal raised."""
    rows = prompts(3, (4, 9, 2, 6))
    with Engine(decoder(shape=ChainShape(3)), EngineConfig(batch_size=4, num_groups=1)) as engine:
        results = engine.run(rows, timeout=TIMEOUT, max_new_tokens=MAX_NEW)
        assert engine.stats.llm_steps == max(r.stats.llm_steps for r in results)
    assert [r.new_tokens for r in results] == [expected(row) for row in rows]
    streams = [Ends(), Ends()]
    config = EngineConfig(batch_size=1, num_groups=1, max_queue=1)
    with Engine(decoder(shape=ChainShape(3)), config) as engine:
        requests = [Request(row, dict(streamer=stream)) for row, stream in zip(rows, streams, strict=False)]
        with pytest.raises(QueueFull, match="max_queue=1"):
            engine.run(requests, max_new_tokens=2)
    assert [stream.ended for stream in streams] == [1, 1]  # the first ran, the second was refused


def test_decoding_in_inference_mode_and_rounds_admitting_only_new_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Generation and the engine's workers decode under `torch.inference_mode`, whatever the caller's
    mode (compiled graphs guard on it: a decoder used in and out of it compiled everything twice),
    and hand back ordinary tensors, which take in-place writes. The engine admits its queue at
    every round: an empty admission is nothing (it had sized every drafter's cache anew and restarted
    the routed scheduler's decision pacing, 16% of the rounds' time at batch 8)."""
    added: list[tuple[int, bool]] = []  # rows admitted, in inference mode
    make = loop.make_drafting

    def spying(*args: object, **kwargs: object) -> object:
        drafting = make(*args, **kwargs)
        add = drafting.add
        drafting.add = lambda rows: (added.append((len(rows), torch.is_inference_mode_enabled())), add(rows))
        return drafting

    monkeypatch.setattr(loop, "make_drafting", spying)
    rows = prompts(3, (4, 9, 2))
    with Engine(decoder(shape=ChainShape(3)), EngineConfig(batch_size=4, num_groups=1)) as engine:
        results = engine.run(rows, timeout=TIMEOUT, max_new_tokens=MAX_NEW)
    assert added == [(3, True)] and [r.new_tokens for r in results] == [expected(row) for row in rows]
    out = decoder(shape=ChainShape(3)).generate(torch.tensor([rows[0]]), max_new_tokens=MAX_NEW)
    assert added[1:] == [(1, True)]
    for sequences in (results[0].sequences, out.sequences):
        assert not sequences.is_inference()
        sequences[0, 0] = 0  # an inference tensor refuses this outside the mode


class Ends(BaseStreamer):
    """A streamer that counts its ends."""

    def __init__(self) -> None:
        self.ended = 0

    def put(self, value: object) -> None:
        """Tokens are not looked at."""

    def end(self) -> None:
        self.ended += 1


def test_concurrent_submission_from_threads(count_resolutions: dict[int, int]) -> None:
    rows = prompts(2, LENGTHS * 2)
    handles: dict[int, RequestHandle] = {}
    lock = threading.Lock()

    def client(start: int) -> None:
        for i in range(start, len(rows), 4):
            handle = engine.submit(rows[i], max_new_tokens=MAX_NEW, eos_token_id=None)
            with lock:
                handles[i] = handle

    with Engine(decoder(shape=ChainShape(2)), EngineConfig(batch_size=3, num_groups=2)) as engine:
        clients = [threading.Thread(target=client, args=(k,)) for k in range(4)]
        for thread in clients:
            thread.start()
        for thread in clients:
            thread.join(TIMEOUT)
        results = {i: handle.result(TIMEOUT) for i, handle in handles.items()}
    assert sorted(results) == list(range(len(rows)))
    for i, result in results.items():
        assert result.new_tokens == expected(rows[i])
    assert all(count_resolutions[id(h)] == 1 for h in handles.values())
    assert len(count_resolutions) == len(rows)
    assert engine.stats.completed == len(rows)


@pytest.mark.parametrize("pipeline", [True, False], ids=["pipelined", "sequential"])
def test_cancellation(pipeline: bool, count_resolutions: dict[int, int]) -> None:
    """Cancel queued and running requests: they raise CancelledError, the rest are unaffected,
    and freed slots serve the queue."""
    rows = prompts(3, LENGTHS)
    engine = Engine(decoder(shape=ChainShape(2)), EngineConfig(batch_size=2, num_groups=2, pipeline=pipeline))
    handles = [engine.submit(row, max_new_tokens=40) for row in rows]
    running = handles[0]
    deadline = time.monotonic() + TIMEOUT
    while not engine.stats.llm_steps and time.monotonic() < deadline:  # request 0 is being decoded
        time.sleep(0.001)
    assert running.cancel() and handles[-1].cancel()  # running, and still queued
    assert not running.cancel()  # resolves once
    engine.close(timeout=TIMEOUT)
    for handle in (running, handles[-1]):
        assert handle.cancelled()
        with pytest.raises(CancelledError):
            handle.result(0)
    for row, handle in zip(rows[1:-1], handles[1:-1], strict=True):
        assert handle.result(0).new_tokens == expected(row, 40)
    assert all(count_resolutions[id(h)] == 1 for h in handles)
    assert not any(thread.is_alive() for thread in engine._threads)


def test_close_with_cancel_resolves_everything() -> None:
    engine = Engine(decoder(), EngineConfig(batch_size=2, num_groups=2))
    handles = [engine.submit(row, max_new_tokens=60) for row in prompts(4, LENGTHS)]
    engine.close(cancel=True, timeout=TIMEOUT)
    assert not any(thread.is_alive() for thread in engine._threads)
    assert all(handle.done() for handle in handles)


def break_engine_loop(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Make the engine's own loop (not a group's round) raise `Boom` once a group is drafted and
    the returned event is set (so a test can submit all its requests first: CI had seen the engine
    fail between two submits, refusing the second)."""
    take = Engine._take_pooled
    release = threading.Event()

    def broken(self: Engine) -> object:
        if take(self) is not None:
            assert release.wait(TIMEOUT)
            raise Boom("engine bug")
        return None

    monkeypatch.setattr(Engine, "_take_pooled", broken)
    return release


class Boom(RuntimeError):
    pass


@pytest.mark.parametrize("pipeline", [True, False], ids=["pipelined", "sequential"])
@pytest.mark.parametrize("side", ["llm", "ssm"])
def test_worker_error_fails_the_affected_requests(pipeline: bool, side: str, count_resolutions: dict) -> None:
    """A model that raises fails the requests of its group with that error; the engine then serves
    new requests with a fresh group."""
    dec = fresh_decoder()
    model = dec.llm if side == "llm" else dec.ssms[0]
    broken = {"on": True}

    def hook(*_: object) -> None:
        if broken["on"]:
            raise Boom(f"{side} failed")

    hook_handle = model.register_forward_pre_hook(hook)
    rows = prompts(5, LENGTHS[:4])
    try:
        with Engine(dec, EngineConfig(batch_size=2, num_groups=2, pipeline=pipeline)) as engine:
            handles = [engine.submit(row, max_new_tokens=MAX_NEW) for row in rows]
            for handle in handles:
                with pytest.raises(Boom, match=f"{side} failed"):
                    handle.result(TIMEOUT)
            broken["on"] = False
            after = engine.run(rows[:3], timeout=TIMEOUT, max_new_tokens=MAX_NEW)
    finally:
        hook_handle.remove()
    assert [r.new_tokens for r in after] == [expected(row) for row in rows[:3]]
    assert engine.stats.failed == len(rows)
    assert all(count_resolutions[id(h)] == 1 for h in handles)


def test_an_engine_error_fails_every_open_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """An error in the engine's own loop (outside a group's rounds) fails every open request,
    queued or running, and the engine refuses new ones."""
    release = break_engine_loop(monkeypatch)
    engine = Engine(decoder(), EngineConfig(batch_size=1, num_groups=2))
    handles = [engine.submit(row, max_new_tokens=MAX_NEW) for row in prompts(8, LENGTHS[:4])]
    release.set()
    for handle in handles:
        with pytest.raises(Boom, match="engine bug"):
            handle.result(TIMEOUT)
    with pytest.raises(RuntimeError, match="the engine failed"):
        engine.submit([1, 2], max_new_tokens=2)
    engine.close(timeout=TIMEOUT)
    assert not any(thread.is_alive() for thread in engine._threads)


def test_no_deadlock_when_the_pool_is_full() -> None:
    """A slow LLM and many groups: the pool fills, the SSM worker pauses (Minions' back-pressure)
    and resumes; every request completes in bounded time."""
    dec = fresh_decoder()
    hook = dec.llm.register_forward_hook(lambda *_: time.sleep(0.005))
    rows = prompts(6, LENGTHS)
    config = EngineConfig(batch_size=1, num_groups=4)
    try:
        with Engine(dec, config) as engine:
            results = engine.run(rows, timeout=TIMEOUT, max_new_tokens=MAX_NEW)
    finally:
        hook.remove()
    assert [r.new_tokens for r in results] == [expected(row) for row in rows]
    stats = engine.stats
    assert stats.paused_seconds > 0  # the SSM worker did wait for the LLM
    # Back-pressure: drafting stops once the pool holds batch_size sequences, so it never holds
    # more than 2 * batch_size - 1.
    assert 1 <= stats.max_pool_sequences <= 2 * config.batch_size - 1


def test_sampling_requests_and_bad_settings() -> None:
    dec = decoder(shape=ChainShape(2))
    with Engine(dec, EngineConfig(batch_size=2)) as engine:
        with pytest.raises(ValueError, match="temperature must be > 0"):
            engine.submit([1, 2], max_new_tokens=4, do_sample=True, temperature=0.0)
        with pytest.raises(TypeError, match="unknown generation options"):
            engine.submit([1, 2], max_new_tokens=4, beams=2)
        handles = [
            engine.submit(row, max_new_tokens=7, do_sample=True, temperature=0.8, seed=i)
            for i, row in enumerate(prompts(7, LENGTHS[:3]))
        ]
        greedy = engine.submit([3, 4, 5], max_new_tokens=7)
        assert all(h.result(TIMEOUT).stats.new_tokens == 7 for h in handles)
        assert greedy.result(TIMEOUT).new_tokens == expected([3, 4, 5], 7)


# Admission limits and live metrics ---------------------------------------------------------------
LONG = 230  # new tokens no request here is left to finish (the model's context is 256)


def slowed(seconds: float = 0.005) -> tuple[SpeculativeDecoder, object]:
    """`fresh_decoder()` with an LLM that sleeps in every pass, and the hook's handle."""
    dec = fresh_decoder()
    return dec, dec.llm.register_forward_hook(lambda *_: time.sleep(seconds))


def wait_for(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def test_queue_full_refuses_beyond_max_queue() -> None:
    """With `max_queue` requests waiting, `submit` raises `QueueFull` naming the limit; running
    requests do not count, and a cancelled one stops counting."""
    dec, hook = slowed()
    try:
        with Engine(dec, EngineConfig(batch_size=1, num_groups=1, max_queue=2)) as engine:
            running = engine.submit([1, 2, 3], max_new_tokens=LONG)
            wait_for(lambda: engine.active_rows == 1)
            waiting = [engine.submit([4 + i], max_new_tokens=4) for i in range(2)]
            assert engine.queue_depth == 2
            with pytest.raises(QueueFull, match=r"2 requests are already waiting.*max_queue=2"):
                engine.submit([9], max_new_tokens=4)
            assert waiting[0].cancel() and engine.queue_depth == 1
            extra = engine.submit([9], max_new_tokens=4)  # the cancelled request's place
            assert engine.queue_depth == 2
            assert running.cancel()
            results = [handle.result(TIMEOUT) for handle in (waiting[1], extra)]
    finally:
        hook.remove()
    assert [r.new_tokens for r in results] == [expected([5], 4), expected([9], 4)]
    assert isinstance(QueueFull("x"), RuntimeError)
    with pytest.raises(ValueError, match="max_queue must be >= 1"):
        EngineConfig(max_queue=0)


@pytest.mark.parametrize("pipeline", [True, False], ids=["pipelined", "sequential"])
def test_a_cancelled_row_leaves_its_group_for_the_next_request(pipeline: bool) -> None:
    """A request cancelled mid-generation frees its row at the group's next round: the queued
    request decodes in it while the other long request, started at the same time, still runs."""
    dec, hook = slowed()
    try:
        with Engine(dec, EngineConfig(batch_size=2, num_groups=1, pipeline=pipeline)) as engine:
            long = [engine.submit([1, 2, 3 + i], max_new_tokens=LONG) for i in range(2)]
            queued = engine.submit([7, 8], max_new_tokens=6)
            wait_for(lambda: engine.active_rows == 2 and engine.stats.llm_steps >= 1)
            assert engine.queue_depth == 1
            assert long[0].cancel()
            result = queued.result(TIMEOUT)
            # Chains of 3 give at most 4 tokens a pass: long[0] could not have finished yet.
            assert engine.stats.llm_steps < LONG // 4
            assert not long[1].done() and engine.queue_depth == 0
            wait_for(lambda: engine.active_rows == 1)  # long[1] alone
            long[1].cancel()
            wait_for(lambda: engine.active_rows == 0)
    finally:
        hook.remove()
    assert result.new_tokens == expected([7, 8], 6)
    assert engine.stats.cancelled == 2 and engine.stats.completed == 1


def test_stats_totals_equal_the_sum_of_the_results() -> None:
    rows = prompts(10, LENGTHS)
    with Engine(decoder(shape=ChainShape(3)), EngineConfig(batch_size=3, num_groups=2)) as engine:
        results = engine.run(rows, timeout=TIMEOUT, max_new_tokens=MAX_NEW)
        assert engine.submit(rows[0], max_new_tokens=LONG).cancel()
    total = merged_stats([result.stats for result in results])
    stats = engine.stats
    assert stats.completed == len(rows) and stats.cancelled == 1 and stats.failed == 0
    assert stats.new_tokens == total.new_tokens == MAX_NEW * len(rows)
    assert (stats.draft_tokens, stats.accepted_tokens) == (total.draft_tokens, total.accepted_tokens)
    assert stats.sequence_steps == total.llm_steps > stats.llm_steps  # passes verify several rows
    assert stats.proposed_per_ssm == dict(total.proposed_per_ssm) and set(stats.proposed_per_ssm) == {0, 1}
    assert stats.accepted_per_ssm == dict(total.accepted_per_ssm)
    stats.proposed_per_ssm[0] += 1  # a snapshot: the engine's own totals stay
    assert engine.stats.proposed_per_ssm == dict(total.proposed_per_ssm)
    assert engine.queue_depth == 0 and engine.active_rows == 0
