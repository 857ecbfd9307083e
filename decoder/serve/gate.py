"""`Gate`: the ASGI layer in front of every route. It counts each answer by route and status,
requires the bearer token (all routes but /health), and reads a request body only up to the
configured size (413 beyond it), so that neither an unauthenticated nor an oversized request
ever reaches the handlers or the engine. Tokens are compared in constant time."""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from prometheus_client import Counter

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

OPEN_ROUTES = ("/health",)


def error_body(message: str, kind: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    """An error in OpenAI's format."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


async def send_error(
    send: Send, status: int, message: str, kind: str, headers: dict[str, str] | None = None
) -> None:
    body = json.dumps(error_body(message, kind)).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    head += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body})


class Gate:
    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int, requests: Counter) -> None:
        self.app = app
        self.expected = None if api_key is None else f"Bearer {api_key}".encode()
        self.max_body_bytes = max_body_bytes
        self.requests = requests

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = scope["path"]
        status = {"code": 500}

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self._guarded(scope, receive, counted, route)
        finally:
            self.requests.labels(route=route, status=str(status["code"])).inc()

    async def _guarded(self, scope: Scope, receive: Receive, send: Send, route: str) -> None:
        if self.expected is not None and route not in OPEN_ROUTES:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                await send_error(
                    send,
                    401,
                    "missing or wrong API key: send 'Authorization: Bearer <key>'",
                    "authentication_error",
                    {"www-authenticate": "Bearer"},
                )
                return
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await self._too_large(send)
            return
        body, more = bytearray(), True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_body_bytes:
                await self._too_large(send)
                return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, send: Send) -> None:
        await send_error(
            send,
            413,
            f"the request body exceeds this server's limit of {self.max_body_bytes} bytes (--max-body-bytes)",
            "invalid_request_error",
        )
