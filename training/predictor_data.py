"""Labels for the match-length predictor (ALGORITHMS.md section 5).

    python -m specboost.training.predictor_data --llm artifacts/reference-llm/tiny/model \\
        --ssm artifacts/pool/ssm-0 artifacts/pool/ssm-1 artifacts/pool/ssm-2 \\
        --distilled artifacts/distill/gutenberg_openings --out artifacts/predictor-data

At many positions t of every distilled sample (the decoder's situation: x_0..x_t verified, x_t the
root of the next tree) it records
- `hidden`: the LLM's last-layer hidden state at x_{t-1}, the state that chose x_t (what the
  decoder's verify pass hands the scheduler, `DraftRequest.hidden`);
- `match`: for every SSM, beam width b and depth d, the match length of that SSM's beam search
  of shape (b, d) after x_0..x_t against the LLM's greedy continuation (greedy rule: the longest
  beam prefix the LLM accepts). Shape [num_ssms, len(widths), len(depths)].

With `--temperature T` (the sampled rule, for a pool that serves sampled requests) the width-1
labels are instead what a sampled chain of d tokens gets accepted in expectation under speculative
sampling at temperature T (ALGORITHMS.md 5): with a_j = sum_v min(p_j(v), q_j(v)) = 1 - TV, the
chance that the token drafted at position j is accepted, p and q the LLM's and the SSM's
distributions teacher-forced along the sample, sampled as a request at temperature T is (the
LLM's generation config, else transformers' top_k=50: `requested_sampling`), the label is
sum_{k=1..d} prod_{j=t..t+k-1} a_j. The router drafts sampled chains at T > 0 and routes by these
labels; the greedy match of an SSM's argmax chain ranks SSMs by something else (on the tiny
fixture's sampled pool it put SSM 2 at or above SSM 0, whose 1 - TV and fixed chains are the
best). Wider beams keep the greedy rule: the beam scheduler drafts deterministic beams.

With `--temperature T --widths 1` no label needs the LLM's greedy continuation, so the labels can
follow text sampled at T (`distill --do-sample --temperature T`): the hidden states the decoder
meets serving sampled requests (on-policy). Labelled along greedy text, the tiny fixture's sampled
predictor fitted those labels with held-out R^2 0.86-0.94, yet while decoding at T = 0.8 its
estimates had a correlation of -0.10 to -0.05 with what was accepted (docs/results.md r41, r43).

The LLM's greedy continuation comes from one teacher-forced pass over the sample: r_1 is the
LLM's argmax after x_t, r_2 its argmax after x_{t+1}, ... as long as r_j = x_{t+j}; where the
sample leaves the LLM's greedy path (sampled distillation data, numerical ties) the continuation
beyond that point is unknown, so positions without a known continuation of max(depths) tokens
are skipped (counted). Use greedy distillation data for greedy labels: nearly every position is
then usable.

Beam search runs batched: all positions of a sample at once, each position's `width` beams as
rows of one left-padded batch with a shared KV cache; the beams alive after d steps are exactly
the beams of a depth-d search, so one depth-16 search per width yields every depth. The search
is the drafter's (`draft_plans.BeamPlan`: top-`width` of beam score + log-softmax over all
beams x vocabulary; a test checks they agree).

OUT gets `run.json`, `shards/` (Parquet, one per `shard_size` samples, written atomically: a
killed run resumes by rerunning the same command, nothing lost or duplicated), then `data/` (a
`datasets` dataset, `save_to_disk`) and `metadata.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset, load_from_disk
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from specboost.decoder.generation_options import requested_sampling
from specboost.decoder.validation import check_same_vocabulary
from specboost.speculator.beam_search import beam_match_lengths
from specboost.speculator.loading import load_causal_lm, load_tokenizer
from specboost.speculator.model_info import check_model_location
from specboost.speculator.predictor import DEPTHS, WIDTHS
from specboost.speculator.sampling import LogitsToProbs
from specboost.training.distill import load_distilled
from specboost.training.run_files import library_versions, write_json_atomic
from specboost.training.run_shards import claim_run_folder, read_shards, write_shard

DATA_DIR, METADATA_FILE = "data", "metadata.json"


@dataclass(frozen=True)
class PredictorDataConfig:
    llm: str
    ssms: tuple[str, ...]
    distilled: str
    widths: tuple[int, ...] = WIDTHS
    depths: tuple[int, ...] = DEPTHS
    stride: int = 2  # every stride-th position of a sample (neighbours are much alike)
    max_positions_per_sample: int = 64
    max_samples: int | None = None
    only_ids: tuple[int, ...] | None = field(default=None)  # sample ids to use (e.g. a boost hold-out)
    shard_size: int = 16  # samples per shard
    temperature: float | None = None  # the sampled rule's temperature (width 1); None: greedy rule

    def __post_init__(self) -> None:
        if self.temperature is not None and not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 (or unset: the greedy rule), got {self.temperature}")
        if self.temperature is not None and 1 not in self.widths:
            raise ValueError(f"the sampled rule labels width 1; the widths are {self.widths}: add width 1")
        if not self.ssms:
            raise ValueError("give at least one SSM (--ssm PATH ...)")
        if self.stride < 1 or self.max_positions_per_sample < 1 or self.shard_size < 1:
            raise ValueError("stride, max_positions_per_sample and shard_size must be >= 1")
        if self.max_samples is not None and self.max_samples < 1:
            raise ValueError("max_samples must be >= 1")

    @property
    def greedy_widths(self) -> tuple[int, ...]:
        """The widths labelled by the greedy match (they need the LLM's greedy continuation)."""
        return tuple(b for b in self.widths if self.temperature is None or b > 1)

    def identity(self) -> dict[str, Any]:
        """What the shards depend on (resuming with other settings is refused), as JSON reads back."""
        return json.loads(json.dumps(asdict(self) | {"max_samples": None, "shard_size": None}))


# ---------------------------------------------------------------- the LLM side


def greedy_reference(
    sequence: torch.Tensor, choices: torch.Tensor, root: int, length: int
) -> list[int] | None:
    """The LLM's greedy continuation after sequence[:root + 1], `length` tokens, or None when the
    sample leaves the greedy path before that is known. `choices[i]` = argmax after sequence[:i + 1]."""
    reference = choices[root : root + length].tolist()
    if len(reference) < length:
        return None
    # r_j is known while the sample follows the LLM's choices before it: x_{root+i} == r_i for i < j.
    follows = sequence[root + 1 : root + length] == choices[root : root + length - 1]
    return reference if bool(follows.all()) else None


@torch.no_grad()
def llm_pass(llm: PreTrainedModel, sequence: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Last-layer hidden states [T, H], greedy choices [T] and logits [T, V] of one teacher-forced
    pass."""
    ids = torch.tensor([sequence], device=llm.device)
    out = llm(input_ids=ids, output_hidden_states=True)
    return out.hidden_states[-1][0].float().cpu(), out.logits[0].argmax(-1).cpu(), out.logits[0]


@torch.no_grad()
def sampled_chain_acceptance(
    p: torch.Tensor,
    ssm: PreTrainedModel,
    sequence: list[int],
    roots: list[int],
    depths: tuple[int, ...],
    probs: LogitsToProbs,
) -> torch.Tensor:
    """[len(roots), len(depths)] the sampled rule's labels (module doc): the expected accepted
    length of a sampled chain of d tokens after each root, from a_j = 1 - TV(p_j, q_j) teacher-forced
    along `sequence`; `p` [T, V] is the LLM's distributions and `probs` makes the SSM's alike.
    Positions past the sequence's end accept nothing."""
    ids = torch.tensor([sequence], device=ssm.device)
    q = probs(ssm(input_ids=ids).logits[0].to(p.device))
    accept = torch.minimum(p, q).sum(-1).cpu()  # [T] a_j: the token after position j is accepted
    depth = max(depths)
    window = torch.zeros(len(roots), depth)
    for row, t in enumerate(roots):
        known = accept[t : t + depth]
        window[row, : len(known)] = known
    expected = window.cumprod(1).cumsum(1)  # [P, depth] sum over k <= d of prod_{j < k} a_{t+j}
    return expected[:, [d - 1 for d in depths]]


# ---------------------------------------------------------------- one sample


def sample_rows(
    llm: PreTrainedModel,
    ssms: list[PreTrainedModel],
    sample: dict[str, Any],
    config: PredictorDataConfig,
    pad_id: int,
    probs: LogitsToProbs | None = None,
) -> tuple[list[dict[str, Any]], int]:
    """The label rows of one distilled sample, and how many candidate positions were skipped;
    `probs`: the sampled rule's distributions (`requested_sampling`), with a temperature."""
    sequence = sample["prompt_ids"] + sample["output_ids"]
    hidden, choices, logits = llm_pass(llm, sequence)
    tokens, depth = torch.tensor(sequence), max(config.depths)
    first = max(1, len(sample["prompt_ids"]) - 1)  # the first root; it needs a state before it
    candidates = list(range(first, len(sequence) - 1, config.stride))[: config.max_positions_per_sample]
    kept, references = [], []
    for t in candidates:
        # Sampled chains alone are labelled along the sample itself: any text, sampled text too.
        reference = greedy_reference(tokens, choices, t, depth) if config.greedy_widths else []
        if reference is not None and t + depth <= len(sequence):
            kept.append(t)
            references.append(reference)
    if not kept:
        return [], len(candidates)
    contexts, reference = [sequence[: t + 1] for t in kept], torch.tensor(references)
    match = torch.zeros(
        len(kept),
        len(ssms),
        len(config.widths),
        len(config.depths),
        dtype=torch.long if config.temperature is None else torch.float,
    )
    for w, width in enumerate(config.widths):
        if width in config.greedy_widths:
            for i, ssm in enumerate(ssms):
                match[:, i, w] = beam_match_lengths(ssm, contexts, reference, width, config.depths, pad_id)
    if probs is not None:
        chain = config.widths.index(1)
        p = probs(logits)  # [T, V], once for every SSM
        for i, ssm in enumerate(ssms):
            match[:, i, chain] = sampled_chain_acceptance(p, ssm, sequence, kept, config.depths, probs)
    rows = [
        {"id": sample["id"], "position": t, "hidden": hidden[t - 1].tolist(), "match": match[i].tolist()}
        for i, t in enumerate(kept)
    ]
    return rows, len(candidates) - len(kept)


# ---------------------------------------------------------------- run


def load_models(config: PredictorDataConfig) -> tuple[PreTrainedModel, list[PreTrainedModel], int]:
    for path in (config.llm, *config.ssms):
        check_model_location(path)
    llm = load_causal_lm(config.llm)
    tokenizer = load_tokenizer(config.llm)
    ssms = [load_causal_lm(path) for path in config.ssms]
    for i, ssm in enumerate(ssms):
        check_same_vocabulary(llm, ssm, i, tokenizer, None)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return llm, ssms, pad_id


def selected_samples(config: PredictorDataConfig) -> list[dict[str, Any]]:
    """The distilled samples to label, those distillation's filters dropped included: the filters
    keep degenerate text out of the SSMs' training, but the decoder meets every output the LLM
    gives, and the dropped ones are where SSMs fail (the quick fixture's label set: the SSMs agree
    with 95% of the LLM's next tokens on the kept outputs, 69-79% on those dropped as repetition,
    39% of them). Labelled on the kept ones only, the predictor learned that every context is easy."""
    distilled = load_distilled(config.distilled, keep_filtered=True)
    rows = distilled.select_columns(["id", "prompt_ids", "output_ids"]).to_list()
    if config.only_ids is not None:
        wanted = set(config.only_ids)
        rows = [r for r in rows if r["id"] in wanted]
    rows = [r for r in rows if r["prompt_ids"] and r["output_ids"]]
    if not rows:
        raise ValueError(f"{config.distilled} holds no usable distilled samples for predictor labels")
    return rows[: config.max_samples]


def save_dataset(rows: list[dict[str, Any]], out: Path) -> Dataset:
    """The labels as a `datasets` dataset in OUT/data, replaced atomically."""
    dataset = Dataset.from_list(sorted(rows, key=lambda r: (r["id"], r["position"])))
    tmp = out / f".{DATA_DIR}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    dataset.save_to_disk(tmp)
    shutil.rmtree(out / DATA_DIR, ignore_errors=True)
    os.replace(tmp, out / DATA_DIR)
    return dataset


def collect(config: PredictorDataConfig, out: Path) -> dict[str, Any]:
    """Collect (or resume) the labels into `out`; returns the metadata."""
    started = time.time()
    llm, ssms, pad_id = load_models(config)
    samples = selected_samples(config)
    identity, rule, probs = config.identity(), "greedy", None
    if config.temperature is not None:
        # The labels depend on the LLM's generation config too: a resume after it changed (or of
        # labels taken at T alone, before `requested_sampling`) would mix two rules in one dataset.
        sampling = requested_sampling(llm, temperature=config.temperature)
        identity["sampling"] = {"top_k": sampling.top_k, "top_p": sampling.top_p}
        rule = f"sampled at temperature {config.temperature}, top_k {sampling.top_k}, top_p {sampling.top_p}"
        probs = LogitsToProbs(sampling)
    claim_run_folder(out, identity, absent={"sampling": "temperature alone"} if probs is not None else None)
    done = {row["id"] for row in read_shards(out)}
    pending = [s for s in samples if s["id"] not in done]
    print(f"[predictor-data] {len(samples)} samples, {len(done)} done, {len(pending)} to label")
    skipped, positions = 0, 0
    bar = tqdm(total=len(pending), desc="labelling", unit="sample")
    for start in range(0, len(pending), config.shard_size):
        shard: list[dict[str, Any]] = []
        for sample in pending[start : start + config.shard_size]:
            rows, missed = sample_rows(llm, ssms, sample, config, pad_id, probs)
            shard.extend(rows)
            skipped += missed
            positions += len(rows)
            bar.update(1)
            bar.set_postfix(positions_per_s=f"{positions / max(bar.format_dict['elapsed'], 1e-9):.1f}")
        if shard:
            write_shard(out, shard)
    bar.close()
    wanted = {s["id"] for s in samples}
    rows = [r for r in read_shards(out) if r["id"] in wanted]
    if not rows:
        raise ValueError(
            f"no usable positions in {config.distilled}: samples need at least {max(config.depths)} "
            "tokens of the LLM's greedy continuation (use greedy distillation data with "
            f"--max-new-tokens > {max(config.depths)}; sampled text serves sampled chains alone: "
            "--temperature T --widths 1)"
        )
    dataset = save_dataset(rows, out)
    metadata = {
        "config": asdict(config),
        "rule": rule,
        "label_shape": ["ssm", "width", "depth"],
        "rows": len(dataset),
        "samples": len({r["id"] for r in rows}),
        "skipped_positions_this_run": skipped,
        "hidden_size": len(rows[0]["hidden"]),
        "mean_match": torch.tensor(dataset["match"]).float().mean((0,)).tolist(),
        "wall_time_s": round(time.time() - started, 1),
        "versions": library_versions(),
    }
    write_json_atomic(out / METADATA_FILE, metadata)
    print(f"[predictor-data] {len(dataset)} positions from {metadata['samples']} samples: {out / DATA_DIR}")
    return metadata


def load_labels(out: str | os.PathLike[str]) -> Dataset:
    path = Path(out) / DATA_DIR
    if not path.is_dir():
        raise FileNotFoundError(
            f"{path} does not exist: run `python -m specboost.training.predictor_data` "
            "(`make predictor-data`)"
        )
    return load_from_disk(str(path))


def parse_args(argv: list[str] | None) -> tuple[PredictorDataConfig, Path]:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--llm", required=True, help="the LLM folder (save_pretrained)")
    p.add_argument("--ssm", dest="ssms", required=True, nargs="+", help="SSM folders, in pool order")
    p.add_argument(
        "--distilled",
        required=True,
        help="a distill run folder (greedy data; sampled at T for --temperature T --widths 1)",
    )
    p.add_argument("--out", required=True, type=Path, help="run folder (resumes when rerun)")
    p.add_argument("--widths", type=int, nargs="+", default=list(WIDTHS))
    p.add_argument("--depths", type=int, nargs="+", default=list(DEPTHS))
    p.add_argument("--stride", type=int, default=2, help="label every stride-th position")
    p.add_argument("--max-positions-per-sample", type=int, default=64)
    p.add_argument("--max-samples", type=int, help="use the first N samples")
    p.add_argument(
        "--held-out-of", type=Path, metavar="BOOST_DIR", help="only the samples that boost run held out"
    )
    p.add_argument("--shard-size", type=int, default=16, help="samples per shard")
    p.add_argument(
        "--temperature",
        type=float,
        help="label width-1 chains by their expected accepted length under speculative sampling "
        "at this temperature, with the LLM's generation config's top_k / top_p as generate "
        "applies them (transformers' default top_k=50); a pool for sampled requests; default: "
        "the greedy match",
    )
    p.add_argument("--threads", type=int, help="torch threads")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    only_ids = None
    if a.held_out_of is not None:
        only_ids = tuple(held_out_ids(a.held_out_of))
    config = PredictorDataConfig(
        llm=a.llm,
        ssms=tuple(a.ssms),
        distilled=a.distilled,
        widths=tuple(a.widths),
        depths=tuple(sorted(set(a.depths))),
        stride=a.stride,
        max_positions_per_sample=a.max_positions_per_sample,
        max_samples=a.max_samples,
        only_ids=only_ids,
        shard_size=a.shard_size,
        temperature=a.temperature,
    )
    return config, a.out


def held_out_ids(boost_dir: Path) -> list[int]:
    """The sample ids a boost run kept out of training (its SSMs never saw them)."""
    state = boost_dir / "boost_state.json"
    if not state.is_file():
        raise FileNotFoundError(f"{state} does not exist: give the folder of a boost run (`make boost`)")
    return json.loads(state.read_text())["held_out_ids"]


def main(argv: list[str] | None = None) -> int:
    try:
        config, out = parse_args(argv)
        collect(config, out)
    except (ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
