"""The GPU executor: any plan's jobs in isolated worker processes, one GPU each.

This process never initializes CUDA. Discovery asks a worker for the machine (the environment and
what cannot run on each GPU; for `certify --target` a worker per GPU also says why the integration
cannot run there); then each device slot's jobs run in order in workers of that GPU (`pool`: a
crash, a hang or an out-of-memory costs one result), the slots side by side, one thread each. A
worker gets one GPU and a Triton cache of its own. Workers are started ahead of need
(`SPARES_PER_GPU`), so their imports overlap the work.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from sage_qual import limits
from sage_qual.errors import UsageError
from sage_qual.qualification.evidence import files, tasks
from sage_qual.qualification.evidence.report_model import Outcome
from sage_qual.qualification.run import plan as plan_mod
from sage_qual.qualification.run import pool
from sage_qual.qualification.run.options import Integration, RunRequest, no_gpu_message, requested_devices
from sage_qual.verdicts.env_record import EnvironmentRecord

# Workers kept starting ahead per GPU: a worker's start (a fork of the zygote, then CUDA's and the
# kernel's first call) costs seconds, and the first spares are forked while the zygote still imports.
SPARES_PER_GPU = 2


class WorkerExecutor:
    """Runs a plan's tasks in worker processes on the GPUs the request names (module docstring)."""
    predicted = False

    def __init__(self, request: RunRequest):
        self.request = request
        self.timeout = request.executor.timeout
        self.pool: pool.Pool | None = None

    def discover(self, request: RunRequest, subjects: list[str]) -> plan_mod.Machine:
        """The GPUs this run uses; UsageError when there is none, when sageattention cannot run our
        variants, or when --devices names a GPU this machine lacks."""
        logs = request.out / "logs"
        logs.mkdir(exist_ok=True)
        self.pool = pool.Pool(logs)
        target = isinstance(request.subject, Integration)
        self.pool.prefetch(SPARES_PER_GPU)  # the first GPU's, while the environment is collected
        try:
            collected = pool.collect_environment(plan_mod.environment_check(), logs / "environment.log",
                                                 limits.startup_timeout(self.timeout))
        except pool.WorkerError as error:
            raise UsageError(str(error)) from None
        env = collected.environment
        if not env.gpus:
            why = "CPU-only torch, no driver, or CUDA_VISIBLE_DEVICES empty"
            raise UsageError(no_gpu_message(target, why))
        if not target and env.sageattention_problem:
            raise UsageError(f"sageattention cannot run here: {env.sageattention_problem}")
        indices = device_indices(request.executor.devices, len(env.gpus))
        self.pool.prefetch(SPARES_PER_GPU * (len(indices) - 1))
        if target:
            not_supported = self._target_machine(subjects[0], indices)
        else:
            not_supported = {i: collected.not_supported.get(str(i), {}) for i in indices}
        return plan_mod.Machine(env, [plan_mod.DeviceFacts(env.gpus[i], not_supported[i]) for i in indices])

    def _target_machine(self, target: str, indices: list[int]) -> dict[int, dict[str, list[str]]]:
        """Per GPU, why the integration cannot run there ({}: it can), each asked in a worker of that
        GPU, side by side."""
        found: dict[int, dict[str, list[str]]] = {}

        def ask(index: int) -> None:
            def answer(task, result: tasks.MachineResult) -> None:
                reasons = result.reasons if result.outcome == Outcome.PASS else [result.detail]
                found[index] = {target: reasons} if reasons else {}

            with gpu_env(index) as env:
                pool.run_tasks([plan_mod.machine_check(target)], self.pool.take, self.timeout,
                               limits.startup_timeout(self.timeout), answer, env=env)

        parallel([functools.partial(ask, index) for index in indices], threading.Event())
        return found

    def run_slots(self, jobs: list[list[list[tasks.Task]]], writer: files.Writer, progress,
                  stop: threading.Event, refine: Callable | None = None,
                  ahead: list[list[tasks.Task]] = ()) -> None:
        """Every device slot's jobs, in order, the slots side by side; `refine(report, slot, job)` gives
        (shapes, tasks) to run after a job (none: nothing follows); `ahead[slot]`: tasks run beside
        the slot's jobs in a worker of their own, sharing its GPU and Triton cache (the plan's
        compile-ahead tasks)."""
        def slot_run(slot: int) -> None:
            index = writer.report.devices[slot].index
            beside = ahead[slot] if ahead else []
            with gpu_env(index) as env, self._beside(beside, index, progress, stop, env):
                for n, job in enumerate(jobs[slot]):
                    for todo in (job, None):
                        if todo is None:  # after a variant's sweep: time more lengths around its crossover
                            if refine is None:
                                continue
                            with writer.lock:
                                shapes, todo = refine(writer.report, slot, job)
                            writer.add_shapes(shapes)
                            progress.grow(len(todo))
                        if not todo:
                            continue
                        # While this worker runs, the next ones import torch: SPARES_PER_GPU started
                        # with the run, and one more per job taken while a job beyond them is left. A
                        # run that follows up always starts one (refinements and span probes follow);
                        # otherwise all jobs are known, so no spare is left unused (each cost a 1.5 s
                        # import on two test cores, 7 s on the H200 host).
                        prefetch = n + SPARES_PER_GPU < len(jobs[slot]) or refine is not None
                        spawn = functools.partial(self.pool.take, prefetch=prefetch)
                        self._run(todo, slot, index, spawn, writer, progress, stop, env)
                        if stop.is_set():
                            return

        parallel([functools.partial(slot_run, slot) for slot in range(len(jobs))], stop)

    @contextlib.contextmanager
    def _beside(self, todo: list[tasks.Task], index: int, progress, stop: threading.Event, env: dict):
        """`todo` run in a thread of its own while the block runs, and waited for before it ends (the
        block's Triton cache outlives it). Each result is one progress line, never evidence: what
        fails here costs time only (the job then compiles as it runs)."""
        if not todo:
            yield
            return

        def said(task: tasks.Task, result) -> None:
            progress.note(f"cuda:{index} {task.id}: " + (
                f"{result.calls} call(s) compiled in {result.seconds:.1f} s" if result.outcome == Outcome.PASS
                else f"{result.outcome.value}, {result.detail}; its job compiles as it runs"))

        def run() -> None:
            try:
                pool.run_tasks(todo, functools.partial(self.pool.take, prefetch=True), self.timeout,
                               limits.startup_timeout(self.timeout), said, stop, env=env)
            except Exception as error:  # a protocol error: the sweep's own jobs go on
                progress.note(f"cuda:{index} compile ahead failed: {type(error).__name__}: {error}")

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        try:
            yield
        finally:
            thread.join()

    def start_ahead(self, jobs: list[tuple[int, list[tasks.Task]]]) -> None:
        """A worker now for each job that will follow and whose tasks declare imports: it imports them
        while the sweep runs (8 context checks' imports, 9-11 s each on the H200 host, ran after it
        until run 31), and `run_side_by_side` takes it."""
        for _, job in jobs:
            if imports := tasks.imports(job):
                self.pool.prefetch(1, imports)

    def run_side_by_side(self, jobs: list[tuple[int, list[tasks.Task]]], writer: files.Writer, progress,
                         stop: threading.Event) -> None:
        """Jobs after the sweep (span probes, context checks), each in workers of its own, all at once."""
        def job_run(slot: int, todo: list[tasks.Task]) -> None:
            index = writer.report.devices[slot].index
            spawn = functools.partial(self.pool.take, imports=tasks.imports(todo))
            with gpu_env(index) as env:  # a cache per job: the jobs of one GPU run side by side
                self._run(todo, slot, index, spawn, writer, progress, stop, env)

        parallel([functools.partial(job_run, slot, todo) for slot, todo in jobs], stop)

    def _run(self, todo: list[tasks.Task], slot: int, index: int, spawn, writer: files.Writer, progress,
             stop: threading.Event, env: dict) -> None:
        pool.run_tasks(todo, spawn, self.timeout, limits.startup_timeout(self.timeout),
                       functools.partial(record, writer, slot, f"cuda:{index}", progress), stop, env=env)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()


