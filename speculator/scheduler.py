"""Learned speculative scheduler (ALGORITHMS.md section 5): per step, the speculation
configuration of every SSM, chosen from the LLM's hidden state and the measured hardware costs.

Each SSM either sits the step out or runs beam search of a (width b, depth d) from the
predictor's grid. A joint choice c = (c_1..c_k) is scored as

    score(c) = expected tokens / expected time
             = (1 + max_i f_i(c_i | h)) / (L_verify(1 + sum_i b_i d_i) + sum_i L_speculate_i(c_i))

- f_i(c_i | h): the predictor's expected match length of SSM i's tree, given h (0 for "sits out"),
  times SSM i's online correction at depth d_i (`OnlineCalibration`, section 5.1); the merged
  tree's match is at least the best SSM's, so max_i f_i is the estimate (a lower bound); the 1 is
  the token the LLM adds every step;
- L_verify of the merged tree's size (an upper bound: merging shares prefixes) and the SSMs'
  speculation times, which add up when the SSMs draft one after another; a pool stacked into one
  model drafts every SSM in the same passes, so it costs the slowest launched SSM's time times the
  profile's `pool_factor` (one stacked step over one SSM's step) instead.
"No SSM" scores 1 / L_verify(1): plain decoding, so the scheduler never speculates where it
expects to lose. The verify and drafting seconds of every joint choice are precomputed once, apart,
and scored as v x verify + g x drafting, v and g being the measured over the profiled time of the
recent steps' verification and drafting (`CostCorrection`, section 5.2): a profile taken on a
quiet machine does not mislead on a busy one. Per step the work is one MLP forward, one product
with the [SSM, grid] correction, an argmax over at most `max_joint_choices` choices and, after the
step, one multiply-add over their [C] costs. Pools too large to enumerate choose per SSM (each
SSM's best score alone), as SpecInfer states the rule.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
from transformers import PreTrainedModel

from specboost.speculator.cost_model import CostModel
from specboost.speculator.drafter import PoolDrafter
from specboost.speculator.majority import count_per_ssm
from specboost.speculator.prediction_spread import PredictionSpread
from specboost.speculator.predictor import MatchLengthPredictor
from specboost.speculator.shapes import BeamShape
from specboost.speculator.speculation import DraftRequest, StepFeedback
from specboost.speculator.tree import DraftKind, TokenTree, merge_trees

SITS_OUT = None
SCALE_RANGE = (0.1, 2.0)  # a correction beyond it says more about a few odd steps than the predictor
IDLE_DECAY = 0.95  # per step, of evidence not renewed (an SSM that sat out): half-life ~13.5 steps
DEPTH_PRIOR = 2.0  # predicted tokens of pseudo-evidence at its SSM's scale behind each depth's scale
# Measured over profiled seconds beyond it says the profile is of another machine: profile again.
COST_RANGE = (0.25, 4.0)


class Draft(NamedTuple):
    """One draft's evidence for `OnlineCalibration.observe`."""

    ssm: int
    predicted: Sequence[float]  # [D] f of its width at every grid depth
    d_index: int  # the grid depth it drafted (an index into the depths)
    matched: float  # its accepted nodes
    cap: float  # the tokens its row still wanted


class _Choice(NamedTuple):
    """The last predicted choice, kept for `observe`."""

    options: list[int]  # option index per SSM (0: sits out)
    match: torch.Tensor  # [S, grid] the predictor's raw estimates
    max_depth: int
    profiled: tuple[float, float] | None = None  # its (verify, drafting) seconds as profiled (5.2)


