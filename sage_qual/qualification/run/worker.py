"""A certify worker: one fresh process runs one job of tasks on one GPU and streams the results.

The parent's side (starting, following and killing workers) is `pool`; the test hooks that fake
the GPU or inject faults (`selftest.faults.FaultyWorker`) sit on top of `Worker`, which knows none.

A worker, forked from the zygote, has torch and what a kernel's first call imports
(`kernels.kernel_imports`); it waits for one JSON job line on stdin (so the parent can start it early,
while another worker still runs). It keeps reading stdin: end of file means the parent died, and
the worker exits. Results leave as JSON lines on the original stdout; file descriptor 1 is pointed
at stderr first, so whatever Triton, CUDA or a print writes there lands in the stderr log whose
tail the parent keeps for crash reports.

The job and the messages are `tasks`' records: the job's tasks (`tasks.parse_task`), then a
"ready" message once it has its job, per task "start" and "result" (the task's report record), and
"done". A task the worker survives always gets a result (oom and crash included); after a CUDA
error that poisons the context it reports the task and exits, and the parent runs the rest in a new
worker.

All numbers come from `sage_qual.qualification.measure.accuracy`, the functions `pytest -m slow` uses.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import ContextManager, Protocol

import torch

from sage_qual import records
from sage_qual.fixtures import fileformat
from sage_qual.kernels import sage_package
from sage_qual.kernels.providers import PROVIDERS
from sage_qual.kernels.variants import VARIANTS
from sage_qual.qualification.evidence import tasks
from sage_qual.qualification.evidence.report_model import Outcome, ShapeSpec
from sage_qual.qualification.evidence.tasks import MessageType
from sage_qual.qualification.measure import accuracy, cell, long_check, span_probe
from sage_qual.qualification.run.pool import EXIT_POISONED
from sage_qual.serving import environment, failures
from sage_qual.serving.assess import assess_machine

# SDPA's backends by the SDPBackend member that selects each; left alone, SDPA picks one of them.
SDPA_BACKENDS = {"cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION"}
# (warm-up, repeats) of the screen that picks the fastest backend: the full timing of all four
# backends took 28 s of a 160 s certify on the H200 (docs/results/run8-h200x2-final/certify/
# certify-a); only the chosen backend needs the repeats behind the confidence interval.
SCREEN = (1, 3)


class WorkerBench(cell.Bench, Protocol):
    """What a worker's handlers need of where they run, beyond a cell's (`cell.Bench`): `GpuBench`
    and the tests' `selftest.faults.FakeBench` implement all of it; the numerics model's
    `in_process.CpuBench` the part its handlers (cells, long checks) call."""

    def tokens(self, n: int) -> int:
        """The token count run for a planned one (a fake GPU cuts them)."""

    def heads(self, heads: int, kv_heads: int) -> int:
        """The query heads a long check runs."""

    def timings_ms(self, fn: Callable[[], object], warmup: int, repeats: int) -> list[float]:
        """fn timed `repeats` times after `warmup` calls, in milliseconds."""

    def healthy(self) -> bool:
        """Whether the device still works (a CUDA fault poisons it)."""

    def release(self) -> None:
        """Whatever a task left allocated, freed."""

    def context_place(self):
        """Where `context_check` runs its execution contexts."""

    def compile_only(self) -> ContextManager[None]:
        """A block whose JIT kernels compile without a launch (`Worker.compile`)."""


class Kernels(Protocol):
    """The kernels a worker measures: the installed providers' (`PackageKernels`, the fakes under the
    test hooks) or each variant's numerics model (`in_process.ModelKernels`)."""

    def problem(self, variant) -> str | None:
        """Why `variant` cannot run here (None: it can)."""

    def call(self, variant, q, k, v, smooth_k: bool = False, fixture=None) -> torch.Tensor:
        """`variant` on [B, H, N, D] q, k, v, as certify calls it."""

    def long_kernel(self, variant) -> long_check.Kernel | None:
        """`variant` called in a layout (None: the model stands for it, `long_check.check`)."""

    def package(self, variant):
        """`variant`'s provider package (span probes call its kernel; a prediction runs none)."""


