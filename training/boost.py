"""Collective boost-tuning of an SSM pool (ALGORITHMS.md section 4, SpecInfer 3.1).

    python -m specboost.training.boost --distilled artifacts/distill/tinystories_openings \\
        --llm artifacts/reference-llm/tiny/model --out artifacts/pool --num-ssms 3
    accelerate launch --config_file training/configs/multi_gpu_ddp.yaml -m specboost.training.boost ...

Round i fine-tunes SSM i (q_i) on the distilled samples that no earlier SSM reproduces, with the
loss on the LLM's (p's) output tokens only (prompt labels are -100). It then marks what q_i already
reproduces, and the next round trains on the rest:

- `--marking sample` (default, SpecInfer's rule): a sample is marked when q_i's greedy output equals
  the LLM's output exactly. Computed by teacher forcing: the argmax at every output position equals
  the LLM's token. That is the same as greedy generation, because greedy decoding only ever sees
  the prefix it produced, which is the LLM's prefix as long as every argmax matches.
- `--marking span --span-depth d`: output position t is marked when q_i's greedy chain from the
  LLM's prefix before t reproduces the next d tokens (fewer at the end of the output). Marked
  positions lose their labels in later rounds; a sample with none left is removed.
Sample marking is the default because it is the published rule, and it removes whole samples,
so later SSMs see only prompts the pool gets wrong somewhere; span marking keeps more data. Both
are measured (record fields, coverage.png): with long outputs and a weak SSM an exact whole-output
match is rare and sample marking may mark nothing (then every SSM trains on the same data and only
the seed differs); span marking marks from the first round, but its later SSMs see only the hard
positions and score lower on their own.

Losses (`--loss`, training/distribution_loss.py, ALGORITHMS.md section 15), on output positions only:
`ce` (default) is next-token cross-entropy on the LLM's tokens, as above; `kl` is the forward
KL(p || q) and `tv` the total variation TV(p, q) against the LLM's stored top-K distribution with
the tail as one bucket (distill `--top-k-probs`), with q = softmax(logits / T) at the temperature T
p was recorded at; `mix` is CE + `--mix-weight` x KL. Training uses a Trainer subclass
(`DistributionTrainer`) whose collator pads the stored top-K tensors.

Boost modes (`--boost-mode`):
- `greedy` (default): the marking above (ALGORITHMS.md section 4).
- `sampled` (section 15, "Boosting for sampling"): no sample is removed. After SSM i is trained,
  every output position of the training data gets the pool's expected one-token acceptance under
  speculative sampling, a_t = max over members j <= i of (1 - TV_b(p, q_j)), with the bucketed
  TV_b. TV_b is a lower bound of the true TV (the tail's differences can cancel inside the
  bucket), so a_t is an upper bound of the best member's true acceptance, exact where p's tail is
  empty; and the max over members is a lower bound of what the pool reaches when every member
  drafts (multi-step sampling tries them in turn). SSM i + 1 trains on every position with loss
  weight w_t = (1 - a_t) / mean(1 - a) over all training positions: proportional to the
  probability that the pool's best draft is rejected there (a position the pool already serves
  surely gets weight 0, the sampled analogue of a marked sample), normalised to mean 1 so that the
  loss scale and the learning rate mean what they meant in round 0 (all ones if the pool accepts
  everywhere). The acceptances are saved per round (round-<i>/pool_acceptance.npy), so a resumed
  run trains with exactly the weights it would have used. Needs the stored distributions; any
  `--loss` applies (the weights multiply it).
Losses and modes that need the stored distributions refuse data without them (exit 2), naming the
distill command that records them.

A held-out split of the distilled data (never trained on, nor marked; all samples of a held-out
prompt) scores each round:
- greedy acceptance: at every output position t, the length of the greedy chain of `chain` (4)
  drafts from the LLM's prefix that match the LLM's tokens in a row. By the argument above this is
  the run of correct teacher-forced argmaxes starting at t, capped at `chain` (and at the end of the
  output); `held_out_mean_match_length` is its mean, `held_out_acceptance` the accepted fraction of
  the drafted tokens;
- pool coverage: the fraction of output positions where ANY SSM so far predicts the LLM's token;
- sampled acceptance, when the data holds the LLM's distributions: the mean over output positions
  of 1 - TV_b(p, q) of this SSM (`held_out_sampled_acceptance`) and of the pool's best member
  (`pool_sampled_acceptance`), q at the temperature p was recorded at.

OUT: ssm-<i>/ (save_pretrained: model + the LLM's tokenizer), round-<i>/checkpoints/ (Trainer),
round-<i>/pool_acceptance.npy (sampled mode), boost_state.json (settings, held-out ids, completed
rounds and their marks; atomic), boost_record.json (atomic; with `boost_mode`, `loss` and
`target_temperature`, the temperature the trained-on p was recorded at, null for CE),
coverage.png. A killed run resumes by rerunning the same command: completed rounds are skipped and
a partly trained round resumes from its last checkpoint. `--num-ssms` may grow.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import peft
import torch
import transformers
from tqdm.auto import tqdm
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Trainer,
    TrainerState,
    TrainingArguments,
)
from transformers.integrations import unset_hf_deepspeed_config

from specboost.speculator.loading import load_causal_lm, load_config, load_tokenizer
from specboost.training.distill import load_distilled
from specboost.training.distribution_loss import LOSSES, position_losses, sampled_acceptance
from specboost.training.reference_llm import last_checkpoint
from specboost.training.run_files import library_versions, write_json_atomic
from specboost.training.target_distributions import PositionTargets, distribution_info, load_targets

STATE_FILE, RECORD_FILE, PLOT_FILE = "boost_state.json", "boost_record.json", "coverage.png"
ACCEPTANCE_FILE = "pool_acceptance.npy"  # round-<i>/: the pool's acceptance at every training position
MARKINGS = ("sample", "span")
BOOST_MODES = ("greedy", "sampled")
DISTILL_HINT = (
    'make distill DISTILL_FLAGS="--top-k-probs 64 --do-sample --temperature 0.8 ..." '
    "(or python -m specboost.training.distill --llm LLM --prompts PROMPTS --top-k-probs 64 ...)"
)
SSM_PRESETS = {"tenth": 0.1, "fifth": 0.2, "twentieth": 0.05}  # SSM parameters / LLM parameters


@dataclass(frozen=True)
class BoostConfig:
    distilled: str = field(metadata={"help": "distill run folder (data.parquet)"})
    llm: str = field(metadata={"help": "the LLM folder or id: its tokenizer and config"})
    num_ssms: int = 3  # may grow between resumes
    ssm_base: str | None = None  # small HF causal LM to start every SSM from (None: a fresh config)
    ssm_config: str = "tenth"  # SSM_PRESETS key, used when ssm_base is None
    marking: str = "sample"  # "sample" (SpecInfer) or "span"; greedy boost mode only
    span_depth: int = 4  # d of span marking
    boost_mode: str = "greedy"  # "greedy" (marking, section 4) or "sampled" (acceptance weights, section 15)
    loss: str = "ce"  # "ce" (the LLM's tokens), "kl" / "tv" (its stored distributions), "mix" (ce + kl)
    mix_weight: float = 1.0  # w of loss "mix" = CE + w KL
    chain: int = 4  # greedy chain length scored on the held-out split
    held_out_fraction: float = 0.1
    seed: int = 0
    # training (per round)
    epochs: float = 3.0
    max_steps: int = -1  # > 0 overrides epochs
    batch_size: int = 8
    grad_accum_steps: int = 1
    learning_rate: float = 1e-3
    warmup_steps: int = 10
    weight_decay: float = 0.0
    save_steps: int = 50
    logging_steps: int = 10
    lora: bool = False  # train LoRA adapters (merged into the weights before saving)
    lora_rank: int = 16
    lora_alpha: int = 32
    eval_batch_size: int = 16

    def __post_init__(self) -> None:
        if self.marking not in MARKINGS:
            raise ValueError(f"marking must be one of {', '.join(MARKINGS)}, got {self.marking!r}")
        if self.boost_mode not in BOOST_MODES:
            raise ValueError(f"boost_mode must be one of {', '.join(BOOST_MODES)}, got {self.boost_mode!r}")
        if self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {', '.join(LOSSES)}, got {self.loss!r}")
        if not self.mix_weight >= 0:
            raise ValueError(f"mix_weight must be >= 0, got {self.mix_weight}")
        if self.ssm_base is None and self.ssm_config not in SSM_PRESETS:
            raise ValueError(f"ssm_config must be one of {', '.join(SSM_PRESETS)}, got {self.ssm_config!r}")
        if min(self.num_ssms, self.span_depth, self.chain, self.batch_size, self.grad_accum_steps) < 1:
            raise ValueError("num_ssms, span_depth, chain, batch_size and grad_accum_steps must be >= 1")
        if not 0 < self.held_out_fraction < 1:
            raise ValueError(f"held_out_fraction must be in (0, 1), got {self.held_out_fraction}")
        if self.max_steps <= 0 and self.epochs <= 0:
            raise ValueError("give epochs > 0 or max_steps > 0")

    def identity(self) -> dict[str, Any]:
        """Settings a resume must share (more SSMs and a new eval batch size are fine). Settings at
        their defaults from before they existed are left out, so older runs still resume."""
        free = {"num_ssms", "eval_batch_size"}
        if self.loss != "mix":
            free.add("mix_weight")
        if self.loss == "ce":
            free.add("loss")
        if self.boost_mode == "greedy":
            free.add("boost_mode")
        return {k: v for k, v in asdict(self).items() if k not in free}

    @property
    def needs_distributions(self) -> bool:
        """Whether training uses the LLM's stored distributions (a distribution loss or sampled mode)."""
        return self.loss != "ce" or self.boost_mode == "sampled"

    @property
    def base_name(self) -> str:
        return self.ssm_base if self.ssm_base is not None else f"config:{self.ssm_config}"


