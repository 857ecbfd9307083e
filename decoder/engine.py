"""Serving engine: continuous batching with decoupled SSM and LLM workers (Minions 3.4 + BASS).

    with Engine(decoder, EngineConfig(batch_size=4)) as engine:
        handle = engine.submit(prompt_ids, max_new_tokens=64)
        print(handle.result().new_tokens)

Requests wait in a queue. The engine keeps `num_groups` groups of at most `batch_size`
sequences each (`SequenceGroup`: a ragged batch, ALGORITHMS.md section 11). A sequence that
finishes or is cancelled leaves its group and the next queued request takes the free slot
(continuous batching). Every group cycles through

    SSM worker: admit queued requests, draft every row's tree  ->  intermediate result pool  ->
    LLM worker: verify the whole group in ONE pass, emit, finish rows  ->  back to the SSM worker

so each sequence is either being drafted or being verified, never both, and only the worker
holding a group touches its state. With `pipeline=True` the two workers are threads working on
different groups at the same time (ALGORITHMS.md section 10): after each drafting round, when the
pool holds >= `batch_size` sequences the SSM worker pauses until the LLM has taken enough out
(Minions' back-pressure), which keeps the LLM busy without piling up drafted groups.
`pipeline=False` runs the same rounds one after the other in one thread, for comparison.

An exception while drafting or verifying a group fails that group's requests with the error
(their `result()` raises it) and the engine serves on with a fresh group; an error in the engine
itself fails every open request. Nothing waits forever.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError
from dataclasses import dataclass, field, replace

import torch
from transformers import GenerationConfig

from specboost.decoder.loop import BatchConfig, LoopParts, SequenceGroup
from specboost.decoder.sequence import SequenceState, new_sequence
from specboost.decoder.stats import DecodeStats
from specboost.decoder.validation import check_generate_arguments, output_vocab_size


@dataclass(frozen=True)
class EngineConfig:
    """batch_size: sequences per group, i.e. the LLM's batch in one verification pass.
    num_groups: groups in flight; with 2 or more, drafting one group overlaps verifying another.
    pipeline: the SSM and LLM workers run concurrently (threads); False runs them in turn.
    batch: how each group drafts (`BatchConfig`: batched chains, the BASS length controller)."""

    batch_size: int = 4
    num_groups: int = 2
    pipeline: bool = True
    batch: BatchConfig = field(default_factory=BatchConfig)

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.num_groups < 1:
            raise ValueError(
                f"batch_size and num_groups must be >= 1, got {self.batch_size}, {self.num_groups}"
            )


@dataclass
class Request:
    """One request for `Engine.run`: a prompt and `submit`'s keyword arguments."""

    prompt_ids: Sequence[int] | torch.Tensor
    options: dict = field(default_factory=dict)


@dataclass
class RequestResult:
    sequences: torch.Tensor  # [1, prompt + new], like generate
    finish_reason: str  # "eos" | "length" | "stop_string" | "time"
    stats: DecodeStats
    latency: float  # seconds from submit to the last token
    queued: float  # seconds from submit to joining a group

    @property
    def new_tokens(self) -> list[int]:
        return self.sequences[0, self.sequences.shape[1] - self.stats.new_tokens :].tolist()

    @property
    def normalized_latency(self) -> float:
        """Latency / output length (Minions; ALGORITHMS.md section 13)."""
        return self.latency / max(1, self.stats.new_tokens)


