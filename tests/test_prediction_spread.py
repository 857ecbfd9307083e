"""The online correction's slopes (ALGORITHMS.md section 5.1, "Slopes"): the ratio scale made a
line by how the predictor's estimates and the accepted tokens vary together."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specboost.speculator.prediction_spread import SLOPE_MAX, SLOPE_PRIOR, PredictionSpread
from specboost.speculator.scheduler import Draft, OnlineCalibration


def observe_one(spread: PredictionSpread, ssm: int, predicted: list[float], accepted: list[float]) -> None:
    """One draft of SSM `ssm`, renewing the depths its lists reach."""
    spread.observe({(ssm, d): [(f, y)] for d, (f, y) in enumerate(zip(predicted, accepted, strict=True))})


def test_no_spread_measured_is_the_ratio_correction() -> None:
    spread = PredictionSpread(2, 3)
    assert spread.lines([[1.3, 0.7, 1.0], [0.5, 0.5, 2.0]]) == (
        [[1.3, 0.7, 1.0], [0.5, 0.5, 2.0]],
        [[0.0] * 3] * 2,
    )
    for _ in range(5):  # one estimate only: nothing to fit a slope on
        observe_one(spread, 0, [2.0], [3.0])
    (b, _, _), (c, _, _) = (row[0] for row in spread.lines([[1.5, 1.0, 1.0], [1.0] * 3]))
    assert (b, c) == (1.5, 0.0)


@settings(max_examples=40, deadline=None)
@given(
    slope=st.floats(0.0, SLOPE_MAX),
    offset=st.floats(-1.0, 2.0),
    scale=st.floats(0.1, 2.0),
    estimates=st.lists(st.floats(0.0, 16.0), min_size=3, max_size=60),
)
def test_the_line_goes_through_the_scaled_mean_with_the_measured_slope(
    slope, offset, scale, estimates
) -> None:
    """Accepted tokens on a line a + b f: the slope is the least-squares one shrunk toward the ratio
    scale by SLOPE_PRIOR, and the line passes through (f_bar, s f_bar)."""
    spread = PredictionSpread(1, 1)
    for f in estimates:
        observe_one(spread, 0, [f], [offset + slope * f])
    (b,), (c,) = (rows[0] for rows in spread.lines([[scale]]))
    w = np.array([0.98**k for k in range(len(estimates))][::-1])
    f = np.array(estimates)
    mean = (w * f).sum() / w.sum()
    spread_ff = (w * (f - mean) ** 2).sum()
    expected = (slope * spread_ff + SLOPE_PRIOR * scale) / (spread_ff + SLOPE_PRIOR)
    assert b == pytest.approx(min(expected, SLOPE_MAX), rel=1e-6, abs=1e-9)
    assert b * mean + c == pytest.approx(scale * mean, rel=1e-6, abs=1e-9)


def test_accepted_tokens_that_do_not_follow_the_estimates_flatten_the_line() -> None:
    rng = np.random.default_rng(0)
    spread = PredictionSpread(1, 1)
    for f in rng.uniform(0.5, 4.0, 200):
        observe_one(spread, 0, [float(f)], [float(rng.integers(2, 5))])
    (b,), (c,) = (rows[0] for rows in spread.lines([[1.2]]))
    assert b < 0.2 and c > 2.0  # nearly the mean, whatever the estimate


def test_a_batch_of_drafts_decays_each_renewed_entry_once() -> None:
    """Two drafts of SSM 0 in one step (a batch's rows) add up after one decay; SSM 1 and the depth
    neither draft reached keep their sums."""
    spread = PredictionSpread(2, 2)
    observe_one(spread, 0, [1.0, 2.0], [1.0, 2.0])
    observe_one(spread, 1, [1.0], [0.0])
    before = [[list(x) for x in row] for row in spread.sums]
    spread.observe({(0, 0): [(1.0, 1.0), (0.5, 0.0)], (0, 1): [(3.0, 2.0)]})  # the second reached depth 0
    assert spread.sums[1] == before[1]
    assert spread.sums[0][0] == pytest.approx(
        [0.98 * x + y for x, y in zip(before[0][0], [2.0, 1.5, 1.0, 1.25, 1.0], strict=True)]
    )
    assert spread.sums[0][1] == pytest.approx(
        [0.98 * x + y for x, y in zip(before[0][1], [1.0, 3.0, 2.0, 9.0, 6.0], strict=True)]
    )


def test_only_a_correction_built_with_slopes_keeps_them() -> None:
    """The beam scheduler's correction (ratio scales only) pays for no regression sums."""
    ratio_only = OnlineCalibration(1, 1, (1, 4), 0.9, torch.device("cpu"))
    ratio_only.observe([Draft(0, [1.0, 3.0], 1, 2.0, 8.0)])
    assert ratio_only.spread is None
    with pytest.raises(ValueError, match="slopes=True"):
        ratio_only.lines  # noqa: B018
