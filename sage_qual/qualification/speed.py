"""Where a variant pays: the break-even thresholds from measured speedups, and what they serve."""

from __future__ import annotations


def break_even(points: list[tuple[int, int, int, float]], min_speedup: float = 1.0) -> dict | None:
    """Where a variant pays, from measured (query tokens, key tokens, head_dim, speedup) points.

    The wrapper serves a call when its head_dim is in `head_dims` and it has at least
    `min_query_tokens` and `min_key_tokens`. Chosen among head_dim sets and thresholds at measured
    lengths: the one that serves the most measured shapes such that every shape it serves was
    faster than `min_speedup`. Ties go to fewer head sizes, then larger thresholds: nothing is
    served where nothing was measured. None when no measured shape was faster. A shape the variant
    failed at counts with speedup 0.
    """
    dims = sorted({d for _, _, d, _ in points})
    subsets = [[d for i, d in enumerate(dims) if mask >> i & 1] for mask in range(1, 2 ** len(dims))]
    best, best_key = None, None
    for head_dims in subsets:
        for min_q in sorted({q for q, _, _, _ in points}):
            for min_k in sorted({k for _, k, _, _ in points}):
                served = [s for q, k, d, s in points if q >= min_q and k >= min_k and d in head_dims]
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
