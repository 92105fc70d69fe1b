"""The one judgement of a cell: its measured metrics, its budget and its fitness bound in, the reasons
it fails out. Two judges: conformance (within the budget its numerics model derives: the kernel is
on its model) and fitness (within the error the family was shown to tolerate, `verdicts.fitness`);
a cell passes only where both hold, and each failure says which judge it is (`ReasonKind.ACCURACY`:
off its model; `ReasonKind.UNFIT`: unfit for the family).

certify's worker calls it as it measures, the verdict recomputes it from the stored metrics, and the
GPU tests assert with it, so a cell cannot pass in one place and fail in another.

A budget is a `report_model.Budget`, per variant and fixture, derived from the numerics model
(`sage_qual.qualification.measure.budgets.budget`) or stored (`Cell.budget`). Every limit is checked
against its metric (null only in a report that predates the limit); a metric that is missing or not a
number for a limit is a reason too, so a report stripped of a number cannot pass. Finiteness is
always checked.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from sage_qual.qualification.evidence.report_model import Budget, Metrics, Reason, ReasonKind
from sage_qual.verdicts.fitness import FitnessBound

# limit -> (metric, "max" or "min", what it says)
LIMITS = {
    "max_rel_l2": ("rel_l2", "max", "relative L2"),
    "max_head_rel_l2": ("worst_head_rel_l2", "max", "worst query head's relative L2"),
    "max_batch_rel_l2": ("worst_batch_rel_l2", "max", "worst batch item's relative L2"),
    "max_block_rel_l2": ("worst_block_rel_l2", "max", "worst query-row block's relative L2"),
    "min_norm_ratio": ("norm_ratio", "min", "output norm / reference norm"),
    "max_norm_ratio": ("norm_ratio", "max", "output norm / reference norm"),
    "min_cosine": ("worst_head_cosine", "min", "worst head cosine"),
    "max_abs": ("max_abs_error", "max", "largest element error |out - ref|"),
}


def _number(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def cell_reasons(metrics: Metrics, per_element: float | None, budget: Budget, memory_bound: float,
                 sdpa_rel_l2: float | None = None, *, fitness: FitnessBound) -> list[Reason]:
    """Why a cell fails, each reason with its numbers; empty when it passes.

    `metrics`: a kernel's (`measure.Accuracy`), a stored cell's (`Cell.metrics`) or a long check's;
    `sdpa_rel_l2`, when known, is quoted beside a failing relative L2; `fitness`: the bound of the
    calls the output stands for.
    """
    reasons = []
    finite = metrics.finite is True
    if not finite:
        reasons.append(Reason(ReasonKind.NON_FINITE, "output not finite where the reference is"))
    for limit, (metric, side, label) in LIMITS.items():
        stored = getattr(budget, limit)
        if stored is None:  # a limit the report predates
            continue
        bound, value = _number(stored), _number(getattr(metrics, metric))
        if bound is None or math.isnan(bound):
            reasons.append(Reason(ReasonKind.ACCURACY, f"budget {limit} is not a number: {stored!r}"))
        elif value is None or math.isnan(value):
            # A non-finite output has no errors to measure: that reason was given once, above.
            missing = Reason(ReasonKind.ACCURACY, f"{label} ({metric}) not measured")
            if finite and missing not in reasons:
                reasons.append(missing)
        elif (side == "max" and not value <= bound) or (side == "min" and not value >= bound):
            relation = ">" if side == "max" else "<"
            extra = ""
            if metric == "rel_l2" and _number(sdpa_rel_l2) is not None:
                extra = f" (SDPA in the input precision: {sdpa_rel_l2:.3g})"
            reasons.append(Reason(ReasonKind.ACCURACY, f"{label} {value:.4g} {relation} {bound:.4g}{extra}"))
    reasons += fitness_reasons(metrics, fitness)
    if per_element is None:
        reasons.append(Reason(ReasonKind.MEMORY, "extra peak memory not measured"))
    elif per_element > memory_bound:
        reasons.append(Reason(ReasonKind.MEMORY,
                              f"extra peak {per_element:.2f} bytes per q/k/v element > {memory_bound:g}"))
    return reasons


def fitness_reasons(metrics: Metrics, fitness: FitnessBound) -> list[Reason]:
    """Why an output is unfit for the calls it stands for, in one reason: its relative L2 past the
    bound's, its worst head's cosine below it (not read where the bound says the reference makes it
    meaningless), or both. A non-finite output is judged once, by its finiteness, and a missing number
    once, by conformance (every budget limits both numbers)."""
    if metrics.finite is not True:
        return []
    checks = [("relative L2", metrics.rel_l2, fitness.max_rel_l2, ">")]
    if fitness.min_cosine is not None:
        checks.append(("worst head cosine", metrics.worst_head_cosine, fitness.min_cosine, "<"))
    past = [f"{label} {number:.4g} {relation} {bound:.4g}" for label, value, bound, relation in checks
            if (number := _number(value)) is not None
            and ((number > bound) if relation == ">" else (number < bound))]
    if not past:
        return []
    return [
        Reason(ReasonKind.UNFIT, f"unfit for the family: {', '.join(past)} (fitness bound: {fitness.source})")
    ]


def hazard_reasons(hazards) -> list[Reason]:
    """A predicted cell's reason per hazard the numerics model names: the kernel's output there
    depends on memory the model cannot see, so a prediction cannot call it finite (on the H200 the
    sm80 kernels returned NaN on 4- and 16-key calls the model flags: docs/results/run18-h200/
    certify-a/report.md)."""
    return [Reason(ReasonKind.NON_FINITE, f"predicted to fail: the numerics model names a hazard: {hazard}")
            for hazard in hazards]


def row_order_reasons(rows_identical: bool | None) -> list[Reason]:
    """A long check's reason when its row blocks, moved to other positions, gave other outputs."""
    if rows_identical is False:
        return [Reason(ReasonKind.ACCURACY, "row blocks moved to other positions gave other outputs: the "
                                            "output depends on where a query row sits (a defect on part of "
                                            "the rows)")]
    return []


def layout_reasons(identical: Mapping, layouts) -> list[Reason]:
    """A long check's reason per declared layout other than contiguous whose output was not the
    contiguous call's bit for bit (`identical`: layout -> bool), or that was not compared."""
    reasons = []
    for name in layouts:
        if name == "contiguous":
            continue
        if name not in identical:
            reasons.append(Reason(ReasonKind.LAYOUT, f"layout {name}: not compared with contiguous"))
        elif identical[name] is not True:
            reasons.append(Reason(ReasonKind.LAYOUT, f"layout {name}: output differs from the same kernel's "
                                                     "on contiguous copies"))
    return reasons
