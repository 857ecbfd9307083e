"""Learned speculative scheduler (ALGORITHMS.md section 5): per step, the speculation
configuration of every SSM, chosen from the LLM's hidden state and the measured hardware costs.

Each SSM either sits the step out or runs beam search of a (width b, depth d) from the
predictor's grid. A joint choice c = (c_1..c_k) is scored as

    score(c) = expected tokens / expected time
             = (1 + max_i f_i(c_i | h)) / (L_verify(1 + sum_i b_i d_i) + sum_i L_speculate_i(c_i))

- f_i(c_i | h): the predictor's expected match length of SSM i's tree, given h (0 for "sits out");
  the merged tree's match is at least the best SSM's, so max_i f_i is the estimate (a lower bound);
  the 1 is the token the LLM adds every step;
- L_verify of the merged tree's size (an upper bound: merging shares prefixes) and the SSMs'
  speculation times, which add up when the SSMs draft one after another; a pool stacked into one
  model drafts every SSM in the same passes, so it costs the slowest launched SSM's time times the
  profile's `pool_factor` (one stacked step over one SSM's step) instead.
"No SSM" scores 1 / L_verify(1): plain decoding, so the scheduler never speculates where it
expects to lose. The cost of every joint choice is precomputed once; per step the work is one
MLP forward and an argmax over at most `max_joint_choices` choices. Pools too large to enumerate
choose per SSM (each SSM's best score alone), as SpecInfer states the rule.
"""

from __future__ import annotations

import itertools
import time

import torch
from transformers import PreTrainedModel

from specboost.speculator.cost_model import CostModel
from specboost.speculator.drafter import PoolDrafter
from specboost.speculator.predictor import MatchLengthPredictor
from specboost.speculator.shapes import BeamShape
from specboost.speculator.speculation import DraftRequest, StepFeedback
from specboost.speculator.tree import DraftKind, TokenTree, merge_trees

SITS_OUT = None