# ---------------------------------------------------------------- marking rules (pure functions)


def true_runs(hits: torch.Tensor) -> torch.Tensor:
    """runs[t] = how many of hits[t], hits[t+1], ... are True in a row.  hits: [n] bool -> [n] long."""
    runs = torch.zeros(hits.shape[0] + 1, dtype=torch.long)
    for t in range(hits.shape[0] - 1, -1, -1):
        runs[t] = runs[t + 1] + 1 if hits[t] else 0
    return runs[:-1]


def sample_marked(hits: torch.Tensor) -> bool:
    """SpecInfer's rule: the SSM's greedy output is the LLM's output (every argmax matches)."""
    return bool(hits.all())


def span_marked(hits: torch.Tensor, depth: int) -> torch.Tensor:
    """[n] bool: the greedy chain from position t reproduces the next `depth` tokens (or all left)."""
    remaining = torch.arange(hits.shape[0], 0, -1)
    return true_runs(hits) >= remaining.clamp(max=depth)


def match_lengths(hits: torch.Tensor, chain: int) -> torch.Tensor:
    """[n] long: accepted length of a greedy chain of `chain` drafts from every position."""
    return true_runs(hits).clamp(max=chain)


def hits_from_logits(
    logits: torch.Tensor, input_ids: torch.Tensor, prompt_lens: list[int], output_lens: list[int]
) -> list[torch.Tensor]:
    """Per row, [n_out] bool: argmax before output token k equals it.
    logits: [B, T, V]; input_ids: [B, T] = prompt + output, right-padded."""
    predicted = logits.argmax(-1)  # [B, T]; position j predicts token j + 1
    rows = []
    for b, (p, n) in enumerate(zip(prompt_lens, output_lens, strict=True)):
        rows.append((predicted[b, p - 1 : p + n - 1] == input_ids[b, p : p + n]).cpu())
    return rows


# ---------------------------------------------------------------- data


def fit(prompt: list[int], output: list[int], max_len: int | None) -> tuple[list[int], list[int]]:
    """Drop the prompt's oldest tokens (keeping one), then the output's tail, to fit `max_len`."""
    if max_len is None or len(prompt) + len(output) <= max_len:
        return prompt, output
    keep = max(1, max_len - len(output))
    prompt = prompt[-keep:]
    return prompt, output[: max_len - len(prompt)]


