"""`ServerConfig`: what `specboost serve` listens on and the limits every request is held to."""

from __future__ import annotations

import os
from dataclasses import dataclass

API_KEY_ENV = "SPECBOOST_API_KEY"  # the bearer token, when --api-key is not given


@dataclass(frozen=True)
class ServerConfig:
    """host: 127.0.0.1 unless told otherwise (the server is not exposed by default).
    api_key: every route but /health needs `Authorization: Bearer <api_key>` (None: no key).
    model_name: the name clients pass as `model` (and /v1/models lists).
    max_body_bytes: larger request bodies get 413 before they are parsed.
    max_prompt_tokens: longer prompts (after the chat template) get 400.
    max_tokens_limit: the most `max_tokens` a request may ask for (more: 400).
    default_max_tokens: `max_tokens` when a request gives none.
    request_timeout: seconds from arrival after which a request is ended (its row freed): a
        stream ends with finish_reason "length", a whole answer is a 504 error.
    retry_after: seconds a 429 (queue full) tells the client to wait.
    shutdown_timeout: seconds open requests get to finish once the server is told to stop."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    model_name: str = "specboost"
    max_body_bytes: int = 1 << 20
    max_prompt_tokens: int = 4096
    max_tokens_limit: int = 2048
    default_max_tokens: int = 256
    request_timeout: float = 600.0
    retry_after: int = 1
    shutdown_timeout: int = 5

    def __post_init__(self) -> None:
        limits = {
            "max_body_bytes": self.max_body_bytes,
            "max_prompt_tokens": self.max_prompt_tokens,
            "max_tokens_limit": self.max_tokens_limit,
            "default_max_tokens": self.default_max_tokens,
            "request_timeout": self.request_timeout,
            "retry_after": self.retry_after,
            "shutdown_timeout": self.shutdown_timeout,
        }
        if bad := [f"{name}={value}" for name, value in limits.items() if value <= 0]:
            raise ValueError(f"server limits must be positive, got {', '.join(bad)}")
        if self.default_max_tokens > self.max_tokens_limit:
            raise ValueError(
                f"default_max_tokens ({self.default_max_tokens}) exceeds max_tokens_limit "
                f"({self.max_tokens_limit}): lower the default or raise the limit"
            )
        if self.api_key is not None and not self.api_key:
            raise ValueError("an empty API key would accept anyone: give a non-empty key, or none")


def api_key_from_env(given: str | None) -> str | None:
    """--api-key, else the SPECBOOST_API_KEY environment variable, else None."""
    return given if given is not None else os.environ.get(API_KEY_ENV) or None
