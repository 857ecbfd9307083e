"""`specboost serve`: the server's own options, and running it under uvicorn.

    specboost serve --llm LLM_DIR --pool POOL_DIR|ID [--host 127.0.0.1 --port 8000 --api-key KEY]

The models and how they decode come from the options `specboost generate` takes
(`decoder/cli.py`); these add where the server listens, its batches and its limits.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from pathlib import Path

import uvicorn

from specboost.decoder.engine import EngineConfig
from specboost.decoder.loop import LoopParts
from specboost.decoder.serve.app import create_app
from specboost.decoder.serve.config import API_KEY_ENV, ServerConfig, api_key_from_env

logger = logging.getLogger(__name__)
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
LIMITS = {  # ServerConfig field -> its option's help (the option: --field-name)
    "max_body_bytes": "the largest request body in bytes",
    "max_prompt_tokens": "the longest prompt, in tokens after the chat template",
    "max_tokens_limit": "the most max_tokens a request may ask",
    "default_max_tokens": "max_tokens of a request that gives none",
    "request_timeout": "seconds after which a request is ended and its row freed",
}


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    d = ServerConfig()
    net = parser.add_argument_group("server")
    net.add_argument("--host", default=d.host, help=f"address to bind (default: {d.host}, this machine only)")
    net.add_argument("--port", type=int, default=d.port, help=f"(default: {d.port})")
    net.add_argument(
        "--api-key",
        metavar="KEY",
        help=f"require 'Authorization: Bearer KEY' on every route but /health (default: ${API_KEY_ENV}, "
        "else no key)",
    )
    net.add_argument(
        "--served-model-name",
        metavar="NAME",
        help="the `model` clients ask for (default: the LLM folder's name)",
    )
    e = EngineConfig()
    batching = parser.add_argument_group("batching (the engine: continuous ragged batches)")
    batching.add_argument(
        "--batch-size", type=int, default=8, metavar="B", help="sequences per LLM pass (default: 8)"
    )
    batching.add_argument(
        "--num-groups",
        type=int,
        default=e.num_groups,
        metavar="N",
        help=f"batches in flight: drafting one overlaps verifying another (default: {e.num_groups})",
    )
    batching.add_argument(
        "--max-queue",
        type=int,
        default=64,
        metavar="N",
        help="requests waiting for a batch row beyond which new ones get 429 (default: 64)",
    )
    limits = parser.add_argument_group("limits (a request past one gets 400 or 413, naming it)")
    for field, meaning in LIMITS.items():
        default = getattr(d, field)
        limits.add_argument(
            "--" + field.replace("_", "-"),
            type=type(default),
            default=default,
            metavar="N",
            help=f"{meaning} (default: {default})",
        )


def server_config(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(
        host=args.host,
        port=args.port,
        api_key=api_key_from_env(args.api_key),
        model_name=args.served_model_name or Path(args.llm).name,
        **{field: getattr(args, field) for field in LIMITS},
    )


def serve(args: argparse.Namespace, build_decoder: Callable[[], LoopParts]) -> int:
    """Serve the decoder `build_decoder` makes (once the server's options are checked) until
    interrupted (Ctrl-C ends the open requests and stops)."""
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
    uvicorn.run(app, host=config.host, port=config.port, log_level="info")
    return 0
