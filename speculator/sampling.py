"""Logits processing shared by the LLM and the SSMs (ALGORITHMS.md section 2, "Logits processing").

P (LLM) and Q (SSM) are the softmax of *processed* scores: transformers' own logits processors
and warpers, built from the generation config exactly as `model.generate` builds them
(`decoder/generation_options.py`), applied in its order to logits cast to float32 as
`generate` casts them. Many processors read the sequence so far (repetition penalty, n-gram
blocking, bad words, minimum lengths, ...), so scores of a tree node are processed with that
node's own history: the verified tokens followed by the path to the node
(`LogitsToProbs.tree_scores`). Without a generation config, `SamplingConfig` alone gives the
temperature / top-k / top-p warpers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import GenerationConfig
from transformers.generation import logits_process as lp
from transformers.generation.logits_process import (
    LogitsProcessor,
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from specboost.speculator.tree import TokenTree

# Processors whose result does not depend on the history: a tree is processed in one call.
HISTORY_FREE: frozenset[type] = frozenset(
    {
        lp.EpsilonLogitsWarper,
        lp.EtaLogitsWarper,
        lp.InfNanRemoveLogitsProcessor,
        lp.LogitNormalization,
        lp.MinPLogitsWarper,
        lp.SuppressTokensLogitsProcessor,
        lp.TemperatureLogitsWarper,
        lp.TopHLogitsWarper,
        lp.TopKLogitsWarper,
        lp.TopPLogitsWarper,
        lp.TypicalLogitsWarper,
    }
)
# Processors that look at each row's scores (and history) alone: they take a batch of tree
# nodes at once. Any other processor (e.g. one holding the prompt as a [1, L] tensor) runs row by row.
ROW_INDEPENDENT: frozenset[type] = HISTORY_FREE | {
    lp.ExponentialDecayLengthPenalty,
    lp.ForcedBOSTokenLogitsProcessor,
    lp.ForcedEOSTokenLogitsProcessor,
    lp.MinLengthLogitsProcessor,
    lp.MinNewTokensLengthLogitsProcessor,
    lp.NoBadWordsLogitsProcessor,
    lp.NoRepeatNGramLogitsProcessor,
    lp.RepetitionPenaltyLogitsProcessor,
    lp.SequenceBiasLogitsProcessor,
    lp.SuppressTokensAtBeginLogitsProcessor,
}


@dataclass(frozen=True)
class SamplingConfig:
    """How one token is chosen from logits. `do_sample=False` is greedy (argmax)."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off

    def __post_init__(self) -> None:
        if self.do_sample and not self.temperature > 0:
            raise ValueError(
                f"temperature must be > 0 when do_sample=True (got {self.temperature}); "
                "use do_sample=False for greedy decoding"
            )
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @classmethod
    def from_generation_config(cls, config: GenerationConfig) -> SamplingConfig:
        return cls(
            do_sample=bool(config.do_sample),
            temperature=1.0 if config.temperature is None else float(config.temperature),
            top_k=int(config.top_k or 0),
            top_p=1.0 if config.top_p is None else float(config.top_p),
        )

    def warpers(self) -> LogitsProcessorList:
        """The warpers `generate` would build for these settings, in its order."""
        warpers = LogitsProcessorList()
        if not self.do_sample:
            return warpers
        if self.temperature != 1.0:
            warpers.append(TemperatureLogitsWarper(self.temperature))
        if self.top_k > 0:
            warpers.append(TopKLogitsWarper(top_k=self.top_k, min_tokens_to_keep=1))
        if self.top_p < 1.0:
            warpers.append(TopPLogitsWarper(top_p=self.top_p, min_tokens_to_keep=1))
        return warpers


def draw(q: torch.Tensor, samples: int = 1, generator: torch.Generator | None = None) -> torch.Tensor:
    """`samples` independent draws (with replacement) from each row of the distribution q [..., V]:
    [..., samples] token ids, by inverting q's cumulative sum at uniform numbers. A draft's tokens
    only need to follow the q it is verified with (MSS, ALGORITHMS.md section 2), not any particular
    stream of random numbers; `torch.multinomial` draws an exponential number per token of the
    vocabulary, 0.12 ms of a 4096-token vocabulary on a 2-core EPYC, against 0.02 ms here: 0.5 ms
    of the 1.4 ms a sampled chain of 4 of the tiny fixture's SSM took over a greedy one. u is uniform
    in [0, 1), so (1 - u) x total lies in (0, total], and the first index whose cumulative sum
    reaches it is never a token of probability 0."""
    u = torch.rand((*q.shape[:-1], samples), generator=generator, device=q.device, dtype=q.dtype)
    return inverse_cdf(q, u)


