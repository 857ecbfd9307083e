"""The learned scheduler's decision rule fed the TRUE match lengths (ALGORITHMS.md section 5): an
oracle that bounds what a perfect predictor would reach with the same cost model. It knows the
LLM's greedy output in advance; the time it spends finding the true lengths is reported as
`untimed_seconds`, which an evaluation leaves out of its time."""

from __future__ import annotations

import time

import torch
from transformers import PreTrainedModel

from specboost.speculator.beam_search import beam_match_lengths
from specboost.speculator.cost_model import CostModel
from specboost.speculator.predictor import MatchLengthPredictor
from specboost.speculator.scheduler import LearnedScheduler
from specboost.speculator.speculation import DraftRequest


class OracleScheduler(LearnedScheduler):
    """The learned scheduler's rule on the true match lengths of every configuration, measured
    against the LLM's greedy output (`references`: prompt + output token lists)."""

    def __init__(
        self,
        ssms: list[PreTrainedModel],
        predictor: MatchLengthPredictor,
        cost_model: CostModel,
        references: list[list[int]],
    ) -> None:
        super().__init__(ssms, predictor, cost_model, calibration=None)
        self.models = ssms
        self.references = references
        self.wants_hidden = False

    def reset(self, seed: int | None) -> None:
        super().reset(seed)
        self.untimed_seconds = 0.0
        self.reference: list[int] | None = None  # the reference output of the prompt being decoded

    def choose(self, request: DraftRequest) -> list[tuple[int, int] | None]:
        start = time.perf_counter()
        verified, c = request.verified, self.predictor.config
        if self.reference is None:
            matches = [r for r in self.references if r[: len(verified)] == verified]
            if not matches:
                raise ValueError("the oracle has no reference output for this prompt")
            self.reference = matches[0]
        depth = max(c.depths)
        continuation = self.reference[len(verified) : len(verified) + depth]
        reference = torch.tensor([continuation + [-1] * (depth - len(continuation))])
        true = torch.stack(
            [
                torch.cat([beam_match_lengths(m, [verified], reference, b, c.depths, 0)[0] for b in c.widths])
                for m in self.models
            ]
        ).float()  # [S, widths * depths], the predictor's order
        chosen = [self.options[o] for o in self.best(true, request.max_depth)]
        self.untimed_seconds += time.perf_counter() - start
        return chosen

    def report(self) -> dict:
        return super().report() | {"strategy": "oracle", "untimed_seconds": self.untimed_seconds}
