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

For a server: `submit(..., streamer=...)` streams a request's tokens as `SpeculativeDecoder.generate`
does (`TokenStream`: the prompt, put by `submit`, then each step's kept tokens, put by the worker
that verifies) and ends the stream exactly once, right after the request resolves: finished (its
result is ready when `end()` comes), failed, or cancelled (then `end()` comes from the thread that
cancels, and nothing is put after it). A streamer that raises fails its group's requests like any
error of a round. `EngineConfig.max_queue` bounds the requests waiting for a row (`submit` raises
`QueueFull` beyond it); `queue_depth`, `active_rows` and `stats` (with running totals of the
completed requests' `DecodeStats`) are live metrics.
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
from transformers.generation.streamers import BaseStreamer

from specboost.decoder.loop import BatchConfig, LoopParts, SequenceGroup
from specboost.decoder.sequence import SequenceState, TokenStream, new_sequence
from specboost.decoder.stats import DecodeStats
from specboost.decoder.validation import check_generate_arguments, output_vocab_size


@dataclass(frozen=True)
class EngineConfig:
    """batch_size: sequences per group, i.e. the LLM's batch in one verification pass.
    num_groups: groups in flight; with 2 or more, drafting one group overlaps verifying another.
    pipeline: the SSM and LLM workers run concurrently (threads); False runs them in turn.
    batch: how each group drafts (`BatchConfig`: batched chains, the BASS length controller).
    max_queue: the most requests that may wait for a row (submitted, not cancelled, not yet in a
        group); `submit` raises `QueueFull` when that many wait. None: no limit."""

    batch_size: int = 4
    num_groups: int = 2
    pipeline: bool = True
    batch: BatchConfig = field(default_factory=BatchConfig)
    max_queue: int | None = None

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.num_groups < 1:
            raise ValueError(
                f"batch_size and num_groups must be >= 1, got {self.batch_size}, {self.num_groups}"
            )
        if self.max_queue is not None and self.max_queue < 1:  # every request waits, if only briefly
            raise ValueError(f"max_queue must be >= 1 or None (no limit), got {self.max_queue}")


class QueueFull(RuntimeError):
    """`submit` refused a request: `EngineConfig.max_queue` requests are already waiting."""


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
    """A submitted request; resolves exactly once: a result, an error, or cancelled. Its stream,
    if any, ends right after."""

    def __init__(
        self, on_cancel: Callable[[], None] = lambda: None, stream: TokenStream | None = None
    ) -> None:
        self.submitted = time.perf_counter()
        self._on_cancel = on_cancel  # counts the cancellation, wakes the engine's workers
        self._stream = stream
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
        if self._stream is not None:
            self._stream.end()
        return True

    def cancel(self) -> bool:
        """Stop the request (queued or running); False if it had already finished. A running
        request leaves its group at the group's next round."""
        cancelled = self._resolve(error=CancelledError("the request was cancelled"))
        if cancelled:
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
    cancelled: int = 0  # requests cancelled before they finished
    llm_steps: int = 0  # verification passes
    draft_rounds: int = 0
    verify_seconds: float = 0.0  # the LLM worker's busy time
    draft_seconds: float = 0.0  # the SSM worker's busy time (admission included)
    paused_seconds: float = 0.0  # the SSM worker's wait on back-pressure
    max_pool_sequences: int = 0  # the most sequences ever waiting in the pool
    # Totals of the completed requests' `DecodeStats` (ALGORITHMS.md section 13).
    new_tokens: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    sequence_steps: int = 0  # verification steps summed over requests (a pass over B rows counts B)
    proposed_per_ssm: dict[int, int] = field(default_factory=dict)
    accepted_per_ssm: dict[int, int] = field(default_factory=dict)

    def add(self, request: DecodeStats) -> None:
        """Count a completed request's statistics in the totals."""
        self.new_tokens += request.new_tokens
        self.draft_tokens += request.draft_tokens
        self.accepted_tokens += request.accepted_tokens
        self.sequence_steps += request.llm_steps
        for counts, total in (
            (request.proposed_per_ssm, self.proposed_per_ssm),
            (request.accepted_per_ssm, self.accepted_per_ssm),
        ):
            for ssm, n in counts.items():
                total[ssm] = total.get(ssm, 0) + n

    def copy(self) -> EngineStats:
        """A snapshot that later rounds do not change (the per-SSM dicts copied too)."""
        return replace(
            self, proposed_per_ssm=dict(self.proposed_per_ssm), accepted_per_ssm=dict(self.accepted_per_ssm)
        )


class Engine:
    """Serves requests for `decoder` (its models, strategy and verification rule); see the module
    doc. Use as a context manager, or call `close()`. While it runs, do not call
    `decoder.generate` from another thread (the engine copies the decoder's speculator)."""

    def __init__(self, decoder: LoopParts, config: EngineConfig | None = None) -> None:
        self.decoder = decoder
        self.config = config or EngineConfig()
        self._cond = threading.Condition()
        self._queue: deque[SequenceState] = deque()  # submitted, not yet in a group
        self._groups = [self._new_group() for _ in range(self.config.num_groups)]  # wherever they are
        # Groups waiting for the SSM worker; the others are in the pool or held by a worker.
        self._idle: deque[SequenceGroup] = deque(self._groups)
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
        """A group whose seeded rows keep their own chain length: a request's seed gives one text,
        whichever requests share its batch (`BatchConfig.seeded_rows_keep_length`)."""
        return SequenceGroup(self.decoder, replace(self.config.batch, seeded_rows_keep_length=True))

    # Public API ------------------------------------------------------------------------------------
    def submit(
        self,
        prompt_ids: Sequence[int] | torch.Tensor,
        *,
        generation_config: GenerationConfig | None = None,
        seed: int | None = None,
        streamer: BaseStreamer | None = None,
        **options: object,
    ) -> RequestHandle:
        """Queue one prompt (token ids, [L] or [1, L]); `options` as for `SpeculativeDecoder.generate`
        (max_new_tokens, do_sample, ..., any `GenerationConfig` field). Bad settings raise here,
        before `streamer` sees anything. `streamer` gets the prompt now, then the request's tokens
        as they are verified, then `end()` once (see the module doc); if the engine then refuses
        the request (`QueueFull`, closed), the stream ends before the error is raised."""
        request = self._request(
            prompt_ids, generation_config=generation_config, seed=seed, streamer=streamer, **options
        )
        return self._enqueue([request])[0]

    def _request(
        self,
        prompt_ids: Sequence[int] | torch.Tensor,
        *,
        generation_config: GenerationConfig | None = None,
        seed: int | None = None,
        streamer: BaseStreamer | None = None,
        **options: object,
    ) -> SequenceState:
        """A checked request's row, its `RequestHandle` as its tag (not queued yet); the keywords
        of `submit`."""
        ids = torch.as_tensor(prompt_ids)
        check_generate_arguments(ids, None, options, seed, output_vocab_size(self.decoder.llm))
        row = new_sequence(
            self.decoder, ids.reshape(-1), None, generation_config, options, seed, streamer=streamer
        )
        row.tag = RequestHandle(self._cancelled, row.stream)
        return row

    def _enqueue(self, rows: list[SequenceState]) -> list[RequestHandle]:
        """Queue `rows` in one hold of the lock, so that a worker admits them together (as many as
        a group has free rows); from the first one refused on, the rest are resolved with the
        refusal, which is raised."""
        queued, refusal = 0, None
        with self._cond:
            for row in rows:
                if (refusal := self._refusal()) is not None:
                    break
                self._queue.append(row)
                self._handles.add(row.tag)
                queued += 1
            self._cond.notify_all()
        if refusal is not None:
            for row in rows[queued:]:
                row.tag._resolve(error=refusal)  # ends the stream, outside the engine's lock
            raise refusal
        return [row.tag for row in rows]

    @property
    def queue_depth(self) -> int:
        """Requests waiting for a row: submitted, not cancelled, not yet in a group."""
        with self._cond:
            return self._waiting()

    @property
    def active_rows(self) -> int:
        """Rows in the groups now (a cancelled request's row until its group's next round)."""
        with self._cond:
            return sum(len(group) for group in self._groups)

    def run(
        self,
        requests: Sequence[Request | Sequence[int] | torch.Tensor],
        timeout: float | None = None,
        **options: object,
    ) -> list[RequestResult]:
        """Submit every request (a `Request`, or a prompt with `options`), then wait for all;
        results in request order. The requests are checked first and queued together, so that
        they join groups together (a group's rows and cache shapes then do not depend on how
        fast the workers take the first ones)."""
        rows = []
        for r in requests:
            request = r if isinstance(r, Request) else Request(r)
            rows.append(self._request(request.prompt_ids, **(options | request.options)))
        return [handle.result(timeout) for handle in self._enqueue(rows)]

    @property
    def stats(self) -> EngineStats:
        with self._cond:
            return self._stats.copy()

    @property
    def failed(self) -> BaseException | None:
        """The engine's own error once it has failed (every open request failed with it), else None."""
        with self._cond:
            return self._error

    def close(self, cancel: bool = False, timeout: float | None = None) -> None:
        """Stop taking requests; finish the open ones (or cancel them) and stop the workers."""
        with self._cond:
            self._closing = True
            handles = list(self._handles) if cancel else []
            self._cond.notify_all()
        for handle in handles:  # outside the lock: cancelling ends streams (the user's code)
            handle.cancel()
        for thread in self._threads:
            thread.join(timeout)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        self.close(cancel=exc_type is not None)

    # Workers ------------------------------------------------------------------------------------------
    def _guard(self, work: Callable[[], None]) -> None:
        """Run a worker, under `torch.inference_mode` as `loop.decode` runs (a thread does not inherit
        its creator's mode); an error of the engine itself fails every open request."""
        try:
            with torch.inference_mode():
                work()
        except BaseException as error:
            with self._cond:
                self._error = error
                handles = list(self._handles)
                self._cond.notify_all()
            for handle in handles:  # outside the lock: resolving ends streams (the user's code)
                handle._resolve(error=error)

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
    def _cancelled(self) -> None:
        with self._cond:
            self._stats.cancelled += 1
            self._cond.notify_all()

    def _waiting(self) -> int:
        return sum(not row.tag.done() for row in self._queue)

    def _refusal(self) -> RuntimeError | None:
        """Why a new request cannot be queued now, if it cannot."""
        if self._error is not None:
            return RuntimeError(f"the engine failed: {self._error!r}")
        if self._closing:
            return RuntimeError("the engine is closed")
        limit = self.config.max_queue
        if limit is not None and self._waiting() >= limit:
            return QueueFull(
                f"{limit} requests are already waiting for a batch row, the engine's limit "
                f"(EngineConfig.max_queue={limit}); retry later"
            )
        return None

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
        completed = [  # resolved with a result (a request cancelled meanwhile is not)
            row
            for row in finished
            if row.tag._resolve(
                RequestResult(
                    sequences=_user_tensor([row.tokens], self.decoder.llm.device),
                    finish_reason=row.finish_reason,
                    stats=row.stats,
                    latency=row.finished - row.tag.submitted,
                    queued=row.started - row.tag.submitted,
                )
            )
        ]
        with self._cond:
            self._stats.llm_steps += 1
            self._stats.completed += len(completed)
            for row in completed:
                self._stats.add(row.stats)
            self._stats.verify_seconds += time.perf_counter() - start
        return group

    def _fail(self, group: SequenceGroup, admitted: list[SequenceState], error: Exception) -> SequenceGroup:
        """Fail the requests of a group whose round raised; a fresh group takes its place."""
        rows = {id(row): row for row in [*group.rows, *admitted]}.values()
        failed = sum(row.tag._resolve(error=error) for row in rows)
        fresh = self._new_group()
        with self._cond:
            self._stats.failed += failed
            self._groups[self._groups.index(group)] = fresh
        return fresh


def _user_tensor(rows: list[list[int]], device: torch.device) -> torch.Tensor:
    """A tensor for the user, made outside the worker's inference mode: an inference tensor refuses
    in-place writes outside the mode."""
    with torch.inference_mode(False):
        return torch.tensor(rows, dtype=torch.long, device=device)
