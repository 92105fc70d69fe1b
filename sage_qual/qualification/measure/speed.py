"""Where a variant pays: confidence bounds on measured times, break-even thresholds, what they serve."""

from __future__ import annotations

import math
from dataclasses import dataclass

# Two-sided 95 % normal quantile, for the distribution-free confidence interval of a median.
Z_95 = 1.96


def median_interval(samples: list[float]) -> tuple[float, float]:
    """A 95 % confidence interval of the median from order statistics (distribution-free; no
    resampling, so the same samples always give the same bounds). One sample: that value twice."""
    ordered = sorted(samples)
    n = len(ordered)
    if n == 0:
        raise ValueError("no samples")
    half_width = Z_95 * math.sqrt(n) / 2
    low_rank = max(1, math.floor(n / 2 - half_width))  # 1-based ranks
    high_rank = min(n, math.ceil(1 + n / 2 + half_width))
    return ordered[low_rank - 1], ordered[high_rank - 1]


def speedup_bounds(sdpa_ms: float, sdpa_samples: list[float], ours_ms: float,
                   ours_samples: list[float]) -> tuple[float, float, float]:
    """(lower bound, median ratio, upper bound) of SDPA's time over ours. Without samples (schema
    version 1 reports) the medians stand for their own bounds."""
    sdpa_low, sdpa_high = median_interval(sdpa_samples) if sdpa_samples else (sdpa_ms, sdpa_ms)
    ours_low, ours_high = median_interval(ours_samples) if ours_samples else (ours_ms, ours_ms)
    return sdpa_low / ours_high, sdpa_ms / ours_ms, sdpa_high / ours_low


# Half-width, in octaves of tokens, of the neighbourhood a steady bound is fitted over: the sweep
# refines the crossover in steps of 2**(1/8) (docs/results/run8-h200x2-final/certify/certify-a/
# report.json: 8192, 8960, 9728, ... 16384 tokens), so one octave each side pools about 16 measured
# lengths there.
FIT_OCTAVES = 1.0


def steady_lower_bounds(shapes: dict, z: float = Z_95) -> dict:
    """Lower 95 % bounds of the speedup that do not jump with one shape's noise.

    `shapes` maps a key to (tokens, lower bound, median ratio, upper bound) of one variant's
    self-attention shapes of one head size on one device. Near the crossover the speedup is flat
    around 1x, so each shape's own lower bound decides the first shape that clears the bar by
    noise (two H200 runs of docs/results/run8-h200x2-final/certify/ put it at 8,960 and 11,648
    tokens). Instead a weighted line of log(speedup) against log2(tokens) is fitted over the
    shapes within FIT_OCTAVES of each one (weights from each shape's own interval, scaled up by
    the residual scatter when the shapes disagree more than their intervals say), and its lower z
    band at that shape is its bound. Never above the shape's own upper bound: a shape measured slower with
    confidence stays slower. A shape with fewer than three neighbours keeps its own lower bound.
    Deterministic: the same numbers always give the same bounds."""
    rows = {key: (math.log2(tokens), math.log(median), _log_se(low, high, z), high)
            for key, (tokens, low, median, high) in shapes.items() if low > 0 and median > 0}
    steady = {key: low for key, (_, low, _, _) in shapes.items()}
    for key, (x0, _, _, high) in rows.items():
        near = [(x - x0, y, 1 / se ** 2) for x, y, se, _ in rows.values() if abs(x - x0) <= FIT_OCTAVES]
        fitted = _weighted_line_at_zero(near)
        if fitted is not None:
            value, se = fitted
            steady[key] = min(math.exp(value - z * se), high)
    return steady


def _log_se(low: float, high: float, z: float) -> float:
    """The standard error of log(speedup) a two-sided z interval implies, for `low` > 0 (a floor of
    0.1 %, so that a shape timed with no spread does not outweigh all others)."""
    return max(math.log(high / low) / (2 * z), 1e-3)


def _weighted_line_at_zero(points: list[tuple[float, float, float]]) -> tuple[float, float] | None:
    """Weighted least squares y = a + b x over (x, y, weight): a and its standard error, inflated
    by the reduced chi-square when above 1. None with fewer than three points or one x only."""
    if len(points) < 3:
        return None
    sw = sum(w for _, _, w in points)
    sx = sum(w * x for x, _, w in points)
    sy = sum(w * y for _, y, w in points)
    sxx = sum(w * x * x for x, _, w in points)
    sxy = sum(w * x * y for x, y, w in points)
    det = sw * sxx - sx * sx
    if det <= 1e-12 * sw * sxx:
        return None
    a, b = (sxx * sy - sx * sxy) / det, (sw * sxy - sx * sy) / det
    chi2 = sum(w * (y - a - b * x) ** 2 for x, y, w in points) / (len(points) - 2)
    return a, math.sqrt(sxx / det * max(1.0, chi2))


