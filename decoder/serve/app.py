"""The OpenAI-compatible HTTP server on the serving engine (`create_app`).

    /v1/completions, /v1/chat/completions   streamed (server-sent events) or whole
    /v1/models                              the one model served
    /metrics                                Prometheus text format (`decoder/serve/metrics.py`)
    /health                                 200 while the engine runs (no API key needed)

Every request becomes one engine request (`Engine.submit`): concurrent requests share the
engine's ragged batches (Minions, BASS; ALGORITHMS.md sections 10-11), and its tokens come back
a verification step at a time through a `TokenQueue`. A full queue answers 429 with
Retry-After. A client that disconnects (noticed as it happens, streamed or not), or a request
past `request_timeout` (a whole answer: 504; a stream: ends with finish_reason "length"),
cancels its engine request, which frees its batch row at the engine's next step. Prompts are
tokenized (and chat templates applied) in a worker thread, so that a long prompt never holds up
the event loop and the other requests on it. Every error, the framework's own included, is
answered in OpenAI's format. Nothing from a request reaches a shell, a file path or model
loading: it only ever becomes token ids and generation options.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import CancelledError
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from specboost.decoder.engine import Engine, EngineConfig, QueueFull, RequestHandle
from specboost.decoder.loop import LoopParts
from specboost.decoder.serve.config import ServerConfig
from specboost.decoder.serve.gate import Gate, error_body, error_kind
from specboost.decoder.serve.metrics import CONTENT_TYPE, ServerMetrics
from specboost.decoder.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerationFields,
    RequestError,
    requested_max_tokens,
)
from specboost.decoder.serve.responses import ChatShapes, CompletionShapes, Shapes
from specboost.decoder.serve.text_stream import TextStream
from specboost.decoder.serve.token_queue import END, TokenQueue

FINISH_REASONS = {"eos": "stop", "stop_string": "stop", "length": "length", "time": "length"}


@dataclass
class Generation:
    """One request in flight: its engine handle, its tokens' queue and text, and its clock."""

    handle: RequestHandle
    tokens: TokenQueue
    text: TextStream
    prompt_tokens: int
    arrived: float
    first_token: float | None = None
    finish_reason: str | None = None
    error: BaseException | None = None
    timed_out: bool = False  # cancelled at the time limit
    client_gone: bool = False  # cancelled because the client disconnected
    id: str = field(default_factory=lambda: uuid.uuid4().hex)

    @property
    def completion_tokens(self) -> int:
        return len(self.text.ids)