class OnlineCalibration:
    """The predictor's estimates corrected per SSM and per depth by what the LLM accepted
    (ALGORITHMS.md section 5.1): a predictor trained on other text, or an SSM that is bad on this
    workload (or swapped for a bad one), is found out by its own drafts, not averaged with the pool.

    Evidence, as decayed sums A (accepted) and P (predicted), from every step's launched SSMs:
    - per SSM i: its own match m_i (the accepted nodes its draft passes through) against f_i of
      its chosen (b_i, d_i), clipped to the tokens still wanted;
    - per SSM i and depth d <= min(d_i, tokens wanted): min(m_i, d), what the first d levels of
      its draft matched, against f_i(b_i, d): one draft also measures every shallower depth.
    Scales: s_i = (A_i + 1) / (P_i + 1), a prior of one pseudo-step at scale 1 that never decays,
    and s_id = (A_id + k s_i) / (P_id + k) with k = DEPTH_PRIOR, shrunk toward s_i (a depth never
    measured takes s_i), both clipped to SCALE_RANGE. Evidence renewed in a step decays by
    `momentum`; evidence not renewed (an SSM that sat out, depths deeper than its draft) by
    IDLE_DECAY, so a discarded SSM's scale drifts back to the prior and it is tried again later.

    The sums are [S][D + 1] Python floats: at batch 1 every drafting step reads the scales and adds
    one draft's evidence, right after the LLM's pass, where each numpy call on arrays this small
    costs 10-20 us (numpy's code and data out of the CPU's caches; ALGORITHMS.md 5.3, "Cost of
    deciding"), and a batch's drafts are added the same way; the learned scheduler gets one copy of
    the [S, grid] scales on the predictor's device per step.
    """

    def __init__(
        self,
        num_ssms: int,
        widths: int,
        depths: tuple[int, ...],
        momentum: float,
        device: torch.device,
        slopes: bool = False,
    ) -> None:
        """`slopes`: also keep the regression sums behind `lines` (the routed scheduler's; the beam
        scheduler scales by s_id alone and would only pay for them)."""
        self.widths, self.momentum, self.device = widths, momentum, device
        self.depths = np.asarray(depths, dtype=np.float64)  # [D]
        self._grid_depth = np.tile(np.arange(len(depths)), widths)  # depth index of each grid entry
        # Column -1 holds the per-SSM sums A_i, P_i; columns 0..D-1 the per-depth A_id, P_id.
        self.accepted = [[0.0] * (len(depths) + 1) for _ in range(num_ssms)]  # [S][D + 1]
        self.predicted = [[0.0] * (len(depths) + 1) for _ in range(num_ssms)]  # [S][D + 1]
        self._depth_list = self.depths.tolist()
        self.spread = PredictionSpread(num_ssms, len(depths)) if slopes else None  # 5.1, "Slopes"
        self._grid: torch.Tensor | None = None
        self._depth: list[list[float]] | None = None
        self._lines: tuple[list[list[float]], list[list[float]]] | None = None

    @property
    def grid(self) -> torch.Tensor:
        """`grid_scales()`, computed once per update, when first asked for."""
        if self._grid is None:
            self._grid = self.grid_scales()
        return self._grid

    @property
    def depth(self) -> list[list[float]]:
        """s_id [S][D]: each depth's own ratio, shrunk toward its SSM's s_i; computed once per
        update, when first asked for (do not modify). Plain Python: the routed scheduler reads it
        every drafting step, where a few dozen floats cost less than numpy's calls on them
        (`ChainRouter._choose_one`)."""
        if self._depth is None:
            rows = zip(self.accepted, self.predicted, self.ssm_scales(), strict=True)
            self._depth = [
                [_scale(a, p, s, DEPTH_PRIOR) for a, p in zip(aa[:-1], pp[:-1], strict=True)]
                for aa, pp, s in rows
            ]
        return self._depth

    @property
    def lines(self) -> tuple[list[list[float]], list[list[float]]]:
        """(slopes b_id, offsets c_id) [S][D]: the corrected estimate of a raw f is b_id f + c_id,
        the scale s_id made a line by the estimates' measured spread (`PredictionSpread`); computed
        once per update, when first asked for (do not modify). The routed scheduler scores these;
        the beam scheduler scales its grid by s_id (`grid`)."""
        if self.spread is None:
            raise ValueError("this correction keeps no slopes: build it with slopes=True")
        if self._lines is None:
            self._lines = self.spread.lines(self.depth)
        return self._lines

    def ssm_scales(self) -> list[float]:
        """s_i [S]: accepted / predicted match of each SSM's drafts, with the prior."""
        rows = zip(self.accepted, self.predicted, strict=True)
        return [_scale(aa[-1], pp[-1], 1.0, 1.0) for aa, pp in rows]

    def depth_scales(self) -> np.ndarray:
        """`depth` [S, D] as an array."""
        return np.array(self.depth)

    def grid_scales(self) -> torch.Tensor:
        """s_id per predictor output [S, widths * depths] (b major), on the predictor's device."""
        grid = self.depth_scales()[:, self._grid_depth].astype(np.float32)
        return torch.from_numpy(grid).to(self.device)

    def update(self, choice: _Choice, matched: list[int]) -> None:
        """Add one step's evidence: `matched[i]`, the accepted nodes of SSM i's draft."""
        option = np.asarray(choice.options)  # [S]
        launched = np.flatnonzero(option > 0)
        # The chosen (b_i, d_i) as indices into widths and depths.
        b_index, d_index = np.divmod(option[launched] - 1, len(self.depths))
        grid = choice.match.detach().float().cpu().numpy().reshape(len(option), self.widths, -1)
        cap = float(choice.max_depth)
        self.observe(
            [
                Draft(i, grid[i, b].tolist(), d, float(matched[i]), cap)
                for i, b, d in zip(launched.tolist(), b_index.tolist(), d_index.tolist(), strict=True)
            ]
        )

    def observe(self, drafts: Sequence[Draft]) -> None:
        """Add one step's evidence of its drafts (several may be of one SSM: the rows of a batch,
        section 5.3). Every SSM and depth some draft renews decays once, by `momentum`, and the
        rest by IDLE_DECAY; then the renewing drafts' evidence is added. Plain Python: numpy's
        per-call cost dominates arrays this small, right after the LLM's pass (a batch of 8 rows
        had taken 0.27 ms a step in numpy on the tiny fixture, about as long as deciding it)."""
        self._decay(IDLE_DECAY)
        renew, depths = self.momentum / IDLE_DECAY, self._depth_list
        columns = len(depths) + 1  # the depths, then the SSM's own match
        added: dict[int, tuple[list[float], list[float], list[bool]]] = {}  # per SSM: A, P, renewed
        evidence: dict[tuple[int, int], list[tuple[float, float]]] = {}  # per (SSM, depth): (f, y)
        for ssm, predicted, d_index, matched, cap in drafts:
            if ssm not in added:
                added[ssm] = ([0.0] * columns, [0.0] * columns, [False] * columns)
            accepted, estimated, renewed = added[ssm]
            reach = min(depths[d_index], cap)
            for d, depth in enumerate(depths):
                if depth <= reach:
                    f, y = min(predicted[d], cap), min(matched, depth)
                    accepted[d], estimated[d], renewed[d] = accepted[d] + y, estimated[d] + f, True
                    evidence.setdefault((ssm, d), []).append((f, y))
            accepted[-1] += matched
            estimated[-1] += min(predicted[d_index], cap)
            renewed[-1] = True
        for ssm, (accepted, estimated, renewed) in added.items():
            sums_a, sums_p = self.accepted[ssm], self.predicted[ssm]  # updated in place
            for c in (c for c, on in enumerate(renewed) if on):
                sums_a[c] = sums_a[c] * renew + accepted[c]
                sums_p[c] = sums_p[c] * renew + estimated[c]
        if self.spread is not None:
            self.spread.observe(evidence)

    def idle(self, steps: int = 1) -> None:
        """`steps` steps that drafted nothing: all evidence ages by IDLE_DECAY per step, so that
        scales a stretch of bad drafts pulled down drift back to the prior while nothing drafts, and
        drafting is tried again (without it, a router that declined after bad text would never draft
        again)."""
        self._decay(IDLE_DECAY**steps)

    def _decay(self, factor: float) -> None:
        """All evidence times `factor`."""
        self.accepted = [[x * factor for x in row] for row in self.accepted]
        self.predicted = [[x * factor for x in row] for row in self.predicted]
        self._grid = self._depth = self._lines = None


