"""`TokenQueue`: a transformers-style streamer that hands the engine's tokens to an asyncio task.

The engine calls `put` and `end` from its worker threads (`decoder/engine.py`); the request's
handler awaits `get` on the event loop. The first `put` is the prompt (as `generate` streams
it) and is skipped; `end` comes exactly once, when the request finishes, fails or is cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib

import torch

END = None  # what `get` returns once the request has ended


class TokenQueue:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._queue: asyncio.Queue[list[int] | None] = asyncio.Queue()
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self._send(value.reshape(-1).tolist())

    def end(self) -> None:
        self._send(END)

    async def get(self) -> list[int] | None:
        """The next step's tokens, or END."""
        return await self._queue.get()

    def _send(self, item: list[int] | None) -> None:
        with contextlib.suppress(RuntimeError):  # a closed event loop (shutting down): nobody listens
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