class GpuBench:
    """The one GPU this worker sees (the parent sets CUDA_VISIBLE_DEVICES)."""

    device = "cuda"

    def tokens(self, n: int) -> int:
        return n

    def heads(self, heads: int, kv_heads: int) -> int:
        return heads

    def extra_peak_bytes(self, fn):
        return accuracy.extra_peak_bytes(fn, 0)

    def timings_ms(self, fn, warmup: int, repeats: int) -> list[float]:
        return accuracy.timings_ms(fn, warmup, repeats)

    def healthy(self) -> bool:
        try:
            torch.cuda.synchronize()
            return True
        except Exception:
            return False

    def context_place(self):
        from sage_qual.qualification.measure import context_check

        return context_check.Gpu()

    def compile_only(self):
        return triton_launches_off()

    def release(self) -> None:
        with contextlib.suppress(Exception):  # a poisoned context fails here too; healthy() says so
            torch.cuda.empty_cache()


class PackageKernels:
    """The variants' kernels of the installed providers (the fakes under the test hooks), each
    provider's package loaded at the first task that needs it, as certify calls them (K smoothing off)."""

    def __init__(self):
        self._packages = {}

    def package(self, variant):
        """The package of `variant`'s provider; SageUnavailable (the task's crash) when it does not load."""
        if variant.provider not in self._packages:
            self._packages[variant.provider] = sage_package.load(PROVIDERS[variant.provider])
        return self._packages[variant.provider]

    def problem(self, variant) -> str | None:
        """Why the package cannot run `variant` (None: it can)."""
        return sage_package.kernel_problem(self.package(variant), variant)

    def call(self, variant, q, k, v, smooth_k: bool = False, fixture=None):
        return accuracy.call_kernel(self.package(variant), variant, q, k, v, smooth_k=smooth_k,
                                    attn_mask=None if fixture is None else fixture.mask)

    def long_kernel(self, variant) -> long_check.Kernel | None:
        return long_check.kernel_of(self.package(variant), variant)