# A sweep length lies near a bar when its median speedup is within this factor of it. The sm90
# kernel's times moved up to 10 % between back-to-back H200 runs while SDPA's repeated to 3 digits
# (docs/results/README.md, run 10), and its speedup stays within 5 % of 1x from about 8k to 15k
# tokens: a length within 10 % of the bar may fall on either side of it in another run.
NEAR_FACTOR = 1.10


def intervals_to_refine(points: list[tuple[int, float, float]],
                        min_speedup: float = 1.0) -> list[tuple[int, int]]:
    """Neighbouring sweep lengths (shorter, longer) to time more lengths between: where the lower
    bound crosses `min_speedup`, and where either end's median speedup lies within NEAR_FACTOR of
    it (so another run's crossover there is found too). `points`: (tokens, lower bound, median)."""
    ordered = sorted(points)
    near = {tokens for tokens, _, median in ordered
            if min_speedup / NEAR_FACTOR <= median <= min_speedup * NEAR_FACTOR}
    pairs = zip(ordered, ordered[1:], strict=False)  # each sweep point with the next
    return [(low, high) for (low, low_bound, _), (high, high_bound, _) in pairs
            if low_bound <= min_speedup < high_bound or low in near or high in near]


# How far a variant's median speedup moves between certify runs of one GPU and one build: over the
# three back-to-back full certifies of docs/results/run29-h200 and runs 27-28 (one H200, SageAttention
# 2.2.0 for sm90, torch 2.11.0+cu130), the largest over the smallest of five runs at each sweep length
# from 8,192 tokens had a median of 1.041 (head_dim 64) and 1.049 (head_dim 128)
# (docs/runs/run29_speed_spread.txt). A length is served only where its lower bound clears the
# family's bar by this much, so a family whose speedup sits within the spread of 1x (SDXL's 16,384
# tokens: 0.957-1.032 median) gets "no speedup" in every run instead of either verdict by chance,
# and the threshold comes from the conservative end of the spread. `compare` judges served speed
# with the same number.
RUN_TO_RUN_SPREAD = 0.05


def served_bar(min_speedup: float) -> float:
    """The lower bound a measured length must clear to be served for a family's `min_speedup`."""
    return min_speedup * (1 + RUN_TO_RUN_SPREAD)


@dataclass(frozen=True)
class Thresholds:
    """Where a variant pays: the head sizes and the query and key lengths from which it is served,
    and how many of the measured shapes that serves."""
    min_query_tokens: int
    min_key_tokens: int
    head_dims: list[int]
    served_shapes: int
    measured_shapes: int


def break_even(points: list[tuple[int, int, int, float]], min_speedup: float = 1.0) -> Thresholds | None:
    """Where a variant pays, from measured (query tokens, key tokens, head_dim, speedup) points.

    The speedup given is what the decision trusts: the lower confidence bound. The wrapper serves
    a call when its head_dim is in `head_dims` and it has at least `min_query_tokens` and
    `min_key_tokens`. Chosen among head_dim sets and thresholds at measured lengths: the one that
    serves the most measured shapes such that every shape it serves cleared `min_speedup`. Ties
    go to fewer head sizes, then larger thresholds: nothing is served where nothing was measured.
    None when no measured shape cleared it. A shape the variant failed at counts with speedup 0.
    """
    dims = sorted({d for _, _, d, _ in points})
    subsets = [[d for i, d in enumerate(dims) if mask >> i & 1] for mask in range(1, 2 ** len(dims))]
    best, best_key = None, None
    query_lengths, key_lengths = sorted({q for q, _, _, _ in points}), sorted({k for _, k, _, _ in points})
    for head_dims in subsets:
        at_dims = [(q, k, s) for q, k, d, s in points if d in head_dims]
        for min_q in query_lengths:
            long_enough = [(k, s) for q, k, s in at_dims if q >= min_q]
            for min_k in key_lengths:
                served = [s for k, s in long_enough if k >= min_k]
                if served and all(s > min_speedup for s in served):
                    key = (len(served), -len(head_dims), min_q, min_k)
                    if best_key is None or key > best_key:
                        best_key = key
                        best = Thresholds(min_q, min_k, head_dims, len(served), len(points))
    return best


def serves(thresholds: Thresholds, q_tokens: int, kv_tokens: int, head_dim: int) -> bool:
    return (q_tokens >= thresholds.min_query_tokens and kv_tokens >= thresholds.min_key_tokens
            and head_dim in thresholds.head_dims)