class LearnedScheduler:
    """A Speculator: predicted match lengths + measured costs -> per-step (b, d) per SSM."""

    wants_hidden = True

    def __init__(
        self,
        ssms: list[PreTrainedModel],
        predictor: MatchLengthPredictor,
        cost_model: CostModel,
        fallback: BeamShape | None = None,
        max_joint_choices: int = 1 << 16,
        calibration: float | None = 0.9,
    ) -> None:
        c = predictor.config
        if c.num_ssms != len(ssms) or cost_model.num_ssms != len(ssms):
            raise ValueError(
                f"the predictor covers {c.num_ssms} SSMs and the cost model {cost_model.num_ssms}, "
                f"but the pool has {len(ssms)}: train and profile for this pool"
            )
        self.drafter = PoolDrafter(ssms)
        self.num_ssms = len(ssms)
        self.predictor = predictor.to(ssms[0].device)
        self._predict = self.predictor.compiled()
        self.fallback = fallback or BeamShape(1, 4)
        # Options per SSM: SITS_OUT, then the grid in the predictor's output order (b major).
        self.options: list[tuple[int, int] | None] = [SITS_OUT] + [(b, d) for b in c.widths for d in c.depths]
        self.joint = (len(self.options) ** self.num_ssms) <= max_joint_choices
        self._precompute_costs(cost_model)
        if calibration is not None and not 0 <= calibration < 1:
            raise ValueError(f"calibration is a momentum in [0, 1) (or None: off), got {calibration}")
        self.calibration = calibration
        # Running sums of accepted and predicted match lengths (one pseudo-step of prior: scale 1).
        self._accepted_sum, self._predicted_sum = 1.0, 1.0
        self.reset(None)

    def _precompute_costs(self, cost: CostModel) -> None:
        """Time of every joint choice (or, per SSM, of every option alone)."""
        spec = torch.tensor(
            [
                [0.0] + [cost.speculate_time(i, b, d) for b, d in self.options[1:]]
                for i in range(self.num_ssms)
            ],
            dtype=torch.float64,
        )  # [S, O]
        size = torch.tensor([0] + [b * d for b, d in self.options[1:]], dtype=torch.float64)  # [O]
        if self.joint:
            choices = torch.tensor(list(itertools.product(range(len(self.options)), repeat=self.num_ssms)))
            tokens = 1 + size[choices].sum(-1)
            drafting = spec.gather(1, choices.T)  # [S, C]
            # A stacked pool drafts every SSM in the same passes: its slowest SSM's time, scaled.
            factor = cost.pool_factor if self.drafter.stacked else None
            drafting = drafting.sum(0) if factor is None else drafting.amax(0) * factor
            seconds = torch.as_tensor(cost.verify_time(tokens.numpy())) + drafting
            self.choices = choices  # [C, S] option index per SSM
        else:
            seconds = torch.as_tensor(cost.verify_time((1 + size).numpy()))[None] + spec  # [S, O]
        self.seconds = seconds.float()
        device = self.predictor.input_mean.device
        self.seconds = self.seconds.to(device)
        if self.joint:
            self.choices = self.choices.to(device)
            self._choices_t = self.choices.T.contiguous()  # [S, C]
        self._f = torch.zeros(self.num_ssms, len(self.options), device=device)
        self._max_option_depth = max(d for _, d in self.options[1:])

    # Speculator protocol -------------------------------------------------------------------------
    def tree_kind(self, do_sample: bool) -> DraftKind:
        return DraftKind.BEAM

    def reset(self, seed: int | None) -> None:
        self.drafter.reset()
        self.history: list[list[tuple[int, int] | None]] = []
        self.scales: list[float] = []
        self._predicted: float | None = None  # predicted match of the last launched choice
        self.decision_seconds = 0.0
        self.step_seconds = 0.0
        self._last_step_start: float | None = None

    @property
    def scale(self) -> float:
        """Online calibration: accepted / predicted match lengths over recent steps. A predictor
        trained on other text over- or under-estimates everywhere alike; scaling its predictions
        by what the LLM actually accepts corrects that within a few steps."""
        if self.calibration is None:
            return 1.0
        return min(2.0, max(0.1, self._accepted_sum / self._predicted_sum))

    def choose(self, request: DraftRequest) -> list[tuple[int, int] | None]:
        """(b, d) or SITS_OUT per SSM for the next step."""
        self._predicted = None
        if request.hidden is None:  # no LLM state yet (one-token prompt): the fixed fallback for all
            return [(self.fallback.width, self.fallback.depth)] * self.num_ssms
        with torch.inference_mode():
            match = self._predict(request.hidden)  # [S, grid]
            choice = self.best(match, request.max_depth, self.scale)
            launched = [match[i, o - 1] for i, o in enumerate(choice) if o > 0]
        self._predicted = min(float(max(launched)), request.max_depth) if launched else None
        return [self.options[o] for o in choice]

    def best(self, match: torch.Tensor, max_depth: int, scale: float = 1.0) -> list[int]:
        """Option indices (0: sits out) of the choice with the most expected tokens per second,
        given expected match lengths [S, grid] in the predictor's output order (kept lean: it runs
        every step)."""
        f = self._f
        torch.mul(match, scale, out=f[:, 1:])  # option 0 (sits out) stays 0
        if max_depth < self._max_option_depth:  # near the end: no match beyond the tokens wanted
            f[:, 1:].clamp_(max=max_depth)
        if self.joint:
            expected = f.gather(1, self._choices_t).amax(0).add_(1)  # [C]
            return self.choices[int(expected.div_(self.seconds).argmax())].tolist()
        return (f + 1).div_(self.seconds).argmax(1).tolist()

    def propose(self, request: DraftRequest) -> TokenTree:
        now = time.perf_counter()
        if self._last_step_start is not None:
            self.step_seconds += now - self._last_step_start
        self._last_step_start = now
        chosen = self.choose(request)
        self.decision_seconds += time.perf_counter() - now
        self.history.append(chosen)
        shapes = [None if option is SITS_OUT else BeamShape(*option) for option in chosen]
        trees = [
            tree
            for tree in self.drafter.draft(request.verified, shapes, request.probs, request.max_depth)
            if tree
        ]
        if not trees:
            return TokenTree.root_only(request.verified[-1], DraftKind.BEAM)
        return trees[0] if len(trees) == 1 else merge_trees(trees)

    def observe(self, feedback: StepFeedback) -> None:
        """Update the calibration with what the LLM accepted of a predicted draft. It persists
        across `generate` calls: it measures the predictor on this workload, not on one sequence."""
        if self.calibration is None or self._predicted is None:
            return
        momentum = self.calibration
        self._accepted_sum = momentum * self._accepted_sum + len(feedback.accepted)
        self._predicted_sum = momentum * self._predicted_sum + self._predicted
        self.scales.append(self.scale)

    def report(self) -> dict:
        """Choices per step and the scheduler's own share of the decoding time."""
        steps = len(self.history)
        launched = [sum(option is not SITS_OUT for option in step) for step in self.history]
        return {
            "strategy": "learned",
            "choices": [[None if o is None else list(o) for o in step] for step in self.history],
            "mean_ssms_launched": sum(launched) / steps if steps else 0.0,
            "calibration_scale": self.scales,
            "decision_seconds": self.decision_seconds,
            # Time between the first and the last propose call: all steps but the last.
            "overhead_fraction": self.decision_seconds / self.step_seconds if self.step_seconds else 0.0,
        }
