"""Certify's span probes (issue 16): each served variant's largest safe element span, measured in workers.

Past 2^31 elements the kernels' 32-bit offsets overflow (`limits.MAX_SPAN_ELEMENTS`): on the H200 a
fused-projection view made every variant hit an illegal memory access, which poisons the process's
CUDA context, and a contiguous tensor made the sm90 extension abort the process. Certify runs
`span_probe`'s cases as worker tasks (kind "span"), so a fault or an abort costs one worker: the
case gets a "crash" result with the worker's stderr tail (the assertion, the signal), and the pool
goes on in a fresh worker. The report keeps every case (`report_model.SpanProbe`); the profile's
`max_span_elements` is `profile_limit()` of them.

The cases, per layout (contiguous; fused_qkv, views into one fused projection): a rung near
limit / 8, then the boundary's `below` case (the longest query the wrapper serves under the
limit) and `above` case (the shortest past it). The rung is where the limit falls back to when a
kernel is wrong below the boundary. The variants: after the sweep, on the first device of each GPU
model, the wrapper's default kernel there and every variant a verdict serves (the profile's limit
must have been measured for what it serves); other variants are not probed, to save time.

Cost, estimated (not measured yet: the next H200 certify's report.json gives each probe's seconds).
The long tensor is the query only, with keys and values of 1,024 tokens, so a call costs at most
4 x 2^31 x 1,024 FLOPs (9e12, tens of ms on an H200). Each case also makes its tensor (at most
4.3 GB, one randn) and runs the float32 reference on 96 rows. A worker's first case initializes
CUDA and compiles the Triton quantizer (seconds). Per probed variant, two workers run at once: one
runs the rungs, the below cases and the contiguous above case (which aborts sm90, issue 16); the
other runs the fused above case (an illegal memory access there). The first worker is a spare the
pool started during the sweep; the others import torch and sageattention first (about 7 s on the
H200 host, docs/results/run9-h200x2-startup/worker-phases.txt), side by side. That is one or two
variants on an H200, about 10 s after the sweep, where certify took 101-107 s plus an estimated
20-30 s of long checks (limit 150 s). At most 12 GB of GPU memory per worker (span_probe), 4
workers.

Why the profile never goes above `limits.MAX_SPAN_ELEMENTS`, even when an above case was right:
the probe's long tensor is the query only, so a right call says nothing of K and V past 2^31 (the
fused V transpose's uint32 offsets, kijai/ComfyUI-KJNodes pull request 748). And past 2^31 an
int32 offset overflows term by term (batch, head, sequence), so one shape right there does not make
every shape of that span right. An above case is a finding of the report; it raises nothing.
"""

from __future__ import annotations

import dataclasses

from sage_qual import limits, records
from sage_qual.qualification import span_probe
from sage_qual.qualification.report_model import Outcome, SpanProbe
from sage_qual.qualification.span_probe import SpanCase, SpanFinding
from sage_qual.qualification.tasks import SpanTask

RUNG_FRACTION = 8  # the rung's limit: the boundary's / 8 (2^28 elements, 0.5 GB of bf16)


def cases(limit: int = limits.MAX_SPAN_ELEMENTS) -> list[tuple[SpanCase, int]]:
    """(case, the limit it sits at): the rung's below cases, then the boundary's below and above
    cases (`span_probe.boundary_cases`)."""
    rung = limit // RUNG_FRACTION
    return ([(c, rung) for c in span_probe.boundary_cases(rung) if c.side == "below"]
            + [(c, limit) for c in span_probe.boundary_cases(limit)])


def task_id(variant: str, case: SpanCase) -> str:
    return f"{variant}^span {case.layout} {case.side} {case.span}"


def jobs(variant: str, planned: list[tuple[SpanCase, int]]) -> list[list[SpanTask]]:
    """Worker jobs for one variant: every below case and the first above case in one job (a fault
    there ends its worker, with nothing after it), each further above case in a job of its own, so
    one that aborts costs its own worker only and the jobs run side by side."""
    def task(case: SpanCase, limit: int) -> SpanTask:
        return SpanTask(task_id(variant, case), variant, limit, **dataclasses.asdict(case))

    below = [task(*c) for c in planned if c[0].side == "below"]
    above = [task(*c) for c in planned if c[0].side != "below"]
    return [below + above[:1]] + [[t] for t in above[1:]]


def run_case(task: SpanTask, variant, package, bench) -> SpanProbe:
    """A worker's span task: the kernel on its case (cut down on fake GPUs: `bench.tokens`/`heads`),
    "pass" when right on the sampled rows, "fail" when wrong; a fault raises."""
    planned = SpanCase(task.layout, task.side, task.tokens, task.span, task.heads, task.head_dim,
                       task.kv_tokens)
    ran = span_probe.scaled(planned, bench.tokens(planned.tokens), bench.heads(planned.heads, planned.heads),
                            bench.tokens(planned.kv_tokens))
    found = span_probe.check_case(variant, package, ran, bench.device)
    right = found.outcome == span_probe.Verdict.OK
    detail = "" if right else (
        f"wrong on sampled rows: relative L2 {found.rel_l2:.3g} (right: below {span_probe.MAX_REL_L2}), "
        f"worst row {found.worst_row:.3g} (right: below {span_probe.MAX_WORST_ROW})")
    scaled = {} if ran == planned else {"ran_tokens": ran.tokens, "ran_heads": ran.heads,
                                        "ran_span": ran.span}
    numbers = records.finite_or_none({"rel_l2": found.rel_l2, "worst_row": found.worst_row})
    return task.record(Outcome.PASS if right else Outcome.FAIL, detail=detail, **numbers, **scaled)


def findings(probes, variant: str) -> list[SpanFinding]:
    """The report's probes (report_model.SpanProbe) of `variant` as span_probe findings."""
    return [SpanFinding(p.variant, SpanCase(p.layout, p.side, p.tokens, p.span, p.heads, p.head_dim,
                                            p.kv_tokens),
                        "ok" if p.outcome.value == "pass" else p.outcome.value)
            for p in probes if p.variant == variant]


def largest_safe(probes, variant: str) -> int | None:
    """The largest span right in every layout with every smaller probe right (None: none was)."""
    return span_probe.largest_safe_span(findings(probes, variant), variant)


def profile_limit(probes, served: set[str]) -> int | None:
    """A GPU's `max_span_elements` for the variants its profile entries serve: the smallest of their
    largest safe spans, never above `limits.MAX_SPAN_ELEMENTS` (the module docstring says why); 1
    when a served variant was probed and nothing was right (every call then goes to torch); None,
    the default, when nothing is served or a served variant was not probed."""
    probed = {p.variant for p in probes}
    if not served or not served <= probed:
        return None
    safe = [largest_safe(probes, variant) for variant in sorted(served)]
    if any(span is None for span in safe):
        return 1
    return min(min(safe), limits.MAX_SPAN_ELEMENTS)