def load_rows(distilled: str) -> list[dict[str, Any]]:
    """id, prompt_ids, output_ids (and prompt_id where distill recorded one) of the kept rows."""
    data = load_distilled(distilled)
    columns = ["id", "prompt_ids", "output_ids"] + (["prompt_id"] if "prompt_id" in data.column_names else [])
    rows = data.select_columns(columns).to_list()
    rows = [r for r in rows if r["prompt_ids"] and r["output_ids"]]
    if not rows:
        raise ValueError(f"{distilled} holds no usable distilled samples: rerun distill with more prompts")
    return rows


@dataclass(frozen=True)
class Targets:
    """The LLM's stored distributions of the distilled rows (training/target_distributions.py)."""

    rows: dict[int, PositionTargets]  # row id -> top-K ids / probs / tail per output position
    temperature: float  # the temperature p was recorded at (q is trained and scored at it too)
    info: dict[str, Any]  # metadata.json's "distributions" entry

    def identity(self) -> dict[str, Any]:
        return {k: self.info.get(k) for k in ("top_k", "temperature", "top_p", "recorded_from")}


def load_row_targets(config: BoostConfig, rows: list[dict[str, Any]]) -> Targets | None:
    """The stored distributions, when the data has them; refused when training needs them and
    the data has none (before anything is written)."""
    info = distribution_info(config.distilled)
    if info is None:
        if config.needs_distributions:
            what = f"--loss {config.loss}" if config.loss != "ce" else f"--boost-mode {config.boost_mode}"
            raise ValueError(
                f"{what} trains on the LLM's stored next-token distributions, and the distilled data "
                f"{config.distilled} has none: distill again with them, e.g. {DISTILL_HINT}"
            )
        return None
    found = load_targets(config.distilled, {r["id"] for r in rows})
    for r in rows:
        stored = found.get(r["id"])
        if stored is None or stored.tail.shape[0] != len(r["output_ids"]):
            raise ValueError(
                f"{config.distilled}: the stored distributions of row {r['id']} do not match its output "
                "tokens: regenerate the distilled data"
            )
    return Targets(found, float(info["temperature"]), info)


def data_digest(rows: list[dict[str, Any]]) -> str:
    digest = hashlib.sha256()
    for r in rows:
        digest.update(json.dumps([r["id"], r["prompt_ids"], r["output_ids"]]).encode())
    return digest.hexdigest()


def split_held_out(rows: list[dict[str, Any]], fraction: float, seed: int) -> list[int]:
    """Ids of the held-out rows: a seeded shuffle of the prompts, at least one, leaving at least one
    to train on. Every sample of a held-out prompt is held out (`--num-samples` writes several)."""
    prompt_of = {r["id"]: r.get("prompt_id", r["id"]) for r in rows}
    prompts = sorted(set(prompt_of.values()))
    if len(prompts) < 2:
        raise ValueError(f"need distilled samples of at least 2 prompts (one held out), got {len(prompts)}")
    random.Random(seed).shuffle(prompts)
    count = min(len(prompts) - 1, max(1, round(fraction * len(prompts))))
    held = set(prompts[:count])
    return sorted(i for i, p in prompt_of.items() if p in held)


def training_examples(
    rows: list[dict[str, Any]],
    masked: dict[int, set[int]],
    max_len: int | None,
    weights: dict[int, torch.Tensor] | None = None,
    targets: Targets | None = None,
) -> datasets.Dataset | ExampleSet:
    """input_ids = prompt + output; labels = -100 on the prompt and on masked output positions.
    With per-position `weights` ([n_out] per row id) or the stored distributions (`targets`),
    the examples carry them too, cut to the kept output positions (an ExampleSet of tensors)."""
    examples: list[dict[str, Any]] = []
    for r in rows:
        prompt, output = fit(r["prompt_ids"], r["output_ids"], max_len)
        gone = masked.get(r["id"], set())
        labels = [-100] * len(prompt) + [-100 if k in gone else t for k, t in enumerate(output)]
        example: dict[str, Any] = {"input_ids": prompt + output, "labels": labels}
        if weights is not None:
            example["weights"] = weights[r["id"]][: len(output)].float()
        if targets is not None:
            stored = targets.rows[r["id"]]
            example["target_ids"] = torch.from_numpy(stored.ids[: len(output)].astype(np.int64))
            example["target_probs"] = torch.from_numpy(stored.probs[: len(output)].astype(np.float32))
            example["target_tail"] = torch.from_numpy(stored.tail[: len(output)].astype(np.float32))
        examples.append(example)
    if weights is None and targets is None:
        return datasets.Dataset.from_dict({k: [e[k] for e in examples] for k in ("input_ids", "labels")})
    return ExampleSet(examples)


class ExampleSet(torch.utils.data.Dataset):
    """Training examples holding tensors (per-position weights, stored distributions)."""

    def __init__(self, examples: list[dict[str, Any]]) -> None:
        self.examples = examples

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.examples[index]