class Worker:
    """Runs tasks, each through its kind's handler (`HANDLERS`), on one bench with one set of kernels;
    an exception becomes the task's oom or crash result."""

    def __init__(self, bench: WorkerBench, kernels: Kernels | None = None):
        self.bench = bench
        self.kernels = kernels or PackageKernels()

    def run(self, task: tasks.Task) -> tasks.Result:
        try:
            return self.handle(task)
        except Exception as error:
            first_line = (str(error).strip().splitlines() or [""])[0]
            detail = f"{type(error).__name__}: {first_line}"[:500]
            if failures.is_out_of_memory(error):
                return task.record(Outcome.OOM, detail=detail)
            return task.record(Outcome.CRASH, detail=detail, traceback=traceback.format_exc()[-3000:])
        finally:
            self.bench.release()

    def handle(self, task: tasks.Task) -> tasks.Result:
        """The task's result from its kind's handler; what it raises, `run` records. The seam where
        the tests' `selftest.faults.FaultyWorker` makes a task misbehave."""
        return HANDLERS[task.KIND](self, task)

    def _variant(self, task):
        """The task's variant, and why the kernels cannot run it (None: they can)."""
        variant = VARIANTS[task.variant]
        return variant, self.kernels.problem(variant)

    # Handlers ------------------------------------------------------------------------------
    def env(self, task: tasks.EnvTask) -> tasks.EnvResult:
        machine = assess_machine()
        env = environment.collect(machine=machine)
        # Per visible GPU, each variant that cannot run on it and why (the parent has no CUDA).
        not_supported = {str(gpu.index): gpu.not_supported() for gpu in machine.gpus}
        return task.record(Outcome.PASS, environment=env, not_supported=not_supported)

    def cell(self, task: tasks.CellTask):
        variant, problem = self._variant(task)
        if problem:
            return task.record(Outcome.SKIP, detail=problem)
        fixture = fileformat.load_fixture(task.fixture, device=self.bench.device)

        def call(q, k, v, smooth_k=False):
            return self.kernels.call(variant, q, k, v, smooth_k=smooth_k, fixture=fixture)

        # K smoothing on, for comparison on outlier fixtures: only where the kernel has the option.
        smoothed = functools.partial(call, smooth_k=True) if variant.kernel_function.can_smooth_k else None
        return cell.measure_cell(task.variant, variant, fixture, call, self.bench, task.memory_bound,
                                 smooth_k_call=smoothed)

    def target_machine(self, task: tasks.TargetMachineTask):
        """`certify --target`: why the integration cannot run on this GPU ([]: it can)."""
        from sage_qual.qualification.integrations import targets  # the wrapper: only where a target runs

        target = targets.resolve(task.target)
        return task.record(Outcome.PASS, reasons=target.machine_reasons(targets.box_facts()))

    def target_cell(self, task: tasks.TargetCellTask):
        """`certify --target`: the integration instead of a variant on a fixture."""
        from sage_qual.qualification.integrations import targets

        fixture = fileformat.load_fixture(task.fixture, device=self.bench.device)
        return cell.measure_target(targets.resolve(task.target), fixture, tuple(task.capability), self.bench,
                               task.memory_bound)

    def sdpa(self, task: tasks.SdpaTask):
        """The fastest SDPA backend: each one timed briefly (SCREEN), the fastest then timed in full."""
        q, k, v = self._tensors(task.shape)
        timings, screened, refused = self._screen_sdpa(q, k, v)
        if not screened:
            return task.record(Outcome.SKIP, detail="no SDPA backend takes this shape", refused=refused)
        best = min(screened, key=screened.get)
        samples = timings(best, task.warmup, task.repeats)
        return task.record(Outcome.PASS, statistics.median(samples), samples_ms=samples, best_backend=best,
                           backends=screened, refused=refused)

    def paired(self, task: tasks.PairedTask):
        """A variant and the fastest SDPA backend at one shape, timed call by call in turn in this
        worker, so that drift of the GPU (clock, temperature, another process) hits both alike and
        cancels in their ratio: the sm90 kernel's times moved up to 10 % between H200 runs while
        SDPA's repeated to 3 digits (docs/results/README.md, run 10). The variant's timing, with
        SDPA's under "sdpa"."""
        variant, problem = self._variant(task)
        if problem:
            return task.record(Outcome.SKIP, detail=problem,
                               sdpa=task.sdpa_record(Outcome.SKIP, detail=f"not timed: {problem}"))
        q, k, v = self._tensors(task.shape)
        timings, screened, refused = self._screen_sdpa(q, k, v)
        if not screened:
            nothing = "no SDPA backend takes this shape"
            return task.record(Outcome.SKIP, detail=nothing,
                               sdpa=task.sdpa_record(Outcome.SKIP, detail=nothing, refused=refused))
        best = min(screened, key=screened.get)

        def ours():
            return self.kernels.call(variant, q, k, v)

        self.bench.timings_ms(ours, task.warmup, 0)
        timings(best, task.warmup, 0)
        ours_ms, sdpa_ms = [], []
        for _ in range(task.repeats):
            ours_ms += self.bench.timings_ms(ours, 0, 1)
            sdpa_ms += timings(best, 0, 1)
        sdpa = task.sdpa_record(Outcome.PASS, statistics.median(sdpa_ms), samples_ms=sdpa_ms,
                                best_backend=best, backends=screened, refused=refused)
        return task.record(Outcome.PASS, statistics.median(ours_ms), samples_ms=ours_ms, sdpa=sdpa)

    def _screen_sdpa(self, q, k, v):
        """SDPA's backends at these tensors, each timed briefly (SCREEN): (a function that times one
        backend, each backend's median, why each refused the shape)."""
        from torch.nn.attention import SDPBackend, sdpa_kernel

        gqa = q.shape[1] != k.shape[1]

        def timings(backend: str, warmup: int, repeats: int) -> list[float]:
            with sdpa_kernel([getattr(SDPBackend, SDPA_BACKENDS[backend])]):  # its cost is not timed
                return self.bench.timings_ms(lambda: accuracy.TORCH_SDPA(q, k, v, enable_gqa=gqa), warmup,
                                             repeats)

        screened, refused = {}, {}
        for name in SDPA_BACKENDS:
            try:
                screened[name] = statistics.median(timings(name, *SCREEN))
            except (RuntimeError, NotImplementedError) as error:  # it does not take the shape (or memory)
                if not self.bench.healthy():
                    raise
                refused[name] = (str(error).strip().splitlines() or [""])[0][:300]
                self.bench.release()
        return timings, screened, refused

    def speed(self, task: tasks.SpeedTask):
        variant, problem = self._variant(task)
        if problem:
            return task.record(Outcome.SKIP, detail=problem)
        q, k, v = self._tensors(task.shape)
        samples = self.bench.timings_ms(lambda: self.kernels.call(variant, q, k, v), task.warmup,
                                        task.repeats)
        return task.record(Outcome.PASS, statistics.median(samples), samples_ms=samples)

    def long(self, task: tasks.LongTask):
        """A long check (`long_check`): the variant at one long call, in each layout of the task; the
        bench may run fewer tokens and heads, and fewer sampled blocks (`bench.long_blocks`)."""
        variant, problem = self._variant(task)
        if problem:
            return task.record(Outcome.SKIP, detail=problem)
        s = task.shape
        heads = self.bench.heads(s.heads, s.kv_heads)
        q, k, v = long_check.synthetic(s, self.bench.device, self.bench.tokens, heads)
        result = long_check.check(task, q, k, v, self.kernels.long_kernel(variant),
                                  blocks=getattr(self.bench, "long_blocks", long_check.SAMPLE_BLOCKS))
        ran, ran_keys = q.shape[2], k.shape[2]
        return dataclasses.replace(result, ran_tokens=ran if ran != s.q_tokens else None,
                                   ran_kv_tokens=ran_keys if ran_keys != s.kv_tokens else None,
                                   ran_heads=heads if heads != s.heads else None)

    def span(self, task: tasks.SpanTask):
        """A span probe (`span_probe`): the variant on one tensor span near the 32-bit limit, cut down
        on fake GPUs (`bench.tokens`/`heads`); "pass" when right on the sampled rows, "fail" when
        wrong; a fault raises (and costs this worker only)."""
        variant, problem = self._variant(task)
        if problem:
            return task.record(Outcome.SKIP, detail=problem)
        return span_probe.run_task(task, variant, self.kernels.package(variant), self.bench)

    def context(self, task: tasks.ContextTask):
        """The variant in every execution context (`context_check`): pass when every check passed."""
        variant, problem = self._variant(task)
        if problem:
            return task.record(Outcome.SKIP, detail=problem)
        from sage_qual.qualification.measure import context_check  # torch.compile's imports: only here

        place = self.bench.context_place()
        runs = context_check.check_variant(variant, place, tuple(task.shape), getattr(torch, task.dtype))
        ran = list(place.kernel_shape(task.shape))
        failed = [run for run in runs if not run.passed]
        detail = "; ".join(f"{run.name}: {run.failure()}" for run in failed)
        return task.record(Outcome.FAIL if failed else Outcome.PASS, runs=runs, detail=detail,
                           ran_shape=ran if ran != list(task.shape) else None)

    def compile(self, task: tasks.CompileTask):
        """A Triton variant's kernels compiled ahead of its sweep job, none launched.

        Triton compiles a kernel at its first call of each specialization (dtype, head size, whether
        each length and stride divides by 16) and builds a C launcher per new signature: so
        sm86-fp16-triton's sweep job took 36.8 s of run 34's 155.6 s certify on the H200, against
        10-16 s for each CUDA variant's (docs/results/run34-h200/certify.log.gz). This worker, on the
        job's GPU and Triton cache, beside the sweep, calls the variant once per call the job will
        make (`plan.compile_ahead`) on uninitialized tensors (a compile reads shapes, strides and
        alignment, never values) under the bench's compile-only mode; the job then loads every
        kernel from the cache. Nothing here is evidence."""
        variant, problem = self._variant(task)
        if problem:
            return task.record(Outcome.SKIP, detail=problem)
        kernel = self.kernels.long_kernel(variant)
        with self.bench.compile_only():
            for call in task.calls:
                kernel(*self._empty(call.shape, call.layout))
        return task.record(Outcome.PASS, calls=len(task.calls))

    def _empty(self, s: ShapeSpec, layout: str) -> tuple:
        """Uninitialized q, k, v of the shape (lengths as the bench runs them) arranged in `layout`,
        and the tensor_layout to call with (`long_check.arrange`)."""
        dtype = getattr(torch, s.dtype.value)

        def empty(heads: int, tokens: int) -> torch.Tensor:
            return torch.empty(s.batch, heads, self.bench.tokens(tokens), s.head_dim, dtype=dtype,
                               device=self.bench.device)

        q, k, v = empty(s.heads, s.q_tokens), empty(s.kv_heads, s.kv_tokens), empty(s.kv_heads, s.kv_tokens)
        return long_check.arrange(q, k, v, layout)

    def _tensors(self, s: ShapeSpec):
        generator = torch.Generator(self.bench.device).manual_seed(0)
        dtype = getattr(torch, s.dtype.value)

        def make(heads, tokens):
            return torch.randn(s.batch, heads, self.bench.tokens(tokens), s.head_dim, dtype=dtype,
                               device=self.bench.device, generator=generator)

        return make(s.heads, s.q_tokens), make(s.kv_heads, s.kv_tokens), make(s.kv_heads, s.kv_tokens)


