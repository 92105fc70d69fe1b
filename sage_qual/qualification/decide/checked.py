"""A report read back as the decisions may trust it: every key and type checked (`report_model`),
then every result checked against its own numbers (a cell's outcome and reasons are what its
metrics and budget give, a long check's too), so an edited outcome is refused with one line."""

from __future__ import annotations

import math

from sage_qual.qualification.evidence import files
from sage_qual.qualification.evidence.report_model import (
    Cell,
    LongCheck,
    Outcome,
    Reason,
    ReasonKind,
    Report,
    ReportError,
)
from sage_qual.qualification.families import LAYOUTS, memory_bound
from sage_qual.qualification.measure import judge
from sage_qual.serving.variants import VARIANTS


def load(path) -> Report:
    """A report whose every key and type checked out and whose cells agree with their numbers;
    ReportError (one line: file, key, fix) otherwise."""
    data = files.load(path)
    check_evidence(data, str(path))
    return data


def parse(data: dict, where: str) -> Report:
    """The same checks as load() on a report already in memory."""
    typed = files.from_dict(data, where)
    check_evidence(typed, where)
    return typed


def judged(report: Report, cell: Cell) -> list[Reason]:
    """Why a cell fails, recomputed from its stored numbers and budget (`judge.cell_reasons`)."""
    if not cell.measured:
        return [Reason(ReasonKind(cell.outcome.value), cell.detail)]
    fixture = next(f for f in report.fixtures if f.name == cell.fixture)
    # A predicted cell (certify --emulate) has no memory number: only its accuracy is judged.
    extra = 0.0 if cell.extra_bytes_per_element is None and report.predicted else cell.extra_bytes_per_element
    return (judge.cell_reasons(cell.metrics, extra, cell.bounds, memory_bound(fixture.family),
                               cell.sdpa_rel_l2) + judge.hazard_reasons(cell.hazards))


def long_judged(check: LongCheck) -> list[Reason]:
    """Why a long check fails, recomputed from its stored numbers, budget and layout comparisons."""
    if not check.measured:
        return [Reason(ReasonKind.LONG, f"{check.outcome.value}: {check.detail}")]
    reasons = judge.cell_reasons(check.metrics, 0.0, check.bounds, math.inf)
    reasons += judge.row_order_reasons(check.rows_identical)
    reasons += judge.layout_reasons(check.identical, check.layouts)
    reasons += [Reason(ReasonKind.LAYOUT, f"layout {name}: unknown to this sage-qual")
                for name in check.layouts if name not in LAYOUTS]
    return reasons


def check_evidence(report: Report, where: str) -> None:
    """ReportError when a cell's stored outcome disagrees with what it measured against its stored
    budget, or its variant is unknown. The budget itself is derived from the numerics model
    (`budgets.budget`) and cannot be recomputed without the fixture's tensors; the fixture's class
    bounds are provenance only, so a budget may be looser than them."""
    for n, device in enumerate(report.devices):
        # Span probes run after the sweep, whose every variant job ends with its long checks: probes
        # beside no long check mean the long checks were removed, and the verdict would lose its
        # upper bound on the tokens served (issue 28).
        if device.span and not device.long:
            raise ReportError(f"{where}: devices[{n}].long: no long check beside {len(device.span)} span "
                              "probe(s): certify runs both, so the long checks were removed; certify again")
        for m, cell in enumerate(device.cells):
            if not cell.measured:
                continue
            key = f"{where}: devices[{n}].cells[{m}] ({cell.variant} on {cell.fixture})"
            # certify --target: the integration stands where a variant stands (not in the registry).
            if not report.target and cell.variant not in VARIANTS:
                raise ReportError(f"{key}: variant: unknown to this sage-qual; certify again with this "
                                  "version")
            reasons = judged(report, cell)
            outcome = Outcome.FAIL if reasons else Outcome.PASS
            if cell.outcome != outcome:
                why = "; ".join(r.detail for r in reasons) or "every number within its bound"
                raise ReportError(f"{key}: outcome: {cell.outcome.value!r} but its numbers say "
                                  f"{outcome.value!r} ({why}); the report was edited: certify again")
        for m, check in enumerate(device.long or []):
            if not check.measured:
                continue
            reasons = long_judged(check)
            outcome = Outcome.FAIL if reasons else Outcome.PASS
            if check.outcome != outcome:
                why = "; ".join(r.detail for r in reasons) or "every number within its bound"
                tokens = check.shape.q_tokens
                where_long = f"{where}: devices[{n}].long[{m}] ({check.variant} at {tokens} tokens)"
                raise ReportError(f"{where_long}: outcome: {check.outcome.value!r} but its numbers say "
                                  f"{outcome.value!r} ({why}); the report was edited: certify again")


def status_line(complete: bool, started: str, finished: str | None, stopped: str) -> str:
    if complete:
        return f"Complete: started {started}, finished {finished}."
    why = f" ({stopped})" if stopped else ""
    return (f"PARTIAL REPORT{why}: the run started {started} did not finish; what is below is what "
            "it measured before it stopped. No verdicts are drawn from a partial run.")


def quick_problem(report: Report) -> str:
    """Why the report cannot enable a family whatever the machine, for a --quick run; '' otherwise.
    A pre-flight runs the smallest fixture of each family only, and the stress fixtures it leaves
    out are the ones that carry the known failures: its "pass" is not a family's."""
    if not report.options.quick:
        return ""
    return ("a --quick report cannot enable a family: it ran the smallest fixture of each family only and "
            "left out the stress fixtures that carry the known failures (report.md lists them); run "
            "`sage-qual certify` without --quick")