class PadCollator:
    """Right padding: input_ids with pad_id, labels with -100, attention_mask 0. Per-output-position
    weights and stored distributions, when the examples hold them, are placed at their labels'
    positions (the output starts after the prompt: where the labels stop being -100 at first)."""

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    def __call__(self, batch: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        width = max(len(b["input_ids"]) for b in batch)
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)  # [B, T]
        labels = torch.full((len(batch), width), -100, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, b in enumerate(batch):
            n = len(b["input_ids"])
            ids[i, :n], labels[i, :n], mask[i, :n] = (
                torch.tensor(b["input_ids"]),
                torch.tensor(b["labels"]),
                1,
            )
        collated = {"input_ids": ids, "labels": labels, "attention_mask": mask}
        if "weights" in batch[0]:
            collated["weights"] = torch.zeros((len(batch), width))  # [B, T]
            for i, b in enumerate(batch):
                start = len(b["input_ids"]) - b["weights"].shape[0]
                collated["weights"][i, start : len(b["input_ids"])] = b["weights"]
        if "target_ids" in batch[0]:
            top_k = batch[0]["target_ids"].shape[-1]
            collated["target_ids"] = torch.zeros((len(batch), width, top_k), dtype=torch.long)  # [B, T, K]
            collated["target_probs"] = torch.zeros((len(batch), width, top_k))
            collated["target_tail"] = torch.zeros((len(batch), width))  # [B, T]
            for i, b in enumerate(batch):
                start, end = len(b["input_ids"]) - b["target_tail"].shape[0], len(b["input_ids"])
                collated["target_ids"][i, start:end] = b["target_ids"]
                collated["target_probs"][i, start:end] = b["target_probs"]
                collated["target_tail"][i, start:end] = b["target_tail"]
        return collated


def acceptance_weights(pool_acceptance: dict[int, torch.Tensor], rows: list[dict[str, Any]]) -> dict:
    """Per-position loss weights of the next SSM in sampled boost mode: proportional to 1 - the
    pool's acceptance there, normalised to mean 1 over every output position of `rows`; all ones
    when the pool already accepts everything."""
    rejection = {r["id"]: (1.0 - pool_acceptance[r["id"]]).clamp(min=0.0) for r in rows}
    mean = float(torch.cat(list(rejection.values())).mean()) if rejection else 0.0
    if mean <= 0:
        return {k: torch.ones_like(v) for k, v in rejection.items()}
    return {k: v / mean for k, v in rejection.items()}


# ---------------------------------------------------------------- SSM setup


def llama_parameters(
    vocab: int, hidden: int, layers: int, heads: int, kv: int, head_dim: int, inter: int, tied: bool
) -> int:
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv * head_dim
    return (
        vocab * hidden * (1 if tied else 2) + layers * (attention + 3 * hidden * inter + 2 * hidden) + hidden
    )


def sized_ssm_config(
    llm: PretrainedConfig, fraction: float, tokenizer: PreTrainedTokenizerBase
) -> LlamaConfig:
    """A Llama with the LLM's vocabulary and about `fraction` of its parameters (embeddings included):
    the LLM's head size and attention grouping, fewer heads and layers."""
    c = llm.get_text_config()
    hidden, layers = c.hidden_size, c.num_hidden_layers
    heads = c.num_attention_heads
    kv = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or hidden // heads
    inter = getattr(c, "intermediate_size", None) or 4 * hidden
    tied = bool(getattr(c, "tie_word_embeddings", True))
    target = fraction * llama_parameters(c.vocab_size, hidden, layers, heads, kv, head_dim, inter, tied)
    best: tuple[float, dict[str, int]] | None = None
    for n_heads in range(1, heads + 1):
        h = n_heads * head_dim
        n_kv = max(
            d for d in range(1, n_heads + 1) if n_heads % d == 0 and d <= max(1, n_heads * kv // heads)
        )
        i = max(8, round(h * inter / hidden / 8) * 8)
        for n_layers in range(1, layers + 1):
            size = llama_parameters(c.vocab_size, h, n_layers, n_heads, n_kv, head_dim, i, tied)
            shape = {"hidden": h, "layers": n_layers, "heads": n_heads, "kv": n_kv, "inter": i}
            if best is None or abs(math.log(size / target)) < best[0]:
                best = (abs(math.log(size / target)), shape)
    assert best is not None
    s = best[1]
    return LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=s["hidden"],
        intermediate_size=s["inter"],
        num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv"],
        head_dim=head_dim,
        max_position_embeddings=getattr(c, "max_position_embeddings", None) or 2048,
        rms_norm_eps=getattr(c, "rms_norm_eps", 1e-6),
        tie_word_embeddings=tied,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )


def check_base_vocab(base: str, llm_config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase) -> None:
    """An SSM must draft in the LLM's vocabulary: same output size and, if it has one, same tokenizer."""
    base_vocab = load_config(base).get_text_config().vocab_size
    llm_vocab = llm_config.get_text_config().vocab_size
    if base_vocab != llm_vocab:
        raise ValueError(
            f"the SSM base {base} has a vocabulary of {base_vocab} tokens but the LLM has {llm_vocab}: "
            "SSM drafts must be LLM token ids; give a base trained with the LLM's tokenizer, "
            "or drop --ssm-base to build SSMs from a config sized for the LLM"
        )
    try:
        base_tokenizer = load_tokenizer(base)
    except ValueError:
        return  # weights only: the LLM's tokenizer is saved with every SSM
    if base_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise ValueError(
            f"the SSM base {base} has {base_vocab} output ids like the LLM, but its tokenizer maps "
            "tokens to other ids: give a base trained with the LLM's tokenizer, or drop --ssm-base"
        )


def build_ssm(config: BoostConfig, ssm_config: LlamaConfig | None, round_index: int) -> PreTrainedModel:
    """A fresh SSM for round `round_index` (seeded), from the base or the sized config."""
    transformers.set_seed(config.seed + round_index)
    if config.ssm_base is not None:
        model = load_causal_lm(config.ssm_base, torch.float32).train()
    else:
        assert ssm_config is not None
        model = LlamaForCausalLM(ssm_config)
    if config.lora:
        lora = peft.LoraConfig(
            r=config.lora_rank,
            lora_alpha=config.lora_alpha,
            target_modules="all-linear",
            task_type="CAUSAL_LM",
        )
        model = peft.get_peft_model(model, lora)
    return model


def context_of(model: PreTrainedModel) -> int | None:
    value = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    return value if isinstance(value, int) and value > 0 else None


# ---------------------------------------------------------------- train, mark, evaluate


def training_arguments(
    config: BoostConfig, checkpoints: Path, round_index: int, examples: int
) -> TrainingArguments:
    cuda = torch.cuda.is_available()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    per_epoch = math.ceil(examples / (config.batch_size * config.grad_accum_steps * world))
    total = config.max_steps if config.max_steps > 0 else math.ceil(config.epochs * per_epoch)
    bf16 = cuda and torch.cuda.is_bf16_supported()
    return TrainingArguments(
        output_dir=str(checkpoints),
        num_train_epochs=config.epochs,
        max_steps=config.max_steps,
        per_device_train_batch_size=config.batch_size,
        gradient_accumulation_steps=config.grad_accum_steps,
        learning_rate=config.learning_rate,
        lr_scheduler_type="cosine",
        warmup_steps=config.warmup_steps,
        weight_decay=config.weight_decay,
        save_strategy="steps",
        save_steps=config.save_steps,
        save_total_limit=2,
        logging_steps=max(1, min(config.logging_steps, total)),  # at least one logged loss
        use_cpu=not cuda,
        bf16=bf16,  # mixed precision only on GPUs that have it; fp32 on CPU
        fp16=cuda and not bf16,
        seed=config.seed + round_index,
        data_seed=config.seed + round_index,
        report_to="none",
        dataloader_num_workers=0,
        remove_unused_columns=False,  # our collator builds the batch
    )


def save_ssm(trainer: Trainer, tokenizer: PreTrainedTokenizerBase, lora: bool, final: Path) -> None:
    """Write `final` through a temporary folder, so that it exists only complete."""
    tmp = final.with_name(final.name + ".tmp")
    if trainer.args.should_save:
        shutil.rmtree(tmp, ignore_errors=True)
    if lora:  # merge the adapters into the weights: a plain model for the decoder
        if trainer.args.should_save:
            trainer.accelerator.unwrap_model(trainer.model).merge_and_unload().save_pretrained(tmp)
    else:
        trainer.save_model(str(tmp))  # gathers ZeRO-3 shards; writes on the main process only
    if trainer.args.should_save:
        tokenizer.save_pretrained(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    trainer.accelerator.wait_for_everyone()


class DistributionTrainer(Trainer):
    """A Trainer whose loss is `distribution_loss.position_losses` of kind `loss` (ce / kl / tv /
    mix) at the output positions (labels != -100), each weighted by the batch's "weights" when
    present (sampled boost mode), summed and divided by the number of trained positions.

    The sum is divided by `num_items_in_batch` (the labelled positions of the whole accumulated
    batch, over every process) when the Trainer counts them, as transformers' own causal-LM loss
    does, so the loss is already scaled for gradient accumulation; else by this micro-batch's
    positions and the accumulation steps."""

    loss_is_scaled_for_ga = True

    def __init__(self, *args: Any, loss: str, temperature: float | None, mix_weight: float, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.loss_kind, self.temperature, self.mix_weight = loss, temperature, mix_weight

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: dict[str, torch.Tensor],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, Any]:
        outputs = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
        labels = inputs["labels"][:, 1:]  # [B, T-1]: position j's logits predict token j + 1
        valid = labels != -100
        logits = outputs.logits[:, :-1][valid]  # [N, V]
        targets = None
        if "target_ids" in inputs:
            targets = tuple(inputs[k][:, 1:][valid] for k in ("target_ids", "target_probs", "target_tail"))
        losses = position_losses(
            self.loss_kind, logits, labels[valid], targets, self.temperature, self.mix_weight
        )  # [N]
        if "weights" in inputs:
            losses = losses * inputs["weights"][:, 1:][valid]
        if num_items_in_batch is not None:
            loss = losses.sum() / num_items_in_batch
            if self.args.average_tokens_across_devices and self.accelerator.num_processes > 1:
                loss = loss * self.accelerator.num_processes  # DDP averages the gradients
        else:
            steps = getattr(self, "current_gradient_accumulation_steps", 1)
            loss = losses.sum() / valid.sum().clamp(min=1) / steps
        return (loss, outputs) if return_outputs else loss


def train_round(
    config: BoostConfig,
    round_index: int,
    train_set: datasets.Dataset | ExampleSet,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    out: Path,
    temperature: float | None = None,
) -> tuple[int, float | None]:
    """Train (or resume) one SSM and save it to OUT/ssm-<i>; returns (steps, final logged loss).
    Examples with weights or stored distributions (an ExampleSet) train with DistributionTrainer
    (q at `temperature`, the one p was recorded at); plain ones with the model's own loss."""
    checkpoints = out / f"round-{round_index}" / "checkpoints"
    resume = last_checkpoint(checkpoints)
    common = dict(
        model=model,
        args=training_arguments(config, checkpoints, round_index, len(train_set)),
        train_dataset=train_set,
        data_collator=PadCollator(tokenizer.pad_token_id),
        processing_class=tokenizer,
    )
    if isinstance(train_set, ExampleSet):
        extra = dict(loss=config.loss, temperature=temperature, mix_weight=config.mix_weight)
        trainer: Trainer = DistributionTrainer(**common, **extra)
    else:
        trainer = Trainer(**common)
    finished = resume is not None and finished_checkpoint(resume)
    if finished:  # killed after training: Trainer.train would take one step too many from here
        trainer._load_from_checkpoint(str(resume))
        trainer.state = TrainerState.load_from_json(str(resume / "trainer_state.json"))
    else:
        trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    save_ssm(trainer, tokenizer, config.lora, out / f"ssm-{round_index}")
    if trainer.is_deepspeed_enabled:
        # The DeepSpeed config stays registered with transformers for the whole process; under
        # ZeRO-3 every later from_pretrained would then partition the SSM it loads, and marking
        # and scoring need the saved SSM whole. The next round's TrainingArguments register it again.
        unset_hf_deepspeed_config()
    return trainer.state.global_step, float(losses[-1]) if losses else None


def finished_checkpoint(checkpoint: Path) -> bool:
    """Whether the checkpoint was saved at the end of training (its step is the run's last)."""
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    return state["global_step"] >= state["max_steps"] > 0


def teacher_forced(
    model: PreTrainedModel, rows: list[dict[str, Any]], pad_id: int, batch_size: int, desc: str
) -> Iterator[tuple[list[dict[str, Any]], torch.Tensor, torch.Tensor, list[int], list[int]]]:
    """(rows, input_ids [B, T], logits [B, T, V], prompt lengths, output lengths) per batch of
    `rows`, each fitted to the model's context."""
    model.eval()
    device, max_len = next(model.parameters()).device, context_of(model)
    for start in tqdm(range(0, len(rows), batch_size), desc=desc, leave=False):
        batch = rows[start : start + batch_size]
        pairs = [fit(r["prompt_ids"], r["output_ids"], max_len) for r in batch]
        collated = PadCollator(pad_id)([{"input_ids": p + o, "labels": p + o} for p, o in pairs])
        ids = collated["input_ids"].to(device)  # [B, T]
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=collated["attention_mask"].to(device)).logits
        yield batch, ids, logits, [len(p) for p, _ in pairs], [len(o) for _, o in pairs]


def output_hits(
    model: PreTrainedModel, rows: list[dict[str, Any]], pad_id: int, batch_size: int, desc: str
) -> dict[int, torch.Tensor]:
    """id -> [n_out] bool: the model's teacher-forced greedy prediction of each LLM output token."""
    hits: dict[int, torch.Tensor] = {}
    for batch, ids, logits, prompt_lens, output_lens in teacher_forced(model, rows, pad_id, batch_size, desc):
        found = hits_from_logits(logits, ids, prompt_lens, output_lens)
        hits.update({r["id"]: h for r, h in zip(batch, found, strict=True)})
    return hits


def output_acceptance(
    model: PreTrainedModel,
    rows: list[dict[str, Any]],
    targets: Targets,
    pad_id: int,
    batch_size: int,
    desc: str,
) -> dict[int, torch.Tensor]:
    """id -> [n_out] float: 1 - TV_b(p, q) at each output position, q = softmax(logits / T) at the
    targets' temperature (distribution_loss.py; positions cut by the context score 0)."""
    found: dict[int, torch.Tensor] = {}
    for batch, _, logits, prompt_lens, output_lens in teacher_forced(model, rows, pad_id, batch_size, desc):
        for b, (r, p, n) in enumerate(zip(batch, prompt_lens, output_lens, strict=True)):
            stored = targets.rows[r["id"]]
            device = logits.device
            accepted = sampled_acceptance(
                logits[b, p - 1 : p + n - 1],
                torch.from_numpy(stored.ids[:n].astype(np.int64)).to(device),
                torch.from_numpy(stored.probs[:n].astype(np.float32)).to(device),
                torch.from_numpy(stored.tail[:n].astype(np.float32)).to(device),
                targets.temperature,
            )
            found[r["id"]] = torch.zeros(len(r["output_ids"]))
            found[r["id"]][:n] = accepted.cpu()
    return found


def load_ssm(path: Path) -> PreTrainedModel:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)


