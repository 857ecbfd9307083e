"""The routed scheduler's rule fed the TRUE match lengths (ALGORITHMS.md section 5.3), greedy: the
hindsight oracle the benchmark sets beside the learned scheduler, a bound on what a perfect
predictor would reach with the same rule, costs and cost correction.

Under greedy verification, SSM i's argmax chain drafted after a text that is a prefix of the LLM's
greedy output matches it for as long as the SSM's own argmax equals the output's next token at
every position: while the chain matches, its context IS the output's prefix. So one teacher-forced
pass of each SSM over the LLM's greedy output gives, at every position, the true match of every
chain length: m_i(p) consecutive agreements from p, f_i(d) = min(m_i(p), d).

The LLM's greedy output of a prompt is generated the first time the prompt is met (with its
teacher-forced passes) and kept: a benchmark's untimed warm-up run pays for it, so timed runs
only look it up.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import PreTrainedModel

from specboost.speculator.chain_router import ChainRouter
from specboost.speculator.hindsight_walk import run_lengths
from specboost.speculator.kv_cache import note_setup
from specboost.speculator.model_info import context_length
from specboost.speculator.predictor import PassHead

LOOKAHEAD = 256  # greedy tokens generated per prompt; a row longer than that starts a new lookahead


class OracleRouter(ChainRouter):
    """`ChainRouter` whose estimates are the true match lengths of the LLM's greedy output."""

    def __init__(self, router: ChainRouter, llm: PreTrainedModel, ssms: list[PreTrainedModel]) -> None:
        momentum = router._momenta[1]  # the same cost correction; no predictor to correct
        super().__init__(router.predictor, router.cost_model, calibration=None, cost_correction=momentum)
        self.llm, self.ssms = llm, ssms
        self._in_pass = None  # it reads texts, never the estimates its passes return (`pass_head`)
        self._learned_head = router.pass_head
        self.max_hold = 0  # every step decided on its own true lengths (`DecisionPacing`)
        self.known: dict[tuple[int, ...], tuple[list[int], np.ndarray]] = {}  # prompt -> output, runs [S, L]
        self._last: tuple[list[int], np.ndarray] = (
            [],
            np.zeros((len(ssms), 1), dtype=np.int64),
        )  # looked up first

    def pass_head(self, device: torch.device) -> PassHead | None:
        """The learned router's head, though the oracle reads no estimates: its LLM passes then have
        the learned scheduler's shapes and share its compiled graphs (`CompiledPass.head`). Without
        a head they were graphs of their own, and their warm-up took 180 s of the quick suite's
        greedy batch-1 table (quick-r35)."""
        return self._learned_head(device)

    def predict(self, hidden: list[torch.Tensor | None], texts: list[list[int]] | None = None) -> np.ndarray:
        if texts is None:
            raise ValueError("the oracle routes on the rows' texts: pass texts= to plan")
        f = np.zeros((len(texts), self.num_ssms, len(self.depths)))
        for b, text in enumerate(texts):
            runs = self._runs(text)
            f[b] = np.minimum(runs[:, len(text) - 1, None], self.depths)
        return f

    def _runs(self, text: list[int]) -> np.ndarray:
        """Each SSM's runs of agreement with the greedy output that continues `text`; a text no
        known output continues is a new prompt."""
        for output, runs in (self._last, *self.known.values()):
            if len(output) > len(text) and output[: len(text)] == text:
                self._last = (output, runs)
                return runs
        return self._learn(text)

    @torch.no_grad()
    def _learn(self, prompt: list[int]) -> np.ndarray:
        """Generate the prompt's greedy output (LOOKAHEAD tokens, or to the context's end) and its
        `agreement_runs`."""
        device = self.llm.device
        ids = torch.tensor([prompt], device=device)
        new = min(LOOKAHEAD, (context_length(self.llm) or len(prompt) + LOOKAHEAD) - len(prompt))
        output = self.llm.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new
        )
        output = output[0].tolist()
        runs = agreement_runs(self.ssms, torch.tensor(output, device=device))
        note_setup()  # a step that paid for this measured the lookahead, not its decoding
        self.known[tuple(prompt)] = self._last = (output, runs)
        return runs


@torch.no_grad()
def agreement_runs(ssms: list[PreTrainedModel], reference: torch.Tensor) -> np.ndarray:
    """[S, L + 1]: per SSM i and position p of `reference` [L] (a text the LLM generated
    greedily), the consecutive positions from p on where SSM i's argmax after reference[: q + 1]
    is reference[q + 1]: the true match length of SSM i's argmax chain drafted after
    reference[: p + 1], before any cap on the chain's length (one teacher-forced pass per SSM;
    0 at the last position and at L). Shared by the oracle and the suite's pool diversity
    (decoder/bench/diversity.py)."""
    runs = np.zeros((len(ssms), len(reference) + 1), dtype=np.int64)
    for i, ssm in enumerate(ssms):
        argmax = ssm(reference[None]).logits[0].float().argmax(-1)  # [L]: predicts token p + 1
        agrees = (argmax[:-1] == reference[1:]).cpu().numpy()  # [L - 1]: position p -> p + 1
        runs[i, : len(agrees)] = run_lengths(agrees)
    return runs
