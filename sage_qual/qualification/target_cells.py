"""One integration on one fixture, in a certify worker: what `certify --target` measures per cell.

The target is enabled as its app enables it, called on the fixture in SDPA's layout, and judged by
`judge.cell_reasons` against the fixture's bounds for the kernel class the integration runs on
that GPU, as certify judges a variant.
"""

from __future__ import annotations

from sage_qual import limits
from sage_qual.fixtures import fileformat
from sage_qual.qualification import budgets, judge, measure, targets, tasks
from sage_qual.qualification.report_model import Cell, Outcome
from sage_qual.serving.variants import capability_label


def machine(task: tasks.TargetMachineTask) -> tasks.MachineResult:
    """Why the target cannot run on this GPU ([]: it can)."""
    target = targets.resolve(task.target)
    return task.record(Outcome.PASS, reasons=target.machine_reasons(targets.box_facts()))


def run_cell(task: tasks.TargetCellTask, bench) -> Cell:
    """One target cell in a certify worker."""
    fixture = fileformat.load_fixture(task.fixture, device=bench.device)
    target = targets.resolve(task.target)
    return measure_cell(target, fixture, tuple(task.capability), bench, task.memory_bound)


def measure_cell(target: targets.Target, fixture: fileformat.Fixture, capability, bench,
                 memory_bound: float = limits.MEMORY_BOUND) -> Cell:
    """The target on one fixture, judged as certify judges a variant (see the module docstring)."""
    def skip(detail: str) -> Cell:
        return Cell(target.name, fixture.name, Outcome.SKIP, detail)

    q, k, v = fixture.q, fixture.k, fixture.v
    sdpa_kwargs = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
    claimed = target.not_supported_reasons(q, k, v, **sdpa_kwargs)
    if claimed:
        return skip(f"{target.name} does not take this call: {'; '.join(claimed)}")
    variant = target.variant(capability)
    if variant is None:
        return skip(f"{target.name} has no kernel for {capability_label(capability)}")
    ref = measure.reference(q, k, v)
    with target.session() as session:
        served = []

        def call():
            out, was_served = session.call(q, k, v, **sdpa_kwargs)
            served.append(was_served)
            return out

        out, extra = bench.extra_peak_bytes(call)
    if not served[0]:
        return skip(f"{target.name} did not run SageAttention on this call: "
                    f"{session.evidence.not_served_detail()}")
    acc = measure.accuracy(out, q, k, v, ref)
    bounds = budgets.budget(variant, fixture)  # the budget certify gives the kernel it runs
    per_element = extra / measure.elements(q, k, v)
    reasons = judge.cell_reasons(acc, per_element, bounds, memory_bound)
    return tasks.judged_cell(target.name, fixture.name, acc.as_dict(), bounds, reasons,
                             variant.accuracy_class, per_element)