def check_pool_size(predictor: MatchLengthPredictor, cost_model: CostModel, num_ssms: int) -> None:
    """Refuse a predictor or profile made for another pool than the `num_ssms` SSMs given."""
    if predictor.config.num_ssms != num_ssms or cost_model.num_ssms != num_ssms:
        raise ValueError(
            f"the predictor covers {predictor.config.num_ssms} SSMs and the cost model "
            f"{cost_model.num_ssms}, but the pool has {num_ssms}: train and profile for this pool"
        )


def _scale(accepted: float, predicted: float, prior: float, weight: float) -> float:
    """(accepted + weight x prior) / (predicted + weight): a ratio with `weight` predicted tokens of
    pseudo-evidence at scale `prior`, clipped to SCALE_RANGE."""
    return min(max((accepted + weight * prior) / (predicted + weight), SCALE_RANGE[0]), SCALE_RANGE[1])


class CostCorrection:
    """The hardware profile's costs corrected by measured step times (ALGORITHMS.md section 5.2).

    One factor on every cost would not change the choice (the score is tokens / seconds), but a
    machine busy elsewhere slows the LLM and the SSMs by different amounts, which does. So the
    verification and the drafting of a step are corrected apart: decayed sums of the measured
    seconds M and of what the profile predicted for the same steps P, and
    v = (M_v + p_v) / (P_v + p_v), g = (M_g + p_g) / (P_g + p_g), clipped to COST_RANGE. The priors
    are one pseudo-step at factor 1 that never decays: p_v = L_verify(1), a plain step, and p_g =
    the cheapest profiled draft. A step's sums decay by `momentum` before its seconds are added; a
    step that drafted nothing is verify evidence only, and its drafting sums decay by IDLE_DECAY,
    so that g drifts back to 1 while the scheduler decodes plainly and drafting is tried again.
    Four host floats: plain Python arithmetic, a few us per step.
    """

    def __init__(self, momentum: float, verify_prior: float, draft_prior: float) -> None:
        self.momentum = momentum
        self.prior = (verify_prior, draft_prior)  # p_v, p_g in seconds
        self.measured = [0.0, 0.0]  # M_v, M_g: decayed sums of measured seconds
        self.profiled = [0.0, 0.0]  # P_v, P_g: the same steps' seconds as profiled
        self.factors = (1.0, 1.0)  # v, g

    def update(self, measured: tuple[float, float], profiled: tuple[float, float]) -> tuple[float, float]:
        """Add one step's (verify, drafting) seconds, measured and as profiled; returns (v, g).
        A step's measured seconds count at most COST_RANGE times its profiled ones: a step that
        compiled a graph (a process's first steps) measures seconds for milliseconds, and one such
        step had held a factor at its bound for a hundred steps after."""
        mu, (sums_m, sums_p) = self.momentum, (self.measured, self.profiled)
        low, high = COST_RANGE
        verify, drafting = (min(max(m, low * p), high * p) for m, p in zip(measured, profiled, strict=True))
        sums_m[0], sums_p[0] = mu * sums_m[0] + verify, mu * sums_p[0] + profiled[0]
        if profiled[1] <= 0:  # drafted nothing: no drafting evidence, the old fades
            return self.idle()
        sums_m[1], sums_p[1] = mu * sums_m[1] + drafting, mu * sums_p[1] + profiled[1]
        return self._refresh()

    def idle(self, parts: tuple[int, ...] = (1,), steps: int = 1) -> tuple[float, float]:
        """`steps` steps that drafted nothing: the drafting evidence fades (IDLE_DECAY per step) as
        in `update`; with `parts=(0, 1)` the verify evidence too (a caller that corrects plain steps
        apart)."""
        for part in parts:
            self.measured[part] *= IDLE_DECAY**steps
            self.profiled[part] *= IDLE_DECAY**steps
        return self._refresh()

    def _refresh(self) -> tuple[float, float]:
        low, high = COST_RANGE
        self.factors = tuple(
            min(max((m + p) / (q + p), low), high)
            for m, q, p in zip(self.measured, self.profiled, self.prior, strict=True)
        )
        return self.factors


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
        cost_correction: float | None = 0.9,
    ) -> None:
        check_pool_size(predictor, cost_model, len(ssms))
        c = predictor.config
        self.drafter = PoolDrafter(ssms)
        self.num_ssms = len(ssms)
        self.predictor = predictor.to(ssms[0].device)
        self._predict = self.predictor.compiled()
        self.fallback = fallback or BeamShape(1, 4)
        # Options per SSM: SITS_OUT, then the grid in the predictor's output order (b major).
        self.options: list[tuple[int, int] | None] = [SITS_OUT] + [(b, d) for b in c.widths for d in c.depths]
        self.joint = (len(self.options) ** self.num_ssms) <= max_joint_choices
        self._precompute_costs(cost_model)
        for name, momentum in (("calibration", calibration), ("cost_correction", cost_correction)):
            if momentum is not None and not 0 <= momentum < 1:
                raise ValueError(f"{name} is a momentum in [0, 1) (or None: off), got {momentum}")
        self._momenta = (calibration, cost_correction)
        self._cost_priors = (  # section 5.2: a plain step's verification and the cheapest draft
            max(float(cost_model.verify_time(1)), 1e-9),
            max(float(self._spec_host[:, 1:].min()), 1e-9),
        )
        self.forget()
        self.reset(None)

    def forget(self) -> None:
        """Start the online corrections (sections 5.1, 5.2) afresh. They persist across `generate`
        calls, as they measure the predictor, the SSMs and this machine's load on the workload, not
        on one sequence; but a warm-up generation (`SpeculativeDecoder.warmup`) is no workload: its
        prompt is made up and its steps compile graphs, and what it taught would mislead."""
        calibration, cost_correction = self._momenta
        c = self.predictor.config
        self.calibration = (
            None
            if calibration is None
            else OnlineCalibration(self.num_ssms, len(c.widths), c.depths, calibration, self._f.device)
        )
        self.costs = None if cost_correction is None else CostCorrection(cost_correction, *self._cost_priors)
        torch.add(self._draft_cost, self._verify_cost, out=self.seconds)  # factors v = g = 1

    def _precompute_costs(self, cost: CostModel) -> None:
        """Time of every joint choice (or, per SSM, of every option alone), its verify and drafting
        seconds kept apart for the online correction (section 5.2)."""
        spec = torch.tensor(
            [
                [0.0] + [cost.speculate_time(i, b, d) for b, d in self.options[1:]]
                for i in range(self.num_ssms)
            ],
            dtype=torch.float64,
        )  # [S, O]
        size = torch.tensor([0] + [b * d for b, d in self.options[1:]], dtype=torch.float64)  # [O]
        # A stacked pool drafts every SSM in the same passes: its slowest SSM's time, scaled.
        factor = cost.pool_factor if self.drafter.stacked else None
        if self.joint:
            choices = torch.tensor(list(itertools.product(range(len(self.options)), repeat=self.num_ssms)))
            tokens = 1 + size[choices].sum(-1)
            drafting = spec.gather(1, choices.T)  # [S, C]
            drafting = drafting.sum(0) if factor is None else drafting.amax(0) * factor  # [C]
            verify = torch.as_tensor(cost.verify_time(tokens.numpy()))  # [C]
            self.choices = choices  # [C, S] option index per SSM
        else:
            verify = torch.as_tensor(cost.verify_time((1 + size).numpy()))[None]  # [1, O]
            drafting = spec  # [S, O]
        device = self.predictor.input_mean.device
        self.seconds = (verify + drafting).float().to(device)  # [C] or [S, O]: what `best` divides by
        self._verify_cost = verify.float().to(device)
        self._draft_cost = drafting.float().to(device)
        # On the host, for the profiled seconds of each step's choice (section 5.2): per joint choice
        # a lookup, per SSM computed from the table.
        self._spec_host, self._size_host, self._pool_factor = spec.numpy(), size.numpy(), factor
        self._verify_time = cost.verify_time
        if self.joint:
            self._profiled_host = torch.stack([verify, drafting], 1).numpy()  # [C, 2]: verify, drafting
        if self.joint:
            self.choices = self.choices.to(device)
            self._choices_t = self.choices.T.contiguous()  # [S, C]
        self._f = torch.zeros(self.num_ssms, len(self.options), device=device)
        self._max_option_depth = max(d for _, d in self.options[1:])

    # Speculator protocol -------------------------------------------------------------------------
    def tree_kind(self, do_sample: bool, seeded: bool = False) -> DraftKind:
        return DraftKind.BEAM

    def reset(self, seed: int | None) -> None:
        self.drafter.reset()
        self.history: list[list[tuple[int, int] | None]] = []
        self.scale_history: list[list[float]] = []  # per observed step: s_i per SSM
        self.cost_history: list[list[float]] = []  # per observed step: [v, g] (section 5.2)
        self._last: _Choice | None = None  # the last predicted choice, for `observe`
        self._drafting: float | None = None  # measured drafting seconds of the last `propose`
        self.decision_seconds = 0.0
        self.step_seconds = 0.0
        self._last_step_start: float | None = None

    @property
    def ssm_scales(self) -> list[float]:
        """Each SSM's online correction s_i (section 5.1; all 1 when calibration is off)."""
        if self.calibration is None:
            return [1.0] * self.num_ssms
        return self.calibration.ssm_scales()

    @property
    def cost_factors(self) -> tuple[float, float]:
        """(v, g): measured over profiled verify and drafting time (section 5.2; 1 when off)."""
        return (1.0, 1.0) if self.costs is None else self.costs.factors

    def choose(self, request: DraftRequest) -> list[tuple[int, int] | None]:
        """(b, d) or SITS_OUT per SSM for the next step."""
        self._last, self._drafting = None, None
        if request.hidden is None:  # no LLM state yet (one-token prompt): the fixed fallback for all
            return [(self.fallback.width, self.fallback.depth)] * self.num_ssms
        with torch.inference_mode():
            match = self._predict(request.hidden)  # [S, grid]
            scale = 1.0 if self.calibration is None else self.calibration.grid
            choice = self.best(match, request.max_depth, scale)
        profiled = None if self.costs is None else self.profiled_seconds(choice)
        self._last = _Choice(choice, match, request.max_depth, profiled)
        return [self.options[o] for o in choice]

    def profiled_seconds(self, options: list[int]) -> tuple[float, float]:
        """The profile's (verify, drafting) seconds of a step launching `options` (option index per
        SSM), as the joint choice's are precomputed (the per-SSM path scores each SSM alone, but the
        step verifies and drafts what they launched together)."""
        if self.joint:  # the index of the choice in itertools.product's order: SSM 0 most significant
            index = 0
            for option in options:
                index = index * len(self.options) + option
            verify, drafting = self._profiled_host[index].tolist()
            return verify, drafting
        option = np.asarray(options)  # [S]
        spec = self._spec_host[np.arange(len(option)), option]  # [S]
        drafting = spec.sum() if self._pool_factor is None else spec.max() * self._pool_factor
        return float(self._verify_time(1 + self._size_host[option].sum())), float(drafting)

    def best(self, match: torch.Tensor, max_depth: int, scale: torch.Tensor | float = 1.0) -> list[int]:
        """Option indices (0: sits out) of the choice with the most expected tokens per second,
        given expected match lengths [S, grid] in the predictor's output order and their
        corrections `scale` ([S, grid] or one number); kept lean: it runs every step."""
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
        start = time.perf_counter()
        drafts = self.drafter.draft(request.verified, shapes, request.probs, request.max_depth)
        self._drafting = time.perf_counter() - start  # the measured drafting time, for section 5.2
        trees = [tree for tree in drafts if tree]
        if not trees:
            return TokenTree.root_only(request.verified[-1], DraftKind.BEAM)
        return trees[0] if len(trees) == 1 else merge_trees(trees)

    def observe(self, feedback: StepFeedback) -> None:
        """Correct the predictor per SSM with what the LLM accepted of each SSM's draft (section
        5.1); greedy or sampled, the accepted path is what the SSM's draft earned. Correct the costs
        with the step's measured verify and drafting seconds (section 5.2); a step not drafted by
        `propose` (a caller of `choose` alone) has no measured drafting and corrects no cost."""
        if self._last is None or (self.calibration is None and self.costs is None):
            return
        start = time.perf_counter()
        if self.calibration is not None:
            matched = count_per_ssm(feedback.tree, feedback.accepted)
            self.calibration.update(self._last, [matched[i] for i in range(self.num_ssms)])
            self.scale_history.append(self.ssm_scales)
        if self.costs is not None:
            if self._drafting is not None:
                v, g = self.costs.update((feedback.verify_seconds, self._drafting), self._last.profiled)
                # seconds = v x verify + g x drafting, fused on the predictor's device: [C] or [S, O].
                torch.mul(self._draft_cost, g, out=self.seconds).add_(self._verify_cost, alpha=v)
                self._drafting = None
            self.cost_history.append(list(self.costs.factors))
        self.decision_seconds += time.perf_counter() - start  # the scheduler's own time, as `choose`

    def report(self) -> dict:
        """Choices per step, the per-SSM and cost corrections and the scheduler's own share of the
        decoding time."""
        steps = len(self.history)
        launched = [sum(option is not SITS_OUT for option in step) for step in self.history]
        return {
            "strategy": "learned",
            "choices": [[None if o is None else list(o) for o in step] for step in self.history],
            "mean_ssms_launched": sum(launched) / steps if steps else 0.0,
            "calibration_scale": self.scale_history,  # per observed step: s_i per SSM
            "cost_factors": self.cost_history,  # per observed step: [v, g] (verify, drafting)
            "decision_seconds": self.decision_seconds,
            # Time between the first and the last propose call: all steps but the last.
            "overhead_fraction": self.decision_seconds / self.step_seconds if self.step_seconds else 0.0,
        }