@contextlib.contextmanager
def triton_launches_off():
    """Every Triton kernel launch in the block replaced by Triton's own warm-up of it (`warmup=True`:
    compiled and cached, not launched), and the compiled kernel's launcher built and its binary
    loaded (`CompiledKernel.run`, which a warm-up leaves to the first launch): all but the launch."""
    from triton.runtime.jit import JITFunction

    launch = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = launch(self, *args, grid=grid, warmup=True, **kwargs)
        if kernel is not None:
            kernel.run  # noqa: B018 (the property builds the launcher and loads the binary)
        return kernel

    JITFunction.run = compile_only
    try:
        yield
    finally:
        JITFunction.run = launch


# One handler per task kind, for a worker process and for the in-process executor alike.
HANDLERS: dict[tasks.TaskKind, Callable[[Worker, tasks.Task], tasks.Result]] = {
    tasks.TaskKind.ENV: Worker.env,
    tasks.TaskKind.CELL: Worker.cell,
    tasks.TaskKind.SDPA: Worker.sdpa,
    tasks.TaskKind.SPEED: Worker.speed,
    tasks.TaskKind.PAIRED: Worker.paired,
    tasks.TaskKind.LONG: Worker.long,
    tasks.TaskKind.SPAN: Worker.span,
    tasks.TaskKind.CONTEXT: Worker.context,
    tasks.TaskKind.COMPILE: Worker.compile,
    tasks.TaskKind.TARGET_MACHINE: Worker.target_machine,
    tasks.TaskKind.TARGET_CELL: Worker.target_cell,
}


