"""Reference LLM: a byte-level BPE tokenizer and a Llama causal LM trained from scratch on the corpus.

    python -m specboost.training.reference_llm --preset tiny --out artifacts/reference-llm/tiny
    python -m specboost.training.reference_llm --preset small --out artifacts/reference-llm/small

This machine cannot download an LLM, so the project trains its own stand-in target model (p) from
the bundled corpus (`data/corpus/`, see its README: ~18 MB of text, ~4.6-4.9M tokens). Presets
(parameters with tied embeddings; times measured on this project's 2-core CPU machine):

| preset | vocab | hidden x layers | params | steps x tokens | tokens seen       | time                   |
|--------|-------|-----------------|--------|----------------|-------------------|------------------------|
| tiny   | 4096  | 192 x 4         | 2.36M  | 160 x 4096     | 0.66M (0.13 pass) | 4.3 min, 1 core (3k/s) |
| small  | 8192  | 384 x 8         | 15.7M  | 900 x 4096     | 3.7M (0.8 pass)   | ~1 h, 2 cores (1k/s)   |

`tiny` is the demo (loss falls from 8.3 to ~5.0; repetitive but English); `small` is the
benchmark target, at least 10x the parameters of the SSMs distilled from it (~1.5M).

OUT gets `tokenizer/` (trained once, reused on resume), `cache/` (the tokenised corpus),
`checkpoints/` (every `save_steps`; a killed run resumes from the last complete one), `run.json`
(what the checkpoints belong to) and finally `model/`: model, tokenizer, generation config and
`training_record.json` (config, seed, data files + sha256, steps, tokens seen, final validation
loss and perplexity, wall time, versions). `model/` appears atomically, and a rerun whose record
matches the config, seed and data only prints where it is.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import hashlib
import json
import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import datasets
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Trainer,
    TrainingArguments,
    default_data_collator,
)

from specboost.decoder.tiny_models import SPECIAL_TOKENS, fast_tokenizer
from specboost.speculator.bundled_data import bundled_corpus
from specboost.training.run_files import library_versions, write_json_atomic

SPLIT_FILES = {"train": "train.jsonl*", "validation": "valid.jsonl*"}  # searched in every subfolder
RECORD = "training_record.json"
SAMPLE_PROMPT = "Once upon a time, there was a little girl who"


@dataclass(frozen=True)
class ReferenceLLMConfig:
    # tokenizer
    vocab_size: int = 4096  # byte-level BPE: 256 bytes + 4 special tokens + merges
    tokenizer_min_frequency: int = 2  # a merge must occur this often in the training split
    # model: Llama with grouped-query attention, RoPE, SwiGLU
    hidden_size: int = 192
    intermediate_size: int = 512  # SwiGLU width
    num_layers: int = 4
    num_heads: int = 6
    num_kv_heads: int = 2  # grouped-query attention: num_heads / num_kv_heads queries share a K/V head
    block_size: int = 256  # training sequence length = max_position_embeddings
    tie_word_embeddings: bool = True  # the LM head reuses the embedding: fewer parameters, same FLOPs
    # optimisation: AdamW, linear warmup then cosine decay to min_lr_ratio * learning_rate
    batch_size: int = 16  # sequences per micro-batch
    grad_accum_steps: int = 1  # micro-batches per optimizer step
    learning_rate: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    max_grad_norm: float = 1.0
    max_steps: int = 160  # optimizer steps
    # bookkeeping
    eval_steps: int = 40  # evaluate on the held-out split every this many steps (and at the end)
    eval_blocks: int = 32  # validation blocks used (evenly spaced, the same for every run)
    save_steps: int = 40  # checkpoint every this many steps (and at the end)
    save_total_limit: int = 2  # checkpoints kept
    logging_steps: int = 10
    max_new_tokens: int = 128  # the saved generation config's default

    def __post_init__(self) -> None:
        if self.vocab_size < 256 + len(SPECIAL_TOKENS):
            raise ValueError(f"vocab_size must cover the 256 bytes and special tokens, got {self.vocab_size}")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must divide by num_heads ({self.num_heads}), "
                f"and num_heads by num_kv_heads ({self.num_kv_heads})"
            )
        positive = ("block_size", "batch_size", "grad_accum_steps", "max_steps", "eval_steps", "save_steps")
        if any(getattr(self, name) < 1 for name in positive):
            raise ValueError(f"{', '.join(positive)} must be >= 1")

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.grad_accum_steps * self.block_size


PRESETS: dict[str, ReferenceLLMConfig] = {
    # The demo: a falling loss and story-like word salad in a few minutes.
    "tiny": ReferenceLLMConfig(),
    # The benchmark target: ~1 h on 2 CPU cores at ~1k tokens/s (650 on one core), 0.8 of a pass
    # over the corpus. Larger models see too few tokens in an hour to become fluent.
    "small": ReferenceLLMConfig(
        vocab_size=8192,
        hidden_size=384,
        intermediate_size=1024,
        num_layers=8,
        num_heads=6,
        num_kv_heads=2,
        batch_size=8,
        grad_accum_steps=2,
        learning_rate=1e-3,
        warmup_steps=50,
        max_steps=900,
        eval_steps=100,
        eval_blocks=64,
        save_steps=50,
    ),
}


# ---------------------------------------------------------------- setup: corpus, tokenizer, blocks


@dataclass(frozen=True)
class CorpusFile:
    path: str
    sha256: str
    bytes: int


def find_corpus(corpus_dir: Path) -> dict[str, list[Path]]:
    """The train and validation files of `corpus_dir` (`train.jsonl[.gz]`, `valid.jsonl[.gz]`)."""
    if not corpus_dir.is_dir():
        raise ValueError(f"corpus folder {corpus_dir} does not exist: pass --corpus DIR (see data/corpus)")
    files = {split: sorted(corpus_dir.rglob(pattern)) for split, pattern in SPLIT_FILES.items()}
    for split, paths in files.items():
        if not paths:
            raise ValueError(f"no {SPLIT_FILES[split]} under {corpus_dir}: the corpus has no {split} split")
        for path in paths:
            with (gzip.open if path.suffix == ".gz" else open)(path, "rb") as f:
                if not f.read(1 << 16).strip():
                    raise ValueError(f"corpus file {path} is empty")
    return files


def describe_files(paths: list[Path], root: Path) -> list[CorpusFile]:
    described = []
    for path in paths:
        data = path.read_bytes()
        name = str(path.relative_to(root)) if path.is_relative_to(root) else str(path)
        described.append(CorpusFile(name, hashlib.sha256(data).hexdigest(), len(data)))
    return described


def load_corpus(files: dict[str, list[Path]], cache_dir: Path) -> datasets.DatasetDict:
    """One record per document, with a `text` field."""
    data_files = {split: [str(p) for p in paths] for split, paths in files.items()}
    try:
        corpus = datasets.load_dataset("json", data_files=data_files, cache_dir=str(cache_dir))
    except datasets.exceptions.DatasetGenerationError as error:
        raise ValueError(f"the corpus files are not JSON Lines with a 'text' field: {data_files}") from error
    for split, dataset in corpus.items():
        if "text" not in dataset.column_names or not any(t.strip() for t in dataset["text"]):
            raise ValueError(f"the {split} split ({', '.join(data_files[split])}) holds no text")
    return corpus


def train_tokenizer(texts: datasets.Dataset, config: ReferenceLLMConfig) -> PreTrainedTokenizerFast:
    """Byte-level BPE (every string encodes; no unknown tokens) that prepends <bos>."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=config.vocab_size,
        min_frequency=config.tokenizer_min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    batches = (texts[i : i + 256]["text"] for i in range(0, len(texts), 256))
    tokenizer.train_from_iterator(batches, trainer=trainer, length=len(texts))
    # Prompts start like training documents: <bos> text.
    return fast_tokenizer(tokenizer, add_bos_token=True, model_max_length=config.block_size)


