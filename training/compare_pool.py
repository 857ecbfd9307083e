"""Does distillation and boosting pay? Two controlled comparisons for a finished boost run.

    python -m specboost.training.compare_pool --boost artifacts/pool [--out artifacts/compare-pool] \\
        [--steps N] [--threads 1]

(a) distilled vs raw: an SSM trained on the distilled samples (the pool's ssm-0: round 0 trains on
    every non-held-out sample, nothing marked yet; retrained here when --steps differs from the
    run's) against the SAME SSM config, seed and Trainer setup trained for the same steps on the raw
    corpus (data/corpus train text packed into blocks of the mean distilled sample length, loss
    on every token), scored by greedy acceptance against the LLM;
(b) pool vs single: the boosted pool's coverage against one SSM of the same config trained on ALL
    the distilled training samples for as many steps as the whole pool took (sum of its rounds).

Everything is scored on the boost run's held-out distilled samples with boost's own functions
(boost_scoring.py: `output_hits`, `held_out_scores`): acceptance = accepted fraction of greedy
chains of `chain` drafts, coverage = fraction of output positions where any SSM's greedy next
token is the LLM's.

OUT (default BOOST/compare-pool): distilled/, raw/, single/ (each ssm-0/ and round-0/checkpoints/,
rebuilt on every run), cache/ (the corpus), compare_pool.json (atomic).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import datasets
import torch

from specboost.speculator.bundled_data import bundled_corpus
from specboost.training.boost import RECORD_FILE, setup
from specboost.training.boost_config import BoostConfig
from specboost.training.boost_data import training_examples
from specboost.training.boost_scoring import add_hits, held_out_scores, output_hits
from specboost.training.reference_llm import find_corpus, load_corpus, pack_blocks
from specboost.training.run_files import library_versions, write_json_atomic
from specboost.training.ssm_setup import build_ssm, context_of, load_ssm
from specboost.training.ssm_training import train_round

RESULT_FILE = "compare_pool.json"
CHARS_PER_TOKEN = 6.0  # a high estimate for the byte-level BPE: enough documents to fill the blocks


def raw_corpus_blocks(
    corpus_dir: Path, tokenizer: Any, block_size: int, blocks_needed: int, seed: int, cache: Path
) -> datasets.Dataset:
    """Packed blocks (input_ids = labels) from a seeded sample of the corpus's train documents,
    enough for `blocks_needed` blocks (one epoch of the run's steps; a small corpus repeats)."""
    train = load_corpus({"train": find_corpus(corpus_dir)["train"]}, cache)["train"].shuffle(seed=seed)
    want, total, count = blocks_needed * block_size * CHARS_PER_TOKEN, 0, 0
    for text in train["text"]:
        total, count = total + len(text), count + 1
        if total >= want:
            break
    subset = datasets.DatasetDict({"train": train.select(range(count))})
    return pack_blocks(subset, tokenizer, block_size)["train"].with_format(None)


def score(hits: dict[int, torch.Tensor], chain: int) -> dict[str, float]:
    s = held_out_scores(hits, hits, chain)
    return {k: s[k] for k in ("held_out_acceptance", "held_out_mean_match_length", "single_coverage")}


def train_ssm(
    config: BoostConfig, ssm_config: Any, train_set: datasets.Dataset, tokenizer: Any, folder: Path
) -> tuple[Path, int, float | None]:
    """A fresh SSM (the pool's round-0 seed) trained with boost's Trainer setup (ssm_training.py)
    into folder/ssm-0."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    steps, loss = train_round(config, 0, train_set, build_ssm(config, ssm_config, 0), tokenizer, folder)
    return folder / "ssm-0", steps, loss


def compare(
    boost_dir: Path, out: Path, steps: int | None = None, corpus: Path | None = None
) -> dict[str, Any]:
    """`corpus` defaults to the bundled corpus, which only a source checkout has."""
    corpus = corpus if corpus is not None else bundled_corpus()
    record = json.loads((boost_dir / RECORD_FILE).read_text())
    rounds = record["rounds"]
    if not rounds:
        raise ValueError(f"{boost_dir / RECORD_FILE} records no trained SSM")
    run_steps = rounds[0]["steps"]
    per_ssm = steps if steps is not None else run_steps
    pool_total = per_ssm * len(rounds) if steps is not None else sum(r["steps"] for r in rounds)
    config = dataclasses.replace(BoostConfig(**record["config"]), max_steps=per_ssm, save_steps=per_ssm)
    tokenizer, ssm_config, rows = setup(config)
    held_ids = set(record["held_out_ids"])
    held = [r for r in rows if r["id"] in held_ids]
    train_rows = [r for r in rows if r["id"] not in held_ids]
    pad, batch, chain = tokenizer.pad_token_id, config.eval_batch_size, config.chain
    out.mkdir(parents=True, exist_ok=True)

    # The boosted pool, as saved: every SSM's held-out hits and their union.
    pool_hits = {r["id"]: torch.zeros(len(r["output_ids"]), dtype=torch.bool) for r in held}
    members = []
    for r in rounds:
        hits = output_hits(load_ssm(boost_dir / r["path"]), held, pad, batch, r["path"])
        add_hits(pool_hits, hits)
        members.append({"ssm": r["path"], "steps": r["steps"], **score(hits, chain)})
    pool_coverage = float(torch.cat(list(pool_hits.values())).float().mean())

    # (a) distilled vs raw corpus, same config, seed and steps.
    if steps is None or steps == run_steps:
        distilled_path, distilled_steps, distilled_source = boost_dir / rounds[0]["path"], run_steps, "pool"
    else:
        distilled_set = training_examples(train_rows, {}, context_of(build_ssm(config, ssm_config, 0)))
        distilled_path, distilled_steps, _ = train_ssm(
            config, ssm_config, distilled_set, tokenizer, out / "distilled"
        )
        distilled_source = "trained"
    block = max(
        2, round(sum(len(r["prompt_ids"]) + len(r["output_ids"]) for r in train_rows) / len(train_rows))
    )
    context = context_of(build_ssm(config, ssm_config, 0))
    block = min(block, context) if context else block
    blocks = raw_corpus_blocks(
        corpus, tokenizer, block, per_ssm * config.batch_size, config.seed, out / "cache"
    )
    raw_path, raw_steps, raw_loss = train_ssm(config, ssm_config, blocks, tokenizer, out / "raw")
    distilled = score(output_hits(load_ssm(distilled_path), held, pad, batch, "distilled"), chain)
    raw = score(output_hits(load_ssm(raw_path), held, pad, batch, "raw"), chain)

    # (b) one SSM on all the distilled training data for the pool's total steps.
    single_config = dataclasses.replace(config, max_steps=pool_total, save_steps=pool_total)
    single_set = training_examples(train_rows, {}, context)
    single_path, single_steps, single_loss = train_ssm(
        single_config, ssm_config, single_set, tokenizer, out / "single"
    )
    single = score(output_hits(load_ssm(single_path), held, pad, batch, "single"), chain)

    result = {
        "boost": str(boost_dir),
        "llm": config.llm,
        "distilled": config.distilled,
        "corpus": str(corpus),
        "base": config.base_name,
        "chain": chain,
        "held_out_samples": len(held),
        "held_out_positions": sum(len(r["output_ids"]) for r in held),
        "train_samples": len(train_rows),
        "distilled_vs_raw": {
            "steps": per_ssm,
            "distilled": {
                "source": distilled_source,
                "path": str(distilled_path),
                "steps": distilled_steps,
                **distilled,
            },
            "raw": {
                "path": str(raw_path),
                "steps": raw_steps,
                "final_loss": raw_loss,
                "block_size": block,
                "blocks": len(blocks),
                **raw,
            },
            "acceptance_gain": distilled["held_out_acceptance"] - raw["held_out_acceptance"],
        },
        "pool_vs_single": {
            "total_steps": pool_total,
            "pool": {"ssms": len(rounds), "pool_coverage": pool_coverage, "members": members},
            "single": {"path": str(single_path), "steps": single_steps, "final_loss": single_loss, **single},
            "coverage_gain": pool_coverage - single["single_coverage"],
        },
        "config": dataclasses.asdict(config),
        "versions": library_versions(),
    }
    write_json_atomic(out / RESULT_FILE, result)
    return result


def table(result: dict[str, Any]) -> str:
    a, b = result["distilled_vs_raw"], result["pool_vs_single"]
    lines = [
        f"held-out: {result['held_out_samples']} samples, {result['held_out_positions']} output positions; "
        f"chain {result['chain']}",
        f"{'model':<34} {'steps':>6} {'acceptance':>11} {'mean match':>11} {'coverage':>9}",
    ]

    def row(name: str, steps: int, s: dict[str, Any], coverage: float | None = None) -> None:
        cov = s["single_coverage"] if coverage is None else coverage
        acc = f"{s['held_out_acceptance']:.3f}" if "held_out_acceptance" in s else "-"
        match = f"{s['held_out_mean_match_length']:.2f}" if "held_out_mean_match_length" in s else "-"
        lines.append(f"{name:<34} {steps:>6} {acc:>11} {match:>11} {cov:>9.3f}")

    row("(a) distilled SSM", a["distilled"]["steps"], a["distilled"])
    row("(a) raw-corpus SSM (same config)", a["raw"]["steps"], a["raw"])
    lines.append(f"    acceptance gain from distillation: {a['acceptance_gain']:+.3f}")
    for m in b["pool"]["members"]:
        row(f"(b) pool member {m['ssm']}", m["steps"], m)
    row(f"(b) boosted pool ({b['pool']['ssms']} SSMs)", b["total_steps"], {}, b["pool"]["pool_coverage"])
    row("(b) single SSM, all distilled data", b["single"]["steps"], b["single"])
    lines.append(f"    coverage gain from boosting: {b['coverage_gain']:+.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Distilled vs raw-corpus SSM; boosted pool vs one SSM.")
    p.add_argument("--boost", type=Path, required=True, help="a finished boost run folder")
    p.add_argument("--out", type=Path, default=None, help="default: BOOST/compare-pool")
    p.add_argument("--steps", type=int, default=None, help="steps per SSM (default: the boost run's)")
    p.add_argument(
        "--corpus",
        type=Path,
        default=None,
        help="raw corpus folder, train.jsonl[.gz] (default: a checkout's)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    a = p.parse_args(argv)
    if a.threads is not None:
        torch.set_num_threads(a.threads)
    if a.steps is not None and a.steps < 1:
        print("error: --steps must be >= 1", file=sys.stderr)
        return 2
    out = a.out if a.out is not None else a.boost / "compare-pool"
    started = time.time()
    try:
        result = compare(a.boost, out, a.steps, a.corpus)
    except (ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(table(result))
    print(f"[compare-pool] done in {time.time() - started:.0f}s: {out / RESULT_FILE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