def mark(
    config: BoostConfig, hits: dict[int, torch.Tensor], masked: dict[int, set[int]], removed: set[int]
) -> int:
    """Apply this round's marks to `masked` / `removed` in place; returns the count newly marked
    (samples for sample marking, output positions for span marking)."""
    newly = 0
    for sample_id, h in hits.items():
        if config.marking == "sample":
            if sample_marked(h):
                removed.add(sample_id)
                newly += 1
            continue
        positions = {int(t) for t in span_marked(h, config.span_depth).nonzero().flatten()}
        before = masked.setdefault(sample_id, set())
        newly += len(positions - before)
        before |= positions
        if len(before) == h.shape[0]:
            removed.add(sample_id)
    return newly


def held_out_scores(hits: dict[int, torch.Tensor], pool_hits: dict[int, torch.Tensor], chain: int) -> dict:
    """This SSM's greedy acceptance and the pool's coverage (pool_hits already includes this SSM)."""
    lengths = torch.cat([match_lengths(h, chain) for h in hits.values()]).float()
    drafted = torch.cat([torch.arange(h.shape[0], 0, -1).clamp(max=chain) for h in hits.values()]).float()
    pool = torch.cat(list(pool_hits.values())).float()
    return {
        "held_out_acceptance": float(lengths.sum() / drafted.sum()),
        "held_out_mean_match_length": float(lengths.mean()),
        "single_coverage": float(torch.cat(list(hits.values())).float().mean()),
        "pool_coverage": float(pool.mean()),
    }


