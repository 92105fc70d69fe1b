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
from sage_qual.qualification import pool as workers
from sage_qual.qualification import span_check, span_probe

pytestmark = [pytest.mark.slow, pytest.mark.gpu]


def test_span_probes_of_the_wrapper_kernel_run_in_certify_workers(gpu0, tmp_path, record):
    assert gpu0.kernel is not None, gpu0.no_kernel_reason
    variant = gpu0.kernel.name
    jobs = span_check.jobs(variant, span_check.cases())
    visible = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]
    pool = workers.Pool(tmp_path)
    results, lock = {}, threading.Lock()

    def on_result(task_id: str, result: dict) -> None:
        with lock:
            results[task_id] = result

    def run(n: int, tasks: list[dict]) -> None:
        env = {"CUDA_VISIBLE_DEVICES": visible, "TRITON_CACHE_DIR": str(tmp_path / f"triton-{n}")}
        workers.run_tasks(tasks, pool.take, 240.0, 300.0, on_result, env=env)

    threads = [threading.Thread(target=run, args=(n, tasks)) for n, tasks in enumerate(jobs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    pool.close()
    tasks = [task for job in jobs for task in job]
    assert set(results) == {task["id"] for task in tasks}  # every case has a finding: nothing lost
    findings = []
    for task in tasks:
        case, result = span_probe.SpanCase(**task["case"]), results[task["id"]]
        record(test="span-certify", variant=variant, kind=f"{case.layout} {case.tokens}", side=case.side,
               span=case.span, outcome=result["outcome"], rel_l2=result.get("rel_l2"),
               error=(result.get("detail") or "")[:200])
        findings.append(span_probe.SpanFinding(variant, case, "ok" if result["outcome"] == "pass"
                                               else result["outcome"]))
    wrong = [(task["id"], results[task["id"]]) for task in tasks
             if task["case"]["side"] == "below" and results[task["id"]]["outcome"] != "pass"]
    assert not wrong, f"within the default span limit: {wrong}"
    assert all(results[t["id"]]["rel_l2"] < span_probe.MAX_REL_L2 for t in tasks
               if results[t["id"]]["outcome"] == "pass")
    smallest_below = min(t["case"]["span"] for t in tasks
                         if t["case"]["side"] == "below" and t["limit"] == limits.MAX_SPAN_ELEMENTS)
    assert span_probe.largest_safe_span(findings, variant) >= smallest_below
