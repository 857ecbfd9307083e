"""One sequence of a batch: its verified tokens, stopping criteria, sampling state and statistics.

In a batch every sequence keeps what `SpeculativeDecoder` keeps for its one sequence (BASS,
ALGORITHMS.md section 11): its own accepted length, EOS and stop strings, its verification rule
and random stream. The LLM cache and the SSM caches of the batch live in `SequenceGroup`.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase
from transformers.generation.streamers import BaseStreamer

from specboost.decoder.generation_options import GenerationSettings, resolve
from specboost.decoder.pool import TemperatureNotice
from specboost.decoder.stats import DecodeStats
from specboost.decoder.stopping import StopCriteria
from specboost.decoder.validation import prompt_tokens
from specboost.decoder.verify import Rule
from specboost.speculator.sampling import LogitsToProbs
from specboost.speculator.speculation import Speculator
from specboost.speculator.tree import DraftKind, TokenTree


class RuleChecker(Protocol):
    def check(self, kind: DraftKind, do_sample: bool, num_ssms: int) -> Rule:
        """The lossless verification rule for these trees, or a ValueError saying what to change."""


class DecoderParts(Protocol):
    """What a sequence takes from its `SpeculativeDecoder` (a protocol, so that the modules the
    decoder drives never import it)."""

    llm: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase | None
    speculator: Speculator
    verifier: RuleChecker
    max_positions: int | None  # the LLM's context
    temperature_notice: TemperatureNotice  # warns when sampling away from the pool's temperature


class TokenStream:
    """Feeds a transformers streamer (`BaseStreamer`: `put(tensor)`, `end()`, e.g. `TextStreamer`,
    `TextIteratorStreamer`) as `model.generate` feeds it with an assistant model: the prompt
    first ([1, L] on the CPU, put when the stream is made), then the tokens each verification
    step keeps ([1, n]: accepted drafts and the LLM's own token, cut by the stopping criteria),
    then `end()` once. `end` may come from another thread than `put` (the engine's workers put,
    a client cancels), so both hold a lock, a second `end` does nothing and nothing is put after it."""

    def __init__(self, streamer: BaseStreamer, prompt: list[int]) -> None:
        self.streamer = streamer
        self.ended = False
        self._lock = threading.Lock()
        self.put(prompt)

    def put(self, tokens: list[int]) -> None:
        with self._lock:
            if not self.ended:
                self.streamer.put(torch.tensor([tokens], dtype=torch.long))

    def end(self) -> None:
        with self._lock:
            if not self.ended:
                self.ended = True
                self.streamer.end()


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
    hidden: torch.Tensor | None = None  # [H] LLM state before the root (or its head's [S * D]: `PassHead`)
    started: float = field(default_factory=time.perf_counter)
    finished: float | None = None  # when its last token was emitted
    timer_mark: int = 0  # the group timer's mark when the row joined (its phases are those since)
    settings: GenerationSettings | None = None  # the resolved generation options
    stream: TokenStream | None = None  # where the kept tokens go as they are verified

    @property
    def finish_reason(self) -> str | None:
        return self.stop.finish_reason

    @property
    def new_tokens(self) -> list[int]:
        return self.tokens[self.prompt_length :]

    @property
    def final_length(self) -> int:
        """The most tokens the row can hold: its text and the tokens still wanted."""
        return len(self.tokens) + self.stop.remaining

    def max_depth(self, max_positions: int | None) -> int:
        """As `SpeculativeDecoder._max_depth`: no deeper than the tokens still wanted (one comes
        from the LLM) nor past the context (the root sits at position len - 1)."""
        depth = self.stop.remaining - 1
        if max_positions is not None:
            depth = min(depth, max_positions - len(self.tokens))
        return depth


def sequence_rule(decoder: DecoderParts, do_sample: bool, seeded: bool = False) -> Rule:
    """The verification rule for a sequence (`seeded`: it has a seed), chosen and checked by the
    decoder's verifier; a ValueError says what to change when the combination is not lossless."""
    speculator = decoder.speculator
    return decoder.verifier.check(speculator.tree_kind(do_sample, seeded), do_sample, speculator.num_ssms)


def new_sequence(
    decoder: DecoderParts,
    input_ids: torch.Tensor,  # [L], maybe left-padded
    attention_mask: torch.Tensor | None,  # [L]
    generation_config: GenerationConfig | None,
    options: dict[str, Any],
    seed: int | None,
    tag: Any = None,
    streamer: BaseStreamer | None = None,
) -> SequenceState:
    """One sequence to decode: its prompt (padding dropped, checked against the LLM's context), its
    options resolved as `generate` resolves them, its verification rule and random stream; with a
    `streamer`, its `TokenStream`, which puts the prompt once everything else checked out."""
    prompt = prompt_tokens(input_ids, attention_mask, decoder.max_positions)
    ids = torch.tensor([prompt], dtype=torch.long, device=decoder.llm.device)
    settings = resolve(decoder.llm, generation_config, options, ids)
    decoder.temperature_notice.check(settings.sampling)
    rule = sequence_rule(decoder, settings.sampling.do_sample, seed is not None)
    stop = StopCriteria(
        settings.max_new_tokens,
        settings.eos_token_ids,
        settings.stop_strings,
        decoder.tokenizer,
        settings.max_time,
        tuple(prompt),
    )
    generator = None if seed is None else torch.Generator(decoder.llm.device).manual_seed(seed)
    stream = None if streamer is None else TokenStream(streamer, prompt)
    return SequenceState(
        prompt,
        len(prompt),
        stop,
        settings.probs,
        rule,
        generator,
        seed,
        tag,
        settings=settings,
        stream=stream,
    )
