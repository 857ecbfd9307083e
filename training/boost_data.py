"""What a boost run trains on: the distilled rows and the LLM's stored distributions, the held-out
split, each round's examples (with sampled mode's per-position weights) and their collator."""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from typing import Any

import datasets
import numpy as np
import torch

from specboost.training.boost_config import BoostConfig
from specboost.training.distill import load_distilled
from specboost.training.target_distributions import PositionTargets, distribution_info, load_targets

DISTILL_HINT = (
    'make distill DISTILL_FLAGS="--top-k-probs 64 --do-sample --temperature 0.8 ..." '
    "(or python -m specboost.training.distill --llm LLM --prompts PROMPTS --top-k-probs 64 ...)"
)


def fit(prompt: list[int], output: list[int], max_len: int | None) -> tuple[list[int], list[int]]:
    """Drop the prompt's oldest tokens (keeping one), then the output's tail, to fit `max_len`."""
    if max_len is None or len(prompt) + len(output) <= max_len:
        return prompt, output
    keep = max(1, max_len - len(output))
    prompt = prompt[-keep:]
    return prompt, output[: max_len - len(prompt)]


def load_rows(distilled: str) -> list[dict[str, Any]]:
    """id, prompt_ids, output_ids (and prompt_id and source where distill recorded them) of the
    kept rows. The source (which prompt set a row came from) is for reports only: no training
    choice may read it, so that a run behaves the same on data without it."""
    data = load_distilled(distilled)
    optional = [c for c in ("prompt_id", "source") if c in data.column_names]
    columns = ["id", "prompt_ids", "output_ids", *optional]
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
