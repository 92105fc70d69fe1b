"""The in-process executor (`certify --emulate`): the worker's own task handlers, run in this
process, with each variant's numerics model (`sage_qual.kernels.numerics`) as its kernel.

No GPU runs: a cell is measured and judged by `measure.cell` exactly as on a GPU, against the budget
derived from the same model with the suite's margin, so a prediction fails where the model's own
output does: non-finite (an fp16 accumulator overflowing, a zero V channel under FP8). It also fails
where the model names a hazard (`numerics.hazards`: output that depends on memory the model cannot
see), naming it: such a cell is never predicted to pass. The report is
marked predicted everywhere: one pseudo-device, "numerics model (CPU)", no speed section, no memory
figures (the model allocates nothing like the kernel), and `sage-qual gate` refuses it.

Long checks are predicted at their full length: the model stands for the kernel on the sampled rows
(so only a non-finite prediction can fail), every layout is identical by construction (the model
reads values, not memory), and one K/V group of heads stands for all of them (each head's
arithmetic is independent of the others'), on `LONG_BLOCKS` sampled row blocks, to keep the CPU cost
at seconds per check; checks alike after that reduction are computed once.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from pathlib import Path

import torch

from sage_qual.fixtures import fileformat
from sage_qual.kernels import numerics
from sage_qual.kernels.variants import VARIANTS
from sage_qual.qualification.evidence import files, tasks
from sage_qual.qualification.evidence.report_model import Cell, LongCheck, Outcome
from sage_qual.qualification.measure import budgets, judge
from sage_qual.qualification.run import plan as plan_mod
from sage_qual.qualification.run import worker as worker_mod
from sage_qual.qualification.run import worker_executor
from sage_qual.serving import environment
from sage_qual.verdicts.env_record import GpuInfo

PREDICTED = "predicted by the CPU numerics model (sage_qual.kernels.numerics), not measured on a GPU"
LONG_BLOCKS = 2  # sampled row blocks per predicted long check: the first and the last
DEVICE_NAME = "numerics model (CPU, predicted)"


class ModelKernels:
    """Each variant's numerics model where the worker calls a kernel: on a fixture, the prediction its
    budget is derived from (computed once for both)."""

    def problem(self, variant) -> None:
        return None  # the model runs every variant

    def call(self, variant, q, k, v, smooth_k: bool = False, fixture=None):
        if fixture is not None and not smooth_k:
            return budgets.prediction(variant, fixture)
        return numerics.predict(variant, q, k, v, smooth_k=smooth_k)

    def long_kernel(self, variant) -> None:
        return None  # long_check.check predicts where it has no kernel


class CpuBench:
    """This process's CPU: whole tensors, one K/V group of heads for long checks, no memory figure."""
    device = "cpu"
    long_blocks = LONG_BLOCKS

    def tokens(self, n: int) -> int:
        return n

    def heads(self, heads: int, kv_heads: int) -> int:
        return heads // kv_heads

    def extra_peak_bytes(self, fn):
        return fn(), None

    def healthy(self) -> bool:
        return True

    def release(self) -> None:
        """Nothing to free between tasks."""


def _with_hazards(task: tasks.CellTask, cell: Cell) -> Cell:
    """A predicted cell failed by each hazard the model names on its fixture (`judge.hazard_reasons`)."""
    if not cell.measured:
        return cell
    fixture = fileformat.load_fixture(task.fixture)
    found = list(budgets.expectation(VARIANTS[task.variant], fixture).hazards)
    if not found:
        return cell
    reasons = cell.reasons + judge.hazard_reasons(found)
    return dataclasses.replace(cell, hazards=found, reasons=reasons, outcome=Outcome.FAIL)