def _exit_when_orphaned() -> None:
    # Raw reads: a daemon thread blocked in the buffered sys.stdin would abort interpreter exit.
    while os.read(0, 65536):
        pass
    os._exit(3)  # end of file: the parent is gone (or done with us)


def main(make_worker: Callable[[list[tasks.Task]], Worker] | None = None) -> int:
    """A worker process: reads its job, runs its tasks on `make_worker(tasks)` (the GPU's by default),
    streams the results."""
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    line = sys.stdin.readline()
    if not line:  # a spare worker the parent did not need
        return 0
    job = records.parse(tasks.Job, json.loads(line), "the job from the parent", tasks.FIX)
    os.environ.update(job.env)  # its GPU and Triton cache: before anything reads them
    todo = [tasks.parse_task(task) for task in job.tasks]
    first = todo[0].id if todo else "-"
    print(f"sage-qual worker {os.getpid()}: {len(todo)} task(s), first {first}, env {job.env}",
          file=sys.stderr, flush=True)
    threading.Thread(target=_exit_when_orphaned, daemon=True).start()

    def send(message: tasks.Message) -> None:
        channel.write(json.dumps(records.dump(message), allow_nan=False) + "\n")

    worker = make_worker(todo) if make_worker else Worker(GpuBench())
    bench = worker.bench
    send(tasks.Message(MessageType.READY))
    for task in todo:
        send(tasks.Message(MessageType.START, task.id))
        start = time.monotonic()
        result = worker.run(task)
        send(tasks.result_message(task, round(time.monotonic() - start, 3), result))
        if result.outcome == Outcome.CRASH and not bench.healthy():
            print(f"sage-qual worker: the CUDA context is unusable after {task.id}; exiting",
                  file=sys.stderr, flush=True)
            return EXIT_POISONED
    send(tasks.Message(MessageType.DONE))
    return 0


if __name__ == "__main__":
    sys.exit(main())