# ---------------------------------------------------------------- state, record, plot


def load_state(out: Path, identity: dict[str, Any], held_out_ids: list[int]) -> dict[str, Any]:
    """The run's state: a fresh one, or the saved one if it was made with the same settings and data."""
    path = out / STATE_FILE
    if not path.is_file():
        return {"identity": identity, "held_out_ids": held_out_ids, "rounds": [], "removed": [], "masked": {}}
    state = json.loads(path.read_text())
    if state["identity"] != identity:
        changed = sorted(
            k
            for k in identity.keys() | state["identity"].keys()
            if identity.get(k) != state["identity"].get(k)
        )
        raise ValueError(
            f"{out} holds a boost run with other settings or data ({', '.join(changed)}): "
            "rerun with the same settings to resume, or use a new --out"
        )
    return state


def plot_coverage(rounds: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["ssm"] + 1 for r in rounds]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(x, [r["pool_coverage"] for r in rounds], "o-", label="pool (any SSM so far)")
    ax.bar(x, [r["single_coverage"] for r in rounds], alpha=0.4, label="this SSM alone")
    ylabel = "held-out next-token coverage"
    if all(r.get("pool_sampled_acceptance") is not None for r in rounds):
        sampled = [r["pool_sampled_acceptance"] for r in rounds]
        ax.plot(x, sampled, "s--", label="pool sampled acceptance (1 - TV)")
        ylabel = "held-out coverage / acceptance"
    ax.set(xlabel="SSMs in the pool", ylabel=ylabel, ylim=(0, 1), xticks=x)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(
    config: BoostConfig, state: dict[str, Any], out: Path, targets: Targets | None = None
) -> dict[str, Any]:
    greedy = config.boost_mode == "greedy"
    record = {
        "llm": config.llm,
        "distilled": config.distilled,
        "base": config.base_name,
        "boost_mode": config.boost_mode,
        "loss": config.loss,
        "mix_weight": config.mix_weight if config.loss == "mix" else None,
        # the temperature of the p the SSMs were trained on (None: trained on the LLM's tokens only)
        "target_temperature": targets.temperature if targets and config.needs_distributions else None,
        # the temperature of the held-out sampled acceptance (None: the data holds no distributions)
        "sampled_scoring_temperature": targets.temperature if targets else None,
        "marking": config.marking if greedy else None,
        "span_depth": config.span_depth if greedy and config.marking == "span" else None,
        "marked_unit": ("samples" if config.marking == "sample" else "positions") if greedy else None,
        "chain": config.chain,
        "rounds": state["rounds"],
        "held_out_ids": state["held_out_ids"],
        "seed": config.seed,
        "config": asdict(config),
        "versions": library_versions(),
    }
    write_json_atomic(out / RECORD_FILE, record)
    plot_coverage(state["rounds"], out / PLOT_FILE)
    return record


# ---------------------------------------------------------------- run


def add_hits(pool_hits: dict[int, torch.Tensor], hits: dict[int, torch.Tensor]) -> None:
    """pool_hits |= hits, row by row (a row cut by `fit` scores only its kept positions)."""
    for k, h in hits.items():
        pool_hits[k][: h.shape[0]] |= h


