"""Measure an SSM's positional acceptance vector (ALGORITHMS.md section 8) on held-out token
sequences, for Sequoia's tree DP (`specboost.speculator.sequoia_dp`).

Both the LLM and the SSM run teacher-forced over each sequence (one plain causal pass each);
every position that predicts a continuation token is one trial. At such a position, with
children filled as the drafter fills a Sequoia topology (`speculator/draft_plans.py`):

- greedy (top-k children, `rule="greedy"`): the child of rank j is accepted iff the LLM's
  argmax is the SSM's j-th ranked token (ranked by `torch.topk`, as the drafter does);
- sampling without replacement (`rule="without_replacement"`, Sequoia Alg. 1): the position is
  replayed `simulations` times (Monte Carlo, fixed seed): k children drawn from q without
  replacement by the drafter's own `choose_children`, verified by
  `verify_without_replacement` of decoder/verify.py (the same residual updates as decoding); the
  accepted child's rank counts. The exact law would sum over every sequence of rejected tokens
  (V^k paths), hence sampling.

`accepted[j]` trials accept the child of rank j + 1; the conditional rate of ALGORITHMS.md is
p_j = accepted[j] / (trials - accepted[0] - ... - accepted[j-1]) (0 when no trial gets that far),
and the DP's weights are the marginals accepted[j] / trials (`AcceptanceVector`).

Measure on contexts like the ones that will be served: the rates depend on them. On the tiny
reference LLM and ssm-0 at T=1, greedy-distilled text gives marginals (0.23, 0.17, 0.07, ...)
but text the LLM sampled at T=1 gives (0.26, 0.09, 0.05, ...), and decoding at T=1 follows the
latter (a 3-child star: 1.36 tokens/step measured, 1.39 and 1.47 predicted).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from transformers import PreTrainedModel

from specboost.decoder.verify import verify_without_replacement
from specboost.speculator.draft_plans import choose_children
from specboost.speculator.model_info import context_length
from specboost.speculator.sampling import LogitsToProbs, SamplingConfig
from specboost.speculator.sequoia_acceptance import AcceptanceVector
from specboost.speculator.tree import DraftKind, TokenTree
from specboost.training.distill import load_distilled

Sample = tuple[Sequence[int], Sequence[int]]  # (context, continuation): continuation tokens are scored


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
            tokens, q, _ = choose_children(probs.scores(logits[None])[0], k, True, generator)
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


def distilled_samples(path: Path, held_out_from: Path | None, max_samples: int | None) -> list[Sample]:
    """(prompt_ids, output_ids) of a distillation run; only the ids listed as "held_out_ids" in
    `held_out_from` (a boost run's boost_record.json) when given."""
    rows = load_distilled(path)
    if held_out_from is not None:
        held = set(json.loads(held_out_from.read_text())["held_out_ids"])
        rows = rows.filter(lambda i: i in held, input_columns="id")
    samples = [(r["prompt_ids"], r["output_ids"]) for r in rows]
    return samples[:max_samples]
