"""Where a variant pays: confidence bounds on measured times, break-even thresholds, what they serve."""

from __future__ import annotations

import math

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


def break_even(points: list[tuple[int, int, int, float]], min_speedup: float = 1.0) -> dict | None:
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
                        best = {"min_query_tokens": min_q, "min_key_tokens": min_k, "head_dims": head_dims,
                                "served_shapes": len(served), "measured_shapes": len(points)}
    return best


def serves(thresholds: dict, q_tokens: int, kv_tokens: int, head_dim: int) -> bool:
    return (q_tokens >= thresholds["min_query_tokens"] and kv_tokens >= thresholds["min_key_tokens"]
            and head_dim in thresholds["head_dims"])
