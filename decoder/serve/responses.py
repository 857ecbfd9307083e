"""The OpenAI response bodies: whole answers and streamed chunks, for completions and chat."""

from __future__ import annotations

import time
from typing import Any, Protocol


class Finished(Protocol):
    """What a response is built from (`decoder/serve/app.py` `Generation`)."""

    id: str
    prompt_tokens: int
    finish_reason: str | None

    @property
    def completion_tokens(self) -> int: ...


def usage(g: Finished) -> dict[str, int]:
    return {
        "prompt_tokens": g.prompt_tokens,
        "completion_tokens": g.completion_tokens,
        "total_tokens": g.prompt_tokens + g.completion_tokens,
    }


class CompletionShapes:
    """/v1/completions: `text_completion` objects, whole or as chunks."""

    def __init__(self, model: str) -> None:
        self.model = model

    def _head(self, g: Finished) -> dict[str, Any]:
        return {
            "id": f"cmpl-{g.id}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model,
        }

    def opening(self, g: Finished) -> dict[str, Any] | None:
        return None

    def chunk(self, g: Finished, text: str, finish_reason: str | None) -> dict[str, Any]:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return self._head(g) | {"choices": [choice]}

    def usage_chunk(self, g: Finished) -> dict[str, Any]:
        return self._head(g) | {"choices": [], "usage": usage(g)}

    def whole(self, g: Finished, text: str) -> dict[str, Any]:
        return self.chunk(g, text, g.finish_reason) | {"usage": usage(g)}


class ChatShapes:
    """/v1/chat/completions: `chat.completion` objects, or `chat.completion.chunk`s whose first
    delta carries the role."""

    def __init__(self, model: str) -> None:
        self.model = model

    def _head(self, g: Finished, kind: str) -> dict[str, Any]:
        return {"id": f"chatcmpl-{g.id}", "object": kind, "created": int(time.time()), "model": self.model}

    def opening(self, g: Finished) -> dict[str, Any] | None:
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        return self._head(g, "chat.completion.chunk") | {"choices": [choice]}

    def chunk(self, g: Finished, text: str, finish_reason: str | None) -> dict[str, Any]:
        delta = {"content": text} if text else {}
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
        return self._head(g, "chat.completion.chunk") | {"choices": [choice]}

    def usage_chunk(self, g: Finished) -> dict[str, Any]:
        return self._head(g, "chat.completion.chunk") | {"choices": [], "usage": usage(g)}

    def whole(self, g: Finished, text: str) -> dict[str, Any]:
        message = {"role": "assistant", "content": text}
        choice = {"index": 0, "message": message, "finish_reason": g.finish_reason}
        return self._head(g, "chat.completion") | {"choices": [choice], "usage": usage(g)}


Shapes = CompletionShapes | ChatShapes
