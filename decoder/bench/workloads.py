"""What the harness decodes: workloads (a category and its prompts) and their left-padded batches.

Sources, one shape (`Workload`):
- the bundled prompt sets (data/README.md), grouped by `CATEGORIES`; each set gives its seeded
  held-out split (`prompt_sets.load_prompt_splits`), which distillation and boosting never see,
  and a category takes its sets' prompts in turn (`bundled_workloads`);
- a question file in Spec-Bench's JSONL format (`question_id`, `category`, `turns`; the first
  turn is the prompt), one workload per category of the file (`load_spec_bench`);
- a prompt file: text, one prompt a line, or JSONL with a "prompt" field or a "turns" list
  (`read_prompt_file`); or one bundled set's held-out split (`held_out_or_file`).
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain, zip_longest
from pathlib import Path

from datasets import Dataset
from transformers import BatchEncoding, PreTrainedTokenizerBase

from specboost.speculator.prompt_sets import (
    BUNDLED_PROMPT_SETS,
    bundled_source,
    load_prompt_splits,
    tokenize_prompts,
)

# Category -> bundled prompt sets (data/prompts/). eagle_sum (long articles) is left out: its
# prompts would not fit the reference LLM's 256-token context beside the generated tokens.
CATEGORIES: dict[str, tuple[str, ...]] = {
    "stories": ("tinystories_openings", "gutenberg_openings"),
    "instructions": ("self_instruct", "eagle_alpaca", "vicuna_bench"),
    "qa": ("eagle_qa",),
    "math": ("gsm8k", "eagle_gsm8k"),
}
SPEC_BENCH_FIELDS = ("question_id", "category", "turns")


@dataclass(frozen=True)
class Prompt:
    text: str
    source: str  # bundled set name, or the file
    id: int | str  # row id in the bundled set, the question_id, or the line number


@dataclass(frozen=True)
class Workload:
    category: str
    prompts: tuple[Prompt, ...]


def held_out(name: str) -> list[Prompt]:
    """The held-out split of the bundled set `name` (never distilled, never boosted on)."""
    split = load_prompt_splits(bundled_source(name))["held_out"]
    return [Prompt(p, name, i) for p, i in zip(split["prompt"], split["id"], strict=True)]


def bundled_workloads(categories: Sequence[str], per_category: int) -> list[Workload]:
    """`per_category` held-out prompts for every category, in `categories` order."""
    unknown = sorted(set(categories) - set(CATEGORIES))
    if unknown:
        raise ValueError(f"unknown categories {unknown}; choose from {sorted(CATEGORIES)}")
    workloads = []
    for category in categories:
        per_set = [held_out(name) for name in CATEGORIES[category]]
        interleaved = [p for p in chain.from_iterable(zip_longest(*per_set)) if p is not None]
        workloads.append(Workload(category, tuple(interleaved[:per_category])))
    return workloads


def mixed_workload(sets: Sequence[str], size: int) -> Workload:
    """`size` held-out prompts of the bundled `sets`, shuffled with a fixed seed so batches mix them."""
    prompts = [p for name in sets for p in held_out(name)]
    random.Random(0).shuffle(prompts)
    return Workload("+".join(sets), tuple(prompts[:size]))


def held_out_or_file(name_or_file: str, max_prompts: int | None) -> Workload:
    """A bundled set's held-out split, or every prompt of a prompt file; the first `max_prompts`."""
    if name_or_file in BUNDLED_PROMPT_SETS:
        prompts = held_out(name_or_file)
    else:
        prompts = [Prompt(text, name_or_file, i) for i, text in enumerate(read_prompt_file(name_or_file))]
    return Workload(Path(name_or_file).stem, tuple(prompts[:max_prompts]))


def read_prompt_file(path: str | Path) -> list[str]:
    """Prompts of a text file (one per non-empty line) or of a `.jsonl` file, from records with a
    "prompt" field or a "turns" list (FastChat / Spec-Bench; the first turn is used)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no prompt file at {path}")
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    prompts = lines
    if path.suffix == ".jsonl":
        prompts = [
            _prompt_of(_json_line(line, f"{path}:{i}"), f"{path}:{i}") for i, line in enumerate(lines, 1)
        ]
    if not prompts:
        raise ValueError(f"the prompt file {path} holds no prompts")
    return prompts


def _json_line(text: str, where: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(
            f"{where}: not valid JSON ({error.msg} at column {error.colno}); fix the line"
        ) from None


def _prompt_of(record: object, where: str) -> str:
    if not isinstance(record, dict):
        raise ValueError(f'{where}: a JSONL prompt must be an object with a "prompt" or "turns" field')
    if isinstance(record.get("prompt"), str):
        return record["prompt"]
    turns = record.get("turns")
    if isinstance(turns, list) and turns and isinstance(turns[0], str):
        return turns[0]
    raise ValueError(f'{where}: a JSONL prompt needs a "prompt" string or a "turns" list of strings')


def load_spec_bench(path: str | Path) -> list[Workload]:
    """A Spec-Bench question file (JSONL: `question_id`, `category`, `turns`), one workload per
    category in the order categories first appear; the prompt is the first turn."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no Spec-Bench question file at {path}")
    by_category: dict[str, list[Prompt]] = {}
    for line_number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{line_number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{where}: not a JSON object ({error.msg})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{where}: not a JSON object")
        missing = [name for name in SPEC_BENCH_FIELDS if name not in record]
        if missing:
            raise ValueError(
                f"{where}: missing field(s) {', '.join(missing)}; a Spec-Bench question needs "
                f"{', '.join(SPEC_BENCH_FIELDS)}"
            )
        category, turns = record["category"], record["turns"]
        if not isinstance(category, str) or not category.strip():
            raise ValueError(f'{where}: "category" must be a non-empty string, got {category!r}')
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise ValueError(f'{where}: "turns" must be a non-empty list of strings')
        by_category.setdefault(category, []).append(Prompt(turns[0], str(path), record["question_id"]))
    if not by_category:
        raise ValueError(f"the Spec-Bench question file {path} holds no questions")
    return [Workload(category, tuple(prompts)) for category, prompts in by_category.items()]


def encode_batches(
    prompts: Sequence[Prompt],
    tokenizer: PreTrainedTokenizerBase,
    batch_size: int,
    max_prompt_tokens: int,
    device: str = "cpu",
) -> list[BatchEncoding]:
    """Consecutive batches of `batch_size` prompts (a last partial batch is dropped), each prompt
    cut to its last `max_prompt_tokens` tokens, left-padded to the batch's longest, on `device`."""
    if len(prompts) < batch_size:
        raise ValueError(f"a batch of {batch_size} needs at least {batch_size} prompts, got {len(prompts)}")
    texts = Dataset.from_dict({"prompt": [p.text for p in prompts]})
    ids = tokenize_prompts(texts, tokenizer, max_prompt_tokens).dataset["input_ids"]
    tokenizer.padding_side = "left"
    return [
        tokenizer.pad({"input_ids": ids[start : start + batch_size]}, return_tensors="pt").to(device)
        for start in range(0, len(ids) - batch_size + 1, batch_size)
    ]
