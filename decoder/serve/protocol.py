"""The OpenAI request bodies the server takes (`/v1/completions`, `/v1/chat/completions`) and
the generation options they become.

A field the server cannot honour is refused with a 400 that names it, never ignored: several
choices (`n` > 1, `best_of` > 1), log-probabilities, `echo`, `logit_bias`, presence and
frequency penalties, tools. Unknown fields are refused the same way. `top_k` is an extension
field (vLLM's spelling). Unset sampling fields fall back to the LLM's own generation_config, as
`SpeculativeDecoder.generate` resolves them; `temperature: 0` means greedy decoding.

Values that would only fail deeper down are refused here, naming their field: numbers that are
not finite (JSON's `NaN`, `Infinity`), text holding a lone surrogate (JSON can escape one,
`"\\ud800"`, but it is not Unicode text and no tokenizer takes it), and seeds torch cannot take.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from specboost.decoder.validation import SEED_LIMIT

MAX_STOP_SEQUENCES = 4  # as OpenAI's API


class RequestError(ValueError):
    """A request the server refuses: `status` (400, 404, 413) and the OpenAI error `code`."""

    def __init__(
        self, message: str, status: int = 400, code: str = "invalid_request_error", param: str | None = None
    ):
        super().__init__(message)
        self.status, self.code, self.param = status, code, param


class GenerationFields(BaseModel):
    """The fields both endpoints share."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, lt=SEED_LIMIT)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = 1
    user: str | None = None
    # Accepted at their neutral values only (a client library may send them).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    logprobs: Any = None

    @field_validator("*", mode="before")
    @classmethod
    def _unicode_text(cls, value: Any) -> Any:
        """Every field, of either endpoint, nested text (messages, content parts) included."""
        if _holds_lone_surrogate(value):
            raise ValueError("the text holds a lone surrogate (\\ud800-\\udfff): send valid Unicode")
        return value

    @model_validator(mode="after")
    def _supported(self) -> GenerationFields:
        if self.n != 1:
            raise ValueError(f"n={self.n}: this server returns one choice per request (n=1)")
        if self.presence_penalty or self.frequency_penalty:
            raise ValueError("presence_penalty and frequency_penalty are not supported: leave them at 0")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        if self.logprobs not in (None, False, 0):
            raise ValueError("logprobs are not supported")
        stops = self.stop_sequences
        if len(stops) > MAX_STOP_SEQUENCES or any(not s for s in stops):
            raise ValueError(f"stop takes 1 to {MAX_STOP_SEQUENCES} non-empty strings, got {self.stop!r}")
        return self

    @property
    def stop_sequences(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))

    def generation_options(self, max_tokens: int) -> dict[str, Any]:
        """The `Engine.submit` options of this request (unset ones: the LLM's generation_config)."""
        options: dict[str, Any] = {"max_new_tokens": max_tokens}
        if self.temperature is not None:
            options["do_sample"] = self.temperature > 0
            if self.temperature > 0:
                options["temperature"] = self.temperature
        if self.top_p is not None:
            options["top_p"] = self.top_p
        if self.top_k is not None:
            options["top_k"] = self.top_k
        if self.stop_sequences:
            options["stop_strings"] = self.stop_sequences
        return options


class CompletionRequest(GenerationFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _one_prompt(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo is not supported")
        if self.best_of not in (None, 1):
            raise ValueError(f"best_of={self.best_of}: only 1 is supported")
        if self.suffix:
            raise ValueError("suffix (insertion) is not supported")
        if self.is_list_of_prompts and len(self.prompt) != 1:
            raise ValueError(
                f"one prompt per request, got {len(self.prompt)}: send them as separate requests"
            )
        return self

    @property
    def is_list_of_prompts(self) -> bool:
        """A list of texts or of token lists (OpenAI's batch form), rather than one prompt."""
        return isinstance(self.prompt, list) and bool(self.prompt) and isinstance(self.prompt[0], (str, list))

    @property
    def single_prompt(self) -> str | list[int]:
        return self.prompt[0] if self.is_list_of_prompts else self.prompt


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id ...: passed to the chat template

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        """The message's text; content parts other than text are refused."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        if any(part.get("type") != "text" for part in self.content):
            raise ValueError("only text content parts are supported")
        return "".join(part.get("text", "") for part in self.content)


class ChatCompletionRequest(GenerationFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _supported_chat(self) -> ChatCompletionRequest:
        if self.tools or self.tool_choice not in (None, "none"):
            raise ValueError("tools are not supported")
        if self.response_format and self.response_format.get("type") != "text":
            raise ValueError("response_format other than text is not supported")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("give max_tokens or max_completion_tokens, not both")
        return self

    def conversation(self) -> list[dict[str, Any]]:
        """The messages as the tokenizer's chat template takes them."""
        out = []
        for message in self.messages:
            extra = {k: v for k, v in (message.model_extra or {}).items() if isinstance(v, str)}
            out.append({"role": message.role, "content": message.text(), **extra})
        return out


def _holds_lone_surrogate(value: Any) -> bool:
    """Whether `value` (JSON: text, lists, objects) holds a string UTF-8 cannot encode."""
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, dict):
        return any(_holds_lone_surrogate(k) or _holds_lone_surrogate(v) for k, v in value.items())
    return isinstance(value, list) and any(_holds_lone_surrogate(v) for v in value)


def requested_max_tokens(request: GenerationFields, default: int, limit: int) -> int:
    """The request's max_tokens (or max_completion_tokens), its default, checked against `limit`."""
    asked = getattr(request, "max_completion_tokens", None) or request.max_tokens
    if asked is None:
        return default
    if asked > limit:
        raise RequestError(
            f"max_tokens={asked} exceeds this server's limit of {limit} (--max-tokens-limit)",
            param="max_tokens",
        )
    return asked
