"""`Gate`: the ASGI layer in front of every route. It counts each answer by route and status,
requires the bearer token (all routes but /health), reads a request body only up to the
configured size (413 beyond it), so that neither an unauthenticated nor an oversized request
ever reaches the handlers or the engine, and answers an unexpected error with a 500 in OpenAI's
format (a log line holds the traceback). Tokens are compared in constant time.

Requests are counted by route template ("/v1/completions"), never by raw path: every path no
route matches shares the label "unmatched", so requests to random paths, authenticated or not,
cannot grow /metrics.
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any

from prometheus_client import Counter
from starlette.routing import BaseRoute, Match

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

logger = logging.getLogger(__name__)
OPEN_ROUTES = ("/health",)
UNMATCHED = "unmatched"  # the route label of every path that no route matches


def error_body(message: str, kind: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    """An error in OpenAI's format. Text the client sent (a path, a model name) may be quoted in
    `message`; a lone surrogate there is escaped, so that the error can always be encoded."""
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_kind(status: int) -> str:
    """OpenAI's error `type` for an HTTP status."""
    if status >= 500:
        return "server_error"
    return "authentication_error" if status == 401 else "invalid_request_error"


async def send_error(
    send: Send, status: int, message: str, kind: str, headers: dict[str, str] | None = None
) -> None:
    body = json.dumps(error_body(message, kind)).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    head += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body})


class Gate:
    """`routes`: the app's routes (its live list: routes added later count), for the labels."""

    def __init__(
        self,
        app: ASGIApp,
        api_key: str | None,
        max_body_bytes: int,
        requests: Counter,
        routes: Sequence[BaseRoute],
    ) -> None:
        self.app = app
        self.api_key = None if api_key is None else api_key.encode()
        self.max_body_bytes = max_body_bytes
        self.requests = requests
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status: int | None = None

        async def counted(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self._guarded(scope, receive, counted)
        except Exception:
            if status is not None:  # the answer has begun: all that is left is to drop the connection
                raise
            logger.exception("unexpected error answering %s %s", scope["method"], scope["path"])
            await send_error(counted, 500, "the server failed on this request (see its log)", "server_error")
        finally:
            self.requests.labels(route=self._route(scope), status=str(status or 500)).inc()

    def _route(self, scope: Scope) -> str:
        """The template of the route that takes this path (whatever its method), else UNMATCHED."""
        for route in self.routes:
            if route.matches(scope)[0] is not Match.NONE:
                return getattr(route, "path", UNMATCHED)
        return UNMATCHED

    def _authorized(self, scope: Scope) -> bool:
        """`Authorization: Bearer <key>`; the scheme's case does not matter (RFC 9110 11.1)."""
        scheme, _, token = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key)

    async def _guarded(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.api_key is not None and scope["path"] not in OPEN_ROUTES and not self._authorized(scope):
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
