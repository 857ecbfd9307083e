"""Positional acceptance rates of one SSM under one verification rule, measured on held-out
token sequences (ALGORITHMS.md section 8): the input of Sequoia's tree DP (`sequoia_dp`).

Both the LLM and the SSM run teacher-forced over each sequence (one plain causal pass each);
every position that predicts a continuation token is one trial. At such a position, with
children filled as `SSMDrafter` fills a Sequoia topology:

- greedy (top-k children, `rule="greedy"`): the child of rank j is accepted iff the LLM's
  argmax is the SSM's j-th ranked token (ranked by `torch.topk`, as the drafter does);
- sampling without replacement (`rule="without_replacement"`, Sequoia Alg. 1): the position is
  replayed `simulations` times (Monte Carlo, fixed seed): k children drawn from q without
  replacement by the drafter's own code, verified by `verify_without_replacement` of
  decoder/verify.py (the same residual updates as decoding); the accepted child's rank counts.
  The exact law would sum over every sequence of rejected tokens (V^k paths), hence sampling.

`accepted[j]` trials accept the child of rank j + 1; the conditional rate of ALGORITHMS.md is
p_j = accepted[j] / (trials - accepted[0] - ... - accepted[j-1]) (0 when no trial gets that far),
and the DP's weights are the marginals accepted[j] / trials (see `sequoia_dp`).

Measure on contexts like the ones that will be served: the rates depend on them. On the tiny
reference LLM and ssm-0 at T=1, greedy-distilled text gives marginals (0.23, 0.17, 0.07, ...)
but text the LLM sampled at T=1 gives (0.26, 0.09, 0.05, ...), and decoding at T=1 follows the
latter (a 3-child star: 1.36 tokens/step measured, 1.39 and 1.47 predicted).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel

from specboost.decoder.verify import verify_without_replacement
from specboost.speculator.drafter import SSMDrafter
from specboost.speculator.model_info import context_length
from specboost.speculator.sampling import LogitsToProbs, SamplingConfig
from specboost.speculator.tree import DraftKind, TokenTree

RULES = ("greedy", "without_replacement")
Sample = tuple[Sequence[int], Sequence[int]]  # (context, continuation): continuation tokens are scored


@dataclass(frozen=True)
class AcceptanceVector:
    """p[j]: P(child j + 1 accepted | children 1..j rejected), ALGORITHMS.md section 8's p_k."""

    p: tuple[float, ...]
    rule: str  # "greedy" | "without_replacement"
    num_positions: int  # scored sequence positions
    temperature: float = 1.0  # the sampling settings p was measured at (unused for greedy)
    top_k: int = 0
    top_p: float = 1.0
    simulations: int = 1  # Monte Carlo replays per position (without replacement)

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"rule must be one of {RULES}, got {self.rule!r}")
        if any(not 0.0 <= x <= 1.0 for x in self.p):
            raise ValueError(f"acceptance rates must lie in [0, 1], got {self.p}")

    @classmethod
    def from_counts(cls, accepted: Sequence[int], trials: int, **fields) -> AcceptanceVector:
        p, left = [], trials
        for count in accepted:
            p.append(count / left if left > 0 else 0.0)
            left -= count
        return cls(tuple(p), **fields)

    @property
    def marginal(self) -> tuple[float, ...]:
        """P(child j + 1 of an accepted node is accepted): the weights of the tree DP."""
        weights, rejected = [], 1.0
        for rate in self.p:
            weights.append(rejected * rate)
            rejected *= 1.0 - rate
        return tuple(weights)

    @property
    def sampling(self) -> SamplingConfig:
        return SamplingConfig(
            do_sample=self.rule != "greedy", temperature=self.temperature, top_k=self.top_k, top_p=self.top_p
        )

    def to_dict(self) -> dict:
        return {**asdict(self), "p": list(self.p)}

    @classmethod
    def from_dict(cls, data: dict) -> AcceptanceVector:
        return cls(**{**data, "p": tuple(data["p"])})

    def save(self, path: str | os.PathLike[str]) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> AcceptanceVector:
        """From a file written by `save`, or by the `sequoia` CLI (its "acceptance" entry)."""
        data = json.loads(Path(path).read_text())
        return cls.from_dict(data.get("acceptance", data))


