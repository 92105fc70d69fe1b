"""One integration on one fixture, in a certify worker: what `certify --target` measures per cell.

The target is enabled as its app enables it, called on the fixture in SDPA's layout, and judged by
`judge.cell_reasons` against the fixture's bounds for the kernel class the integration runs on
that GPU, as certify judges a variant.
"""

from __future__ import annotations

from sage_qual import limits
from sage_qual.fixtures import fileformat
from sage_qual.qualification import budgets, judge, measure, targets
from sage_qual.serving.variants import capability_label


def run_task(task: dict, bench) -> dict:
    """One target task in a certify worker: "machine" (why it cannot run on this GPU) or "cell"."""
    target = targets.resolve(task["target"])
    if task["action"] == "machine":
        box = targets.box_facts()
        return {"outcome": "pass", "reasons": target.machine_reasons(box),
                "capability": list(box.capability) if box else None}
    fixture = fileformat.load_fixture(task["fixture"], device=bench.device)
    return measure_cell(target, fixture, tuple(task["capability"]), bench, task["memory_bound"])


def measure_cell(target: targets.Target, fixture: fileformat.Fixture, capability, bench,
                 memory_bound: float = limits.MEMORY_BOUND) -> dict:
    """The target on one fixture, judged as certify judges a variant (see the module docstring)."""
    q, k, v = fixture.q, fixture.k, fixture.v
    sdpa_kwargs = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
    claimed = target.not_supported_reasons(q, k, v, **sdpa_kwargs)
    if claimed:
        return {"outcome": "skip", "detail": f"{target.name} does not take this call: {'; '.join(claimed)}"}
    variant = target.variant(capability)
    if variant is None:
        detail = f"{target.name} has no kernel for {capability_label(capability)}"
        return {"outcome": "skip", "detail": detail}
    ref = measure.reference(q, k, v)
    with target.session() as session:
        served = []

        def call():
            out, was_served = session.call(q, k, v, **sdpa_kwargs)
            served.append(was_served)
            return out

        out, extra = bench.extra_peak_bytes(call)
    if not served[0]:
        return {"outcome": "skip", "detail": f"{target.name} did not run SageAttention on this call: "
                                             f"{session.evidence.not_served_detail()}"}
    acc = measure.accuracy(out, q, k, v, ref)
    bounds = budgets.budget(variant, fixture)  # the budget certify gives the kernel it runs
    per_element = extra / measure.elements(q, k, v)
    reasons = judge.cell_reasons(acc, per_element, bounds, memory_bound)
    return {"outcome": "fail" if reasons else "pass", "reasons": reasons,
            "accuracy_class": variant.accuracy_class, "bounds": bounds, **acc.as_dict(),
            "extra_bytes_per_element": per_element}

