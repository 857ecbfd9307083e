"""Workloads of the benchmark suite: held-out prompts grouped by category, tokenized into batches.

Two sources, one shape (`Workload`: a category and its prompts):
- the bundled prompt sets (data/README.md), grouped by `CATEGORIES`; each set contributes its
  seeded held-out split (`prompt_sets.load_prompt_splits`), which distillation and boosting
  never see, and a category takes its sets' prompts in turn (round robin);
- a question file in Spec-Bench's JSONL format (`question_id`, `category`, `turns`; the first
  turn is the prompt), grouped by the file's own categories (`load_spec_bench`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain, zip_longest
from pathlib import Path

from datasets import Dataset
from transformers import BatchEncoding, PreTrainedTokenizerBase

from specboost.speculator.prompt_sets import bundled_source, load_prompt_splits, tokenize_prompts

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
    source: str  # bundled set name, or the question file
    id: int | str  # row id in the bundled set, or the question_id


@dataclass(frozen=True)
class Workload:
    category: str
    prompts: tuple[Prompt, ...]


def bundled_workloads(categories: Sequence[str], per_category: int) -> list[Workload]:
    """`per_category` held-out prompts for every category, in `categories` order. The split is the
    training pipeline's (`bundled_source`'s fraction and seed), so no prompt was ever distilled."""
    unknown = sorted(set(categories) - set(CATEGORIES))
    if unknown:
        raise ValueError(f"unknown categories {unknown}; choose from {sorted(CATEGORIES)}")
    workloads = []
    for category in categories:
        per_set = []
        for name in CATEGORIES[category]:
            held_out = load_prompt_splits(bundled_source(name))["held_out"]
            per_set.append(
                [Prompt(p, name, i) for p, i in zip(held_out["prompt"], held_out["id"], strict=True)]
            )
        interleaved = [p for p in chain.from_iterable(zip_longest(*per_set)) if p is not None]
        workloads.append(Workload(category, tuple(interleaved[:per_category])))
    return workloads


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
    prompts: Sequence[Prompt], tokenizer: PreTrainedTokenizerBase, batch_size: int, max_prompt_tokens: int
) -> list[BatchEncoding]:
    """Consecutive batches of `batch_size` prompts (a last partial batch is dropped), each prompt
    cut to its last `max_prompt_tokens` tokens, left-padded to the batch's longest."""
    if len(prompts) < batch_size:
        raise ValueError(f"a batch of {batch_size} needs at least {batch_size} prompts, got {len(prompts)}")
    texts = Dataset.from_dict({"prompt": [p.text for p in prompts]})
    ids = tokenize_prompts(texts, tokenizer, max_prompt_tokens).dataset["input_ids"]
    tokenizer.padding_side = "left"
    return [
        tokenizer.pad({"input_ids": ids[start : start + batch_size]}, return_tensors="pt")
        for start in range(0, len(ids) - batch_size + 1, batch_size)
    ]
