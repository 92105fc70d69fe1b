"""The parent's side of certify's worker processes: start them, feed them a job, follow them.

A worker (`sage_qual.qualification.run.worker`, its own process) runs one job of tasks on one GPU
and streams JSON lines back (`tasks`: the typed tasks, messages and results); this module starts
workers ahead of need (`Pool`), kills one that sends nothing for the task timeout, turns a death
into a "crash" or "timeout" result for the task it was in, and runs the rest in a fresh worker
(`run_tasks`). A message that breaks the protocol ends the run with one line naming its key. It
never imports torch and never touches CUDA: a fault in a kernel can only take a worker down.

Workers are forked from a zygote (multiprocessing's fork server), one process per parent that has
imported torch and the worker's modules but never touches CUDA, so that each worker skips that
import (`_Forked`): each was a fresh interpreter importing torch, 1.1 of its 1.2 s start on two CPU
cores (`python -X importtime`, docs/fast-suite.md). A forked worker is still its own process in its
own session, with the environment, stdin, stdout and stderr a fresh interpreter would get.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import multiprocessing
import multiprocessing.forkserver
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from multiprocessing import reduction
from pathlib import Path
from typing import Callable

from sage_qual import records
from sage_qual.limits import MAX_WORKER_FAILURES
from sage_qual.qualification.evidence import tasks as tasks_mod
from sage_qual.qualification.evidence.report_model import Outcome
from sage_qual.qualification.evidence.tasks import MessageType, Result, Task
from sage_qual.qualification.run.options import TEST_HOOK

WORKER_MODULE = "sage_qual.qualification.run.worker"
# Under the test suite's fake-GPU hook (`options.TEST_HOOK`) a worker is the self-test's, faults on top
# of `worker.Worker`: named, never imported here, so that run/ does not depend on selftest/.
FAULTY_WORKER_MODULE = "sage_qual.qualification.selftest.faults"
EXIT_POISONED = 70  # a worker's exit code when a CUDA error left its context unusable
# Seconds to wait for a dead worker's pipe to close (its process group was killed, so at once; a
# grandchild that escaped the group could hold it open, and then the reader is left behind).
READER_JOIN_TIMEOUT = 10.0
# Imported once, in the zygote, before it forks a worker: this module first, so that the environment
# those imports set is known (`_ENV_AT_IMPORT`); the worker module imports torch; `kernels.kernel_imports`
# what a kernel's first call imports.
ZYGOTE_PRELOAD = [__name__, WORKER_MODULE, "sage_qual.kernels.kernel_imports"]
_ENV_AT_IMPORT = dict(os.environ)
_zygote_lock = threading.Lock()
_zygote: multiprocessing.context.ForkServerContext | None = None


def _zygote_context() -> multiprocessing.context.ForkServerContext:
    global _zygote
    with _zygote_lock:
        if _zygote is None:
            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload(ZYGOTE_PRELOAD)
            _zygote = context
        return _zygote


def start_zygote() -> None:
    """Start the zygote now, without waiting for it: its imports (torch, torch._dynamo and
    sageattention, 8-10 s on the H200 host, whose image writes no bytecode) then run beside the
    parent's own import of torch instead of after it (docs/results/run31-h200)."""
    _zygote_context()
    multiprocessing.forkserver.ensure_running()