class Server:
    """The engine, its metrics and the request handling behind the routes of `create_app`."""

    def __init__(self, decoder: LoopParts, config: ServerConfig, engine_config: EngineConfig) -> None:
        if decoder.tokenizer is None:
            raise ValueError("the server needs the LLM's tokenizer: build the decoder with tokenizer=")
        self.decoder, self.config, self.engine_config = decoder, config, engine_config
        self.tokenizer = decoder.tokenizer
        self.engine: Engine | None = None
        self.metrics = ServerMetrics(lambda: self.engine)

    # Requests ------------------------------------------------------------------------------------
    def prompt_ids(self, body: GenerationFields) -> list[int]:
        if isinstance(body, ChatCompletionRequest):
            if not getattr(self.tokenizer, "chat_template", None):
                raise RequestError(
                    "this model's tokenizer has no chat template: use /v1/completions with a plain prompt",
                    param="messages",
                )
            try:
                text = self.tokenizer.apply_chat_template(
                    body.conversation(), add_generation_prompt=True, tokenize=False
                )
            except Exception as error:  # jinja2 errors raised by the template itself
                raise RequestError(
                    f"the chat template refused the messages: {error}", param="messages"
                ) from None
            return self.tokenizer(text, add_special_tokens=False).input_ids
        prompt = body.single_prompt
        return self.tokenizer(prompt).input_ids if isinstance(prompt, str) else list(prompt)

    async def respond(self, body: GenerationFields, request: Request, shapes: Shapes) -> Response:
        arrived = time.perf_counter()
        config = self.config
        if body.model != config.model_name:
            raise RequestError(
                f"the model {body.model!r} is not served here; this server serves {config.model_name!r}",
                status=404,
                code="model_not_found",
                param="model",
            )
        ids = await asyncio.to_thread(self.prompt_ids, body)
        if not ids:
            raise RequestError("the prompt is empty", param="prompt")
        if len(ids) > config.max_prompt_tokens:
            raise RequestError(
                f"the prompt has {len(ids)} tokens; this server's limit is {config.max_prompt_tokens} "
                "(--max-prompt-tokens)",
                param="prompt",
            )
        max_tokens = requested_max_tokens(body, config.default_max_tokens, config.max_tokens_limit)
        generation = self.submit(body, ids, max_tokens, arrived)
        self.metrics.prompt_tokens.inc(len(ids))
        if body.stream:
            events = self.events(generation, request, shapes, body.include_usage)
            return StreamingResponse(
                events, media_type="text/event-stream", headers={"cache-control": "no-cache"}
            )
        text = "".join([piece async for piece in self.run(generation, request)])
        if generation.timed_out:
            message = (
                f"the request ran past this server's limit of {config.request_timeout} s (--request-timeout)"
            )
            return JSONResponse(error_body(message, "server_error", "request_timeout"), 504)
        if generation.error is not None:
            return JSONResponse(error_body(f"generation failed: {generation.error}", "server_error"), 500)
        return JSONResponse(shapes.whole(generation, text))

    def submit(self, body: GenerationFields, ids: list[int], max_tokens: int, arrived: float) -> Generation:
        tokens = TokenQueue(asyncio.get_running_loop())
        try:
            handle = self.engine.submit(
                ids, seed=body.seed, streamer=tokens, **body.generation_options(max_tokens)
            )
        except QueueFull as error:
            raise RequestError(str(error), status=429, code="queue_full") from None
        except ValueError as error:  # options or a prompt the engine cannot take (context length ...)
            raise RequestError(str(error)) from None
        return Generation(handle, tokens, TextStream(self.tokenizer, body.stop_sequences), len(ids), arrived)

    async def run(self, generation: Generation, request: Request) -> AsyncIterator[str]:
        """The request's text as it is accepted, up to the engine's end or a stop sequence. A
        client that leaves, or the time limit, cancels the engine request at once (its row leaves
        the batch at the engine's next step), which ends the text."""
        loop = asyncio.get_running_loop()
        left = generation.arrived + self.config.request_timeout - time.perf_counter()
        limit = loop.call_later(max(0.0, left), _time_out, generation)
        watch = asyncio.create_task(_cancel_when_gone(generation, request))
        try:
            while (ids := await generation.tokens.get()) is not END:
                if generation.text.stopped:
                    # The engine ends at the step that completes a stop sequence too (the same stop
                    # strings), and then counts the request completed; should it go on (its match
                    # is on tokens, this one on text), it is cancelled here.
                    generation.handle.cancel()
                    continue
                if generation.first_token is None and ids:
                    generation.first_token = time.perf_counter()
                    self.metrics.time_to_first_token.observe(generation.first_token - generation.arrived)
                if piece := generation.text.add(ids):
                    yield piece
            if piece := generation.text.finish():
                yield piece
            generation.finish_reason = "stop" if generation.text.stopped else self._engine_finish(generation)
            if not generation.client_gone:
                self.metrics.latency.observe(time.perf_counter() - generation.arrived)
        finally:
            limit.cancel()
            watch.cancel()
            generation.handle.cancel()  # frees the row if it is still running; a no-op once finished

    @staticmethod
    def _engine_finish(generation: Generation) -> str:
        try:
            result = generation.handle.result(timeout=0)
        except CancelledError:
            return "length"
        except Exception as error:
            generation.error = error
            return "error"
        return FINISH_REASONS.get(result.finish_reason, result.finish_reason)

    async def events(
        self, generation: Generation, request: Request, shapes: Shapes, include_usage: bool
    ) -> AsyncIterator[str]:
        """Server-sent events: the chunks, the closing chunk (or an error), then [DONE]."""
        if opening := shapes.opening(generation):
            yield _event(opening)
        async for piece in self.run(generation, request):
            yield _event(shapes.chunk(generation, piece, None))
        if generation.error is not None:
            yield _event(error_body(f"generation failed: {generation.error}", "server_error"))
        else:
            yield _event(shapes.chunk(generation, "", generation.finish_reason))
            if include_usage:
                yield _event(shapes.usage_chunk(generation))
        yield "data: [DONE]\n\n"


