"""How far the predictor's estimates track what was accepted from one state to the next
(ALGORITHMS.md section 5.1, "Slopes"): a decayed least-squares slope of accepted on predicted,
per SSM and depth, that turns the online correction's scale into a line.

The ratio scale s_id (`OnlineCalibration`) corrects the level of the predictor's estimates, not
how they vary: where the predictor tells states apart, s_id x f is right; where it does not (a
predictor trained on greedy text routing sampled requests, whose hidden states it never saw:
measured correlation -0.10 between its estimates and the accepted tokens over 176 steps of the
tiny fixture's sampled pool at T = 0.8, against 0.90 for the greedy pool's on greedy requests),
the states it rates low accept as much as the others, and scaling them still declines there. So
the router scores the line through (f_bar, s_id f_bar) with slope b_id:

    estimate(f) = s_id f_bar + b_id (f - f_bar),   b_id = (C_fy + k s_id) / (C_ff + k)

f_bar the mean of the estimates, C_ff and C_fy the centred sums of squares and products of
(estimate f, accepted y) of SSM i's drafts at depth d, decayed by SLOPE_MOMENTUM per draft that
renews them (never while nothing drafts: plain steps say nothing of the predictor's spread), and
k = SLOPE_PRIOR tokens squared of pseudo-evidence at slope s_id. With no spread measured the line
is s_id f, the ratio correction itself; with a predictor that tells states apart, b_id is about
s_id; with one that does not, b_id goes to 0 and every state is scored at the measured mean.
Selecting drafts by their estimate (the router drafts where f is high) biases a ratio, not a
least-squares slope of y on f: the selection is on the regressor. b_id is clipped to
[0, SCALE_RANGE[1]]: a falling line is noise or a predictor worse than none, and the mean is then
the better estimate.
"""

from __future__ import annotations

SLOPE_MOMENTUM = 0.98  # per renewing draft: the slope's evidence spans about the last 50 drafts
SLOPE_PRIOR = 2.0  # tokens squared of pseudo-spread at the ratio scale's slope
SLOPE_MAX = 2.0  # as the ratio scale's upper clip (`scheduler.SCALE_RANGE`)
_SUMS = 5  # per SSM and depth: weight, sum f, sum y, sum f^2, sum f y


class PredictionSpread:
    """Decayed regression sums of accepted on predicted tokens, per SSM and depth (module doc).
    Plain Python lists: every drafting step adds its drafts' evidence right after the LLM's pass,
    where numpy's per-call cost dominates arrays this small."""

    def __init__(self, num_ssms: int, depths: int) -> None:
        self.sums = [[[0.0] * _SUMS for _ in range(depths)] for _ in range(num_ssms)]  # [S][D][5]

    def observe(self, evidence: dict[tuple[int, int], list[tuple[float, float]]]) -> None:
        """One step's drafts: per (SSM, depth) they renew, each draft's (estimate, accepted tokens).
        Every renewed entry decays once per step, however many drafts (rows of a batch) renew it."""
        for (ssm, depth), pairs in evidence.items():
            sums = self.sums[ssm][depth]
            w, sf, sy, sff, sfy = (x * SLOPE_MOMENTUM for x in sums)
            for f, y in pairs:
                w, sf, sy, sff, sfy = w + 1.0, sf + f, sy + y, sff + f * f, sfy + f * y
            sums[:] = (w, sf, sy, sff, sfy)

    def lines(self, scales: list[list[float]]) -> tuple[list[list[float]], list[list[float]]]:
        """(slopes b [S][D], offsets c [S][D]): the estimate of a raw f is b f + c, given the ratio
        scales s_id `scales` [S][D] (module doc)."""
        slopes, offsets = [], []
        for per_depth, row in zip(self.sums, scales, strict=True):
            b_row, c_row = [], []
            for (w, sf, sy, sff, sfy), s in zip(per_depth, row, strict=True):
                mean = sf / w if w > 0 else 0.0
                spread = max(sff - sf * mean, 0.0)  # C_ff
                product = sfy - sy * mean  # C_fy
                b = min(max((product + SLOPE_PRIOR * s) / (spread + SLOPE_PRIOR), 0.0), SLOPE_MAX)
                b_row.append(b)
                c_row.append((s - b) * mean)
            slopes.append(b_row)
            offsets.append(c_row)
        return slopes, offsets
