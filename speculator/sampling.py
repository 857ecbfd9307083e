"""Logits processing shared by the LLM and the SSMs.

Temperature, top-k and top-p are applied with `transformers`' own logits warpers, in the
order `generate` applies them, so P (LLM) and Q (SSM) are processed identically and exactly
as `model.generate` would process them (ALGORITHMS.md section 2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)


@dataclass(frozen=True)
class SamplingConfig:
    """How one token is chosen from logits. `do_sample=False` is greedy (argmax)."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off

    def __post_init__(self) -> None:
        if self.do_sample and not self.temperature > 0:
            raise ValueError(
                f"temperature must be > 0 when do_sample=True (got {self.temperature}); "
                "use do_sample=False for greedy decoding"
            )
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @classmethod
    def from_generation_config(cls, config: GenerationConfig) -> SamplingConfig:
        return cls(
            do_sample=bool(config.do_sample),
            temperature=1.0 if config.temperature is None else float(config.temperature),
            top_k=int(config.top_k or 0),
            top_p=1.0 if config.top_p is None else float(config.top_p),
        )

    def warpers(self) -> LogitsProcessorList:
        """The warpers `generate` would build for these settings, in its order."""
        warpers = LogitsProcessorList()
        if not self.do_sample:
            return warpers
        if self.temperature != 1.0:
            warpers.append(TemperatureLogitsWarper(self.temperature))
        if self.top_k > 0:
            warpers.append(TopKLogitsWarper(top_k=self.top_k, min_tokens_to_keep=1))
        if self.top_p < 1.0:
            warpers.append(TopPLogitsWarper(top_p=self.top_p, min_tokens_to_keep=1))
        return warpers


class LogitsToProbs:
    """Turns raw logits into the distribution tokens are drawn from (P for the LLM, Q for SSMs)."""

    def __init__(self, config: SamplingConfig) -> None:
        self.config = config
        self._warpers = config.warpers()
        self._dummy_ids = torch.zeros(1, 1, dtype=torch.long)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """[N, V] logits -> [N, V] probabilities (float32 or wider)."""
        scores = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
        ids = self._dummy_ids.to(scores.device).expand(scores.shape[0], 1)
        scores = self._warpers(ids, scores)
        return torch.softmax(scores, dim=-1)

    def choose(self, logits: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """[N, V] -> [N] tokens: argmax when greedy, else one sample from the processed distribution."""
        if not self.config.do_sample:
            return logits.argmax(dim=-1)
        return torch.multinomial(self(logits), 1, generator=generator).squeeze(-1)
