"""The certify worker under the test hook: fake GPUs and injected faults, on top of `run.worker`.

The environment variable `SAGE_QUAL_TEST_WORKER` holds JSON. {"gpus": [{"name", "capability"}...]}
runs the job on the fake CUDA and fake sageattention of `sage_qual.testing` with CPU tensors
(`FakeBench`), and {"comfy_kitchen": version} a fake comfy-kitchen of that version beside it;
{"faults": {task id: fault}} makes that task misbehave (`FAULTS`);
{"span_faults": {variant: [{"above": N, "fault": F, "layouts": [...]}, ...]}} makes that variant's
span probes (`span_probe`) misbehave as F where the planned span exceeds N elements (in the layouts
named; all when left out; the first rule that applies), as the real kernels fault or abort past
their 32-bit offsets; {"context_faults": {variant: defect}} applies that `detection.CONTEXT_DEFECTS`
defect (by name) to the variant's served calls during its context check. Without the variable the
worker measures the real GPU and nothing here runs (`pool.FAULTY_WORKER_MODULE` picks this module).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import time

import torch

from sage_qual.qualification.evidence import tasks
from sage_qual.qualification.evidence.tasks import TaskKind
from sage_qual.qualification.run import worker
from sage_qual.qualification.run.in_process import ModelKernels
from sage_qual.qualification.run.options import TEST_HOOK, test_hook  # noqa: F401 (tests set TEST_HOOK here)

FAULTS = {
    "crash": "abort the worker process",
    "hang": "sleep for an hour (the parent's timeout kills it)",
    "oom": "raise torch.OutOfMemoryError",
    "noise": "the fake kernel returns exact attention plus noise (fake GPUs only)",
    "model": ("the kernel computes as the variant's numerics model: on its model however poor that model "
              "is, a defect only the fitness judge sees"),
    "cuda-fault": "trip a real device-side assert, which poisons the worker's CUDA context",
    "illegal-address": "raise the error of a kernel's illegal memory access (fake GPUs: nothing poisoned)",
}


class FakeBench:
    """Test-only: the fake CUDA and fake sageattention on CPU tensors, speed shapes cut 256-fold."""

    device = "cpu"

    def __init__(self, gpus: list[dict], compiles: bool = False, comfy_kitchen: str | None = None):
        from sage_qual.testing import FakeCuda, FakeGpu, FakeSageAttention

        if compiles:  # TorchDynamo imports triton.language as it loads: before the fake `triton` stands in
            importlib.import_module("torch._dynamo")
            importlib.import_module("torch._functorch.aot_autograd")
            importlib.import_module("torch._inductor.codecache")

        fakes = [FakeGpu(tuple(g["capability"]), g["name"]) for g in gpus]
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible:
            fakes = [fakes[int(i)] for i in visible.split(",")]
        self.sage = FakeSageAttention(comfy_kitchen=comfy_kitchen)
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(FakeCuda(fakes))
        self._stack.enter_context(self.sage.installed())

    def tokens(self, n: int) -> int:
        return max(16, n // 256)

    def heads(self, heads: int, kv_heads: int) -> int:
        """Query heads a long check runs: one K/V group (each head's arithmetic is independent)."""
        return heads // kv_heads

    def extra_peak_bytes(self, fn):
        return fn(), 0

    def timings_ms(self, fn, warmup: int, repeats: int) -> list[float]:
        times = []
        for _ in range(min(repeats, 3)):  # enough for an interval; the fake's times mean nothing
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1000)
        return times

    def healthy(self) -> bool:
        return True

    def compile_only(self):
        return contextlib.nullcontext()  # the fake kernels compile nothing: their calls just run

    def context_place(self):
        from sage_qual.qualification.measure import context_check

        return context_check.FakePlace()

    def release(self) -> None:
        self.sage.behave()


class FaultyWorker(worker.Worker):
    """The certify worker under the test hook: on the fake GPUs its "gpus" name (the real GPU without
    them), each task misbehaving as "faults", "span_faults" and "context_faults" say."""

    def __init__(self, hook: dict, compiles: bool = False):
        super().__init__(FakeBench(hook["gpus"], compiles, hook.get("comfy_kitchen")) if "gpus" in hook
                         else worker.GpuBench())
        self.faults = hook.get("faults", {})
        self.span_faults = hook.get("span_faults", {})
        self.context_faults = hook.get("context_faults", {})

    def handle(self, task: tasks.Task) -> tasks.Result:
        fault = self.faults.get(task.id) or span_fault(self.span_faults, task)
        inject(fault, self.bench)
        defect = self.context_faults.get(task.variant) if task.KIND == TaskKind.CONTEXT else None
        kernels = self.kernels
        if fault == "model":
            self.kernels = ModelKernels()
        try:
            with context_fault(defect):
                return super().handle(task)
        finally:
            self.kernels = kernels


def main() -> int:
    """A worker process whose tasks run on `FaultyWorker` (read after its job set the environment)."""
    return worker.main(lambda todo: FaultyWorker(test_hook(), any(t.KIND == TaskKind.CONTEXT for t in todo)))


def span_fault(settings: dict, task) -> str | None:
    """The fault `span_faults` assigns a span probe task (`tasks.SpanTask`): that of the variant's
    first rule whose span it exceeds, in a layout the rule names (None: none, or not a span task)."""
    if task.KIND != TaskKind.SPAN:
        return None
    return next((rule["fault"] for rule in settings.get(task.variant, []) if task.span > rule["above"]
                 and task.layout in rule.get("layouts", [task.layout])), None)


def context_fault(name: str | None):
    """The context defect `context_faults` names for a variant, applied for a block (none: nothing)."""
    if name is None:
        return contextlib.nullcontext()
    from sage_qual.qualification.selftest import detection  # it certifies, through this module

    known = {defect.name: defect for defect in detection.CONTEXT_DEFECTS}
    if name not in known:
        raise ValueError(f"unknown context defect {name!r} (known: {', '.join(known)})")
    return detection.injected(known[name])


def inject(fault: str | None, bench) -> None:
    """Make the current task misbehave as `fault` says (None: behave)."""
    if fault == "crash":
        print("test fault: aborting the worker", file=sys.stderr, flush=True)
        os.abort()
    elif fault == "hang":
        time.sleep(3600)
    elif fault == "oom":
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 GiB (test fault)")
    elif fault == "noise":
        if not isinstance(bench, FakeBench):
            raise ValueError("the test fault 'noise' needs the fake kernel")
        bench.sage.return_value(lambda exact: exact + torch.randn_like(exact))
    elif fault == "cuda-fault":
        torch._assert_async(torch.zeros((), dtype=torch.bool, device="cuda"))
        torch.cuda.synchronize()
    elif fault == "illegal-address":
        raise RuntimeError("CUDA error: an illegal memory access was encountered (test fault)")
    elif fault is not None and fault not in FAULTS:
        raise ValueError(f"unknown test fault {fault!r} (known: {', '.join(FAULTS)})")
