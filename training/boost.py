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
- `specialists` (section 4.1, training/specialists.py): the `--num-ssms` K members split the
  training samples among themselves instead of each covering what the earlier ones miss (which
  yields near-clones), by hard EM on their own greedy acceptance, without labels. Init: k-means
  (seeded) on an unsupervised feature of every sample made from the LLM's input embeddings
  (`--em-feature`: `sif`, the default, a frequency-weighted mean over prompt and output tokens;
  `prompt-mean`, the plain mean over the prompt). Then `--em-rounds` R (default 2) rounds, each
  an M-step (member k continues training on its samples, with the losses above, for its share
  max_steps / R of its budget: the pool trains K x max_steps steps in all, as in the other
  modes) and an E-step (every training sample goes to the member with the best mean greedy
  match length on it, as the held-out greedy acceptance below measures it; a tie keeps it where
  it was; no member keeps fewer than `--min-share` / K of the samples: the samples that lose
  least by moving fill it up). `--em-span N` (default 0: whole samples) assigns spans of N
  output positions of a sample instead, each to the member that matches it best; a member trains
  on the samples that hold one of its spans, with no loss at the other spans' positions. Marking
  options do not apply (refused); `--num-ssms` cannot grow on resume. A `source` column of the
  distilled data is only reported, never used to assign.
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

Specialists mode writes instead: round-<r>/assignment.npy (every training sample's member, in the
training rows' order, or with --em-span every span's, sample by sample: round 0's is the
clustering, round r + 1's the E-step after round r, the last one the final split),
round-<r>/member-<k>/checkpoints/ (Trainer), round-<r>/ssm-<k>/
(member k after round r; the last round's is ssm-<k>/). boost_state.json's "em" holds the finished
EM rounds and the members finished in the current one, so a resumed run loads the saved
assignments, skips what is done and ends as an uninterrupted run does. boost_record.json's "em"
holds the settings and, per EM round ("history"), per member: `share` (of the samples, or spans),
`train_units` and `train_samples` (the units it was assigned, the samples it trained on),
`next_share` (after the E-step), `own_mean_match_length` (position-weighted mean greedy match on
its own units), `train_mean_match_length` (on all of them), the
held-out scores below (`held_out_mean_match_length`, `held_out_acceptance`, `single_coverage`,
`pool_coverage` over members 0..k, sampled ones when p is stored), `steps`, `final_loss`, and
`source_shares` / `next_source_shares` when the data has a `source` column; per round also
`reassigned`, `balance_moves`, and the mean match of the best member per sample
(`train_best_member_mean_match_length`, `held_out_best_member_mean_match_length`: an oracle
router's). Its "rounds" lists the pool's members as in the other modes (path, total steps,
held-out scores), so export and compare_pool read it unchanged.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import LlamaConfig, PreTrainedTokenizerBase

from specboost.speculator.loading import load_config, load_tokenizer
from specboost.training.boost_config import BOOST_MODES, EM_FEATURES, MARKINGS, SSM_PRESETS, BoostConfig
from specboost.training.boost_data import (
    Targets,
    acceptance_weights,
    data_digest,
    load_row_targets,
    load_rows,
    split_held_out,
    training_examples,
)
from specboost.training.boost_scoring import HeldOutPool, mark, output_acceptance, output_hits, pool_max
from specboost.training.distribution_loss import LOSSES
from specboost.training.run_files import library_versions, write_json_atomic
from specboost.training.specialists import SpecialistRun, save_array
from specboost.training.ssm_setup import build_ssm, check_base_vocab, context_of, load_ssm, sized_ssm_config
from specboost.training.ssm_training import train_round

STATE_FILE, RECORD_FILE, PLOT_FILE = "boost_state.json", "boost_record.json", "coverage.png"
ACCEPTANCE_FILE = "pool_acceptance.npy"  # round-<i>/: the pool's acceptance at every training position


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
        # specialists mode: the EM settings and, per EM round, every member's share and scores
        "em": (
            {
                "rounds": config.em_rounds,
                "feature": config.em_feature,
                "min_share": config.min_share,
                "span": config.em_span,
                "history": state.get("em", {}).get("rounds", []),
            }
            if config.boost_mode == "specialists"
            else None
        ),
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
    main_process = int(os.environ.get("RANK", "0")) == 0

    def persist() -> None:
        if main_process:
            write_json_atomic(out / STATE_FILE, state)
            write_outputs(config, state, out, targets)

    if config.boost_mode == "specialists":
        run = SpecialistRun(
            config, out, tokenizer, ssm_config, train_rows, held, targets, main_process, persist
        )
        run.run(state)
        return write_outputs(config, state, out, targets) if main_process else {}
    removed = set(state["removed"])
    masked = {int(k): set(v) for k, v in state["masked"].items()}
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
        persist()
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


def save_acceptance(path: Path, acceptance: dict[int, torch.Tensor], rows: list[dict[str, Any]]) -> None:
    """The acceptance at every output position of `rows`, in their order, as one float32 array
    (written to a temporary file and renamed)."""
    save_array(path, torch.cat([acceptance[r["id"]] for r in rows]).numpy().astype(np.float32))


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
        help="greedy: mark what earlier SSMs reproduce; sampled: weight positions by the pool's 1 - TV; "
        "specialists: split the samples among the SSMs by hard EM on their acceptance",
    )
    defaults = {f.name: f.default for f in fields(BoostConfig)}
    p.add_argument(
        "--em-rounds",
        type=int,
        default=defaults["em_rounds"],
        help="specialists: EM rounds (each trains every member on its samples, then reassigns them)",
    )
    p.add_argument(
        "--em-feature",
        choices=EM_FEATURES,
        default=defaults["em_feature"],
        help="specialists: the feature k-means clusters to start from (LLM input embeddings of each sample)",
    )
    p.add_argument(
        "--min-share",
        type=float,
        default=defaults["min_share"],
        help="specialists: every member keeps at least this fraction of 1/num-ssms of the samples",
    )
    p.add_argument(
        "--em-span",
        type=int,
        default=defaults["em_span"],
        help="specialists: assign spans of this many output positions of a sample, each to its best "
        "member (0: whole samples)",
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
    p.add_argument(
        "--max-steps",
        type=int,
        default=-1,
        help="optimizer steps per SSM (overrides epochs); specialists split them over the EM rounds",
    )
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
        em_rounds=a.em_rounds,
        em_feature=a.em_feature,
        min_share=a.min_share,
        em_span=a.em_span,
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
