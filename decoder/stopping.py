"""When generation ends: EOS, `max_new_tokens`, stop strings, the model's context."""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase


@dataclass
class StopCriteria:
    """Consumes emitted tokens one at a time and says where generation ends, with
    `model.generate`'s semantics: the EOS token or the token completing a stop string is kept."""

    max_new_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    tokenizer: PreTrainedTokenizerBase | None = None
    generated: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "eos" | "length" | "stop_string"

    def __post_init__(self) -> None:
        if self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens}")
        if self.stop_strings and self.tokenizer is None:
            raise ValueError("stop_strings need a tokenizer: pass tokenizer= to SpeculativeDecoder")
        self._tail = max((len(s) for s in self.stop_strings), default=0) + 8  # tokens decoded per check

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
        return kept

    def _hits_stop_string(self) -> bool:
        if not self.stop_strings:
            return False
        text = self.tokenizer.decode(self.generated[-self._tail :])
        return any(s in text for s in self.stop_strings)