def free_cpus() -> int:
    """Torch threads for a prediction: the CPUs this process may use less those other processes keep
    busy as the run starts, at least one. torch's threads wait for each other at every parallel
    operation, so one CPU taken by another process stalls them all: on 2 cores with two CPU-bound
    processes beside it, 2 threads took the main job 127 s where it took 25 s alone
    (docs/fast-suite.md, "The main job on a busy machine"). The load average would count this
    process's own recent work and lags by a minute; the processes running now (`others_running`) do
    not."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, usable - others_running())


def others_running(samples: int = 5, interval: float = 0.01) -> int:
    """Threads of other processes running now: the kernel's count of running threads
    (/proc/loadavg's fourth field) less this process's own, the median of a few samples; 0 where
    /proc cannot say (not Linux)."""
    counts = []
    for sample in range(samples):
        try:
            running = int(Path("/proc/loadavg").read_text().split()[3].split("/")[0])
            own = sum(1 for task in Path("/proc/self/task").iterdir() if _state(task) == "R")
        except (OSError, ValueError, IndexError):
            return 0
        counts.append(max(0, running - own))
        if sample + 1 < samples:
            time.sleep(interval)
    return sorted(counts)[len(counts) // 2]


def _state(task: Path) -> str:
    """A thread's scheduler state letter ("R": running), from its stat line (after the parenthesised name)."""
    try:
        return (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


class InProcessExecutor:
    """Runs a plan's jobs in this thread, through `worker.HANDLERS`; an interrupt (KeyboardInterrupt)
    stops between two tasks. Its torch threads are the free CPUs (`free_cpus`) unless OMP_NUM_THREADS
    says how many."""
    predicted = True

    def __init__(self):
        if not os.environ.get("OMP_NUM_THREADS"):
            torch.set_num_threads(free_cpus())
        self.worker = worker_mod.Worker(CpuBench(), kernels=ModelKernels())
        self.long: dict[tuple, LongCheck] = {}

    def discover(self, request, subjects: list[str]) -> plan_mod.Machine:
        device = GpuInfo(index=0, name=DEVICE_NAME, capability=(0, 0), memory_gib=0.0)
        return plan_mod.Machine(environment.collect(), [plan_mod.DeviceFacts(device, {})])

    def run_slots(self, jobs: list[list[list[tasks.Task]]], writer: files.Writer, progress,
                  stop: threading.Event, refine=None, ahead=()) -> None:
        # A prediction is planned with neither a refinement nor tasks ahead (`plan.build`).
        for slot, slot_jobs in enumerate(jobs):
            for job in slot_jobs:
                for task in job:
                    start = time.monotonic()
                    result = self.predict(task)
                    result = dataclasses.replace(tasks.timed(result, round(time.monotonic() - start, 3)),
                                                 detail=result.detail or PREDICTED)
                    worker_executor.record(writer, slot, "cpu", progress, task, result)

    def predict(self, task: tasks.Task) -> tasks.Result:
        """One task's result as the model predicts it: a cell failed by each hazard the model names,
        a long check computed once per reduced call."""
        if isinstance(task, tasks.LongTask):
            return self._long(task)
        found = self.worker.run(task)
        return _with_hazards(task, found) if isinstance(task, tasks.CellTask) else found

    def run_side_by_side(self, jobs, writer, progress, stop) -> None:
        raise AssertionError("an in-process plan follows nothing up")

    def _long(self, task: tasks.LongTask) -> LongCheck:
        """A long check, computed once per reduced call and variant."""
        shape = task.shape
        key = (task.variant, shape.heads // shape.kv_heads, shape.q_tokens, shape.kv_tokens, shape.head_dim,
               shape.dtype)
        if key not in self.long:
            self.long[key] = self.worker.run(task)
        found = self.long[key]
        if not isinstance(found, LongCheck) or found.shape == shape:
            return found
        return dataclasses.replace(found, shape=shape, uses=task.uses, layouts=task.layouts,
                                   identical={name: True for name in task.layouts if name != "contiguous"},
                                   ran_heads=key[1] if key[1] != shape.heads else None)

    def close(self) -> None:
        """Nothing to end: no worker ran."""
