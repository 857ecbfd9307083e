"""Distillation data: the LLM's own continuations of the training prompts (ALGORITHMS.md section 9).

    python -m specboost.training.distill --llm artifacts/reference-llm/tiny/model --prompts gsm8k \\
        --out artifacts/distill/tiny-gsm8k --max-new-tokens 128 --batch-size 16
    python -m specboost.training.distill --llm ... --prompts tinystories_openings:60,eagle_qa,gsm8k:40
    accelerate launch --multi_gpu --num_processes 2 -m specboost.training.distill ...   # split over processes

`--multi_gpu` starts the processes through torchrun, also on a machine without GPUs: then every
process runs on the CPU and they talk over gloo (`accelerate launch --cpu` starts only one process
unless MPI is set up). Each process generates its own share of the pending prompts.

Only the TRAIN split of the prompt set is used (`load_prompt_splits`; the held-out prompts stay
unseen for evaluation). The LLM (p) continues each prompt with `model.generate`, batched with left
padding, greedily or with the sampling settings that will be served.

Several domains: `--prompts` takes a comma-separated list of sets (bundled names or files), each
`SET` or `SET:N`. Every set is split into train / held-out by itself, exactly as a run of it alone
(and an evaluation loading it alone) splits it, so no held-out prompt of any set is distilled;
`:N` then keeps at most N of the set's train prompts (a seeded sample: the split is shuffled),
leaving its held-out part as it is. A train prompt that another set holds out or already trains
on is dropped (sets may overlap). The train splits are distilled together. Every row says its
set in `source` (the bundled name as given, or the file's stem; a single set's rows have it too).
Prompt ids stay unique: each set's are offset by the id ranges of the sets before it (the first
set keeps its own, so a single-set run is the run it always was and old runs resume).
`--prompt-field` / `--answer-field` apply to every set; `--max-prompts` caps each set before its
split. Without `--out` the run goes to artifacts/distill/<name>, names joined with "+" for a list.

OUT gets `run.json` (the settings the shards belong to), `shards/` (Parquet, one file per
`shard_size` prompts, each written to a temporary file and renamed, so a shard exists only
complete), and finally `data.parquet` (every prompt exactly once, with the filter that dropped it,
if any) and `metadata.json`. A killed run (even kill -9) resumes by rerunning the same command:
prompts already in a complete shard are skipped. Other settings are refused.

`--use-pool POOL` (an exported pool, `make export`) generates through the lossless speculative
decoder instead of `model.generate`: the same greedy outputs, the same sampling distribution.

`--num-samples N` (with `--do-sample`) writes N sampled continuations of every prompt, each its
own row: row id = prompt id * N + sample index, so shards, resume and the split over processes
work on rows and every (prompt, sample) is generated exactly once.

`--top-k-probs K` (default 64; 0 turns it off) also records, at every output position, the top-K
token ids and probabilities of the LLM's processed distribution p and the remaining mass as one
number (`training/target_distributions.py`; ALGORITHMS.md section 15): what `make boost --loss
kl|tv|mix` and `--boost-mode sampled` train on. A sampled run records the distribution it sampled
from; a greedy run records the one sampling at `--temperature` / `--top-p` would use (they
change nothing else in a greedy run). K larger than the vocabulary is clamped with a notice.
metadata.json reports the settings and the storage per output token.

Rows: id, prompt_id, sample, source, prompt, prompt_ids, output_ids, output (text), finish_reason
("eos" | "length"), answer when a prompt set has reference answers (None for a set without them
in a list), and with `--top-k-probs` the columns
top_k_ids (int32), top_k_probs (float16), tail_prob (float32), one entry per output token.
`load_distilled(out)` gives the kept rows. metadata.json lists the sets (`prompt_sets`: name, cap,
id offset, source) and their counts (`counts.sources`: prompts, rows, kept, filtered by filter).

Filters (applied when merging, so they can change without regenerating; counts in metadata):
empty output, `--drop-truncated` (finish_reason "length"), degenerate repetition (a block of up
to `repeat_max_ngram` tokens repeated `repeat_min_count` times in a row), and a wrong final
number where the prompt set has GSM8K-style reference answers ("#### 72"; `--keep-wrong-answers`
keeps them: a small LLM that cannot do the math still shows the SSMs what it writes).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch
import transformers
from accelerate import Accelerator
from datasets import Dataset
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specboost.decoder.decoder import SpeculativeDecoder
from specboost.decoder.pool import SSMPool
from specboost.speculator.loading import load_causal_lm, load_tokenizer
from specboost.speculator.model_info import context_length
from specboost.speculator.padding import left_pad
from specboost.speculator.prompt_sets import (
    BUNDLED_PROMPT_SETS,
    PromptSource,
    load_prompt_splits,
    named_source,
    tokenize_prompts,
)
from specboost.training.run_files import library_versions, write_json_atomic
from specboost.training.run_shards import claim_run_folder, read_shards, shard_tables, write_shard
from specboost.training.target_distributions import (
    COLUMN_TYPES,
    COLUMNS,
    PositionTargets,
    TopKRecorder,
    clamp_top_k,
    processor_names,
    raw_bytes_per_token,
    stored_bytes_per_token,
    target_processing,
)

SPLIT = "train"  # the only split distilled; "held_out" is kept for evaluation
METADATA_FILE, DATA_FILE = "metadata.json", "data.parquet"
FILTERS = ("empty", "truncated", "repetition", "wrong_answer")
DTYPES = {"auto": "auto", "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Identity values of settings that runs made before the setting existed had (their run.json lacks it)
OFF = {"top_k_probs": 0, "num_samples": 1}
# --prompts "SET[:N],SET[:N],...": N caps the set's train prompts
SET_SEPARATOR = ","
CAPPED = re.compile(r"(?P<spec>.*\S)\s*:\s*(?P<cap>-?\d+)")
OUT_NAME_JOIN = "+"  # default run folder of several sets: their names joined, e.g. tinystories_openings+gsm8k


@dataclass(frozen=True)
class PromptSetEntry:
    """One entry of --prompts: a bundled set's name or a file, and at most how many of its train
    prompts to distill (None: all of them)."""

    spec: str
    max_train_prompts: int | None = None

    @property
    def name(self) -> str:
        """What the rows' `source` column says: the bundled name as given, else the file's stem."""
        return self.spec if self.spec in BUNDLED_PROMPT_SETS else Path(self.spec).stem


def parse_prompt_sets(prompts: str) -> list[PromptSetEntry]:
    """The entries of --prompts, "SET[:N],SET[:N],..." (an existing file whose name holds a comma
    is one set). Refuses empty entries, caps below 1 and a set named twice: each set is split
    into train / held-out by itself, so it must appear once, with one cap."""
    if prompts.strip() and Path(prompts).expanduser().exists():
        return [PromptSetEntry(prompts)]
    entries = []
    for part in prompts.split(SET_SEPARATOR):
        capped = CAPPED.fullmatch(part.strip())
        spec = (capped["spec"] if capped else part).strip()
        cap = int(capped["cap"]) if capped else None
        if not spec:
            raise ValueError(
                f"--prompts {prompts!r} has an empty entry: give SET[:N],SET[:N],... without gaps"
            )
        if cap is not None and cap < 1:
            raise ValueError(f"--prompts: the cap of {spec!r} must be at least 1 train prompt, got {cap}")
        entries.append(PromptSetEntry(spec, cap))
    names = [entry.name for entry in entries]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise ValueError(
            f"--prompts {prompts!r} names the same prompt set more than once ({', '.join(twice)}): "
            "give each set once (its rows are told apart by the set's name)"
        )
    return entries


def default_out_name(prompts: str) -> str:
    """The run folder's name under artifacts/distill: the set's name (a file's stem), for several
    sets their names joined with "+" (caps left out). The Makefile's `distill_name` is the same."""
    return OUT_NAME_JOIN.join(entry.name for entry in parse_prompt_sets(prompts))


@dataclass(frozen=True)
class DistillConfig:
    # what to generate (all of these identify a run: a resume must match them)
    llm: str = field(metadata={"help": "any Hugging Face causal LM folder or id"})
    prompts: str = field(
        metadata={
            "help": f"bundled set ({', '.join(BUNDLED_PROMPT_SETS)}) or a file; several as "
            "SET[:N],SET[:N],... (N: at most N train prompts of that set)"
        }
    )
    # Both apply to every set of the list (None: each set's own / auto)
    prompt_field: str | None = None  # column of the prompt
    answer_field: str | None = None  # column of a reference answer (bundled gsm8k: "answer")
    chat_template: bool = False  # render prompts as one user turn with the tokenizer's template
    max_prompts: int | None = None  # first N distinct prompts of each set, before its split
    held_out_fraction: float = 0.1
    split_seed: int = 0
    max_new_tokens: int = 128
    do_sample: bool = False  # False: greedy
    temperature: float = 1.0  # greedy runs: the temperature of the recorded distributions only
    top_p: float = 1.0  # greedy runs: the top-p of the recorded distributions only
    seed: int = 0  # sampling seed (each batch is seeded from it and its first row id)
    num_samples: int = 1  # sampled continuations per prompt (each its own row; needs do_sample)
    top_k_probs: int = 64  # top-K of p stored per output position (0: none)
    shard_size: int = 256  # prompts per Parquet shard: at most this much work is lost to a kill
    dtype: str = "auto"
    # how to run (free to change between resumes)
    batch_size: int = 8
    # an exported SSM pool (folder or hub id): generate through the lossless speculative decoder
    # (the same greedy outputs, the same sampling distribution; faster once a pool exists)
    use_pool: str | None = None
    # filters, applied at merge time
    drop_truncated: bool = False
    repeat_max_ngram: int = 8  # longest repeated block looked for
    repeat_min_count: int = 6  # consecutive repeats that make an output degenerate (0: off)
    # an LLM that cannot do the math still shows the SSMs what it writes for math prompts
    keep_wrong_answers: bool = False

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1 or self.batch_size < 1 or self.shard_size < 1:
            raise ValueError("max_new_tokens, batch_size and shard_size must be at least 1")
        if self.top_k_probs < 0 or self.num_samples < 1:
            raise ValueError(
                f"top_k_probs must be >= 0 and num_samples >= 1 (got {self.top_k_probs}, {self.num_samples})"
            )
        if self.num_samples > 1 and not self.do_sample:
            raise ValueError(
                f"--num-samples {self.num_samples} needs --do-sample: greedy decoding writes the same "
                "continuation every time"
            )
        if (self.do_sample or self.top_k_probs) and (self.temperature <= 0 or not 0 < self.top_p <= 1):
            what = "sampling" if self.do_sample else "recording distributions"
            raise ValueError(
                f"{what} needs temperature > 0 and 0 < top_p <= 1 (got {self.temperature}, {self.top_p})"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        parse_prompt_sets(self.prompts)  # a malformed list is refused before anything loads

    def identity(self) -> dict[str, Any]:
        """Settings that change what is generated: a resume must match them exactly."""
        free = {
            "batch_size",
            "use_pool",
            "drop_truncated",
            "repeat_max_ngram",
            "repeat_min_count",
            "keep_wrong_answers",
        }
        settings = {k: v for k, v in asdict(self).items() if k not in free}
        if not self.do_sample:
            settings.pop("seed")
            if not self.top_k_probs:
                settings.pop("temperature"), settings.pop("top_p")
        # Off values are left out, so that runs made before these settings existed still resume.
        return {k: v for k, v in settings.items() if not (k in OFF and v == OFF[k])}


# ---------------------------------------------------------------- setup: prompts, model


@dataclass(frozen=True)
class PromptSet:
    """One set of the run, loaded and split by itself (as an evaluation holding out the same split
    of the set does); only its (capped) train prompts are distilled."""

    entry: PromptSetEntry
    source: PromptSource
    train: Dataset  # id (the record's row in the set), prompt (and answer), after the cap
    train_available: int  # train prompts before the cap (and after dropping overlaps)
    held_out: int
    overlapping: int  # train prompts dropped: held out by another set, or trained from an earlier one
    # Added to the set's prompt ids, so that row ids stay unique over the sets: the sum of the id
    # ranges of the sets before it (0 for the first, so a single-set run keeps its ids).
    id_offset: int


def prompt_sources(config: DistillConfig) -> list[tuple[PromptSetEntry, PromptSource]]:
    """Each entry's source: a bundled set by name, else a file / hub dataset. The same file named
    twice (by its bundled name and its path, say) is refused."""
    overrides: dict[str, Any] = {
        "max_prompts": config.max_prompts,
        "chat_template": config.chat_template,
        "held_out_fraction": config.held_out_fraction,
        "seed": config.split_seed,
    }
    if config.prompt_field is not None:
        overrides.update(prompt_field=config.prompt_field, prompt_template=None)
    if config.answer_field is not None:
        overrides["answer_field"] = config.answer_field
    sources = [(entry, named_source(entry.spec, **overrides)) for entry in parse_prompt_sets(config.prompts)]
    seen: dict[Path, str] = {}
    for entry, source in sources:
        path = Path(source.path).expanduser().resolve()
        if path.exists() and seen.setdefault(path, entry.spec) != entry.spec:
            raise ValueError(
                f"--prompts names the same prompt set twice: {seen[path]!r} and {entry.spec!r} are both "
                f"{path}"
            )
    return sources


def load_prompt_sets(config: DistillConfig, tokenizer: PreTrainedTokenizerBase) -> list[PromptSet]:
    """Every set of --prompts split into train / held-out by itself (`load_prompt_splits`), its
    train split cut to the entry's cap (the split is seeded and shuffled, so that is a seeded
    sample, and the held-out part is the same as without the cap). An error names its set.

    Sets may share prompts (bundled `bench` is part of `vicuna_bench`): a train prompt that another
    set holds out, or that an earlier set already trains on, is dropped, so no set's held-out
    split is ever distilled and no prompt twice. Within one set the split already guarantees it."""
    loaded = []
    for entry, source in prompt_sources(config):
        try:
            loaded.append((entry, source, load_prompt_splits(source, tokenizer)))
        except (ValueError, FileNotFoundError) as error:
            raise type(error)(f"prompt set {entry.name!r}: {error}") from error
    taken = {prompt for *_, splits in loaded for prompt in splits["held_out"]["prompt"]}
    sets, offset = [], 0
    for entry, source, splits in loaded:
        train = splits[SPLIT]
        fresh = [i for i, prompt in enumerate(train["prompt"]) if prompt not in taken]
        if not fresh:
            raise ValueError(
                f"prompt set {entry.name!r}: every train prompt is held out or trained by another set of "
                "--prompts; leave one of them out"
            )
        cap = len(fresh) if entry.max_train_prompts is None else min(entry.max_train_prompts, len(fresh))
        distilled = train.select(fresh[:cap])
        taken.update(distilled["prompt"])
        sets.append(
            PromptSet(
                entry=entry,
                source=source,
                train=distilled,
                train_available=len(fresh),
                held_out=len(splits["held_out"]),
                overlapping=len(train) - len(fresh),
                id_offset=offset,
            )
        )
        offset += max(max(splits[split]["id"]) for split in splits) + 1
    return sets


def train_prompts(sets: list[PromptSet]) -> Dataset:
    """The train prompts of every set as one table: id (offset), prompt, answer (None for a set
    without answers, when another set has them) and source (the set's name)."""
    with_answers = any("answer" in s.train.column_names for s in sets)
    columns: dict[str, list[Any]] = {"id": [], "prompt": [], **({"answer": []} if with_answers else {})}
    columns["source"] = []
    for s in sets:
        n = len(s.train)
        columns["id"] += [i + s.id_offset for i in s.train["id"]]
        columns["prompt"] += s.train["prompt"]
        if with_answers:
            columns["answer"] += s.train["answer"] if "answer" in s.train.column_names else [None] * n
        columns["source"] += [s.entry.name] * n
    return Dataset.from_dict(columns)


def load_llm(config: DistillConfig) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    tokenizer = load_tokenizer(config.llm)
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise ValueError(f"the tokenizer of {config.llm} has neither a pad nor an eos token: set one")
        tokenizer.pad_token = tokenizer.eos_token  # padding is masked out; any id works
    tokenizer.padding_side = "left"
    return load_causal_lm(config.llm, DTYPES[config.dtype]), tokenizer


def eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    ids = model.generation_config.eos_token_id
    found = set(ids if isinstance(ids, list) else [] if ids is None else [ids])
    if tokenizer.eos_token_id is not None:
        found.add(tokenizer.eos_token_id)
    return found


def load_pool(
    location: str, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, device: torch.device
) -> SSMPool:
    """An exported pool, checked to be trained for this LLM, on the device the LLM will use."""
    pool = SSMPool.from_pretrained(location, device=device, dtype=model.dtype)
    pool.check_llm(model, tokenizer)
    return pool


# ---------------------------------------------------------------- generation


def trim_output(tokens: list[int], eos: set[int]) -> tuple[list[int], str]:
    """Tokens up to and including the first EOS (what follows is padding), and why it stopped."""
    for i, token in enumerate(tokens):
        if token in eos:
            return tokens[: i + 1], "eos"
    return tokens, "length"


@torch.no_grad()
def generate_batch(
    generator: PreTrainedModel | SpeculativeDecoder,
    prompts: list[list[int]],
    pad_id: int,
    eos: set[int],
    config: DistillConfig,
    seed: int,
) -> list[tuple[list[int], str]]:
    """(output_ids, finish_reason) for each prompt, from `model.generate` or the speculative decoder."""
    ids, mask = left_pad(prompts, pad_id)  # [B, T]
    sampling = {"temperature": config.temperature, "top_p": config.top_p} if config.do_sample else {}
    common = dict(max_new_tokens=config.max_new_tokens, do_sample=config.do_sample, **sampling)
    if isinstance(generator, SpeculativeDecoder):
        device = generator.llm.device
        out = generator.generate(
            ids.to(device),
            attention_mask=mask.to(device),
            eos_token_id=sorted(eos) or None,
            seed=seed,
            **common,
        ).sequences
    else:
        out = generator.generate(
            input_ids=ids.to(generator.device),
            attention_mask=mask.to(generator.device),
            pad_token_id=pad_id,
            eos_token_id=sorted(eos) or None,
            **common,
        )  # [B, T + new]; finished rows are padded
    return [trim_output(row.tolist(), eos) for row in out[:, ids.shape[1] :].cpu()]


def batch_targets(
    llm: PreTrainedModel,
    prompts: list[list[int]],
    outputs: list[list[int]],
    pad_id: int,
    eos: set[int],
    config: DistillConfig,
) -> list[PositionTargets]:
    """The top-K of p at every output position of a generated batch (target_distributions.py)."""
    processing = target_processing(
        llm,
        left_pad(prompts, pad_id)[0],
        config.temperature,
        config.top_p,
        config.max_new_tokens,
        pad_id,
        eos,
    )
    return TopKRecorder(llm, processing, config.top_k_probs, pad_id)(prompts, outputs)


def generate_pending(
    generator: PreTrainedModel | SpeculativeDecoder,
    tokenizer: PreTrainedTokenizerBase,
    pending: Dataset,
    config: DistillConfig,
    out: Path,
    show_progress: bool,
) -> None:
    """Generate this process's rows, one shard at a time (with their distributions when asked)."""
    llm = generator.llm if isinstance(generator, SpeculativeDecoder) else generator
    eos = eos_ids(llm, tokenizer)
    has_answer = "answer" in pending.column_names
    bar = tqdm(total=len(pending), unit="prompt", disable=not show_progress, desc="distill")
    started, tokens = time.perf_counter(), 0
    for start in range(0, len(pending), config.shard_size):
        shard = pending.select(range(start, min(start + config.shard_size, len(pending))))
        rows: list[dict[str, Any]] = []
        for b in range(0, len(shard), config.batch_size):
            batch = shard[b : b + config.batch_size]
            seed = config.seed * 1_000_003 + batch["id"][0]  # reproducible per batch, whatever ran before
            if config.do_sample:
                transformers.set_seed(seed)
            results = generate_batch(generator, batch["input_ids"], tokenizer.pad_token_id, eos, config, seed)
            targets = (
                batch_targets(
                    llm, batch["input_ids"], [o for o, _ in results], tokenizer.pad_token_id, eos, config
                )
                if config.top_k_probs
                else None
            )
            for i, (output_ids, reason) in enumerate(results):
                row = {
                    "id": batch["id"][i],
                    "prompt": batch["prompt"][i],
                    "prompt_ids": batch["input_ids"][i],
                    "output_ids": output_ids,
                    "output": tokenizer.decode(output_ids, skip_special_tokens=True),
                    "finish_reason": reason,
                }
                if has_answer:
                    row["answer"] = batch["answer"][i]
                if targets is not None:
                    row.update(zip(COLUMNS, (targets[i].ids, targets[i].probs, targets[i].tail), strict=True))
                rows.append(row)
                tokens += len(output_ids)
            bar.update(len(results))
            elapsed = max(time.perf_counter() - started, 1e-9)
            bar.set_postfix(prompts_s=f"{bar.n / elapsed:.2f}", tokens_s=f"{tokens / elapsed:.1f}")
        write_shard(out, rows)
    bar.close()


# ---------------------------------------------------------------- filters


def repeated_block(tokens: list[int], max_ngram: int, min_count: int) -> bool:
    """Whether some block of 1..max_ngram tokens occurs min_count times in a row."""
    if min_count < 2:
        return False
    for n in range(1, max_ngram + 1):
        run = 0  # positions i with tokens[i] == tokens[i - n], in a row
        for i in range(n, len(tokens)):
            run = run + 1 if tokens[i] == tokens[i - n] else 0
            if run + n >= n * min_count:
                return True
    return False


NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_number(text: str) -> str | None:
    """The number after '####' if there is one, else the last number in the text, normalised."""
    tail = text.rsplit("####", 1)[1] if "####" in text else text
    found = NUMBER.findall(tail)
    if not found:
        return None
    number = found[0] if "####" in text else found[-1]
    number = number.replace(",", "")
    return number.rstrip("0").rstrip(".") if "." in number else number


def filter_reason(row: dict[str, Any], config: DistillConfig) -> str:
    """The first filter that drops the row, or "" if it is kept."""
    content = row["output_ids"] if row["finish_reason"] == "length" else row["output_ids"][:-1]  # no EOS
    if not content or not row["output"].strip():
        return "empty"
    if config.drop_truncated and row["finish_reason"] == "length":
        return "truncated"
    if repeated_block(content, config.repeat_max_ngram, config.repeat_min_count):
        return "repetition"
    answer = row.get("answer") or ""
    if (
        not config.keep_wrong_answers
        and "####" in answer
        and final_number(row["output"]) != final_number(answer)
    ):
        return "wrong_answer"
    return ""


# ---------------------------------------------------------------- merge, metadata


def merge(out: Path, expected: dict[int, str], config: DistillConfig) -> Dataset:
    """All shards as one table with one row per (prompt, sample) of `expected` (row id -> its
    prompt set), its prompt id, sample index, source and filter; written to OUT/data.parquet.
    The source comes from `expected`, not the shards, so shards of runs made before the column
    existed merge too. Arrow throughout, so the stored distributions keep their compact types."""
    table = pa.concat_tables(shard_tables(out), promote_options="default")
    first: dict[int, int] = {}
    for index, row_id in enumerate(table.column("id").to_pylist()):
        first.setdefault(row_id, index)  # duplicates cannot arise from complete shards; be safe
    missing = expected.keys() - first.keys()
    assert not missing, f"{len(missing)} rows have no output (e.g. {sorted(missing)[:5]})"
    ordered = sorted(expected)
    table = table.take(pa.array([first[i] for i in ordered], type=pa.int64()))
    derived = ("prompt_id", "sample", "source")
    table = table.drop_columns([c for c in derived if c in table.column_names])
    n = config.num_samples
    table = table.add_column(1, "prompt_id", pa.array([i // n for i in ordered], type=pa.int64()))
    table = table.add_column(2, "sample", pa.array([i % n for i in ordered], type=pa.int64()))
    table = table.add_column(3, "source", pa.array([expected[i] for i in ordered], type=pa.string()))
    light = ("output_ids", "output", "finish_reason", "answer")
    filters = [
        filter_reason(row, config)
        for row in table.select([c for c in light if c in table.column_names]).to_pylist()
    ]
    table = table.append_column("filter", pa.array(filters, type=pa.string()))
    tmp = out / f".{DATA_FILE}.tmp-{os.getpid()}"
    pq.write_table(table, tmp)
    os.replace(tmp, out / DATA_FILE)
    return Dataset(table)


def filter_counts(filters: list[str]) -> dict[str, int]:
    """Rows dropped by each filter (every filter named, also at 0, so reports line up)."""
    return {name: filters.count(name) for name in FILTERS}


def source_counts(sets: list[PromptSet], prompts: Dataset, merged: Dataset) -> dict[str, dict[str, Any]]:
    """Per prompt set: its prompts, and its rows kept and filtered (by filter)."""
    truncated = [name for name, cut in zip(prompts["source"], prompts["truncated"], strict=True) if cut]
    counts = {}
    for s in sets:
        name = s.entry.name
        filters = [f for source, f in zip(merged["source"], merged["filter"], strict=True) if source == name]
        counts[name] = {
            "train_prompts": len(s.train),
            "train_available": s.train_available,
            "held_out_prompts": s.held_out,
            "overlapping_prompts": s.overlapping,
            "truncated_prompts": truncated.count(name),
            "rows": len(filters),
            "kept": filters.count(""),
            "filtered": filter_counts(filters),
        }
    return counts


def load_distilled(out: str | os.PathLike[str], keep_filtered: bool = False) -> Dataset:
    """The distilled rows of a finished run: one per kept (prompt, sample) (all with keep_filtered),
    with each row's prompt set (`source`) and the stored distributions' columns when the run
    recorded them. A run finished before `source` existed gets it from its metadata.json."""
    path = Path(out) / DATA_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} does not exist: run `python -m specboost.training.distill` to finish"
        )
    ds = Dataset(pq.read_table(path))
    if len(set(ds["id"])) != len(ds):
        raise RuntimeError(f"{path} holds duplicate row ids: regenerate it")
    source = None if "source" in ds.column_names else single_set_name(Path(out))
    if source is not None:
        ds = ds.add_column("source", [source] * len(ds))
    return ds if keep_filtered else ds.filter(lambda reason: reason == "", input_columns="filter")


def single_set_name(out: Path) -> str | None:
    """The one prompt set of a run made before rows had a `source` (such runs took one set), from
    its metadata.json; None when there is none to read (data written by other tools)."""
    try:
        entries = parse_prompt_sets(json.loads((out / METADATA_FILE).read_text())["config"]["prompts"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return entries[0].name if len(entries) == 1 else None


# ---------------------------------------------------------------- run


def distill(config: DistillConfig, out: Path) -> dict[str, Any]:
    """Generate (or resume) the distillation data in `out`; returns the metadata."""
    started = time.time()
    # Without a GPU, accelerate treats processes started by torchrun as independent single-process
    # runs (each generating every prompt) unless told to use the CPU: then they form one gloo group.
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    # 1. Load (and so validate) the LLM, the prompts' train split and their token budget in the
    #    LLM's context before the settings claim the run folder: a bad path or setting must not
    #    leave a run folder that refuses the corrected command.
    model, tokenizer = load_llm(config)
    pool = (
        None if config.use_pool is None else load_pool(config.use_pool, model, tokenizer, accelerator.device)
    )
    with accelerator.main_process_first():  # one process fills the datasets cache, the others read it
        sets = load_prompt_sets(config, tokenizer)
    context = context_length(model)
    budget = (context - config.max_new_tokens) if context else 1 << 30
    tokenized = tokenize_prompts(
        train_prompts(sets), tokenizer, budget, add_special_tokens=not config.chat_template
    )
    config, processors = check_distributions(config, model, tokenizer, tokenized.dataset, accelerator)
    if accelerator.is_main_process:
        claim_run_folder(out, config.identity(), OFF)
    accelerator.wait_for_everyone()

    # 2. Skip rows already in a complete shard; each process takes its share of the rest. Every
    #    process must see the same shards, so none may write one before all have read them.
    rows = expand_samples(tokenized.dataset, config.num_samples)
    done = {row["id"] for row in read_shards(out, columns=["id"])}
    pending = rows.filter(lambda i: i not in done, input_columns="id")
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        per_prompt = f" x {config.num_samples} samples" if config.num_samples > 1 else ""
        per_set = ", ".join(f"{s.entry.name} {len(s.train)}" for s in sets)
        print(
            f"[distill] {len(tokenized.dataset)} train prompts ({per_set}){per_prompt}, {len(done)} rows "
            f"done, {len(pending)} to generate"
        )
    model.to(accelerator.device)
    generator = model if pool is None else SpeculativeDecoder(model, pool, tokenizer)
    with accelerator.split_between_processes(list(range(len(pending)))) as mine:
        generate_pending(
            generator, tokenizer, pending.select(mine), config, out, accelerator.is_local_main_process
        )
    accelerator.wait_for_everyone()
    if not accelerator.is_main_process:
        return {}

    # 3. Merge to one row per (prompt, sample), apply the filters, record what was done.
    merged = merge(out, dict(zip(rows["id"], rows["source"], strict=True)), config)
    counts = filter_counts(merged["filter"])
    tokens = sum(len(o) for o in merged["output_ids"])
    metadata = {
        "llm": config.llm,
        "generation": {
            "do_sample": config.do_sample,
            "temperature": config.temperature if config.do_sample else None,
            "top_p": config.top_p if config.do_sample else None,
            "seed": config.seed if config.do_sample else None,
            "num_samples": config.num_samples,
            "max_new_tokens": config.max_new_tokens,
            "dtype": config.dtype,
            "batch_size": config.batch_size,
            "use_pool": config.use_pool,
            "padding": "left",
        },
        "config": asdict(config),
        "prompt_sets": [
            {
                "name": s.entry.name,
                "max_train_prompts": s.entry.max_train_prompts,
                "id_offset": s.id_offset,
                "source": asdict(s.source),
            }
            for s in sets
        ],
        "split": SPLIT,
        "counts": {
            "train_prompts": len(tokenized.dataset),
            "samples_per_prompt": config.num_samples,
            "held_out_prompts": sum(s.held_out for s in sets),
            "truncated_prompts": tokenized.num_truncated,
            "max_prompt_tokens": budget if context else None,
            "generated_this_run": len(pending),
            "resumed_from": len(done),
            "rows": len(merged),
            "finish_eos": sum(r == "eos" for r in merged["finish_reason"]),
            "finish_length": sum(r == "length" for r in merged["finish_reason"]),
            "filtered": counts,
            "kept": sum(f == "" for f in merged["filter"]),
            "output_tokens": tokens,
            "tokens_generated_this_run": sum(
                len(o) for i, o in zip(merged["id"], merged["output_ids"], strict=True) if i not in done
            ),  # every process's, read back from the shards
            "sources": source_counts(sets, tokenized.dataset, merged),
        },
        "distributions": distributions_metadata(config, processors, out, tokens),
        "processes": accelerator.num_processes,
        "wall_time_s": round(time.time() - started, 1),
        "versions": library_versions(),
    }
    write_json_atomic(out / METADATA_FILE, metadata)
    c, d = metadata["counts"], metadata["distributions"]
    print(f"[distill] {c['rows']} rows, {c['kept']} kept, filtered {counts}: {out / DATA_FILE}")
    if len(sets) > 1:
        kept = ", ".join(f"{name} {n['kept']} of {n['rows']}" for name, n in c["sources"].items())
        print(f"[distill] kept per prompt set: {kept}")
    if d is not None:
        print(
            f"[distill] distributions: top-{d['top_k']} of p at temperature {d['temperature']} "
            f"(top_p {d['top_p']}), {d['bytes_per_token']:.1f} bytes per output token on disk "
            f"({d['raw_bytes_per_token']} raw), {d['megabytes']:.1f} MB"
        )
    return metadata


def check_distributions(
    config: DistillConfig,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Dataset,
    accelerator: Accelerator,
) -> tuple[DistillConfig, list[str]]:
    """Clamp K to the vocabulary (with a notice) and resolve the processors p is recorded with,
    on the first prompt, before the run folder is claimed (a refused option leaves none behind);
    returns the config and the processors' names."""
    if not config.top_k_probs:
        return config, []
    top_k = clamp_top_k(config.top_k_probs, model)
    if top_k < config.top_k_probs:
        if accelerator.is_main_process:
            print(
                f"[distill] --top-k-probs {config.top_k_probs} is more than the LLM's vocabulary "
                f"({top_k} tokens): storing all {top_k} probabilities (the tail is 0)"
            )
        config = replace(config, top_k_probs=top_k)
    first = left_pad(prompts[:1]["input_ids"], tokenizer.pad_token_id)[0]
    eos = eos_ids(model, tokenizer)
    processing = target_processing(
        model, first, config.temperature, config.top_p, config.max_new_tokens, tokenizer.pad_token_id, eos
    )
    return config, processor_names(processing)


def distributions_metadata(
    config: DistillConfig, processors: list[str], out: Path, tokens: int
) -> dict[str, Any] | None:
    """What the stored distributions are, and what they cost on disk (in data.parquet)."""
    if not config.top_k_probs:
        return None
    per_token = stored_bytes_per_token(out / DATA_FILE, tokens)
    return {
        "top_k": config.top_k_probs,
        "temperature": config.temperature,
        "top_p": config.top_p,
        "recorded_from": "sampled outputs" if config.do_sample else "greedy outputs",
        "processors": processors,
        "columns": COLUMN_TYPES,
        "output_tokens": tokens,
        "bytes_per_token": per_token,
        "raw_bytes_per_token": raw_bytes_per_token(config.top_k_probs),
        "megabytes": (per_token or 0.0) * tokens / 2**20,
    }


def expand_samples(prompts: Dataset, num_samples: int) -> Dataset:
    """One row per (prompt, sample): id = prompt id * num_samples + sample index."""
    if num_samples == 1:
        return prompts

    def repeat(batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        rows = {k: [v for v in values for _ in range(num_samples)] for k, values in batch.items()}
        rows["id"] = [i * num_samples + s for i in batch["id"] for s in range(num_samples)]
        return rows

    return prompts.map(repeat, batched=True)


def parse_args(argv: list[str] | None) -> tuple[DistillConfig, Path]:
    p = argparse.ArgumentParser(description="Generate distillation data: the LLM's continuations of prompts.")
    p.add_argument("--llm", required=True, help="Hugging Face causal LM folder or id")
    p.add_argument(
        "--prompts",
        required=True,
        metavar="SET[:N],...",
        help=f"bundled set ({', '.join(BUNDLED_PROMPT_SETS)}) or file; several, comma-separated, are "
        "each split into train / held-out by itself and their train splits mixed (rows say their set "
        "in `source`); SET:N distills at most N train prompts of SET",
    )
    p.add_argument("--prompt-field", default=None, help="prompt column, for every set (default: each set's)")
    p.add_argument(
        "--answer-field", default=None, help="reference answers ('#### n') for the answer check, every set"
    )
    p.add_argument("--chat-template", action="store_true")
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="run folder (default artifacts/distill/<set name or file stem>; several sets: the names "
        f"joined with {OUT_NAME_JOIN!r})",
    )
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument(
        "--use-pool",
        default=None,
        metavar="POOL",
        help="exported SSM pool (folder or hub id): generate through the speculative decoder",
    )
    p.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        help="sampling temperature (greedy runs: the temperature of the recorded distributions only)",
    )
    p.add_argument(
        "--top-p", type=float, default=1.0, help="sampling top-p (greedy runs: of the recorded distributions)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--num-samples",
        type=int,
        default=1,
        help="sampled continuations per prompt, each its own row (needs --do-sample)",
    )
    p.add_argument(
        "--top-k-probs",
        type=int,
        default=64,
        metavar="K",
        help="store the top-K probabilities of p and the tail mass per output token (default 64; 0: off)",
    )
    p.add_argument("--shard-size", type=int, default=256)
    p.add_argument(
        "--max-prompts", type=int, default=None, help="first N distinct prompts of each set, before its split"
    )
    p.add_argument("--held-out-fraction", type=float, default=0.1)
    p.add_argument("--split-seed", type=int, default=0)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="auto")
    p.add_argument("--drop-truncated", action="store_true", help="drop outputs cut at max-new-tokens")
    p.add_argument("--repeat-max-ngram", type=int, default=8)
    p.add_argument("--repeat-min-count", type=int, default=6, help="0 turns the repetition filter off")
    p.add_argument(
        "--keep-wrong-answers",
        action="store_true",
        help="keep outputs whose final number misses the reference answer (an LLM that cannot do the "
        "math still shows the SSMs what it writes)",
    )
    a = p.parse_args(argv)
    out = a.out or Path("artifacts") / "distill" / default_out_name(a.prompts)
    config = DistillConfig(
        llm=a.llm,
        prompts=a.prompts,
        prompt_field=a.prompt_field,
        answer_field=a.answer_field,
        chat_template=a.chat_template,
        max_prompts=a.max_prompts,
        held_out_fraction=a.held_out_fraction,
        split_seed=a.split_seed,
        max_new_tokens=a.max_new_tokens,
        do_sample=a.do_sample,
        temperature=a.temperature,
        top_p=a.top_p,
        seed=a.seed,
        num_samples=a.num_samples,
        top_k_probs=a.top_k_probs,
        shard_size=a.shard_size,
        dtype=a.dtype,
        batch_size=a.batch_size,
        use_pool=a.use_pool,
        drop_truncated=a.drop_truncated,
        repeat_max_ngram=a.repeat_max_ngram,
        repeat_min_count=a.repeat_min_count,
        keep_wrong_answers=a.keep_wrong_answers,
    )
    return config, out


def main(argv: list[str] | None = None) -> int:
    try:
        config, out = parse_args(argv)
        distill(config, out)
    except (ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
