"""`specboost serve`: the server's own options, and running it under uvicorn.

    specboost serve --llm LLM_DIR --pool POOL_DIR|ID [--host 127.0.0.1 --port 8000 --api-key KEY]

The models and how they decode come from the options `specboost generate` takes
(`decoder/cli.py`); these add where the server listens, its batches and its limits.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from collections.abc import Callable
from pathlib import Path

from specboost.decoder.engine import EngineConfig
from specboost.decoder.loop import LoopParts
from specboost.decoder.serve.config import API_KEY_ENV, ServerConfig, api_key_from_env

logger = logging.getLogger(__name__)
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
# Folder names that do not say which model is in them: the served name skips them (`model_name_of`).
GENERIC_FOLDERS = frozenset(
    {"model", "models", "llm", "hf", "checkpoint", "checkpoints", "final", "weights", "artifacts"}
)
LIMITS = {  # ServerConfig field -> its option's help (the option: --field-name)
    "max_body_bytes": "the largest request body in bytes",
    "max_prompt_tokens": "the longest prompt, in tokens after the chat template",
    "max_tokens_limit": "the most max_tokens a request may ask",
    "default_max_tokens": "max_tokens of a request that gives none",
    "request_timeout": "seconds after which a request is ended and its row freed",
}


def bounded(
    kind: type[int] | type[float], low: int | None = None, high: int | None = None
) -> Callable[[str], int | float]:
    """An argparse type: a finite number of `kind` within [low, high], else a one-line usage
    error saying what is expected (also for `specboost generate`'s numbers, `decoder/cli.py`)."""
    what = "an integer" if kind is int else "a finite number"
    if low is not None:
        what += f" from {low}" if high is not None else f" >= {low}"
    if high is not None:
        what += f" to {high}" if low is not None else f" <= {high}"

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if (
            not math.isfinite(value)
            or (low is not None and value < low)
            or (high is not None and value > high)
        ):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    return parse


def model_name_of(llm: Path) -> str:
    """The name the LLM is served under by default: its folder's name or, when that is generic
    (model, llm, checkpoint ...), the nearest folder above it that is not, with its parent unless
    that is generic too: models/my-llm -> my-llm; artifacts/reference-llm/tiny/model ->
    reference-llm/tiny; models/llama-3/model -> llama-3. The pool is not in it: speculation is
    lossless, so the text is the LLM's whichever pool drafts."""
    named = list(Path(llm).resolve().parts[1:]) or ["specboost"]
    if named[-1].lower() not in GENERIC_FOLDERS:
        return named[-1]
    while len(named) > 1 and named[-1].lower() in GENERIC_FOLDERS:
        named.pop()
    if len(named) > 1 and named[-2].lower() not in GENERIC_FOLDERS:
        return f"{named[-2]}/{named[-1]}"
    return named[-1]


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    d = ServerConfig()
    net = parser.add_argument_group("server")
    net.add_argument("--host", default=d.host, help=f"address to bind (default: {d.host}, this machine only)")
    net.add_argument("--port", type=bounded(int, 1, 65535), default=d.port, help=f"(default: {d.port})")
    net.add_argument(
        "--api-key",
        metavar="KEY",
        help=f"require 'Authorization: Bearer KEY' on every route but /health (default: ${API_KEY_ENV}, "
        "else no key)",
    )
    net.add_argument(
        "--served-model-name",
        metavar="NAME",
        help="the `model` clients ask for (default: the --llm folder's name; when that is generic, such as "
        "model or llm, the nearest folder above that is not, with its parent unless generic: "
        "artifacts/reference-llm/tiny/model -> reference-llm/tiny, models/llama-3/model -> llama-3)",
    )
    net.add_argument(
        "--shutdown-timeout",
        type=bounded(int, 1),
        default=d.shutdown_timeout,
        metavar="S",
        help="on Ctrl-C or SIGTERM, seconds open requests get to finish before they are ended "
        f"(default: {d.shutdown_timeout})",
    )
    e = EngineConfig()
    batching = parser.add_argument_group("batching (the engine: continuous ragged batches)")
    batching.add_argument(
        "--batch-size",
        type=bounded(int, 1),
        default=8,
        metavar="B",
        help="sequences per LLM pass (default: 8)",
    )
    batching.add_argument(
        "--num-groups",
        type=bounded(int, 1),
        default=e.num_groups,
        metavar="N",
        help=f"batches in flight: drafting one overlaps verifying another (default: {e.num_groups})",
    )
    batching.add_argument(
        "--max-queue",
        type=bounded(int, 1),
        default=64,
        metavar="N",
        help="requests waiting for a batch row beyond which new ones get 429 (default: 64)",
    )
    limits = parser.add_argument_group("limits (a request past one gets 400 or 413, naming it)")
    for field, meaning in LIMITS.items():
        default = getattr(d, field)
        limits.add_argument(
            "--" + field.replace("_", "-"),
            type=bounded(int, 1) if isinstance(default, int) else bounded(float),
            default=default,
            metavar="N",
            help=f"{meaning} (default: {default})",
        )


def server_config(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(
        host=args.host,
        port=args.port,
        api_key=api_key_from_env(args.api_key),
        model_name=args.served_model_name or model_name_of(args.llm),
        shutdown_timeout=args.shutdown_timeout,
        **{field: getattr(args, field) for field in LIMITS},
    )


def serve(args: argparse.Namespace, build_decoder: Callable[[], LoopParts]) -> int:
    """Serve the decoder `build_decoder` makes (once the server's options are checked) until
    interrupted: Ctrl-C or SIGTERM stops taking requests, gives the open ones up to
    --shutdown-timeout seconds to finish, ends the rest (their engine requests cancelled) and stops.
    The web stack (uvicorn, fastapi and what it imports) is imported here, not with the module: every
    `specboost` command builds its parser from this module, and `specboost profile` on a GPU machine
    whose environment lacked fastapi's dependencies failed on an import it never used."""
    import uvicorn

    from specboost.decoder.serve.app import create_app

    config = server_config(args)
    engine = EngineConfig(batch_size=args.batch_size, num_groups=args.num_groups, max_queue=args.max_queue)
    if config.host not in LOCAL_HOSTS and config.api_key is None:
        print(
            f"specboost serve: warning: listening on {config.host} without an API key: anyone who can reach "
            f"this machine can use it (give --api-key or ${API_KEY_ENV})",
            file=sys.stderr,
        )
    app = create_app(build_decoder(), config, engine)
    print(
        f"specboost serve: model {config.model_name!r} on http://{config.host}:{config.port}/v1",
        file=sys.stderr,
    )
    uvicorn.run(
        app,
        host=config.host,
        port=config.port,
        log_level="info",
        timeout_graceful_shutdown=config.shutdown_timeout,
    )
    return 0