def greedy_counts(llm_logits: torch.Tensor, ssm_logits: torch.Tensor, k: int) -> list[int]:
    """[N, V] logits of both models at N positions -> how many positions accept the child of rank
    j + 1 (j < k) of a top-k node: the LLM's argmax is the SSM's (j + 1)-th ranked token."""
    target = llm_logits.argmax(dim=-1, keepdim=True)  # [N, 1]
    ranked = torch.topk(ssm_logits, min(k, ssm_logits.shape[-1]), dim=-1).indices  # [N, k]
    counts = (ranked == target).sum(dim=0).tolist()
    return counts + [0] * (k - len(counts))


def without_replacement_counts(
    llm_logits: torch.Tensor,
    ssm_logits: torch.Tensor,
    k: int,
    probs: LogitsToProbs,
    simulations: int,
    generator: torch.Generator,
) -> list[int]:
    """Like `greedy_counts` for k children sampled without replacement and Sequoia's rule, each
    position replayed `simulations` times (N * simulations trials)."""
    counts = [0] * k
    p_rows = probs(llm_logits)  # [N, V]
    for p, logits in zip(p_rows, ssm_logits, strict=True):
        for _ in range(simulations):
            tokens, q = SSMDrafter._children(logits, k, probs, generator)
            tree = TokenTree.root_only(-1, DraftKind.SAMPLED_WITHOUT_REPLACEMENT)
            for token in tokens:
                tree.add_child(0, token, 0, q)
            verdict = verify_without_replacement(tree, p.expand(len(tree), -1), generator)
            if verdict.accepted:
                counts[verdict.accepted[0] - 1] += 1  # children are nodes 1..k in rank order
    return counts


@torch.no_grad()
def continuation_logits(model: PreTrainedModel, sample: Sample, length: int | None) -> torch.Tensor:
    """[positions, V]: teacher-forced logits at the positions that predict the continuation, over
    the first `length` tokens of context + continuation (None: all)."""
    tokens = [*sample[0], *sample[1]][:length]
    first = max(len(sample[0]) - 1, 0)
    ids = torch.tensor([tokens], device=model.device)
    return model(input_ids=ids).logits[0, first:-1].double()


def estimate_acceptance(
    llm: PreTrainedModel,
    ssm: PreTrainedModel,
    samples: Iterable[Sample],
    *,
    k: int = 8,
    sampling: SamplingConfig | None = None,
    simulations: int = 8,
    seed: int = 0,
) -> AcceptanceVector:
    """The acceptance vector of `ssm` drafting for `llm` over `samples` ((context, continuation)
    token id pairs, e.g. distilled prompts and outputs). `sampling` None or greedy measures the
    greedy rule; with do_sample=True, sampling without replacement at those settings."""
    sampling = sampling or SamplingConfig()
    probs = LogitsToProbs(sampling)
    generator = torch.Generator(llm.device).manual_seed(seed)  # everything runs on the LLM's device
    length = min((n for n in (context_length(llm), context_length(ssm)) if n is not None), default=None)
    accepted, positions = [0] * k, 0
    for sample in samples:
        llm_logits = continuation_logits(llm, sample, length)
        ssm_logits = continuation_logits(ssm, sample, length).to(llm_logits.device)
        if sampling.do_sample:
            counts = without_replacement_counts(llm_logits, ssm_logits, k, probs, simulations, generator)
        else:
            counts = greedy_counts(llm_logits, ssm_logits, k)
        accepted = [a + c for a, c in zip(accepted, counts, strict=True)]
        positions += llm_logits.shape[0]
    replays = simulations if sampling.do_sample else 1
    return AcceptanceVector.from_counts(
        accepted,
        positions * replays,
        rule="without_replacement" if sampling.do_sample else "greedy",
        num_positions=positions,
        temperature=sampling.temperature,
        top_k=sampling.top_k,
        top_p=sampling.top_p,
        simulations=replays,
    )
