"""A report read back as the decisions may trust it: every key and type checked (`report_model`),
then every result checked against its own numbers (a cell's outcome and reasons are what its
metrics, budget and fitness bound give, a long check's too), so an edited outcome is refused with
one line. A report written before the fitness judge (schema 4 and older) is checked against the
judges it was written with, then judged for fitness too: what every reader gets is both judges."""

from __future__ import annotations

import dataclasses
import math

from sage_qual.kernels.variants import VARIANTS
from sage_qual.qualification.evidence import files, tasks
from sage_qual.qualification.evidence.report_model import (
    Cell,
    FixtureRecord,
    LongCheck,
    Outcome,
    Reason,
    ReasonKind,
    Report,
    ReportError,
)
from sage_qual.qualification.families import (
    GENERIC_HEADS,
    LAYOUTS,
    SELF_TOKENS,
    family_of,
    memory_bound,
    self_attention,
)
from sage_qual.qualification.measure import judge
from sage_qual.verdicts import fitness


def load(path) -> Report:
    """A report whose every key and type checked out and whose cells agree with their numbers;
    ReportError (one line: file, key, fix) otherwise."""
    data = files.load(path)
    check_evidence(data, str(path))
    return fitted(data)


def parse(data: dict, where: str) -> Report:
    """The same checks as load() on a report already in memory."""
    typed = files.from_dict(data, where)
    check_evidence(typed, where)
    return fitted(typed)


def cell_fitness(fixture: FixtureRecord, cell: Cell) -> fitness.FitnessBound:
    """The fitness bound of a cell: its fixture's bound for the cell's accuracy class."""
    accuracy_class = cell.accuracy_class or VARIANTS[cell.variant].accuracy_class
    return fitness.bound_for(fixture.name, fixture.kind.value, accuracy_class, fixture.bounds[accuracy_class])


def judged(report: Report, cell: Cell, with_fitness: bool = True) -> list[Reason]:
    """Why a cell fails, recomputed from its stored numbers, budget and fitness bound
    (`judge.cell_reasons`); `with_fitness` false: as a report written before the fitness judge
    judged it."""
    if not cell.measured:
        return [Reason(ReasonKind(cell.outcome.value), cell.detail)]
    fixture = next(f for f in report.fixtures if f.name == cell.fixture)
    # A predicted cell (certify --emulate) has no memory number: only its accuracy is judged.
    extra = 0.0 if cell.extra_bytes_per_element is None and report.predicted else cell.extra_bytes_per_element
    reasons = (judge.cell_reasons(cell.metrics, extra, cell.budget, memory_bound(fixture.family),
                                  cell.sdpa_rel_l2, fitness=cell_fitness(fixture, cell))
               + judge.hazard_reasons(cell.hazards))
    return reasons if with_fitness else [r for r in reasons if r.kind != ReasonKind.UNFIT]


def long_judged(check: LongCheck, with_fitness: bool = True) -> list[Reason]:
    """Why a long check fails, recomputed from its stored numbers, budget, fitness bound
    (`fitness.LONG_CHECK_BOUND`) and layout comparisons."""
    if not check.measured:
        return [Reason(ReasonKind.LONG, f"{check.outcome.value}: {check.detail}")]
    reasons = judge.cell_reasons(check.metrics, 0.0, check.budget, math.inf, fitness=fitness.LONG_CHECK_BOUND)
    if not with_fitness:
        reasons = [r for r in reasons if r.kind != ReasonKind.UNFIT]
    reasons += judge.row_order_reasons(check.rows_identical)
    reasons += judge.layout_reasons(check.identical, check.layouts)
    reasons += [Reason(ReasonKind.LAYOUT, f"layout {name}: unknown to this sage-qual")
                for name in check.layouts if name not in LAYOUTS]
    return reasons


def check_evidence(report: Report, where: str) -> None:
    """ReportError when a cell's stored outcome disagrees with what it measured against its stored
    budget, or its variant is unknown. The budget itself is derived from the numerics model
    (`budgets.budget`) and cannot be recomputed without the fixture's tensors; the fixture's class
    bounds are provenance only, so a budget may be looser than them. A fixture the fitness table names
    must carry the table's bounds: the verdict's fitness bound is the table's, never the report's copy."""
    for n, fixture in enumerate(report.fixtures):
        mismatch = fitness.table_mismatch(fixture.name, fixture.bounds)
        if mismatch:
            raise ReportError(f"{where}: fixtures[{n}].bounds: {mismatch}: the report's copy was edited, and "
                              "the verdict reads the table's bound: certify again")
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
            if cell.accuracy_class is None and cell.variant not in VARIANTS:
                raise ReportError(f"{key}: accuracy_class: null, and no variant of that name gives it: the "
                                  "cell's fitness bound cannot be found; certify again")
            reasons = judged(report, cell, report.fitness_judged)
            outcome = Outcome.FAIL if reasons else Outcome.PASS
            if cell.outcome != outcome:
                why = "; ".join(r.detail for r in reasons) or "every number within its bound"
                raise ReportError(f"{key}: outcome: {cell.outcome.value!r} but its numbers say "
                                  f"{outcome.value!r} ({why}); the report was edited: certify again")
        for m, check in enumerate(device.long or []):
            where_long = f"{where}: devices[{n}].long[{m}] ({check.variant} at {check.shape.q_tokens} tokens)"
            unplanned = _unplanned(report, check)
            if unplanned:
                raise ReportError(f"{where_long}: {unplanned}; the report was edited: certify again")
            if not check.measured:
                continue
            rows = _rows_problem(check)
            if rows:
                raise ReportError(f"{where_long}: rows: {rows}; the report was edited: certify again")
            reasons = long_judged(check, report.fitness_judged)
            outcome = Outcome.FAIL if reasons else Outcome.PASS
            if check.outcome != outcome:
                why = "; ".join(r.detail for r in reasons) or "every number within its bound"
                raise ReportError(f"{where_long}: outcome: {check.outcome.value!r} but its numbers say "
                                  f"{outcome.value!r} ({why}); the report was edited: certify again")