def setup(config: BoostConfig) -> tuple[PreTrainedTokenizerBase, LlamaConfig | None, list[dict[str, Any]]]:
    """The LLM's tokenizer and config (its weights are not needed), the SSM config, the data."""
    tokenizer = load_tokenizer(config.llm)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # padding is masked out; any id works
    llm_config = load_config(config.llm)
    ssm_config = None
    if config.ssm_base is not None:
        check_base_vocab(config.ssm_base, llm_config, tokenizer)
    else:
        ssm_config = sized_ssm_config(llm_config, SSM_PRESETS[config.ssm_config], tokenizer)
    return tokenizer, ssm_config, load_rows(config.distilled)


def boost(config: BoostConfig, out: Path) -> dict[str, Any]:
    """Train (or resume) the pool in `out`; returns boost_record.json's content."""
    # 1. Setup: tokenizer, SSM config, the data (and its stored distributions) and its held-out
    #    split, the saved state. Refusals come before anything is written.
    tokenizer, ssm_config, rows = setup(config)
    targets = load_row_targets(config, rows)
    pad, batch = tokenizer.pad_token_id, config.eval_batch_size
    held_ids = split_held_out(rows, config.held_out_fraction, config.seed)
    held = [r for r in rows if r["id"] in set(held_ids)]
    train_rows = [r for r in rows if r["id"] not in set(held_ids)]
    out.mkdir(parents=True, exist_ok=True)
    identity = {**config.identity(), "data": data_digest(rows)}
    if config.needs_distributions and targets is not None:
        identity["targets"] = targets.identity()
    state = load_state(out, identity, held_ids)
    removed = set(state["removed"])
    masked = {int(k): set(v) for k, v in state["masked"].items()}
    main_process = int(os.environ.get("RANK", "0")) == 0
    sampled = config.boost_mode == "sampled"
    pool: HeldOutPool | None = None  # held-out positions any SSM so far predicts / accepts
    pool_train: dict[int, torch.Tensor] | None = None  # sampled mode: the pool's training acceptance

    for i in range(config.num_ssms):
        if i < len(state["rounds"]):
            print(f"[boost] round {i}: done ({out / f'ssm-{i}'}), skipped")
            continue
        if pool is None:  # first round of this run: the earlier SSMs' held-out predictions
            pool = HeldOutPool(held, targets)
            for j in range(i):
                pool.add(load_ssm(out / f"ssm-{j}"), pad, batch, f"ssm-{j}")
        if sampled and pool_train is None and i > 0:
            pool_train = load_acceptance(out / f"round-{i - 1}" / ACCEPTANCE_FILE, train_rows)
        # 2. Train SSM i on what no earlier SSM reproduces (greedy), or on every training sample
        #    weighted by how badly the pool serves each position (sampled).
        active = train_rows if sampled else [r for r in train_rows if r["id"] not in removed]
        if not active:
            print(f"[boost] every training sample is marked after {i} SSMs: the pool stops at {i}")
            break
        model = build_ssm(config, ssm_config, i)
        weights = acceptance_weights(pool_train, train_rows) if pool_train is not None else None
        train_targets = targets if config.loss != "ce" else None
        train_set = training_examples(active, masked, context_of(model), weights, train_targets)
        print(f"[boost] round {i}: training ssm-{i} on {len(active)} samples", flush=True)
        temperature = targets.temperature if targets is not None else None
        steps, loss = train_round(config, i, train_set, model, tokenizer, out, temperature)
        del model
        ssm = load_ssm(out / f"ssm-{i}")
        # 3. Mark what it reproduces (greedy), or score the pool's acceptance at every training
        #    position for the next round's weights (sampled; saved: part of the resumable state).
        progress: dict[str, Any]
        if sampled:
            assert targets is not None  # load_row_targets refused the data otherwise
            accepted = output_acceptance(ssm, train_rows, targets, pad, batch, f"ssm-{i} acceptance")
            pool_train = accepted if pool_train is None else pool_max(pool_train, accepted)
            if main_process:
                save_acceptance(out / f"round-{i}" / ACCEPTANCE_FILE, pool_train, train_rows)
            progress = {
                "marked": None,
                "remaining_samples": len(train_rows),
                "train_pool_sampled_acceptance": float(torch.cat(list(pool_train.values())).mean()),
            }
        else:
            marked = mark(config, output_hits(ssm, active, pad, batch, f"ssm-{i} mark"), masked, removed)
            progress = {
                "marked": marked,
                "remaining_samples": sum(r["id"] not in removed for r in train_rows),
            }
        # 4. Score it and the pool on the held-out split; record the round.
        scores = pool.add(ssm, pad, batch, f"ssm-{i} held-out", config.chain)
        r = {
            "ssm": i,
            "path": f"ssm-{i}",
            "train_samples": len(active),
            **progress,
            **scores,
            "steps": steps,
            "final_loss": loss,
            "parameters": sum(p.numel() for p in ssm.parameters()),
        }
        state["rounds"].append(r)
        state["removed"] = sorted(removed)
        state["masked"] = {str(k): sorted(v) for k, v in masked.items() if v}
        if main_process:
            write_json_atomic(out / STATE_FILE, state)
            write_outputs(config, state, out, targets)
        tqdm.write(round_line(config, r))
    return write_outputs(config, state, out, targets) if main_process else {}


def round_line(config: BoostConfig, r: dict[str, Any]) -> str:
    done = (
        f"pool training acceptance {r['train_pool_sampled_acceptance']:.3f}"
        if r.get("train_pool_sampled_acceptance") is not None
        else f"marked {r['marked']}"
    )
    line = (
        f"[boost] ssm-{r['ssm']}: loss {r['final_loss']:.3f}, {done}, held-out acceptance "
        f"{r['held_out_acceptance']:.3f} (mean match {r['held_out_mean_match_length']:.2f}"
        f"/{config.chain}), coverage alone {r['single_coverage']:.3f}, pool {r['pool_coverage']:.3f}"
    )
    if r.get("held_out_sampled_acceptance") is not None:
        line += (
            f"; sampled acceptance (1 - TV) alone {r['held_out_sampled_acceptance']:.3f}, "
            f"pool {r['pool_sampled_acceptance']:.3f}"
        )
    return line


