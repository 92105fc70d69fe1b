"""The one judgement of a cell: its measured metrics and its budget in, the reasons it fails out.

certify's worker calls it as it measures, the verdict recomputes it from the stored metrics, and the
GPU tests assert with it, so a cell cannot pass in one place and fail in another.
"""

from __future__ import annotations

from sage_qual.qualification import measure


def cell_reasons(acc: measure.Accuracy, per_element: float, bounds: dict, memory_bound: float) -> list[dict]:
    """Why a cell fails, each reason with its numbers; empty when it passes."""
    reasons = []
    if not acc.finite:
        reasons.append({"kind": "non_finite", "detail": "output not finite where the reference is"})
    if not acc.rel_l2 <= bounds["max_rel_l2"]:
        reasons.append({"kind": "accuracy",
                        "detail": f"relative L2 {acc.rel_l2:.4g} > {bounds['max_rel_l2']:g} "
                                  f"(SDPA in the input precision: {acc.sdpa_rel_l2:.3g})"})
    if not acc.worst_head_cosine >= bounds["min_cosine"]:
        reasons.append({"kind": "accuracy", "detail": f"worst head cosine {acc.worst_head_cosine:.4g} < "
                                                      f"{bounds['min_cosine']:g}"})
    if per_element > memory_bound:
        reasons.append({"kind": "memory",
                        "detail": f"extra peak {per_element:.2f} bytes per q/k/v element > {memory_bound:g}"})
    return reasons