class _PassedFd:
    """A file descriptor handed to a forked worker, sent as multiprocessing sends a Connection's."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return _received_fd, (reduction.DupFd(self.fd),)


def _received_fd(duplicate) -> int:
    return duplicate.detach()


def _forked_worker(env: dict, imports: tuple[str, ...], stdin: int, stdout: int, stderr: int) -> None:
    """A worker's start in the forked child: its own session, its pipes and log as fds 0-2, the
    environment it was given (plus what the zygote's imports set, as they would set it again), then
    `imports`, before it waits for its job. An import that fails here fails again, explained, in
    the task that needs it."""
    os.setsid()
    for fd, target in ((stdin, 0), (stdout, 1), (stderr, 2)):
        os.dup2(fd, target)
        os.close(fd)
    sys.stdin = open(0, encoding="utf-8", closefd=False)
    sys.stdout = open(1, "w", encoding="utf-8", buffering=1, closefd=False)
    sys.stderr = open(2, "w", encoding="utf-8", buffering=1, closefd=False)
    set_by_imports = {key: value for key, value in os.environ.items() if _ENV_AT_IMPORT.get(key) != value}
    os.environ.clear()
    os.environ.update(env)
    for key, value in set_by_imports.items():
        os.environ.setdefault(key, value)
    for name in imports:
        with contextlib.suppress(Exception):
            importlib.import_module(name)
    # By name, as `python -m` ran it: the worker imports this module, not the other way round.
    module = FAULTY_WORKER_MODULE if os.environ.get(TEST_HOOK, "").strip() else WORKER_MODULE
    sys.exit(importlib.import_module(module).main())


class _Forked:
    """A worker forked from the zygote, with the part of subprocess.Popen's interface `Process` uses."""

    def __init__(self, env: dict, log_path: Path, imports: tuple[str, ...]):
        child_stdin, self_stdin = os.pipe()
        self_stdout, child_stdout = os.pipe()
        log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            self._process = _zygote_context().Process(
                target=_forked_worker, name="sage-qual worker",
                args=(env, imports, _PassedFd(child_stdin), _PassedFd(child_stdout), _PassedFd(log)))
            self._process.start()
        finally:
            for fd in (child_stdin, child_stdout, log):
                os.close(fd)
        self.pid = self._process.pid
        self.stdin = os.fdopen(self_stdin, "wb")
        self.stdout = os.fdopen(self_stdout, "rb")
        self.returncode: int | None = None

    def poll(self) -> int | None:
        self.returncode = self._process.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self._process.name, timeout)
        return self.returncode

    def kill_group(self) -> None:
        """SIGKILL to its session's process group; to the worker alone before it made one."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


class Process:
    """The parent's handle on one worker process; its stderr goes to `log_path`. It imports `imports`
    (what its tasks declare, `tasks.imports`) while it waits for its job."""

    def __init__(self, env: dict, log_path: Path, imports: tuple[str, ...] = ()):
        self.log_path, self.imports = log_path, imports
        # Own session: a signal meant for the parent's terminal does not hit the worker, and
        # killing its process group also ends what it started (compilers, nvidia-smi).
        self.proc = _Forked(env, log_path, imports)
        self.messages: queue.Queue = queue.Queue()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                self.messages.put(json.loads(line))
            except ValueError:  # a line torn by a dying worker
                continue
        self.messages.put(None)

    def start(self, tasks: list[Task], env: dict[str, str] | None = None) -> None:
        """Send the job; `env` is applied in the worker before anything touches CUDA or Triton."""
        job = tasks_mod.Job([tasks_mod.dump_task(task) for task in tasks], env or {})
        try:
            self.proc.stdin.write((json.dumps(records.dump(job)) + "\n").encode())
            self.proc.stdin.flush()
        except OSError:  # it died before reading its job: the reader reports the end
            pass

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill_group()
        self.proc.wait()
        self._join_reader()

    def _join_reader(self) -> None:
        """Wait for the reader to see the pipe's end. A daemon thread still blocked in the pipe's
        buffered read when the interpreter exits holds that reader's lock while finalization closes
        it, and the parent aborts (SIGABRT) instead of exiting with its code (certify's exit 130
        after SIGTERM, tests_fast/run/test_certify_targets.py)."""
        self.reader.join(timeout=READER_JOIN_TIMEOUT)

    def close(self) -> None:
        """End the worker: closing stdin lets an idle one exit; a busy one is killed."""
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.kill()
        self._join_reader()

    def ended(self) -> str:
        code = self.proc.wait()
        if code < 0:
            return f"killed by {signal.Signals(-code).name}"
        return f"exit code {code}" + (" (CUDA context unusable)" if code == EXIT_POISONED else "")

    def stderr_tail(self, chars: int = 2500) -> str:
        try:
            with open(self.log_path, "rb") as log:
                log.seek(0, os.SEEK_END)
                log.seek(max(0, log.tell() - chars))
                return log.read().decode(errors="replace")
        except OSError:
            return ""


def run_tasks(tasks: list[Task], spawn: Callable[[], Process], timeout: float, startup_timeout: float,
              on_result: Callable[[Task, Result], None], stop: threading.Event | None = None,
              max_failures: int = MAX_WORKER_FAILURES, env: dict[str, str] | None = None) -> None:
    """Run tasks in workers until each has a result (`on_result(task, result)`) or the run is stopped.

    A task that kills its worker (signal, exit) gets "crash" with the stderr tail; one that sends
    nothing for `timeout` seconds gets "timeout" and its worker is killed (the first task of a
    worker, which sets up CUDA and compiles kernels, gets `startup_timeout`). The other tasks go
    on in a fresh worker. After `max_failures` such endings the rest are skipped, so one broken
    variant cannot eat the time budget of the whole run. A message that breaks the protocol raises
    `records.RecordError` (its worker killed).
    """
    pending = {task.id: task for task in tasks}
    failures = 0
    while pending and not (stop and stop.is_set()):
        process = spawn()
        process.start(list(pending.values()), env)
        try:
            how, current, progressed, waited = _follow(process, pending, timeout, startup_timeout, on_result,
                                                       stop)
        except records.RecordError:
            process.kill()
            raise
        if how in ("done", "stopped"):
            process.close()
            break
        process.kill()
        tail = process.stderr_tail()
        ended = (f"it sent nothing for {waited:g} s and was killed" if how == "timeout"
                 else f"it died ({process.ended()})")
        if current is not None:
            task = pending.pop(current)
            on_result(task, task.record(Outcome.TIMEOUT if how == "timeout" else Outcome.CRASH,
                                        detail=f"the worker ran this task when {ended}", stderr_tail=tail))
        elif progressed:  # it reported its last task, then exited (a poisoned CUDA context): go on
            continue
        else:  # it never started a task: the rest would fail the same way
            for task in list(pending.values()):
                on_result(task, task.record(Outcome.CRASH, detail=f"a worker failed to start: {ended}",
                                            stderr_tail=tail))
            break
        failures += 1
        if failures >= max_failures:
            for task in list(pending.values()):
                on_result(task, task.record(Outcome.SKIP, detail=f"not run: workers of this job crashed or "
                                                                 f"hung {failures} times"))
            break


def _follow(process: Process, pending: dict[str, Task], timeout: float, startup_timeout: float,
            on_result: Callable, stop: threading.Event | None) -> tuple[str, str | None, bool, float]:
    """Feed the worker's results to on_result.

    Returns how it ended, the task it was in, whether it reported any result, and how long it
    was given for its last message.
    """
    where = f"a message of the worker logging to {process.log_path}"
    current, progressed, allowed = None, False, startup_timeout
    deadline = time.monotonic() + allowed
    while True:
        if stop is not None and stop.is_set():
            process.kill()
            return "stopped", current, progressed, allowed
        try:
            message = process.messages.get(timeout=min(0.5, max(0.0, deadline - time.monotonic())))
        except queue.Empty:
            if time.monotonic() >= deadline:
                return "timeout", current, progressed, allowed
            continue
        if message is None:
            return "exited", current, progressed, allowed
        message = tasks_mod.parse_message(message, where)
        if message.type in (MessageType.START, MessageType.RESULT) and message.id not in pending:
            raise records.RecordError(where, "id", f"{message.id!r} is no task of this job still waiting "
                                                   "for its result", tasks_mod.FIX)
        starting = message.type in (MessageType.READY, MessageType.START) and not progressed
        allowed = startup_timeout if starting else timeout
        deadline = time.monotonic() + allowed
        if message.type == MessageType.START:
            current = message.id
        elif message.type == MessageType.RESULT:
            task = pending.pop(message.id)
            on_result(task, tasks_mod.parse_result(task, message, where))
            current, progressed = None, True
        elif message.type == MessageType.DONE:
            return "done", None, progressed, allowed


class WorkerError(RuntimeError):
    """A worker could not do what the parent needs before any measurement (the environment)."""


def collect_environment(task: tasks_mod.EnvTask, log_path: Path, timeout: float) -> tasks_mod.EnvResult:
    """This machine's environment and unsupported variants (`task`), collected in a worker:
    collecting initializes CUDA, which the parent must not. WorkerError unless the worker passed."""
    results = []
    run_tasks([task], lambda: Process(worker_env(), log_path), timeout, timeout,
              lambda task, result: results.append(result))
    (result,) = results
    if result.outcome != Outcome.PASS:
        tail = (result.stderr_tail or result.traceback).strip().splitlines()
        last = f" (last stderr line: {tail[-1]})" if tail else ""
        raise WorkerError(f"collecting this machine's environment failed: {result.outcome.value}: "
                          f"{result.detail}{last}")
    return result


class Pool:
    """Workers started ahead of need, forked from the zygote that imported torch and what a kernel's
    first call imports (`kernels.kernel_imports`). Those started with the same `imports` are alike
    until their job (and its GPU and Triton cache) arrives."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.count = 0
        self.spares: list[Process] = []
        self.lock = threading.Lock()

    def _new(self, imports: tuple[str, ...]) -> Process:
        with self.lock:
            self.count += 1
            path = self.log_dir / f"worker-{self.count}.log"
        return Process(worker_env(), path, imports)

    def prefetch(self, count: int = 1, imports: tuple[str, ...] = ()) -> None:
        for _ in range(count):
            process = self._new(imports)
            with self.lock:
                self.spares.append(process)

    def take(self, prefetch: bool = False, imports: tuple[str, ...] = ()) -> Process:
        """A spare started with `imports` (a new worker if none is left); `prefetch`: start another
        spare like it."""
        with self.lock:
            alike = [process for process in self.spares if process.imports == imports]
            if alike:
                self.spares.remove(alike[0])
        if prefetch:
            self.prefetch(1, imports)
        return alike[0] if alike else self._new(imports)

    def close(self) -> None:
        with self.lock:
            spares, self.spares = self.spares, []
        for process in spares:  # idle: no job, no GPU; no need to wait for their imports
            process.kill()
            if process.log_path.stat().st_size == 0:
                process.log_path.unlink()


def worker_env() -> dict:
    """The environment a worker starts with: this one, with this copy of sage_qual importable."""
    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parents[3])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    return env