def inverse_cdf(q: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """`draw`'s tokens [..., samples] for its uniform numbers u [..., samples] in [0, 1): drawn
    outside a compiled graph, they leave the graph no random state to hold (a sampled chain's block,
    speculator/chain_block.py), and a chain's block needs one number a token, not one a token of
    the vocabulary as an exponential race would (`exponential_` over 7 x 4096 tokens took 0.49 ms on a
    2-core EPYC, as long as the block's 7 passes)."""
    cdf = q.cumsum(-1)
    return torch.searchsorted(cdf, (1 - u.to(cdf.dtype)) * cdf[..., -1:])


class LogitsToProbs:
    """Turns raw logits into processed scores and the distribution tokens are drawn from (P for the
    LLM, Q for the SSMs).

    `processors` is the whole list `generate` applies under `config.do_sample` (warpers included
    when sampling); `greedy_processors` the list it applies without sampling (majority voting
    drafts argmax chains under either). Left None, both come from `config` (its warpers only).
    """

    def __init__(
        self,
        config: SamplingConfig,
        processors: LogitsProcessorList | None = None,
        greedy_processors: LogitsProcessorList | None = None,
    ) -> None:
        self.config = config
        self.processors = config.warpers() if processors is None else processors
        self.greedy_processors = LogitsProcessorList() if greedy_processors is None else greedy_processors
        self.needs_history = any(type(p) not in HISTORY_FREE for p in self.processors)

    def greedy(self) -> LogitsToProbs:
        """The argmax of the scores `generate` would compute without sampling."""
        return LogitsToProbs(SamplingConfig(do_sample=False), self.greedy_processors, self.greedy_processors)

    def scores(self, logits: torch.Tensor, histories: torch.Tensor | None = None) -> torch.Tensor:
        """[N, V] logits -> [N, V] processed float32 scores (`generate` casts logits to float32
        before processing them); `histories` [N, L] is each row's token sequence so far (needed
        when `needs_history`)."""
        scores = logits.float()
        if not self.processors:
            return scores
        if histories is None:
            if self.needs_history:
                raise ValueError("these logits processors read the sequence so far: pass its tokens")
            histories = torch.zeros(scores.shape[0], 1, dtype=torch.long, device=scores.device)
        histories = histories.to(scores.device)
        for processor in self.processors:
            scores = _apply(processor, histories, scores)
        return scores

    def __call__(self, logits: torch.Tensor, histories: torch.Tensor | None = None) -> torch.Tensor:
        """[N, V] logits -> [N, V] float32 probabilities."""
        return torch.softmax(self.scores(logits, histories), dim=-1)

    def along(self, logits: torch.Tensor, ids: torch.Tensor, start: int) -> torch.Tensor:
        """Teacher forcing: [B, n, V] logits that predict ids[:, start : start + n] -> [B, n, V]
        probabilities, step t processed with its history ids[:, : start + t] as `generate` saw it
        (one processor call per step only when the processors read the history)."""
        return torch.softmax(self.scores_along(logits, ids, start), dim=-1)

    def scores_along(self, logits: torch.Tensor, ids: torch.Tensor, start: int) -> torch.Tensor:
        """`along`'s processed float32 scores, before the softmax: what a greedy row's argmax reads
        along a drafted chain (`TreeVerifier._verify_chains`)."""
        if not self.needs_history:
            return self.scores(logits.flatten(0, 1)).view(logits.shape)
        steps = [self.scores(logits[:, t], ids[:, : start + t]) for t in range(logits.shape[1])]
        return torch.stack(steps, 1) if steps else torch.zeros(logits.shape, device=logits.device)

    def tree_scores(
        self,
        logits: torch.Tensor,  # [n, V]: the logits at `nodes` (default: every node of `tree`)
        tree: TokenTree,
        verified: list[int],  # prompt + verified tokens; the last one is the tree's root
        nodes: list[int] | range | None = None,
    ) -> torch.Tensor:
        """Processed scores [n, V] of tree nodes, each with its own history `verified` + the path
        to it; one processor call per depth."""
        nodes = range(len(tree)) if nodes is None else nodes
        if not self.needs_history:
            return self.scores(logits)
        out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
        by_depth: dict[int, list[int]] = {}
        for row, u in enumerate(nodes):
            by_depth.setdefault(tree.depths[u], []).append(row)
        for rows in by_depth.values():
            histories = [verified + [tree.tokens[v] for v in tree.path_to(nodes[r])] for r in rows]
            index = torch.tensor(rows, device=logits.device)
            out[index] = self.scores(logits[index], torch.tensor(histories, device=logits.device))
        return out


def _apply(processor: LogitsProcessor, histories: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    if type(processor) in ROW_INDEPENDENT or scores.shape[0] == 1:
        return processor(histories, scores)
    return torch.cat([processor(histories[i : i + 1], scores[i : i + 1]) for i in range(scores.shape[0])])


@dataclass(frozen=True)
class ChainWarp:
    """A sampled row's processing where it is only `generate`'s config warpers (temperature, then
    top-k, then top-p, each at most once, filtering to -inf): what a compiled sampled-chain block
    applies inside its graph (speculator/chain_block.py) as `warped_probs`. The block's q is what
    its tokens are drawn from and what MSS verifies them with (ALGORITHMS.md section 2), so it
    need not equal the processors' bit for bit: it only has to be q, exactly, for its draws."""

    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off

    @classmethod
    def of(cls, probs: LogitsToProbs) -> ChainWarp | None:
        """`probs`' sampling as a ChainWarp; None where it samples not or processes otherwise."""
        if not probs.config.do_sample:
            return None
        found: dict[type, LogitsProcessor] = {}
        order = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)
        for processor in probs.processors:
            kind = type(processor)
            if kind not in order or kind in found or any(order.index(k) > order.index(kind) for k in found):
                return None
            if kind is not TemperatureLogitsWarper and processor.filter_value != -float("inf"):
                return None
            if kind is TopPLogitsWarper and processor.min_tokens_to_keep != 1:
                return None
            found[kind] = processor
        temperature = found.get(TemperatureLogitsWarper)
        top_k, top_p = found.get(TopKLogitsWarper), found.get(TopPLogitsWarper)
        return cls(
            1.0 if temperature is None else float(temperature.temperature),
            0 if top_k is None else int(top_k.top_k),
            1.0 if top_p is None else float(top_p.top_p),
        )

    @property
    def key(self) -> tuple[int, bool]:
        """What a compiled block's graph holds of it (top-k, top-p on); the rest are its inputs."""
        return self.top_k, self.top_p < 1

    def arguments(self, rows: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int, bool]:
        """`warped_probs`' arguments for `rows` rows: temperature and top-p as [rows, 1] float32
        tensors (inputs of a compiled block, not a graph per value), top-k, top-p on."""
        values = torch.tensor([[self.temperature, self.top_p]], dtype=torch.float32, device=device)
        temperature, top_p = (values[:, i : i + 1].expand(rows, 1).contiguous() for i in range(2))
        return temperature, top_p, *self.key


def warped_probs(
    logits: torch.Tensor,  # [B, V]
    temperature: torch.Tensor,  # [B, 1] float32
    top_p: torch.Tensor,  # [B, 1] float32
    top_k: int,  # 0: off
    nucleus: bool,  # apply top-p (static in a graph: its sort costs where top-p is off)
) -> torch.Tensor:
    """[B, V] float32 q: `ChainWarp`'s warpers as transformers applies them, then the softmax."""
    scores = logits.float() / temperature
    if top_k:
        kth = torch.topk(scores, min(top_k, scores.shape[-1])).values[..., -1:]
        scores = scores.masked_fill(scores < kth, -float("inf"))
    if nucleus:
        ordered, order = torch.sort(scores, descending=False)
        drop = ordered.softmax(-1).cumsum(-1) <= 1 - top_p
        drop[..., -1:] = False
        scores = scores.masked_fill(drop.scatter(-1, order, drop), -float("inf"))
    return torch.softmax(scores, -1)