def fitted(report: Report) -> Report:
    """`report` with every outcome judged for fitness too: a report written before the fitness judge
    gets the unfit cells and long checks failed, with the reasons (run 40's comfy-kitchen cell on the
    Krea-2 outlier replica: a pass at relative L2 0.508, unfit against the fixture's 0.3)."""
    if report.fitness_judged:
        return report

    def refit(result, reasons: list[Reason]):
        unfit = [r for r in reasons if r.kind == ReasonKind.UNFIT]
        if not result.measured or not unfit:
            return result
        return dataclasses.replace(result, outcome=Outcome.FAIL, reasons=[*result.reasons, *unfit])

    devices = [dataclasses.replace(
        device, cells=[refit(cell, judged(report, cell)) for cell in device.cells],
        long=None if device.long is None else [refit(check, long_judged(check)) for check in device.long])
        for device in report.devices]
    return dataclasses.replace(report, devices=devices, fitness_judged=True)


# The shapes of the sweep's long checks, as run/plan.py plans them.
_SWEEP_SHAPES = [tasks.shape_spec(self_attention(GENERIC_HEADS, t).as_dict()) for t in SELF_TOKENS]


def _unplanned(report: Report, check: LongCheck) -> str:
    """Why `check` is no long check certify plans ('' when it is one): each family use is a chosen
    family's longest call, each sweep use the generic self-attention at a sweep length. A check
    relabelled to a longer call would lift the verified range past what ran (issue 28: 10^6 tokens
    enabled FLUX.1, whose longest call is 16,896)."""
    for use in check.uses:
        if use.family is None:
            if check.shape not in _SWEEP_SHAPES:
                return (f"shape: not the generic sweep's self-attention ({GENERIC_HEADS} heads x 128 at "
                        f"{', '.join(map(str, SELF_TOKENS))} tokens)")
            continue
        family = family_of(use.family)
        if family is None or family.name not in report.options.families:
            return f"uses: {use.family!r} is not a family of this run"
        if check.shape != tasks.shape_spec(family.longest.as_dict()):
            longest = family.longest
            return (f"shape: not {family.name}'s longest call ({longest.q_tokens} query / "
                    f"{longest.kv_tokens} key tokens, {longest.heads} heads x {longest.head_dim})")
    return ""


def _rows_problem(check: LongCheck) -> str:
    """Why a measured long check's `rows` are not the query rows it judged ('' when they are): block
    starts, distinct, in order, below the tokens it ran (issue 28: one that sampled none passed)."""
    rows, block, tokens = check.rows, check.row_block or 1, check.ran_tokens or check.shape.q_tokens
    if not rows:
        return "empty for a measured long check (it judges the sampled query rows)"
    if rows != sorted(set(rows)) or rows[-1] >= tokens or any(row % block for row in rows):
        return (f"{rows} are not distinct {block}-row block starts in order below the {tokens} query "
                "tokens it ran")
    return ""


def status_line(complete: bool, started: str, finished: str | None, stopped: str) -> str:
    if complete:
        return f"Complete: started {started}, finished {finished}."
    why = f" ({stopped})" if stopped else ""
    return (f"PARTIAL REPORT{why}: the run started {started} did not finish; what is below is what "
            "it measured before it stopped. No verdicts are drawn from a partial run.")


def undecidable(report: Report, source: str) -> str:
    """Why `report` (read from `source`) can decide nothing, on any machine; '' when it can. gate,
    compare and the defaults builder refuse through here, in these words (merge shows the same three
    in its table). A partial run did not finish; a predicted one measured nothing on a GPU; a --quick
    pre-flight runs the smallest fixture of each family and those with a known failure, leaves the
    others out and times no family's shapes: its "pass" is not a family's."""
    if not report.complete:
        line = status_line(report.complete, report.started, report.finished, report.stopped)
        return f"{source} is a partial report ({line}): it decides nothing; run certify to the end"
    if report.predicted:
        return (f"{source} is a predicted report (certify --emulate: the CPU numerics model, no GPU ran): it "
                "decides nothing; run `sage-qual certify` on the GPU")
    if report.options.quick:
        return (f"{source} is a --quick report: it ran the smallest fixture of each family and those with "
                "a known failure, left the others out (report.md lists them) and timed no family's "
                "shapes, so it decides nothing; run `sage-qual certify` without --quick")
    return ""