class RequestHandle:
    """A submitted request; resolves exactly once: a result, an error, or cancelled."""

    def __init__(self, on_cancel: Callable[[], None] = lambda: None) -> None:
        self.submitted = time.perf_counter()
        self._on_cancel = on_cancel  # wakes the engine's workers
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._result: RequestResult | None = None
        self._error: BaseException | None = None

    def _resolve(self, result: RequestResult | None = None, error: BaseException | None = None) -> bool:
        with self._lock:
            if self._done.is_set():
                return False
            self._result, self._error = result, error
            self._done.set()
            return True

    def cancel(self) -> bool:
        """Stop the request (queued or running); False if it had already finished."""
        cancelled = self._resolve(error=CancelledError("the request was cancelled"))
        self._on_cancel()
        return cancelled

    def cancelled(self) -> bool:
        return isinstance(self._error, CancelledError)

    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> RequestResult:
        """Wait for the result; raises the worker's error, `CancelledError`, or `TimeoutError`."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"the request is not done after {timeout} s")
        if self._error is not None:
            raise self._error
        return self._result


@dataclass
class EngineStats:
    completed: int = 0  # requests finished with a result
    failed: int = 0  # requests failed by an error
    llm_steps: int = 0  # verification passes
    draft_rounds: int = 0
    verify_seconds: float = 0.0  # the LLM worker's busy time
    draft_seconds: float = 0.0  # the SSM worker's busy time (admission included)
    paused_seconds: float = 0.0  # the SSM worker's wait on back-pressure
    max_pool_sequences: int = 0  # the most sequences ever waiting in the pool


class Engine:
    """Serves requests for `decoder` (its models, strategy and verification rule); see the module
    doc. Use as a context manager, or call `close()`. While it runs, do not call
    `decoder.generate` from another thread (the engine copies the decoder's speculator)."""

    def __init__(self, decoder: LoopParts, config: EngineConfig | None = None) -> None:
        self.decoder = decoder
        self.config = config or EngineConfig()
        self._cond = threading.Condition()
        self._queue: deque[SequenceState] = deque()  # submitted, not yet in a group
        # Groups waiting for the SSM worker; the others are in the pool or held by a worker.
        self._idle: deque[SequenceGroup] = deque(self._new_group() for _ in range(self.config.num_groups))
        self._pool: deque[SequenceGroup] = deque()  # drafted, waiting for the LLM
        self._handles: weakref.WeakSet[RequestHandle] = weakref.WeakSet()  # every submitted request
        self._closing = False
        self._error: BaseException | None = None  # an error of the engine itself
        self._stats = EngineStats()
        workers = [self._ssm_worker, self._llm_worker] if self.config.pipeline else [self._serial_worker]
        self._threads = [
            threading.Thread(
                target=self._guard, args=(work,), name=f"specboost-{work.__name__[1:]}", daemon=True
            )
            for work in workers
        ]
        for thread in self._threads:
            thread.start()

    def _new_group(self) -> SequenceGroup:
        return SequenceGroup(self.decoder, self.config.batch)

    # Public API ------------------------------------------------------------------------------------
    def submit(
        self,
        prompt_ids: Sequence[int] | torch.Tensor,
        *,
        generation_config: GenerationConfig | None = None,
        seed: int | None = None,
        **options: object,
    ) -> RequestHandle:
        """Queue one prompt (token ids, [L] or [1, L]); `options` as for `SpeculativeDecoder.generate`
        (max_new_tokens, do_sample, ..., any `GenerationConfig` field). Bad settings raise here."""
        ids = torch.as_tensor(prompt_ids)
        check_generate_arguments(ids, None, options, seed, output_vocab_size(self.decoder.llm))
        handle = RequestHandle(self._wake)
        row = new_sequence(self.decoder, ids.reshape(-1), None, generation_config, options, seed, tag=handle)
        with self._cond:
            if self._closing or self._error is not None:
                raise RuntimeError(
                    "the engine is closed" if self._error is None else f"the engine failed: {self._error!r}"
                )
            self._queue.append(row)
            self._handles.add(handle)
            self._cond.notify_all()
        return handle

    def run(
        self,
        requests: Sequence[Request | Sequence[int] | torch.Tensor],
        timeout: float | None = None,
        **options: object,
    ) -> list[RequestResult]:
        """Submit every request (a `Request`, or a prompt with `options`), then wait for all;
        results in request order."""
        handles = [
            self.submit(r.prompt_ids, **(options | r.options))
            if isinstance(r, Request)
            else self.submit(r, **options)
            for r in requests
        ]
        return [handle.result(timeout) for handle in handles]

    @property
    def stats(self) -> EngineStats:
        with self._cond:
            return replace(self._stats)

    def close(self, cancel: bool = False, timeout: float | None = None) -> None:
        """Stop taking requests; finish the open ones (or cancel them) and stop the workers."""
        with self._cond:
            self._closing = True
            if cancel:
                for handle in list(self._handles):
                    handle.cancel()
            self._cond.notify_all()
        for thread in self._threads:
            thread.join(timeout)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        self.close(cancel=exc_type is not None)

    # Workers ------------------------------------------------------------------------------------------
    def _guard(self, work: Callable[[], None]) -> None:
        """Run a worker; an error of the engine itself fails every open request."""
        try:
            work()
        except BaseException as error:
            with self._cond:
                self._error = error
                for handle in list(self._handles):
                    handle._resolve(error=error)
                self._cond.notify_all()

    def _ssm_worker(self) -> None:
        while (taken := self._take_group()) is not None:
            group = self._draft(*taken)
            with self._cond:
                if len(group):
                    self._pool.append(group)
                    pooled = sum(len(g) for g in self._pool)
                    self._stats.max_pool_sequences = max(self._stats.max_pool_sequences, pooled)
                else:
                    self._idle.append(group)
                self._cond.notify_all()
                start = time.perf_counter()  # Minions' back-pressure: pause while the pool is full
                self._cond.wait_for(
                    lambda: (
                        sum(len(g) for g in self._pool) < self.config.batch_size or self._error is not None
                    )
                )
                self._stats.paused_seconds += time.perf_counter() - start

    def _llm_worker(self) -> None:
        while (group := self._take_pooled()) is not None:
            group = self._verify(group)
            with self._cond:
                self._idle.append(group)
                self._cond.notify_all()

    def _serial_worker(self) -> None:
        while (taken := self._take_group()) is not None:
            group = self._draft(*taken)
            if len(group):
                group = self._verify(group)
            with self._cond:
                self._idle.append(group)
                self._cond.notify_all()

    # Taking work (under the lock) ----------------------------------------------------------------
    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _finished(self) -> bool:
        """Nothing left to do, ever: closing, no open queued request, every group home and empty."""
        if self._error is not None:
            return True
        return (
            self._closing
            and all(row.tag.done() for row in self._queue)
            and len(self._idle) == self.config.num_groups
            and not any(len(g) for g in self._idle)
        )

    def _take_group(self) -> tuple[SequenceGroup, list[SequenceState]] | None:
        """An idle group with work (rows, or free slots and queued requests) and the queued
        requests that fill its free slots; None when the engine is finished."""
        with self._cond:
            while True:
                if self._finished():
                    return None
                while self._queue and self._queue[0].tag.done():  # cancelled while queued
                    self._queue.popleft()
                for group in self._idle:
                    if len(group) or self._queue:
                        self._idle.remove(group)
                        free = self.config.batch_size - len(group)
                        admitted = [self._queue.popleft() for _ in range(min(free, len(self._queue)))]
                        return group, admitted
                self._cond.wait()

    def _take_pooled(self) -> SequenceGroup | None:
        with self._cond:
            self._cond.wait_for(lambda: self._pool or self._finished())
            return self._pool.popleft() if self._pool and self._error is None else None

    # Rounds (outside the lock: only the worker holding the group touches it) ----------------------
    def _draft(self, group: SequenceGroup, admitted: list[SequenceState]) -> SequenceGroup:
        """The SSM side: drop cancelled rows, admit new ones, draft every row's tree."""
        start = time.perf_counter()
        try:
            group.retain(lambda row: not row.tag.done())
            now = time.perf_counter()
            for row in admitted:
                row.started = now
            group.admit([row for row in admitted if not row.tag.done()])
            if len(group):
                group.draft()
        except Exception as error:
            group = self._fail(group, admitted, error)
        with self._cond:
            self._stats.draft_rounds += 1
            self._stats.draft_seconds += time.perf_counter() - start
        return group

    def _verify(self, group: SequenceGroup) -> SequenceGroup:
        """The LLM side: one verification pass; finished rows resolve their requests."""
        start = time.perf_counter()
        try:
            finished = group.verify()
        except Exception as error:
            return self._fail(group, [], error)
        completed = 0
        for row in finished:
            handle = row.tag
            completed += handle._resolve(
                RequestResult(
                    sequences=torch.tensor([row.tokens], dtype=torch.long),
                    finish_reason=row.finish_reason,
                    stats=row.stats,
                    latency=row.finished - handle.submitted,
                    queued=row.started - handle.submitted,
                )
            )
        with self._cond:
            self._stats.llm_steps += 1
            self._stats.completed += completed
            self._stats.verify_seconds += time.perf_counter() - start
        return group

    def _fail(self, group: SequenceGroup, admitted: list[SequenceState], error: Exception) -> SequenceGroup:
        """Fail the requests of a group whose round raised; a fresh group takes its place."""
        rows = {id(row): row for row in [*group.rows, *admitted]}.values()
        failed = sum(row.tag._resolve(error=error) for row in rows)
        with self._cond:
            self._stats.failed += failed
        return self._new_group()