def _time_out(generation: Generation) -> None:
    generation.timed_out = generation.handle.cancel()  # False: it had finished in time after all


async def _cancel_when_gone(generation: Generation, request: Request) -> None:
    """Wait for the client to disconnect, then cancel its engine request. The body has been read,
    so the next message is the disconnect (it comes at once once the answer is complete, when
    this watch is no longer running)."""
    while (await request.receive())["type"] != "http.disconnect":
        continue
    generation.client_gone = True
    generation.handle.cancel()


def _event(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def create_app(
    decoder: LoopParts, config: ServerConfig, engine_config: EngineConfig | None = None
) -> FastAPI:
    """The server for `decoder` (which needs its tokenizer). The engine starts with the app and is
    closed, its open requests cancelled, when the app shuts down."""
    server = Server(decoder, config, engine_config or EngineConfig())

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        server.engine = Engine(decoder, server.engine_config)
        try:
            yield
        finally:
            server.engine.close(cancel=True, timeout=30)

    app = FastAPI(title="specboost", lifespan=lifespan)
    app.state.server = server
    app.add_middleware(
        Gate,
        api_key=config.api_key,
        max_body_bytes=config.max_body_bytes,
        requests=server.metrics.requests,
        routes=app.routes,
    )

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, error: RequestValidationError) -> JSONResponse:
        errors = error.errors()
        fields = [".".join(str(p) for p in e["loc"][1:]) for e in errors]
        problems = "; ".join(
            f"{field or 'body'}: {e['msg']}" for field, e in zip(fields, errors, strict=True)
        )
        param = fields[0] if fields and fields[0] else None
        return JSONResponse(error_body(problems, "invalid_request_error", param=param), status_code=400)

    @app.exception_handler(HTTPException)
    async def framework_error(request: Request, error: HTTPException) -> JSONResponse:
        """The framework's own errors (an unknown route, a wrong method, a body it cannot parse)."""
        message = str(error.detail)
        if error.status_code in (404, 405):
            message = f"{message}: {request.method} {request.url.path}"
        elif error.__cause__ is not None:  # why the body could not be parsed: bad UTF-8, nesting ...
            message = f"{message}: {error.__cause__}"
        body = error_body(message, error_kind(error.status_code))
        return JSONResponse(body, status_code=error.status_code, headers=error.headers)

    @app.exception_handler(RequestError)
    async def refused(_: Request, error: RequestError) -> JSONResponse:
        headers = {"retry-after": str(config.retry_after)} if error.status == 429 else None
        body = error_body(str(error), "invalid_request_error", error.code, error.param)
        return JSONResponse(body, status_code=error.status, headers=headers)

    @app.get("/health")
    async def health() -> JSONResponse:
        failed = server.engine.failed if server.engine is not None else None
        if failed is not None:
            body = error_body(f"the engine failed: {failed!r}", "server_error", "engine_failed")
            return JSONResponse(body, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": config.model_name, "object": "model", "created": 0, "owned_by": "specboost"}
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await server.respond(body, request, CompletionShapes(config.model_name))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await server.respond(body, request, ChatShapes(config.model_name))

    return app
