"""Certify's span probes on the real GPU (issue 16 item 3): `span_check`'s cases for the wrapper's
kernel on this GPU, run as worker tasks in certify's own pool, as `sage-qual certify` runs them
after its sweep. Below the limit every case must be right (the wrapper's default limit rests on
it); above, whatever happens is a finding (issue 16: an illegal memory access on the fused view, an
abort of the sm90 extension on a contiguous 2.15e9), and an abort or fault must cost its worker only.

Time on one H200, estimated (span_check's docstring): two workers side by side, about 10 s with
their imports (no spare started ahead here).
"""

import os
import threading

import pytest

from sage_qual import limits
from sage_qual.qualification.decide import profile
from sage_qual.qualification.evidence.report_model import Outcome, SpanProbe
from sage_qual.qualification.evidence.tasks import SpanTask
from sage_qual.qualification.measure import span_probe
from sage_qual.qualification.run import plan
from sage_qual.qualification.run import pool as workers

pytestmark = [pytest.mark.slow, pytest.mark.gpu]


def test_span_probes_of_the_wrapper_kernel_run_in_certify_workers(gpu0, tmp_path, record):
    assert gpu0.kernel is not None, gpu0.no_kernel_reason
    variant = gpu0.kernel.name
    jobs = plan.span_jobs(variant, plan.span_cases())
    visible = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]
    pool = workers.Pool(tmp_path)
    results, lock = {}, threading.Lock()

    def on_result(task: SpanTask, result: SpanProbe) -> None:
        with lock:
            results[task.id] = result

    def run(n: int, tasks: list[SpanTask]) -> None:
        env = {"CUDA_VISIBLE_DEVICES": visible, "TRITON_CACHE_DIR": str(tmp_path / f"triton-{n}")}
        workers.run_tasks(tasks, pool.take, 240.0, 300.0, on_result, env=env)

    threads = [threading.Thread(target=run, args=(n, tasks)) for n, tasks in enumerate(jobs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    pool.close()
    tasks = [task for job in jobs for task in job]
    assert set(results) == {task.id for task in tasks}  # every case has a finding: nothing lost
    # each finding is the report's probe of its task's case
    assert all((results[t.id].variant, results[t.id].layout, results[t.id].side, results[t.id].span,
                results[t.id].limit) == (variant, t.layout, t.side, t.span, t.limit) for t in tasks)
    for task in tasks:
        result = results[task.id]
        record(test="span-certify", variant=variant, kind=f"{task.layout} {task.tokens}", side=task.side,
               span=task.span, outcome=result.outcome.value, rel_l2=result.rel_l2, error=result.detail[:200])
    findings = profile.findings([results[t.id] for t in tasks], variant)
    wrong = [(task.id, results[task.id]) for task in tasks
             if task.side == "below" and results[task.id].outcome != Outcome.PASS]
    assert not wrong, f"within the default span limit: {wrong}"
    assert all(results[t.id].rel_l2 < span_probe.MAX_REL_L2 for t in tasks
               if results[t.id].outcome == Outcome.PASS)
    smallest_below = min(t.span for t in tasks if t.side == "below" and t.limit == limits.MAX_SPAN_ELEMENTS)
    assert span_probe.largest_safe_span(findings, variant) >= smallest_below
