"""`SpeculativeDecoder`: lossless speculative decoding of any Hugging Face causal LM with a
pool of SSMs, verified as one token tree per LLM pass (ALGORITHMS.md sections 1-3, 12).

`generate` resolves the options of each sequence (`decoder/sequence.py`) and runs the one decode
loop (`decoder/loop.py`): a single sequence is a group of one, a batch a group of several.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase
from transformers.generation.streamers import BaseStreamer

from specboost.decoder.batched import BatchedDecoder, BatchedOutput
from specboost.decoder.compilation import CompileSetting, ModelCalls, compile_by_default
from specboost.decoder.loop import decode
from specboost.decoder.pool import SSMPool, TemperatureNotice
from specboost.decoder.sequence import new_sequence
from specboost.decoder.stats import DecodeStats
from specboost.decoder.strategies import StrategyInputs, StrategyOptions, make_speculator
from specboost.decoder.validation import (
    check_causal_lm,
    check_generate_arguments,
    check_same_device,
    check_same_vocabulary,
    check_shape,
    context_length,
    output_vocab_size,
)
from specboost.decoder.verifiers import StairsVerifier, TreeVerifier, Verifier
from specboost.decoder.verify import Rule
from specboost.speculator.cost_model import CostModel
from specboost.speculator.length_control import LengthController
from specboost.speculator.loading import has_tokenizer, load_causal_lm, load_tokenizer, resolve_device
from specboost.speculator.predictor import MatchLengthPredictor
from specboost.speculator.routed_scheduler import RoutedScheduler
from specboost.speculator.scheduler import LearnedScheduler
from specboost.speculator.shapes import DraftShape
from specboost.speculator.speculation import Speculator, pool_drafters


@dataclass
class SpeculativeOutput:
    sequences: torch.Tensor  # [1, prompt + new] LongTensor, like model.generate
    stats: DecodeStats
    finish_reason: str  # "eos" | "length" | "stop_string" | "time"


class SpeculativeDecoder:
    """Speeds up `llm` with the SSMs `ssms`; greedy output is identical to `llm.generate`'s and
    sampled output has the LLM's distribution.

    Args:
        llm: the target causal LM.
        ssms: small speculative models sharing the LLM's vocabulary, or an `SSMPool`.
        tokenizer: the LLM's tokenizer (needed for stop strings and tokenizer checks).
        shape: what every SSM drafts per step: `ChainShape(length)` (`ChainShape(length,
            samples=k)`: k sampled chains per SSM), `BeamShape(width, depth)` or
            `TopologyShape(parents)`. Default: a chain of 4.
        rule: verification rule, "greedy" | "mss" | "k_sequential" | "without_replacement" |
            "target"; None picks greedy for do_sample=False and the lossless rule for the tree
            kind otherwise. "k_sequential" (sampled chains: several SSMs, or `samples` > 1) is
            SpecTr's k-sequential selection generalised to drafts of different SSMs, or MSS at
            the nodes where that accepts more (`decoder/multi_draft.py`).
        verification: "tree" (one tree-attention pass) or "stairs" (ALGORITHMS.md 12; greedy chains).
        speculator: a custom speculation strategy (overrides `strategy` and `shape`).
        ssm_tokenizers: the SSMs' own tokenizers, checked against `tokenizer` when given.
        strategy: how the SSMs speculate (see `specboost.decoder.strategies`): "pool" (every SSM
            drafts `shape`, trees merged), "learned" (the learned scheduler picks a beam per SSM
            and step; needs a predictor, from `predictor=` or the pool), "majority" (only the
            weighted-majority chain of `shape`'s length is verified), "pruned" (the merged tree
            cut to a node budget by SSM weight) or "sequoia" (one SSM fills a DP-optimal tree;
            needs an acceptance vector, from `strategy_options` or the pool) or "plain" (drafts
            nothing, `ssms=[]`: plain decoding through the same loop, speculation off).
        predictor, cost_model: the learned scheduler's match-length predictor and the hardware
            cost model of "learned" and "sequoia" (default: the pool's; "learned" measures a
            missing cost model on the spot).
        force_profile: use the pool's hardware profile even if measured on other hardware.
        length_controller: "minions", "bass" or a `LengthController`: adapts the chain length of
            "pool", "majority" and "pruned" at every step (ALGORITHMS.md section 7).
        strategy_options: `StrategyOptions`, the less common settings (pruning budget, Sequoia
            tree size and acceptance vector, majority weight update).
        compile: compile the LLM's verify pass and the SSMs' drafting passes with `torch.compile`
            at bucketed shapes (`decoder/compilation.py`); "auto" compiles on CUDA only. Call
            `warmup` to compile before timing.
    """

    def __init__(
        self,
        llm: PreTrainedModel,
        ssms: Sequence[PreTrainedModel] | SSMPool,
        tokenizer: PreTrainedTokenizerBase | None = None,
        *,
        shape: DraftShape | None = None,
        rule: Rule | str | None = None,
        verification: Literal["tree", "stairs"] = "tree",
        speculator: Speculator | None = None,
        ssm_tokenizers: Sequence[PreTrainedTokenizerBase | None] | None = None,
        strategy: str = "pool",
        predictor: MatchLengthPredictor | None = None,
        cost_model: CostModel | None = None,
        force_profile: bool = False,
        length_controller: LengthController | str | None = None,
        strategy_options: StrategyOptions | None = None,
        compile: CompileSetting = "auto",
    ) -> None:
        check_causal_lm(llm, "LLM")
        check_shape(shape)
        strategy_args = strategy != "pool" or length_controller is not None or strategy_options is not None
        if speculator is not None and strategy_args:
            raise ValueError(
                "speculator= replaces the built-in strategies: drop strategy=, length_controller= and "
                "strategy_options=, or drop speculator="
            )
        pool = ssms if isinstance(ssms, SSMPool) else None
        if pool is not None:  # its tokenizer is every SSM's
            ssm_tokenizers = ssm_tokenizers or [pool.tokenizer] * len(pool)
            ssms = pool.models
        ssms = list(ssms)
        for i, ssm in enumerate(ssms):
            check_causal_lm(ssm, f"SSM {i}")
            check_same_device(llm, ssm, i)
            ssm_tok = ssm_tokenizers[i] if ssm_tokenizers else None
            check_same_vocabulary(llm, ssm, i, tokenizer, ssm_tok)
        if verification not in ("tree", "stairs"):
            raise ValueError(f"verification must be 'tree' or 'stairs', got {verification!r}")
        if verification == "stairs" and rule not in (None, Rule.GREEDY, "greedy"):
            raise ValueError("verification='stairs' is greedy only; drop rule= or use verification='tree'")
        self.llm = llm.eval()
        self.ssms = [ssm.eval() for ssm in ssms]
        self.tokenizer = tokenizer
        inputs = StrategyInputs(
            shape,
            predictor,
            cost_model,
            force_profile,
            length_controller,
            strategy_options or StrategyOptions(),
        )
        self.speculator: Speculator = speculator or make_speculator(
            strategy, self.llm, self.ssms, pool, inputs
        )
        self.verifier: Verifier = StairsVerifier() if verification == "stairs" else TreeVerifier(rule)
        self.max_positions = context_length(llm)
        self.temperature_notice = TemperatureNotice(pool.target_temperature if pool else None)
        if compile not in (True, False, "auto"):
            raise ValueError(f'compile must be True, False or "auto", got {compile!r}')
        enabled = compile_by_default(self.llm.device) if compile == "auto" else compile
        self.calls = ModelCalls(self.llm.device, enabled)
        for drafter in pool_drafters(self.speculator):
            drafter.compiler = self.calls.get
        if isinstance(self.speculator, RoutedScheduler):
            self.speculator.compiler = self.calls.get
            self.speculator.router.costs_on_compiled_loop(enabled)
        self.calls.expect_passes(self.llm, self.speculator)

    @classmethod
    def from_pretrained(
        cls,
        llm: PreTrainedModel | str | Path,
        pool: SSMPool | str | Path,
        tokenizer: PreTrainedTokenizerBase | str | Path | None = None,
        *,
        device: str | torch.device | None = None,
        dtype: torch.dtype | str | None = None,
        **overrides: Any,
    ) -> SpeculativeDecoder:
        """A decoder for `llm` with an exported SSM pool, decoding as the pool recommends.

        `llm` is a loaded model or a folder / hub id; `pool` an `SSMPool` or a folder / hub id for
        `SSMPool.from_pretrained` (loaded first: a wrong pool fails before the LLM loads). Models
        loaded here go to `device` (default: a given LLM's device, else the CPU) in `dtype`
        (default: as saved). `tokenizer` (a tokenizer or its folder) defaults to the one in the
        LLM's folder, else the pool's (boost saves the LLM's with every SSM). `pool.check_llm`
        then refuses an LLM or tokenizer the pool was not exported for. The manifest's decoding
        choices (`pool.defaults`: strategy, shape, length controller) are the defaults of
        `overrides`, any keyword of `SpeculativeDecoder`; an explicit `strategy=` or `speculator=`
        replaces all of them (see `PoolDefaults.decoder_options`). A pool exported with a
        predictor and a hardware profile recommends the learned scheduler; `strategy="pool",
        shape=ChainShape(4)` decodes with a fixed chain instead. A learned scheduler the pool
        recommends measures this machine's latencies when the pool's profile is of other hardware
        (`SSMPool.for_recommended_learned`); `compile="auto"` compiles on CUDA.
        """
        target = resolve_device(device) if device is not None else None  # before anything loads
        if target is None and isinstance(llm, PreTrainedModel):
            target = llm.device  # the SSMs must sit on the LLM's device
        if not isinstance(pool, SSMPool):
            pool = SSMPool.from_pretrained(pool, target, dtype)
        llm_folder = None
        if not isinstance(llm, PreTrainedModel):
            llm_folder = Path(llm).expanduser()
            llm = load_causal_lm(llm, dtype, target)
        if tokenizer is None:
            own = llm_folder is not None and llm_folder.is_dir() and has_tokenizer(llm_folder)
            tokenizer = load_tokenizer(llm_folder) if own else pool.tokenizer
        elif not isinstance(tokenizer, PreTrainedTokenizerBase):
            tokenizer = load_tokenizer(tokenizer)
        pool.check_llm(llm, tokenizer)
        options = pool.defaults.decoder_options(overrides)
        chosen = "strategy" not in overrides and "speculator" not in overrides  # by the pool
        own_costs = overrides.get("cost_model") is not None or overrides.get("force_profile")
        if chosen and options["strategy"] == "learned" and not own_costs:
            pool = pool.for_recommended_learned(llm.device, llm.dtype)
        return cls(llm, pool, tokenizer, **options)

    # Generation ----------------------------------------------------------------------------------
    def generate(
        self,
        input_ids: torch.Tensor,  # [1, L] or [B, L]
        attention_mask: torch.Tensor | None = None,  # like input_ids
        max_new_tokens: int | None = None,
        do_sample: bool | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        eos_token_id: int | list[int] | None = None,
        stop_strings: str | list[str] | None = None,
        generation_config: GenerationConfig | None = None,
        seed: int | None = None,
        streamer: BaseStreamer | None = None,
        **options: Any,
    ) -> SpeculativeOutput | BatchedOutput:
        """Generate like `llm.generate`: options are resolved as `generate` resolves them (explicit
        arguments > `generation_config` > the LLM's own generation_config > transformers' defaults)
        and every `GenerationConfig` field is honoured or refused with a ValueError
        (`decoder/generation_options.py`); `options` takes any other field, e.g.
        `repetition_penalty=1.2`. `seed` makes sampling reproducible. A batch (`input_ids` [B, L],
        B > 1, left-padded `attention_mask`) decodes every row at once and returns a
        `BatchedOutput` (`decoder/batched.py`, ALGORITHMS.md section 11).

        `streamer` (a transformers `BaseStreamer`, e.g. `TextStreamer`, `TextIteratorStreamer`)
        gets what `llm.generate(streamer=...)` with an assistant model gives it: the prompt
        ([1, L], padding dropped), then the tokens each verification step keeps ([1, n]), then
        `end()` once, also when generation raises (`decoder/sequence.py`, `TokenStream`). As in
        transformers, streaming is for one sequence: a batch with a streamer is refused."""
        options |= dict(
            max_new_tokens=max_new_tokens,
            do_sample=do_sample,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            eos_token_id=eos_token_id,
            stop_strings=stop_strings,
        )
        check_generate_arguments(input_ids, attention_mask, options, seed, output_vocab_size(self.llm))
        if input_ids.dim() == 2 and input_ids.shape[0] != 1:
            if streamer is not None:
                raise ValueError(
                    "streamers support batch size 1, as in transformers; got a batch of "
                    f"{input_ids.shape[0]}: generate the rows one by one, or submit each to the serving "
                    "engine with its own streamer"
                )
            batched = BatchedDecoder(self)
            return batched.generate(
                input_ids, attention_mask, generation_config=generation_config, seed=seed, **options
            )
        mask = None if attention_mask is None else attention_mask.reshape(-1)
        ids = input_ids.reshape(-1)
        row = new_sequence(self, ids, mask, generation_config, options, seed, streamer=streamer)
        decode(self, [row])
        sequences = torch.tensor([row.tokens], dtype=torch.long, device=self.llm.device)
        return SpeculativeOutput(sequences, row.stats, row.finish_reason)

    def warmup(self, prompt_length: int = 16, max_new_tokens: int = 16, do_sample: bool = False) -> float:
        """Run one short generation so that compiled graphs for the usual shapes exist (and caches
        are allocated) before anything is timed; returns its wall time in seconds. For the learned
        scheduler, every shape its choices can produce is compiled at that generation's cache sizes
        (`ModelCalls.expect_passes`)."""
        start = time.perf_counter()
        ids = torch.ones(1, prompt_length, dtype=torch.long, device=self.llm.device)
        self.generate(ids, max_new_tokens=max_new_tokens, do_sample=do_sample, seed=0 if do_sample else None)
        if isinstance(self.speculator, LearnedScheduler | RoutedScheduler):
            self.speculator.forget()  # a made-up prompt whose steps compiled graphs: nothing to learn
        return time.perf_counter() - start
