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

A held-out split of the distilled data (never trained on, nor marked) scores each round:
- greedy acceptance: at every output position t, the length of the greedy chain of `chain` (4)
  drafts from the LLM's prefix that match the LLM's tokens in a row. By the argument above this is
  the run of correct teacher-forced argmaxes starting at t, capped at `chain` (and at the end of the
  output); `held_out_mean_match_length` is its mean, `held_out_acceptance` the accepted fraction of
  the drafted tokens;
- pool coverage: the fraction of output positions where ANY SSM so far predicts the LLM's token.

OUT: ssm-<i>/ (save_pretrained: model + the LLM's tokenizer), round-<i>/checkpoints/ (Trainer),
boost_state.json (settings, held-out ids, completed rounds and their marks; atomic), boost_record.json
(atomic), coverage.png. A killed run resumes by rerunning the same command: completed rounds are
skipped and a partly trained round resumes from its last checkpoint. `--num-ssms` may grow.
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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import datasets
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
from specboost.training.reference_llm import last_checkpoint
from specboost.training.run_files import library_versions, write_json_atomic

STATE_FILE, RECORD_FILE, PLOT_FILE = "boost_state.json", "boost_record.json", "coverage.png"
MARKINGS = ("sample", "span")
SSM_PRESETS = {"tenth": 0.1, "fifth": 0.2, "twentieth": 0.05}  # SSM parameters / LLM parameters


@dataclass(frozen=True)
class BoostConfig:
    distilled: str = field(metadata={"help": "distill run folder (data.parquet)"})
    llm: str = field(metadata={"help": "the LLM folder or id: its tokenizer and config"})
    num_ssms: int = 3  # may grow between resumes
    ssm_base: str | None = None  # small HF causal LM to start every SSM from (None: a fresh config)
    ssm_config: str = "tenth"  # SSM_PRESETS key, used when ssm_base is None
    marking: str = "sample"  # "sample" (SpecInfer) or "span"
    span_depth: int = 4  # d of span marking
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
        if self.ssm_base is None and self.ssm_config not in SSM_PRESETS:
            raise ValueError(f"ssm_config must be one of {', '.join(SSM_PRESETS)}, got {self.ssm_config!r}")
        if min(self.num_ssms, self.span_depth, self.chain, self.batch_size, self.grad_accum_steps) < 1:
            raise ValueError("num_ssms, span_depth, chain, batch_size and grad_accum_steps must be >= 1")
        if not 0 < self.held_out_fraction < 1:
            raise ValueError(f"held_out_fraction must be in (0, 1), got {self.held_out_fraction}")
        if self.max_steps <= 0 and self.epochs <= 0:
            raise ValueError("give epochs > 0 or max_steps > 0")

    def identity(self) -> dict[str, Any]:
        """Settings a resume must share (more SSMs and a new eval batch size are fine)."""
        return {k: v for k, v in asdict(self).items() if k not in {"num_ssms", "eval_batch_size"}}

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
    rows = load_distilled(distilled).select_columns(["id", "prompt_ids", "output_ids"]).to_list()
    rows = [r for r in rows if r["prompt_ids"] and r["output_ids"]]
    if not rows:
        raise ValueError(f"{distilled} holds no usable distilled samples: rerun distill with more prompts")
    return rows


def data_digest(rows: list[dict[str, Any]]) -> str:
    digest = hashlib.sha256()
    for r in rows:
        digest.update(json.dumps([r["id"], r["prompt_ids"], r["output_ids"]]).encode())
    return digest.hexdigest()


def split_held_out(rows: list[dict[str, Any]], fraction: float, seed: int) -> list[int]:
    """Ids of the held-out rows: a seeded shuffle, at least one, leaving at least one to train on."""
    if len(rows) < 2:
        raise ValueError(f"need at least 2 distilled samples (one held out), got {len(rows)}")
    ids = sorted(r["id"] for r in rows)
    random.Random(seed).shuffle(ids)
    count = min(len(ids) - 1, max(1, round(fraction * len(ids))))
    return sorted(ids[:count])


def training_examples(
    rows: list[dict[str, Any]], masked: dict[int, set[int]], max_len: int | None
) -> datasets.Dataset:
    """input_ids = prompt + output; labels = -100 on the prompt and on masked output positions."""
    examples: dict[str, list[list[int]]] = {"input_ids": [], "labels": []}
    for r in rows:
        prompt, output = fit(r["prompt_ids"], r["output_ids"], max_len)
        gone = masked.get(r["id"], set())
        labels = [-100] * len(prompt) + [-100 if k in gone else t for k, t in enumerate(output)]
        examples["input_ids"].append(prompt + output)
        examples["labels"].append(labels)
    return datasets.Dataset.from_dict(examples)


class PadCollator:
    """Right padding: input_ids with pad_id, labels with -100, attention_mask 0."""

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    def __call__(self, batch: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
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
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}


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


def train_round(
    config: BoostConfig,
    round_index: int,
    train_set: datasets.Dataset,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    out: Path,
) -> tuple[int, float | None]:
    """Train (or resume) one SSM and save it to OUT/ssm-<i>; returns (steps, final logged loss)."""
    checkpoints = out / f"round-{round_index}" / "checkpoints"
    resume = last_checkpoint(checkpoints)
    trainer = Trainer(
        model=model,
        args=training_arguments(config, checkpoints, round_index, len(train_set)),
        train_dataset=train_set,
        data_collator=PadCollator(tokenizer.pad_token_id),
        processing_class=tokenizer,
    )
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


@torch.no_grad()
def output_hits(
    model: PreTrainedModel, rows: list[dict[str, Any]], pad_id: int, batch_size: int, desc: str
) -> dict[int, torch.Tensor]:
    """id -> [n_out] bool: the model's teacher-forced greedy prediction of each LLM output token."""
    model.eval()
    device, max_len = next(model.parameters()).device, context_of(model)
    hits: dict[int, torch.Tensor] = {}
    for start in tqdm(range(0, len(rows), batch_size), desc=desc, leave=False):
        batch = rows[start : start + batch_size]
        pairs = [fit(r["prompt_ids"], r["output_ids"], max_len) for r in batch]
        collated = PadCollator(pad_id)([{"input_ids": p + o, "labels": p + o} for p, o in pairs])
        ids = collated["input_ids"].to(device)  # [B, T]
        logits = model(input_ids=ids, attention_mask=collated["attention_mask"].to(device)).logits
        found = hits_from_logits(logits, ids, [len(p) for p, _ in pairs], [len(o) for _, o in pairs])
        hits.update({r["id"]: h for r, h in zip(batch, found, strict=True)})
    return hits


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
    ax.set(xlabel="SSMs in the pool", ylabel="held-out next-token coverage", ylim=(0, 1), xticks=x)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(config: BoostConfig, state: dict[str, Any], out: Path) -> dict[str, Any]:
    record = {
        "llm": config.llm,
        "distilled": config.distilled,
        "base": config.base_name,
        "marking": config.marking,
        "span_depth": config.span_depth if config.marking == "span" else None,
        "marked_unit": "samples" if config.marking == "sample" else "positions",
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
    # 1. Setup: tokenizer, SSM config, the data and its held-out split, the saved state.
    tokenizer, ssm_config, rows = setup(config)
    pad, batch = tokenizer.pad_token_id, config.eval_batch_size
    held_ids = split_held_out(rows, config.held_out_fraction, config.seed)
    held = [r for r in rows if r["id"] in set(held_ids)]
    train_rows = [r for r in rows if r["id"] not in set(held_ids)]
    out.mkdir(parents=True, exist_ok=True)
    state = load_state(out, {**config.identity(), "data": data_digest(rows)}, held_ids)
    removed = set(state["removed"])
    masked = {int(k): set(v) for k, v in state["masked"].items()}
    main_process = int(os.environ.get("RANK", "0")) == 0
    pool_hits: dict[int, torch.Tensor] | None = None  # held-out positions any SSM so far predicts

    for i in range(config.num_ssms):
        if i < len(state["rounds"]):
            print(f"[boost] round {i}: done ({out / f'ssm-{i}'}), skipped")
            continue
        if pool_hits is None:  # first round of this run: the earlier SSMs' held-out predictions
            pool_hits = {r["id"]: torch.zeros(len(r["output_ids"]), dtype=torch.bool) for r in held}
            for j in range(i):
                add_hits(pool_hits, output_hits(load_ssm(out / f"ssm-{j}"), held, pad, batch, f"ssm-{j}"))
        # 2. Train SSM i on what no earlier SSM reproduces.
        active = [r for r in train_rows if r["id"] not in removed]
        if not active:
            print(f"[boost] every training sample is marked after {i} SSMs: the pool stops at {i}")
            break
        model = build_ssm(config, ssm_config, i)
        train_set = training_examples(active, masked, context_of(model))
        print(f"[boost] round {i}: training ssm-{i} on {len(active)} samples", flush=True)
        steps, loss = train_round(config, i, train_set, model, tokenizer, out)
        del model
        # 3. Mark what it reproduces.
        ssm = load_ssm(out / f"ssm-{i}")
        marked = mark(config, output_hits(ssm, active, pad, batch, f"ssm-{i} mark"), masked, removed)
        # 4. Score it and the pool on the held-out split; record the round.
        held_hits = output_hits(ssm, held, pad, batch, f"ssm-{i} held-out")
        add_hits(pool_hits, held_hits)
        r = {
            "ssm": i,
            "path": f"ssm-{i}",
            "train_samples": len(active),
            "marked": marked,
            "remaining_samples": sum(r["id"] not in removed for r in train_rows),
            **held_out_scores(held_hits, pool_hits, config.chain),
            "steps": steps,
            "final_loss": loss,
            "parameters": sum(p.numel() for p in ssm.parameters()),
        }
        state["rounds"].append(r)
        state["removed"] = sorted(removed)
        state["masked"] = {str(k): sorted(v) for k, v in masked.items() if v}
        if main_process:
            write_json_atomic(out / STATE_FILE, state)
            write_outputs(config, state, out)
        tqdm.write(
            f"[boost] ssm-{i}: loss {loss:.3f}, marked {marked}, held-out acceptance "
            f"{r['held_out_acceptance']:.3f} (mean match {r['held_out_mean_match_length']:.2f}"
            f"/{config.chain}), coverage alone {r['single_coverage']:.3f}, pool {r['pool_coverage']:.3f}"
        )
    return write_outputs(config, state, out) if main_process else {}


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
    p.add_argument("--marking", choices=MARKINGS, default="sample")
    p.add_argument("--span-depth", type=int, default=4, help="d: tokens a marked span must reproduce")
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
