"""One sequence of a batch: its verified tokens, stopping criteria, sampling state and statistics.

In a batch every sequence keeps what `SpeculativeDecoder` keeps for its one sequence (BASS,
ALGORITHMS.md section 11): its own accepted length, EOS and stop strings, its verification rule
and random stream. The LLM cache and the SSM caches of the batch live in `SequenceGroup`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from specboost.decoder.stats import DecodeStats
from specboost.decoder.stopping import StopCriteria
from specboost.decoder.verifiers import TreeVerifier
from specboost.decoder.verify import Rule
from specboost.speculator.sampling import LogitsToProbs, SamplingConfig
from specboost.speculator.tree import TokenTree

if TYPE_CHECKING:
    from specboost.decoder.decoder import SpeculativeDecoder

# What `SpeculativeDecoder._settings` returns: sampling, max_new_tokens, EOS ids, stop strings.
Settings = tuple[SamplingConfig, int, frozenset[int], tuple[str, ...]]
# The per-sequence generation options of `SpeculativeDecoder.generate` (besides generation_config, seed).
OPTIONS = frozenset(
    {"max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "eos_token_id", "stop_strings"}
)


def check_options(options: dict) -> None:
    unknown = sorted(set(options) - OPTIONS)
    if unknown:
        raise TypeError(f"unknown generation options {unknown}; the options are {sorted(OPTIONS)}")


@dataclass
class SequenceState:
    tokens: list[int]  # prompt + verified tokens; the last one is the root of the next tree
    prompt_length: int
    stop: StopCriteria
    probs: LogitsToProbs
    rule: Rule
    generator: torch.Generator | None = None  # the LLM's random stream (sampling)
    seed: int | None = None  # seeds the SSMs' streams too
    tag: Any = None  # the owner's reference: a row of the input batch, an engine request
    stats: DecodeStats = field(default_factory=DecodeStats)
    tree: TokenTree | None = None  # drafted, waiting for verification
    hidden: torch.Tensor | None = None  # [H] LLM state before the root, for strategies that want it
    started: float = field(default_factory=time.perf_counter)
    finished: float | None = None  # when its last token was emitted

    @property
    def finish_reason(self) -> str | None:
        return self.stop.finish_reason

    @property
    def new_tokens(self) -> list[int]:
        return self.tokens[self.prompt_length :]

    def max_depth(self, max_positions: int | None) -> int:
        """As `SpeculativeDecoder._max_depth`: no deeper than the tokens still wanted (one comes
        from the LLM) nor past the context (the root sits at position len - 1)."""
        depth = self.stop.remaining - 1
        if max_positions is not None:
            depth = min(depth, max_positions - len(self.tokens))
        return depth


def batch_rule(decoder: SpeculativeDecoder, do_sample: bool) -> Rule:
    """The verification rule for a sequence of a batch, chosen and checked as `generate` does;
    a ValueError says what to change when the combination is not lossless."""
    if not isinstance(decoder.verifier, TreeVerifier):
        raise ValueError(
            "batched decoding verifies with tree attention; verification='stairs' is for one sequence"
        )
    verifier = TreeVerifier(decoder.verifier.rule)
    speculator = decoder.speculator
    verifier.check(speculator.tree_kind(do_sample), do_sample, speculator.num_ssms)
    return verifier.active_rule


def new_sequence(
    decoder: SpeculativeDecoder, prompt: list[int], settings: Settings, seed: int | None, tag: Any = None
) -> SequenceState:
    sampling, max_new_tokens, eos_ids, stop_strings = settings
    rule = batch_rule(decoder, sampling.do_sample)
    stop = StopCriteria(max_new_tokens, eos_ids, stop_strings, decoder.tokenizer)
    generator = None if seed is None else torch.Generator(decoder.llm.device).manual_seed(seed)
    return SequenceState(list(prompt), len(prompt), stop, LogitsToProbs(sampling), rule, generator, seed, tag)