class HeldOutPool:
    """The held-out split's running pool scores: positions any SSM so far predicts (greedy), and
    the best member's sampled acceptance 1 - TV_b at each position (when the data has p)."""

    def __init__(self, held: list[dict[str, Any]], targets: Targets | None) -> None:
        self.held, self.targets = held, targets
        self.hits = {r["id"]: torch.zeros(len(r["output_ids"]), dtype=torch.bool) for r in held}
        self.accepted = {r["id"]: torch.zeros(len(r["output_ids"])) for r in held} if targets else None

    def add(
        self, ssm: PreTrainedModel, pad_id: int, batch_size: int, desc: str, chain: int | None = None
    ) -> dict[str, Any]:
        """Add an SSM to the pool; with `chain`, return its scores and the pool's."""
        hits = output_hits(ssm, self.held, pad_id, batch_size, desc)
        add_hits(self.hits, hits)
        accepted = None
        if self.targets is not None and self.accepted is not None:
            accepted = output_acceptance(ssm, self.held, self.targets, pad_id, batch_size, f"{desc} sampled")
            self.accepted = pool_max(self.accepted, accepted)
        if chain is None:
            return {}
        scores = held_out_scores(hits, self.hits, chain)
        scores["held_out_sampled_acceptance"] = mean_of(accepted)
        scores["pool_sampled_acceptance"] = mean_of(self.accepted)
        return scores


def mean_of(values: dict[int, torch.Tensor] | None) -> float | None:
    return None if values is None else float(torch.cat(list(values.values())).mean())


def pool_max(pool: dict[int, torch.Tensor], member: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """The best member's acceptance at every position: max over the pool and the new member."""
    return {k: torch.maximum(v, member[k]) for k, v in pool.items()}


def save_acceptance(path: Path, acceptance: dict[int, torch.Tensor], rows: list[dict[str, Any]]) -> None:
    """The acceptance at every output position of `rows`, in their order, as one float32 array
    (written to a temporary file and renamed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with tmp.open("wb") as file:
        np.save(file, torch.cat([acceptance[r["id"]] for r in rows]).numpy().astype(np.float32))
    os.replace(tmp, path)


def load_acceptance(path: Path, rows: list[dict[str, Any]]) -> dict[int, torch.Tensor]:
    """What `save_acceptance` wrote for these rows."""
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: the sampled boost run cannot resume without it")
    flat = torch.from_numpy(np.load(path))
    lengths = [len(r["output_ids"]) for r in rows]
    if flat.shape[0] != sum(lengths):
        raise ValueError(f"{path} holds {flat.shape[0]} positions, the training rows {sum(lengths)}")
    return {r["id"]: part for r, part in zip(rows, flat.split(lengths), strict=True)}


def parse_args(argv: list[str] | None) -> tuple[BoostConfig, Path, int | None]:
    p = argparse.ArgumentParser(description="Collective boost-tuning of an SSM pool (ALGORITHMS.md 4).")
    p.add_argument("--distilled", required=True, help="distill run folder (data.parquet)")
    p.add_argument("--llm", required=True, help="the LLM folder or id (tokenizer and config)")
    p.add_argument("--out", type=Path, required=True, help="pool folder: OUT/ssm-0, OUT/ssm-1, ...")
    p.add_argument("--num-ssms", type=int, default=3)
    base = p.add_mutually_exclusive_group()
    base.add_argument(
        "--ssm-base", default=None, help="small causal LM (folder or hub id) every SSM starts from"
    )
    base.add_argument(
        "--ssm-config",
        choices=sorted(SSM_PRESETS),
        default="tenth",
        help="fresh Llama with the LLM's vocabulary and this share of its parameters",
    )
    p.add_argument("--marking", choices=MARKINGS, default="sample", help="greedy boost mode: what is marked")
    p.add_argument("--span-depth", type=int, default=4, help="d: tokens a marked span must reproduce")
    p.add_argument(
        "--boost-mode",
        choices=BOOST_MODES,
        default="greedy",
        help="greedy: mark what earlier SSMs reproduce; sampled: weight positions by the pool's 1 - TV",
    )
    p.add_argument(
        "--loss",
        choices=LOSSES,
        default="ce",
        help="ce: the LLM's tokens; kl / tv: its stored distributions (top-K + tail); mix: ce + kl",
    )
    p.add_argument("--mix-weight", type=float, default=1.0, help="w of --loss mix = CE + w KL")
    p.add_argument("--chain", type=int, default=4, help="greedy chain length scored on the held-out split")
    p.add_argument("--held-out-fraction", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--epochs", type=float, default=3.0)
    p.add_argument("--max-steps", type=int, default=-1, help="optimizer steps per round (overrides epochs)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--grad-accum-steps", type=int, default=1)
    p.add_argument("--learning-rate", type=float, default=1e-3)
    p.add_argument("--warmup-steps", type=int, default=10)
    p.add_argument("--save-steps", type=int, default=50)
    p.add_argument("--lora", action="store_true", help="train LoRA adapters, merged before saving")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    a = p.parse_args(argv)
    config = BoostConfig(
        distilled=a.distilled,
        llm=a.llm,
        num_ssms=a.num_ssms,
        ssm_base=a.ssm_base,
        ssm_config=a.ssm_config,
        marking=a.marking,
        span_depth=a.span_depth,
        boost_mode=a.boost_mode,
        loss=a.loss,
        mix_weight=a.mix_weight,
        chain=a.chain,
        held_out_fraction=a.held_out_fraction,
        seed=a.seed,
        epochs=a.epochs,
        max_steps=a.max_steps,
        batch_size=a.batch_size,
        grad_accum_steps=a.grad_accum_steps,
        learning_rate=a.learning_rate,
        warmup_steps=a.warmup_steps,
        save_steps=a.save_steps,
        lora=a.lora,
        lora_rank=a.lora_rank,
    )
    return config, a.out, a.threads


def main(argv: list[str] | None = None) -> int:
    try:
        config, out, threads = parse_args(argv)
        if threads is not None:
            torch.set_num_threads(threads)
        started = time.time()
        boost(config, out)
    except (ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"[boost] done in {time.time() - started:.0f}s: {out / RECORD_FILE}, {out / PLOT_FILE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