def pack_blocks(
    corpus: datasets.DatasetDict, tokenizer: PreTrainedTokenizerFast, block_size: int
) -> datasets.DatasetDict:
    """Documents as `<bos> text <eos>`, concatenated and cut into blocks of `block_size` tokens."""
    eos = tokenizer.eos_token_id

    def tokenize(batch: dict[str, list[str]]) -> dict[str, list[list[int]]]:
        ids = tokenizer(batch["text"], verbose=False)["input_ids"]  # <bos> prepended; longer than a block
        return {"ids": [[*doc, eos] for doc in ids]}

    def group(batch: dict[str, list[list[int]]]) -> dict[str, list[list[int]]]:
        stream = [token for doc in batch["ids"] for token in doc]
        usable = len(stream) // block_size * block_size  # the tail of each batch is dropped
        blocks = [stream[i : i + block_size] for i in range(0, usable, block_size)]
        return {"input_ids": blocks, "labels": blocks}  # the model shifts labels itself

    columns = corpus["train"].column_names
    tokenized = corpus.map(tokenize, batched=True, remove_columns=columns, desc="tokenizing")
    blocks = tokenized.map(group, batched=True, batch_size=2000, remove_columns=["ids"], desc="packing")
    for split, dataset in blocks.items():
        if len(dataset) == 0:
            raise ValueError(f"the {split} split has fewer than {block_size} tokens: the corpus is too small")
    return blocks.with_format("torch")


