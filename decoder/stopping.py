"""When generation ends: EOS, `max_new_tokens`, stop strings, `max_time`, the model's context."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedTokenizerBase
from transformers.generation.stopping_criteria import StopStringCriteria


@dataclass
class StopCriteria:
    """Consumes emitted tokens one at a time and says where generation ends, with
    `model.generate`'s semantics: the EOS token or the token completing a stop string is kept.
    Stop strings are matched by transformers' own `StopStringCriteria` over the prompt's end
    (`prompt`) and the generated tokens, as `generate` matches them."""

    max_new_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    tokenizer: PreTrainedTokenizerBase | None = None
    max_time: float | None = None  # seconds from the start (transformers' MaxTimeCriteria)
    prompt: tuple[int, ...] = ()  # the prompt's tokens (stop strings may start in it)
    generated: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "eos" | "length" | "stop_string" | "time"

    def __post_init__(self) -> None:
        if self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens}")
        if self.stop_strings and self.tokenizer is None:
            raise ValueError("stop_strings need a tokenizer: pass tokenizer= to SpeculativeDecoder")
        self._stop_strings = (
            StopStringCriteria(self.tokenizer, self.stop_strings) if self.stop_strings else None
        )
        self._deadline = None if self.max_time is None else time.perf_counter() + self.max_time

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.generated)

    def extend(self, tokens: list[int]) -> list[int]:
        """Append tokens up to the first stopping point; returns the ones kept."""
        kept = []
        for token in tokens:
            if self.finish_reason is not None:
                break
            self.generated.append(token)
            kept.append(token)
            if token in self.eos_token_ids:
                self.finish_reason = "eos"
            elif self._hits_stop_string():
                self.finish_reason = "stop_string"
            elif self.remaining == 0:
                self.finish_reason = "length"
        if self.finish_reason is None and self._deadline is not None and time.perf_counter() > self._deadline:
            self.finish_reason = "time"  # as `generate`: checked after each step, the step's tokens kept
        return kept

    def _hits_stop_string(self) -> bool:
        if self._stop_strings is None:
            return False
        tail = self._stop_strings.maximum_token_len  # the criteria reads no further back
        ids = [*self.prompt[-tail:], *self.generated[-tail:]][-tail:]
        return bool(self._stop_strings(torch.tensor([ids]), None)[0])
