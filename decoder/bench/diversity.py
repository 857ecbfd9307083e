"""How much a pool's members differ, measured on the LLM's greedy outputs, untimed: what a pool can
gain over its best member only shows where the members' chains match the LLM at different places.

Per SSM and output position (a prompt's greedy output of n new tokens, position j = 0 .. n - 1:
the chain drafted after the prompt and the first j new tokens), the match m_i(j) is the number of
consecutive tokens SSM i's argmax chain of length L gets right, min(run, L), where the run comes
from one teacher-forced pass of the SSM over prompt + output (`oracle_router.agreement_runs`,
what the `learned+oracle` row routes on). Runs near the output's end are cut by it, as
`max_new_tokens` cuts decoding. From these:

- the member x category matrix: the mean of m_i(j) over a category's positions;
- the hindsight walk: along each output from j = 0, a step at j emits 1 + m(j) tokens (the
  matched drafts and the LLM's own; at most the n - j left) and moves to j + 1 + m(j);
  tokens/step = new tokens / steps, summed over the category's outputs. With m = m_i that is
  greedy chain decoding with SSM i alone (its tokens/step, bonus token included, as the suite's
  tables count it); with m(j) = max_i m_i(j), the member with the longest match chosen in
  hindsight at every step: the union. Taking the farthest step is also the fewest steps, since
  from a later position no member reaches less far. The union's gain is its tokens/step over the
  best single member's in the same column.

A chain of L caps every step at L + 1 tokens, so where the members' chains of the fixed shape
already match most of their tokens the union has little room over the best member however
differently they match further on. The learned scheduler routes chains of up to the predictor's
longest depth: the union and the best member are walked at each such length too (`by_length`),
beside a reference SSM's chain alone (the generalist's, where the suite has one).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from transformers import BatchEncoding, PreTrainedModel

from specboost.decoder.bench.methods import unpadded
from specboost.speculator.hindsight_walk import walk_positions
from specboost.speculator.oracle_router import agreement_runs

ALL = "all"  # the column over every category's positions

Output = tuple[list[int], list[int]]  # a prompt's tokens and the LLM's greedy new tokens


@dataclass(frozen=True)
class Diversity:
    """One pool's diversity by column: each category, then ALL."""

    chain_length: int  # L: the chains' length, the cap on every match
    prompts: dict[str, int]  # column -> outputs walked
    positions: dict[str, int]  # column -> output positions (new tokens)
    mean_match: dict[str, list[float]]  # column -> per SSM: mean of min(run, L) over the positions
    tokens_per_step: dict[str, list[float]]  # column -> per SSM: the walk with that SSM alone
    union_tokens_per_step: dict[str, float]  # column -> the walk with the best member at every step
    union_gain: dict[str, float]  # column -> union / the best single member's tokens/step
    by_length: dict[int, dict] = field(default_factory=dict)  # L -> `walks_at` over every output


def match_runs(models: Sequence[PreTrainedModel], output: Output) -> np.ndarray:
    """[S, n]: each model's run of correct argmaxes at the n new-token positions of `output` (cut by
    the output's end)."""
    prompt, new = output
    reference = torch.tensor(prompt + new, device=models[0].device)
    return agreement_runs(list(models), reference)[:, len(prompt) - 1 : len(prompt) - 1 + len(new)]


def pool_diversity(
    ssms: Sequence[PreTrainedModel],
    outputs: Mapping[str, Sequence[Output]],
    chain_length: int,
    lengths: Sequence[int] = (),
    reference: PreTrainedModel | None = None,
) -> Diversity:
    """The pool's `Diversity` on the greedy `outputs` of each category (categories without one are
    left out) at `chain_length`, and its walks at each of `lengths` (`walks_at`), `reference`'s
    chain alone beside them where given. One teacher-forced pass per model and output."""
    models = [*ssms, *([] if reference is None else [reference])]
    runs = {category: [match_runs(models, output) for output in pairs] for category, pairs in outputs.items()}
    members = len(ssms)
    base = summarise_matches(_capped(runs, range(members), chain_length), chain_length)
    by_length = {
        length: walks_at(runs, members, length, reference is not None) for length in sorted(set(lengths))
    }
    return replace(base, by_length=by_length)


def walks_at(runs: Mapping[str, Sequence[np.ndarray]], members: int, length: int, reference: bool) -> dict:
    """The walks with chains of `length` over every output: the best single member (`best_member`,
    its tokens/step `best`), the union (`union`), union / best per column (`gain`), and with
    `reference` (the row after the members in `runs`) its chain alone (`reference`)."""
    pool = summarise_matches(_capped(runs, range(members), length), length)
    alone = pool.tokens_per_step[ALL]
    walks = {
        "best_member": int(np.argmax(alone)),
        "best": max(alone),
        "union": pool.union_tokens_per_step[ALL],
        "gain": pool.union_gain,
    }
    if reference:
        walk = summarise_matches(_capped(runs, [members], length), length).tokens_per_step[ALL]
        walks["reference"] = walk[0]
    return walks


def _capped(runs: Mapping[str, Sequence[np.ndarray]], rows: Sequence[int], length: int) -> dict:
    """The matches of chains of `length`: the runs of `rows`, capped at it."""
    return {category: [np.minimum(r[list(rows)], length) for r in rs] for category, rs in runs.items()}


def summarise_matches(per_category: Mapping[str, Sequence[np.ndarray]], chain_length: int) -> Diversity:
    """`Diversity` of the matches [S, n] of each output, by category (categories without one are
    left out; at least one output of at least one position is needed)."""
    columns = {category: matches for category, matches in per_category.items() if matches}
    columns[ALL] = [m for matches in columns.values() for m in matches]
    prompts, positions, mean_match, alone, union, gain = {}, {}, {}, {}, {}, {}
    for column, matches in columns.items():
        tokens, members = sum(m.shape[1] for m in matches), matches[0].shape[0]
        prompts[column], positions[column] = len(matches), tokens
        mean_match[column] = (sum(m.sum(axis=1) for m in matches) / tokens).tolist()
        alone[column] = [tokens / sum(len(walk_positions(m[i])) for m in matches) for i in range(members)]
        union[column] = tokens / sum(len(walk_positions(m.max(axis=0))) for m in matches)
        gain[column] = union[column] / max(alone[column])
    return Diversity(chain_length, prompts, positions, mean_match, alone, union, gain)


def greedy_outputs(
    kept: Iterable[tuple[BatchEncoding, list[list[int]]]], batches: Mapping[str, Sequence[BatchEncoding]]
) -> dict[str, list[Output]]:
    """Per category, each prompt of its `batches` with the new tokens plain greedy decoding gave it
    in the timed runs (`kept`: items and their rows); prompts it did not decode (or decoded to
    nothing) are left out."""
    known = {
        tuple(prompt.tolist()): row
        for batch, rows in kept
        for prompt, row in zip(unpadded(batch), rows, strict=True)
    }
    outputs: dict[str, list[Output]] = {}
    for category, items in batches.items():
        prompts = [prompt.tolist() for batch in items for prompt in unpadded(batch)]
        outputs[category] = [(prompt, known[tuple(prompt)]) for prompt in prompts if known.get(tuple(prompt))]
    return outputs