def evenly_spaced(dataset: datasets.Dataset, count: int) -> datasets.Dataset:
    """At most `count` rows spread over the whole split, independent of the seed."""
    if len(dataset) <= count:
        return dataset
    return dataset.select([i * len(dataset) // count for i in range(count)])


# ---------------------------------------------------------------- model and trainer


def llama_config(config: ReferenceLLMConfig, vocab_size: int) -> LlamaConfig:
    """The model's config; special-token ids follow SPECIAL_TOKENS, as the tokenizer trains them."""
    pad, bos, eos, _ = range(len(SPECIAL_TOKENS))
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        max_position_embeddings=config.block_size,
        tie_word_embeddings=config.tie_word_embeddings,
        pad_token_id=pad,
        bos_token_id=bos,
        eos_token_id=eos,
    )


def build_model(config: ReferenceLLMConfig, tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    ids = (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id)
    assert ids == (0, 1, 2), f"special tokens moved: {ids}"
    model = LlamaForCausalLM(llama_config(config, len(tokenizer)))
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        max_new_tokens=config.max_new_tokens,
        do_sample=False,
    )
    return model


def count_parameters(config: ReferenceLLMConfig) -> int:
    """Parameters of the preset's model at its full vocabulary (tied weights once), not allocated."""
    with torch.device("meta"):
        model = LlamaForCausalLM(llama_config(config, config.vocab_size))
    return sum(p.numel() for p in model.parameters())


def training_arguments(config: ReferenceLLMConfig, checkpoints: Path, seed: int) -> TrainingArguments:
    cuda = torch.cuda.is_available()
    return TrainingArguments(
        output_dir=str(checkpoints),
        max_steps=config.max_steps,
        per_device_train_batch_size=config.batch_size,
        per_device_eval_batch_size=config.batch_size,
        gradient_accumulation_steps=config.grad_accum_steps,
        learning_rate=config.learning_rate,
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": config.min_lr_ratio},
        warmup_steps=config.warmup_steps,
        weight_decay=config.weight_decay,
        adam_beta2=0.95,
        max_grad_norm=config.max_grad_norm,
        eval_strategy="steps",
        eval_steps=config.eval_steps,
        save_strategy="steps",
        save_steps=config.save_steps,
        save_total_limit=config.save_total_limit,
        logging_steps=config.logging_steps,
        include_num_input_tokens_seen=True,  # logs tokens seen and tokens/s
        use_cpu=not cuda,
        bf16=cuda and torch.cuda.is_bf16_supported(),  # CPUs here lack fast bf16: fp32 there
        seed=seed,
        data_seed=seed,
        report_to="none",
        dataloader_num_workers=0,
    )


def last_checkpoint(checkpoints: Path) -> Path | None:
    """The newest checkpoint that was written completely (its trainer state is saved last)."""
    if not checkpoints.is_dir():
        return None
    found = [p for p in checkpoints.glob("checkpoint-*") if p.name.split("-")[-1].isdigit()]
    for path in sorted(found, key=lambda p: int(p.name.split("-")[-1]), reverse=True):
        try:
            json.loads((path / "trainer_state.json").read_text())
            return path
        except (OSError, json.JSONDecodeError):
            continue  # killed while saving: fall back to the one before
    return None


# ---------------------------------------------------------------- save and record


def run_identity(config: ReferenceLLMConfig, seed: int, data: dict[str, list[CorpusFile]]) -> dict[str, Any]:
    """What checkpoints must share to be resumed (max_steps may grow between runs)."""
    settings = {k: v for k, v in asdict(config).items() if k != "max_steps"}
    files = {split: [asdict(f) for f in found] for split, found in data.items()}
    return {"config": settings, "seed": seed, "data": files}


def final_validation_loss(trainer: Trainer) -> float:
    history = [e for e in trainer.state.log_history if "eval_loss" in e]
    if history and history[-1]["step"] == trainer.state.global_step:
        return float(history[-1]["eval_loss"])
    return float(trainer.evaluate()["eval_loss"])  # e.g. resumed from the final checkpoint


@torch.no_grad()
def greedy_sample(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, max_new_tokens: int = 40
) -> str:
    inputs = tokenizer(SAMPLE_PROMPT, return_tensors="pt").to(model.device)
    output = model.eval().generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(output[0], skip_special_tokens=True)


def save_final(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, record: dict, out: Path) -> Path:
    """Write `out/model` through a temporary folder, so that it exists only complete."""
    final, tmp = out / "model", out / "model.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    write_json_atomic(tmp / RECORD, record)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return final


# ---------------------------------------------------------------- train


def previous_record(out: Path, config: ReferenceLLMConfig, identity: dict[str, Any]) -> dict | None:
    """The record of a finished run with this config, seed and corpus, if `out` holds one."""
    path = out / "model" / RECORD
    if not path.is_file():
        return None
    record = json.loads(path.read_text())
    same = (record["config"], record["seed"], record["data"]["files"])
    return record if same == (asdict(config), identity["seed"], identity["data"]) else None


def claim_run_folder(out: Path, identity: dict[str, Any]) -> None:
    """Refuse to resume checkpoints that belong to another config, seed or corpus."""
    out.mkdir(parents=True, exist_ok=True)
    run = out / "run.json"
    if run.is_file() and json.loads(run.read_text()) != identity:
        raise ValueError(
            f"{out} holds a run with another config, seed or corpus: use a new --out or delete it"
        )
    write_json_atomic(run, identity)


def load_or_train_tokenizer(
    out: Path, corpus: datasets.DatasetDict, config: ReferenceLLMConfig
) -> PreTrainedTokenizerFast:
    """Trained once per run folder: resumed checkpoints need the same token ids."""
    if (out / "tokenizer" / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(out / "tokenizer")
    tokenizer = train_tokenizer(corpus["train"], config)
    tokenizer.save_pretrained(out / "tokenizer")
    return tokenizer


def make_record(
    trainer: Trainer,
    tokenizer: PreTrainedTokenizerFast,
    config: ReferenceLLMConfig,
    *,
    preset: str | None,
    seed: int,
    data: dict[str, Any],
    resumed_from_step: int | None,
    started: float,
) -> dict[str, Any]:
    state = trainer.state
    loss = final_validation_loss(trainer)
    special = {
        f"{name}_token_id": getattr(tokenizer, f"{name}_token_id") for name in ("bos", "eos", "pad", "unk")
    }
    return {
        "preset": preset,
        "config": asdict(config),
        "seed": seed,
        "parameters": sum(p.numel() for p in trainer.model.parameters()),
        "tokenizer": {"vocab_size": len(tokenizer), **special},
        "data": data,
        "steps": state.global_step,
        "epochs": state.epoch,
        "tokens_seen": state.global_step * config.tokens_per_step,
        "resumed_from_step": resumed_from_step,
        "final_validation_loss": loss,
        "final_validation_perplexity": math.exp(loss),
        "eval_history": [
            {"step": e["step"], "loss": e["eval_loss"]} for e in state.log_history if "eval_loss" in e
        ],
        "sample": {"prompt": SAMPLE_PROMPT, "greedy": greedy_sample(trainer.model, tokenizer)},
        "wall_time_s": round(time.time() - started, 1),
        "device": str(trainer.args.device),
        "threads": torch.get_num_threads(),
        "versions": library_versions(),
        "finished": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def train_reference_llm(
    config: ReferenceLLMConfig,
    out: Path,
    corpus_dir: Path | None = None,
    seed: int = 0,
    preset: str | None = None,
) -> dict[str, Any]:
    """Train (or resume, or find already trained) the reference LLM; returns its training record.
    `corpus_dir` defaults to the bundled corpus, which only a source checkout has."""
    started = time.time()
    corpus_dir = corpus_dir if corpus_dir is not None else bundled_corpus()
    # 1. Identify the run by config, seed and corpus files; skip it if it is already done.
    files = find_corpus(corpus_dir)
    identity = run_identity(
        config, seed, {split: describe_files(p, corpus_dir) for split, p in files.items()}
    )
    if (record := previous_record(out, config, identity)) is not None:
        loss = record["final_validation_loss"]
        print(f"[reference-llm] already trained: {out / 'model'} (validation loss {loss:.3f})")
        return record
    claim_run_folder(out, identity)

    # 2. Tokenizer and packed blocks.
    corpus = load_corpus(files, out / "cache")
    tokenizer = load_or_train_tokenizer(out, corpus, config)
    blocks = pack_blocks(corpus, tokenizer, config.block_size)
    validation = evenly_spaced(blocks["validation"], config.eval_blocks)

    # 3. Model and trainer; resume from the last complete checkpoint if there is one.
    transformers.set_seed(seed)
    model = build_model(config, tokenizer)
    resume = last_checkpoint(out / "checkpoints")
    print(
        f"[reference-llm] {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, "
        f"{len(blocks['train'])} train blocks of {config.block_size} tokens, "
        f"{config.max_steps} steps x {config.tokens_per_step} tokens"
        + (f", resuming {resume.name}" if resume else ""),
        flush=True,
    )
    trainer = Trainer(
        model=model,
        args=training_arguments(config, out / "checkpoints", seed),
        train_dataset=blocks["train"],
        eval_dataset=validation,
        data_collator=default_data_collator,
        processing_class=tokenizer,
    )
    trainer.train(resume_from_checkpoint=str(resume) if resume else None)

    # 4. Final validation loss, record, and the model folder.
    data = {
        "corpus": str(corpus_dir),
        "files": identity["data"],
        "train_blocks": len(blocks["train"]),
        "validation_blocks": len(blocks["validation"]),
        "eval_blocks": len(validation),
    }
    resumed = int(resume.name.split("-")[-1]) if resume else None
    record = make_record(
        trainer,
        tokenizer,
        config,
        preset=preset,
        seed=seed,
        data=data,
        resumed_from_step=resumed,
        started=started,
    )
    final = save_final(trainer.model, tokenizer, record, out)
    loss = record["final_validation_loss"]
    print(f"[reference-llm] saved {final}: validation loss {loss:.3f} (perplexity {math.exp(loss):.1f})")
    print(f"[reference-llm] greedy sample: {record['sample']['greedy']!r}")
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Train the reference LLM (tokenizer + Llama) on the corpus.")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--out", type=Path, required=True, help="run folder; the model lands in OUT/model")
    parser.add_argument(
        "--corpus",
        type=Path,
        default=None,
        help="has */train.jsonl.gz etc. (default: a checkout's data/corpus)",
    )
    parser.add_argument("--max-steps", type=int, default=None, help="override the preset's optimizer steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = parser.parse_args(argv)
    config = PRESETS[args.preset]
    if args.max_steps is not None:
        config = dataclasses.replace(config, max_steps=args.max_steps)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        train_reference_llm(config, args.out, args.corpus, args.seed, preset=args.preset)
    except (ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
