"""Specialist boosting (ALGORITHMS.md section 4.1): `boost --boost-mode specialists`.

The other boost modes train SSM i on what SSMs 0..i-1 still get wrong; members trained that way
see overlapping data with the same objective and come out near-clones. Here the K = num_ssms
members split the training samples among themselves, without labels, by hard EM on their own
greedy acceptance:

- init: k-means (fixed seed) on an unsupervised feature of every sample (`sample_features`),
  then the balance guard;
- M-step: member k continues training on the samples assigned to it (the same examples, losses
  and Trainer as the other modes: boost_data.training_examples, ssm_training.train_round);
- E-step: every training sample is scored under every member by its mean greedy match length
  (boost_scoring's teacher-forced run of correct argmaxes, capped at `chain`, the held-out greedy
  acceptance's measure) and goes to the member that scores it best (a tie keeps it where it was),
  then the balance guard: a member below `min_share` / K of the samples takes the samples that
  lose least by moving to it.
- `em_span` > 0: the same, with spans of `em_span` output positions of a sample in place of whole
  samples (`Units`): a member trains on the samples holding one of its spans, its loss masked at
  the positions of the others' spans. A pool is judged step by step (the hindsight union, the
  router), and a span is closer to a step than a sample is.

Each member's step budget (max_steps, else epochs over ALL the training samples) is split over
the EM rounds, so the pool trains K x max_steps steps in all, as the other modes do, and one SSM
trained on everything for that many steps is a fair comparison (compare_pool).

Files (beside boost.py's): round-<r>/assignment.npy, the member of every unit (int64, in the
training rows' order, a sample's spans in turn) that round r's M-step trains on: round 0's is the clustering,
round r + 1's the E-step of round r, and round-<R>/assignment.npy the final split;
round-<r>/member-<k>/checkpoints/ (Trainer); round-<r>/ssm-<k>/ member k after round r, the last
round's at ssm-<k>/ (the pool). A resumed run loads the saved assignments, skips finished members
and continues a partly trained one from its checkpoint, so it ends as an uninterrupted run does.
The `source` column of the distilled data, when present, is only reported (source_shares), never
used to assign.
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from sklearn.cluster import KMeans
from tqdm.auto import tqdm
from transformers import LlamaConfig, PreTrainedModel, PreTrainedTokenizerBase

from specboost.speculator.loading import load_causal_lm
from specboost.training.boost_config import BoostConfig
from specboost.training.boost_data import Targets, training_examples
from specboost.training.boost_scoring import HeldOutPool, match_lengths, output_hits
from specboost.training.ssm_setup import build_ssm, context_of, load_ssm
from specboost.training.ssm_training import planned_steps, train_round

ASSIGNMENT_FILE = "assignment.npy"
SIF_A = 1e-3  # Arora et al.'s a: token weight a / (a + p(w)); 1e-3 is their recommended scale


# ---------------------------------------------------------------- init: features and clustering


def input_embeddings(llm: str) -> np.ndarray:
    """[V, H] float32: the LLM's input embedding matrix (the model is loaded once, in its stored
    dtype, and no forward pass is run)."""
    model = load_causal_lm(llm, dtype="auto")
    weight = model.get_input_embeddings().weight.detach().float().cpu().numpy()
    del model
    return weight


def sample_features(rows: list[dict[str, Any]], embeddings: np.ndarray, feature: str) -> np.ndarray:
    """[N, H]: one unsupervised vector per sample, from the LLM's input embeddings E.

    - "prompt-mean": the mean of E over the prompt's tokens.
    - "sif" (default): the smooth-inverse-frequency average of Arora et al. ("A simple but
      tough-to-beat baseline for sentence embeddings", ICLR 2017) over the prompt AND the output
      tokens: the mean of a / (a + p(w)) E[w], p the token's frequency in these samples, less
      the samples' mean vector. Why over the plain prompt mean: a plain mean is dominated by the
      frequent tokens every sample shares (punctuation, articles, formatting), so its clusters
      follow length and noise; SIF weights exactly those down, and subtracting the mean removes
      the direction all samples share (LLM embeddings are anisotropic) before the vectors are
      normalised for k-means. Arora et al. remove the first singular direction instead; we do
      not, because when the data is a balanced mix of two domains that direction is the one that
      tells them apart. The output tokens count because they are what a member learns to
      predict: samples whose LLM outputs look alike belong together even when their prompts are
      short or generic. Neither feature runs the LLM.
    """
    if feature == "prompt-mean":
        return np.stack([embeddings[r["prompt_ids"]].mean(0) for r in rows])
    ids = [np.asarray(r["prompt_ids"] + r["output_ids"]) for r in rows]
    counts = np.bincount(np.concatenate(ids), minlength=embeddings.shape[0])
    weight = SIF_A / (SIF_A + counts / counts.sum())  # [V]
    vectors = np.stack([(embeddings[i] * weight[i, None]).mean(0) for i in ids])  # [N, H]
    return vectors - vectors.mean(0)


def initial_assignment(features: np.ndarray, members: int, seed: int, min_count: int) -> np.ndarray:
    """[N] int64: k-means clusters of the L2-normalised features (seeded), balanced with the
    negative distance to each centroid as the score."""
    norms = np.linalg.norm(features, axis=1, keepdims=True)
    unit = features / np.where(norms > 0, norms, 1.0)
    kmeans = KMeans(n_clusters=members, n_init=10, random_state=seed).fit(unit)
    assignment, _ = balance(-kmeans.transform(unit), kmeans.labels_.astype(np.int64), min_count)
    return assignment


# ---------------------------------------------------------------- E-step: reassign and balance


def balance(scores: np.ndarray, assignment: np.ndarray, min_count: int) -> tuple[np.ndarray, int]:
    """The balance guard: every member ends with at least `min_count` samples (K x min_count <= N).
    A member short of them takes, from members that have more, the samples whose score drops
    least by moving (margin = score under their member - score under it; ties: lowest index).
    Returns the new assignment and the number of samples moved.  scores: [N, K]; assignment: [N]."""
    assignment = assignment.copy()
    rows = np.arange(scores.shape[0])
    counts = np.bincount(assignment, minlength=scores.shape[1])
    moved = 0
    for k in range(scores.shape[1]):
        if counts[k] >= min_count:
            continue
        margin = scores[rows, assignment] - scores[:, k]
        for i in np.argsort(margin, kind="stable"):
            if counts[k] >= min_count:
                break
            donor = assignment[i]
            if donor != k and counts[donor] > min_count:
                assignment[i], counts[donor], counts[k], moved = (
                    k,
                    counts[donor] - 1,
                    counts[k] + 1,
                    moved + 1,
                )
    return assignment, moved


def reassign(scores: np.ndarray, current: np.ndarray, min_count: int) -> tuple[np.ndarray, int]:
    """Hard E-step: each sample to its best-scoring member, a tie keeping the current one (so
    samples no member serves yet do not all fall to member 0), then `balance`."""
    rows = np.arange(scores.shape[0])
    best = scores.argmax(1)
    keep = scores[rows, current] >= scores[rows, best]
    return balance(scores, np.where(keep, current, best), min_count)


@dataclasses.dataclass(frozen=True)
class Units:
    """What the EM loop assigns to members: each training sample whole (`span` 0), or each span
    of `span` output positions of a sample (the last one shorter). A member trains on the samples
    that hold one of its units, with no loss at the output positions of the others' units."""

    row: np.ndarray  # [U] int64: the sample (index into the rows) each unit belongs to
    start: np.ndarray  # [U] int64: its first output position
    span: int

    @classmethod
    def of(cls, rows: list[dict[str, Any]], span: int) -> Units:
        if span == 0:
            return cls(np.arange(len(rows)), np.zeros(len(rows), dtype=np.int64), 0)
        counts = [max(1, -(-len(r["output_ids"]) // span)) for r in rows]
        row = np.repeat(np.arange(len(rows)), counts)
        start = np.concatenate([np.arange(c, dtype=np.int64) * span for c in counts])
        return cls(row, start, span)

    def __len__(self) -> int:
        return len(self.row)

    def positions(self, unit: int, length: int) -> range:
        """The output positions of `unit`, within its sample's `length` of them."""
        start = int(self.start[unit])
        return range(start, length if self.span == 0 else min(length, start + self.span))

    def training(
        self, rows: list[dict[str, Any]], chosen: np.ndarray
    ) -> tuple[list[dict[str, Any]], dict[int, set[int]]]:
        """The samples holding a `chosen` unit ([U] bool), and per sample id the output positions
        of its units not chosen (labels -100 there: `boost_data.training_examples`)."""
        picked = np.unique(self.row[chosen])
        masked: dict[int, set[int]] = {}
        for unit in np.flatnonzero(~chosen & np.isin(self.row, picked)).tolist():
            row = rows[self.row[unit]]
            masked.setdefault(row["id"], set()).update(self.positions(unit, len(row["output_ids"])))
        return [rows[i] for i in picked.tolist()], masked

    def totals(self, matches: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """([U] summed match lengths, [U] scored positions) from every sample's matches (one per
        scored output position)."""
        sums, counts = np.zeros(len(self)), np.zeros(len(self))
        for unit, row in enumerate(self.row.tolist()):
            span = self.positions(unit, len(matches[row]))
            part = matches[row][span.start : span.stop]
            sums[unit], counts[unit] = float(part.sum()), part.shape[0]
        return sums, counts


def sample_matches(
    model: PreTrainedModel, rows: list[dict[str, Any]], pad_id: int, batch_size: int, chain: int, desc: str
) -> list[np.ndarray]:
    """Per row, its greedy match length at every output position kept within the model's context:
    the teacher-forced run of correct argmaxes capped at `chain` (boost_scoring.match_lengths).
    A unit's mean of them is the E-step's score."""
    hits = output_hits(model, rows, pad_id, batch_size, desc)
    return [match_lengths(hits[r["id"]], chain).numpy() for r in rows]


# ---------------------------------------------------------------- files and budgets


def save_array(path: Path, array: np.ndarray) -> None:
    """np.save to a temporary file in the same folder, then rename (never half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with tmp.open("wb") as file:
        np.save(file, array)
    os.replace(tmp, path)


def load_assignment(path: Path, rows: int, members: int) -> np.ndarray:
    assignment = np.load(path)
    if assignment.shape != (rows,) or assignment.min() < 0 or assignment.max() >= members:
        raise ValueError(f"{path} does not assign {rows} samples to {members} members: use a new --out")
    return assignment.astype(np.int64)


def round_steps(config: BoostConfig, train_samples: int) -> list[int]:
    """Each member's optimizer steps per EM round: its budget (max_steps, else epochs over all
    the training samples, what one SSM of the other modes takes) split as evenly as whole steps
    allow, summing to the budget."""
    total, rounds = planned_steps(config, train_samples), config.em_rounds
    if total < rounds:
        raise ValueError(
            f"specialists split each member's {total} steps (max_steps, else epochs) over em_rounds "
            f"({rounds}): give max_steps >= em_rounds, or more epochs"
        )
    return [total * (r + 1) // rounds - total * r // rounds for r in range(rounds)]


def min_count(config: BoostConfig, units: int) -> int:
    """The fewest units a member may keep: min_share / K of them, at least one."""
    if units < config.num_ssms:
        raise ValueError(
            f"{units} training units (samples, or spans of --em-span positions) cannot be split among "
            f"{config.num_ssms} specialists: distill more prompts or use fewer SSMs"
        )
    return max(1, int(config.min_share * units / config.num_ssms))


def member_path(out: Path, round_index: int, member: int, rounds: int) -> Path:
    """Where member k is saved after round r: the pool's ssm-<k>/ after the last round."""
    return (
        out / f"ssm-{member}" if round_index == rounds - 1 else out / f"round-{round_index}" / f"ssm-{member}"
    )


# ---------------------------------------------------------------- the EM loop


@dataclasses.dataclass
class SpecialistRun:
    """What the EM loop needs of boost.py's setup; `persist` writes the state and the record."""

    config: BoostConfig
    out: Path
    tokenizer: PreTrainedTokenizerBase
    ssm_config: LlamaConfig | None
    train_rows: list[dict[str, Any]]
    held: list[dict[str, Any]]
    targets: Targets | None
    main_process: bool
    persist: Callable[[], None]

    def __post_init__(self) -> None:
        self.units = Units.of(self.train_rows, self.config.em_span)

    def write(self, path: Path, array: np.ndarray) -> None:
        if self.main_process:
            save_array(path, array)

    def first_assignment(self, lowest: int) -> np.ndarray:
        """Round 0's assignment: saved, or clustered now (the LLM's embeddings are read only then)."""
        path = self.out / "round-0" / ASSIGNMENT_FILE
        if path.is_file():
            return load_assignment(path, len(self.units), self.config.num_ssms)
        embeddings = input_embeddings(self.config.llm)
        features = sample_features(self.train_rows, embeddings, self.config.em_feature)
        # a span starts in its sample's cluster
        assignment = initial_assignment(
            features[self.units.row], self.config.num_ssms, self.config.seed, lowest
        )
        self.write(path, assignment)
        return assignment

    def train_member(self, round_index: int, member: int, assignment: np.ndarray, steps: int) -> dict:
        """M-step of one member: continue from its weights after the previous round (round 0: a
        fresh SSM, as the other modes build it) on its samples, for `steps` steps."""
        config, rounds, count = self.config, self.config.em_rounds, self.config.num_ssms
        index = round_index * count + member  # seeds the SSM's init (round 0) and the data order
        start = config
        if round_index > 0:
            start = dataclasses.replace(
                config, ssm_base=str(member_path(self.out, round_index - 1, member, rounds))
            )
        model = build_ssm(start, self.ssm_config, index)
        rows, masked = self.units.training(self.train_rows, assignment == member)
        targets = self.targets if config.loss != "ce" else None
        train_set = training_examples(rows, masked, context_of(model), None, targets)
        print(
            f"[boost] EM round {round_index}: training ssm-{member} on {len(rows)} samples "
            f"({int((assignment == member).sum())} of {len(self.units)} units)",
            flush=True,
        )
        done, loss = train_round(
            dataclasses.replace(config, max_steps=steps),
            index,
            train_set,
            model,
            self.tokenizer,
            self.out,
            self.targets.temperature if self.targets is not None else None,
            checkpoints=self.out / f"round-{round_index}" / f"member-{member}" / "checkpoints",
            final=member_path(self.out, round_index, member, rounds),
        )
        return {"steps": done, "final_loss": loss}

    def run(self, state: dict[str, Any]) -> None:
        """Train (or resume) every EM round; state["em"] holds the finished rounds and the
        members finished in the current one, state["rounds"] the pool as of the last round."""
        config, out = self.config, self.out
        lowest = min_count(config, len(self.units))  # both refuse before anything is written
        budgets = round_steps(config, len(self.train_rows))
        em = state.setdefault("em", {"rounds": [], "members": []})
        self.persist()  # the settings are on disk before any assignment is: a later run checks them
        assignment: np.ndarray | None = None
        for r in range(config.em_rounds):
            if r < len(em["rounds"]):
                print(f"[boost] EM round {r}: done, skipped")
                continue
            if assignment is None:
                assignment = (
                    self.first_assignment(lowest)
                    if r == 0
                    else load_assignment(
                        out / f"round-{r}" / ASSIGNMENT_FILE, len(self.units), config.num_ssms
                    )
                )
            for k in range(len(em["members"]), config.num_ssms):
                em["members"].append(self.train_member(r, k, assignment, budgets[r]))
                self.persist()
            assignment = self.score_round(state, r, assignment, lowest)
            self.persist()

    def score_round(self, state: dict[str, Any], r: int, assignment: np.ndarray, lowest: int) -> np.ndarray:
        """E-step of round r, the held-out scores, and the round's record; returns the next
        assignment (saved as round-<r+1>/assignment.npy before the round is recorded)."""
        config, em = self.config, state["em"]
        pad, batch, chain = self.tokenizer.pad_token_id, config.eval_batch_size, config.chain
        pool = HeldOutPool(self.held, self.targets)
        held_units = Units.of(self.held, 0)
        train, held, members = [], [], []  # per member: (match sums, scored positions) per unit
        for k in range(config.num_ssms):
            path = member_path(self.out, r, k, config.em_rounds)
            ssm = load_ssm(path)
            train.append(
                self.units.totals(sample_matches(ssm, self.train_rows, pad, batch, chain, f"ssm-{k} E-step"))
            )
            held.append(
                held_units.totals(
                    sample_matches(ssm, self.held, pad, batch, chain, f"ssm-{k} held-out match")
                )
            )
            scores = pool.add(ssm, pad, batch, f"ssm-{k} held-out", chain)
            members.append({"ssm": k, "path": str(path.relative_to(self.out)), **scores, **em["members"][k]})
            members[-1]["parameters"] = sum(p.numel() for p in ssm.parameters())
            del ssm
        # the members share one architecture, so they score the same positions of every sample
        totals, train_counts = np.stack([t[0] for t in train], axis=1), train[0][1]  # [U, K], [U]
        held_totals, held_counts = np.stack([h[0] for h in held], axis=1), held[0][1]
        scores = totals / np.maximum(train_counts, 1)[:, None]  # [U, K] mean match length per unit
        following, moved = reassign(scores, assignment, lowest)
        self.write(self.out / f"round-{r + 1}" / ASSIGNMENT_FILE, following)
        em["rounds"].append(
            {
                "round": r,
                "members": [
                    self.member_record(m, totals[:, k], train_counts, assignment == k, following == k)
                    for k, m in enumerate(members)
                ],
                "reassigned": int((following != assignment).sum()),
                "balance_moves": moved,
                # position-weighted means of the best member's match: each unit (held out: each
                # sample) drafted by the member that serves it best (an oracle router), comparable
                # to the members' own
                "train_best_member_mean_match_length": float(totals.max(1).sum() / train_counts.sum()),
                "held_out_best_member_mean_match_length": float(
                    held_totals.max(1).sum() / max(held_counts.sum(), 1)
                ),
            }
        )
        em["members"] = []
        state["rounds"] = [
            self.pool_entry(m, len(np.unique(self.units.row[assignment == k])), em["rounds"])
            for k, m in enumerate(members)
        ]
        round_record = em["rounds"][-1]
        tqdm.write(
            f"[boost] EM round {r}: shares {[m['share'] for m in round_record['members']]} -> "
            f"{[m['next_share'] for m in round_record['members']]} ({round_record['reassigned']} moved), "
            f"held-out mean match per member {[round(m['held_out_mean_match_length'], 3) for m in members]}, "
            f"best member {round_record['held_out_best_member_mean_match_length']:.3f}, "
            f"pool coverage {members[-1]['pool_coverage']:.3f}"
        )
        return following

    def member_record(
        self, member: dict, sums: np.ndarray, counts: np.ndarray, own: np.ndarray, following: np.ndarray
    ) -> dict[str, Any]:
        """One member's line of an EM round: its shares of the units before and after the E-step,
        the samples it trained on, its mean match on its own units and on all (training and
        held-out), the sources its units come from."""
        n = len(self.units)
        return {
            **member,
            "train_samples": len(np.unique(self.units.row[own])),
            "train_units": int(own.sum()),
            "share": float(own.sum() / n),
            "next_share": float(following.sum() / n),
            "own_mean_match_length": float(sums[own].sum() / max(counts[own].sum(), 1)),
            "train_mean_match_length": float(sums.sum() / max(counts.sum(), 1)),
            "source_shares": self.source_shares(own),
            "next_source_shares": self.source_shares(following),
        }

    def source_shares(self, chosen: np.ndarray) -> dict[str, float] | None:
        """The share of each `source` among the chosen units' samples (reporting only)."""
        if not any("source" in r for r in self.train_rows):
            return None
        counts = Counter(str(self.train_rows[i].get("source")) for i in self.units.row[chosen].tolist())
        total = max(sum(counts.values()), 1)
        return {source: counts[source] / total for source in sorted(counts)}

    def pool_entry(
        self, member: dict[str, Any], trained: int, rounds: list[dict[str, Any]]
    ) -> dict[str, Any]:
        """The member as boost_record.json's `rounds` lists SSMs in every mode (export and
        compare_pool read them): the samples of its last M-step, its steps over all rounds."""
        return {
            **member,
            "train_samples": trained,
            "marked": None,
            "remaining_samples": len(self.train_rows),
            "steps": sum(r["members"][member["ssm"]]["steps"] for r in rounds),
        }
