"""One cell: a subject called on one fixture, measured against float32 and judged against the budget
of the variant it runs. The one measurement of a cell, whoever the subject is and wherever it runs:

- our variant's kernel in a certify worker (the GPU, or the fake GPU of the tests);
- the numerics model standing for that kernel in this process (`certify --emulate`);
- an integration's call (`certify --target`, the pytest plugin), judged by the budget of the kernel
  it runs on that GPU.

The bench says where the tensors live and measures the extra peak memory of the call (None where
nothing can be measured: the model allocates nothing like the kernel, so no memory figure is stored
and the judgement's memory term cannot fire).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import torch

from sage_qual import limits, records
from sage_qual.fixtures.fileformat import Fixture
from sage_qual.kernels.variants import Variant, capability_label
from sage_qual.qualification.evidence import tasks
from sage_qual.qualification.evidence.report_model import Cell, Outcome, SmoothK
from sage_qual.qualification.measure import accuracy, budgets, judge

Call = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Bench(Protocol):
    """Where a cell runs, the seam every measurement of a cell goes through. Four benches implement
    it: a certify worker's GPU (`worker.GpuBench`), the tests' fake GPU (`selftest.faults.FakeBench`),
    this process's CPU under the numerics model (`in_process.CpuBench`) and a pytest session's GPU
    (the plugin's `_CudaBench`); a worker's bench does more (`worker.WorkerBench`)."""

    device: str  # where the fixture's tensors are put

    def extra_peak_bytes(self, fn: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, int | None]:
        """fn's output, and the peak bytes it allocated beyond it (None: not measurable here)."""


class NotServed(Exception):
    """The subject took the call but did not run SageAttention on it: the cell is a skip saying why,
    so a family is never enabled on a call SageAttention never saw."""


def is_outlier(fixture_name: str) -> bool:
    """Outlier fixtures (a Q/K channel far above the rest) are named so, as tests_gpu selects them."""
    return "outlier" in fixture_name


def measure_cell(name: str, variant: Variant, fixture: Fixture, call: Call, bench: Bench,
                 memory_bound: float = limits.MEMORY_BOUND, smooth_k_call: Call | None = None) -> Cell:
    """`call(q, k, v)` on the fixture, judged by `variant`'s budget; `name` is what the report calls the
    subject. `smooth_k_call`, on an outlier fixture: the same kernel with K smoothing on, recorded
    beside the served choice (smoothing off) where it matters."""
    q, k, v = fixture.q, fixture.k, fixture.v
    ref = budgets.reference(fixture)
    try:
        out, extra = bench.extra_peak_bytes(lambda: call(q, k, v))
    except NotServed as why:
        return Cell(name, fixture.name, Outcome.SKIP, str(why))
    found = accuracy.accuracy(out, q, k, v, ref, attn_mask=fixture.mask)
    del out
    budget = budgets.budget(variant, fixture)  # derived from the numerics model
    per_element = None if extra is None else extra / accuracy.elements(q, k, v)
    reasons = judge.cell_reasons(found, per_element or 0.0, budget,
                                 math.inf if per_element is None else memory_bound, found.sdpa_rel_l2,
                                 fitness=fixture.fitness(variant))
    smooth_k_on = None
    if smooth_k_call is not None and is_outlier(fixture.name):
        rel_l2, cosine, finite = accuracy.compare(smooth_k_call(q, k, v), ref)
        smooth_k_on = SmoothK(**records.finite_or_none({"rel_l2": rel_l2, "worst_head_cosine": cosine,
                                                        "finite": finite}))
    return tasks.judged_cell(name, fixture.name, found, budget, reasons, variant.accuracy_class,
                             per_element, smooth_k_on=smooth_k_on)


def measure_target(target, fixture: Fixture, capability, bench,
                   memory_bound: float = limits.MEMORY_BOUND) -> Cell:
    """An integration (an `integrations.targets.Target`) on one fixture, enabled as its app enables it
    and called in SDPA's layout, measured and judged as certify's cell of the kernel it runs on that
    GPU (`measure_cell`). A call it claims not to take is a skip with its claim (`head_dim=96
    (supported: 64, 128)`); one it takes but does not serve on SageAttention is a skip with why."""
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
    with target.session() as session:
        def call(q, k, v):
            out, served = session.call(q, k, v, **sdpa_kwargs)
            if not served:
                raise NotServed(f"{target.name} did not run SageAttention on this call: "
                                     f"{session.evidence.not_served_detail()}")
            return out

        return measure_cell(target.name, variant, fixture, call, bench, memory_bound)


