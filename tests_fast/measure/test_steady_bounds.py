"""Exact values of the steady lower bounds (speed.steady_lower_bounds): the weighted line of
log(speedup) against log2(tokens) over the shapes within FIT_OCTAVES, its lower z band, and the
shapes that keep their own bound. The fits are recomputed here by matrix algebra or by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from sage_qual.qualification.measure import speed

Z = speed.Z_95


def fitted(shapes: dict, key: str, z: float = Z) -> float:
    """The steady bound of one shape by weighted least squares in matrix form: weights 1/se**2 with
    se = log(high/low) / 2z, the intercept's variance scaled by the reduced chi-square when above 1,
    capped at the shape's upper bound; its own lower bound with fewer than three neighbours. (No
    interval here is narrow enough for speed's 0.1 % floor on se.)"""
    tokens0, low0, _, high0 = shapes[key]
    rows = [(math.log2(t) - math.log2(tokens0), math.log(m), math.log(h / lo) / (2 * z))
            for t, lo, m, h in shapes.values() if abs(math.log2(t) - math.log2(tokens0)) <= speed.FIT_OCTAVES]
    if len(rows) < 3:
        return low0
    x, y, se = np.array(rows).T
    design, w = np.column_stack([np.ones_like(x), x]), 1 / se ** 2
    info = design.T @ (w[:, None] * design)
    coef = np.linalg.solve(info, design.T @ (w * y))
    resid = y - design @ coef
    chi2 = resid @ (w * resid) / (len(rows) - 2)
    return min(math.exp(coef[0] - z * math.sqrt(np.linalg.inv(info)[0, 0] * max(1.0, chi2))), high0)


def curve(medians, log_half_widths, start=4096) -> dict:
    """Shapes a quarter octave apart from `start` tokens, each interval median * exp(±half width)."""
    return {f"{i}": (round(start * 2 ** (i / 4)), m * math.exp(-h), m, m * math.exp(h))
            for i, (m, h) in enumerate(zip(medians, log_half_widths, strict=True))}


ON_A_LINE = [0.9 * 2 ** (0.3 * i / 4) for i in range(5)]
CASES = {
    # chi-square below 1: the band is the intervals' alone; unequal widths weigh the shapes unequally.
    "on-a-line-unequal-intervals": curve(ON_A_LINE, [0.02, 0.1, 0.05, 0.3, 0.04]),
    # the shapes disagree beyond their intervals: the band widens by sqrt(chi-square).
    "scattered-beyond-intervals": curve([1.0, 1.1, 0.98, 1.15, 1.12], [0.02, 0.03, 0.02, 0.05, 0.02]),
    "scattered-three-points": curve([1.0, 1.2, 0.95], [0.02, 0.03, 0.05]),
    # the middle shape's own upper bound (1.0) is below what its neighbours say: it is the cap.
    "slower-with-confidence": {"0": (8192, 1.18, 1.2, 1.22), "1": (9728, 0.5, 0.98, 1.0),
                               "2": (11648, 1.2, 1.22, 1.24), "3": (13824, 1.23, 1.25, 1.27)},
}


@pytest.mark.parametrize("shapes", CASES.values(), ids=CASES.keys())
def test_steady_bounds_are_the_weighted_fit_at_each_shape(shapes):
    """Each shape's bound: the fit over its neighbours, weighted by their intervals, widened by
    their scatter, at most its own upper bound."""
    steady = speed.steady_lower_bounds(shapes)
    assert steady == pytest.approx({key: fitted(shapes, key) for key in shapes}, rel=1e-9)


def test_the_cap_at_the_upper_bound_is_reached():
    """The case above that should hit the cap does: otherwise it tests nothing."""
    shapes = CASES["slower-with-confidence"]
    assert speed.steady_lower_bounds(shapes)["1"] == 1.0


# 1024, 2048 and 4096 tokens: 2048 has both others exactly FIT_OCTAVES away, so exactly three points;
# 1024 and 4096 have two. Medians 0.8, 1, 1.25 lie on a line through 0 at 2048 (chi-square 0), and
# every interval is median * 1.1**±1, so se = log(1.1) / z and the intercept's variance is se**2 / 3.
OCTAVES = {"1024": (1024, 0.8 / 1.1, 0.8, 0.88), "2048": (2048, 1 / 1.1, 1.0, 1.1),
           "4096": (4096, 1.25 / 1.1, 1.25, 1.375)}
MIDDLE = 1.1 ** (-1 / math.sqrt(3))  # exp(0 - z * (log(1.1) / z) / sqrt(3))


@pytest.mark.parametrize("z", [Z, 1.0, 1e-6], ids=["z-1.96", "z-1", "z-1e-6"])
def test_a_neighbour_exactly_one_octave_away_counts_and_three_points_make_a_fit(z):
    """z turns each interval into a standard error and the fit's band back, so shapes that agree
    within their intervals get the same bound at any z: nothing, the degenerate-x test included,
    depends on the absolute size of the weights."""
    assert speed.steady_lower_bounds(OCTAVES, z) == pytest.approx(
        {"1024": 0.8 / 1.1, "2048": MIDDLE, "4096": 1.25 / 1.1}, rel=1e-12)
    assert MIDDLE > 1 / 1.1, "the fit differs from the middle shape's own lower bound"


EXCLUDED = {
    "low-zero": (1448, 0.0, 1.0, 1.1),
    "median-zero": (1448, 0.5, 0.0, 1.1),
    "low-negative": (1448, -0.1, 1.0, 1.1),
}


@pytest.mark.parametrize("bad", EXCLUDED.values(), ids=EXCLUDED.keys())
def test_a_shape_with_a_non_positive_bound_is_in_no_fit_and_keeps_its_own(bad):
    """Half an octave from 1024 and 2048 tokens, such a shape would give 1024 a third neighbour."""
    shapes = {**OCTAVES, "bad": bad}
    assert speed.steady_lower_bounds(shapes) == pytest.approx(
        {"1024": 0.8 / 1.1, "2048": MIDDLE, "4096": 1.25 / 1.1, "bad": bad[1]}, rel=1e-12)


def test_one_length_only_is_no_line_and_each_shape_keeps_its_own_bound():
    shapes = {"a": (4096, 0.9, 1.0, 1.1), "b": (4096, 1.0, 1.1, 1.2), "c": (4096, 0.8, 0.9, 1.0)}
    assert speed.steady_lower_bounds(shapes) == {"a": 0.9, "b": 1.0, "c": 0.8}