def record(writer: files.Writer, slot: int, where: str, progress, task: tasks.Task,
           result: tasks.Result) -> None:
    """A task's report records (`tasks.report_entries`: a paired timing gives SDPA's, then the
    variant's) appended to its device's lists, and one tick of the progress."""
    entry = None
    for field, entry in tasks.report_entries(result):
        writer.append(slot, field, entry)
    progress.tick(where, entry)


def device_indices(text: str, count: int) -> list[int]:
    indices = requested_devices(text)
    if indices is None:
        return list(range(count))
    for index in indices:
        if index >= count:
            raise UsageError(f"there is no cuda:{index}: this machine shows {count} GPU(s) (cuda:0 to "
                             f"cuda:{count - 1})")
    return indices


def this_machine() -> EnvironmentRecord:
    """This machine's environment (what `sage-qual gate` checks a report against), collected in a
    worker process: collecting initializes CUDA, which the caller must not."""
    with tempfile.TemporaryDirectory(prefix="sage-qual-gate-") as logs:
        try:
            collected = pool.collect_environment(plan_mod.environment_check(), Path(logs) / "environment.log",
                                                 limits.STARTUP_TIMEOUT)
        except pool.WorkerError as error:
            raise UsageError(str(error)) from None
    return collected.environment


def parallel(jobs: list[Callable[[], None]], stop: threading.Event) -> None:
    """Each job in a thread of its own (one per GPU), waited for in this thread, which takes the
    interrupt: it sets `stop`, waits for every job to wind down and raises KeyboardInterrupt. A
    job's error is raised once all have ended: the other GPUs' results stay valid."""
    errors: list[BaseException] = []

    def guarded(job: Callable[[], None]) -> None:
        try:
            job()
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=guarded, args=(job,), daemon=True) for job in jobs]
    for thread in threads:
        thread.start()
    try:
        while any(t.is_alive() for t in threads):
            for thread in threads:
                thread.join(timeout=0.5)
    except KeyboardInterrupt:
        stop.set()
        for thread in threads:
            thread.join()
        raise
    if errors:
        raise errors[0]


@contextlib.contextmanager
def gpu_env(index: int):
    """The environment of a worker on GPU `index` (an index among the GPUs this process sees): that
    GPU only, and a Triton cache of its own, removed afterwards: no other process writes it at the
    same time, and the user's cache can neither serve a stale kernel nor be corrupted by a crashing
    worker."""
    parent_visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = parent_visible.split(",")[index] if parent_visible else str(index)
    cache = tempfile.mkdtemp(prefix=f"sage-qual-triton-cuda{index}-")
    try:
        yield {"CUDA_VISIBLE_DEVICES": visible, "TRITON_CACHE_DIR": cache}
    finally:
        shutil.rmtree(cache, ignore_errors=True)
