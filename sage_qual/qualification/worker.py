"""A certify worker: one fresh process runs one job of tasks on one GPU and streams the results.

`python -m sage_qual.qualification.worker` imports torch, then waits for one JSON job line on stdin (so the
parent can start it early, while another worker still runs). It keeps reading stdin: end of file
means the parent died, and the worker exits. Results leave as JSON lines on the original stdout;
file descriptor 1 is pointed at stderr first, so whatever Triton, CUDA or a print writes there
lands in the stderr log whose tail the parent keeps for crash reports.

Messages: {"type": "ready"} once it has its job, then per task
{"type": "start", "id"} and {"type": "result", "id", "seconds", "result"}, and {"type": "done"}.
A task the worker survives always gets a result (oom and crash included); after a CUDA error that
poisons the context it reports the task and exits, and the parent runs the rest in a new worker.

All numbers come from `sage_qual.qualification.measure`, the functions `pytest -m slow` uses.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Callable

import torch

from sage_qual.fixtures import fileformat
from sage_qual.limits import MAX_WORKER_FAILURES, MEMORY_BOUND
from sage_qual.qualification import measure
from sage_qual.qualification.families import Shape
from sage_qual.qualification.judge import cell_reasons
from sage_qual.serving import environment, failures, platform, sage_package
from sage_qual.serving.variants import VARIANTS, BoxFacts

# Test hook, read only here: JSON {"gpus": [{"name", "capability"}...]} runs the job on the fake
# CUDA and fake sageattention of sage_qual.testing with CPU tensors; {"faults": {task id: "crash" |
# "hang" | "oom" | "noise" | "cuda-fault"}} makes that task abort, hang, raise OOM, (fake only)
# return noise, or trip a real device-side assert that poisons the worker's CUDA context.
TEST_HOOK = "SAGE_QUAL_TEST_WORKER"
EXIT_POISONED = 70  # a CUDA error left the context unusable: the parent restarts the rest
SDPA_BACKENDS = ("default", "cudnn", "flash", "efficient")


class GpuBench:
    """The one GPU this worker sees (the parent sets CUDA_VISIBLE_DEVICES)."""

    device = "cuda"

    def tokens(self, n: int) -> int:
        return n

    def extra_peak_bytes(self, fn):
        return measure.extra_peak_bytes(fn, 0)

    def median_ms(self, fn, warmup: int, repeats: int) -> float:
        return measure.median_ms(fn, warmup, repeats)

    def healthy(self) -> bool:
        try:
            torch.cuda.synchronize()
            return True
        except Exception:
            return False

    def release(self) -> None:
        with contextlib.suppress(Exception):  # a poisoned context fails here too; healthy() says so
            torch.cuda.empty_cache()

    def noise(self) -> None:
        raise ValueError("the test fault 'noise' needs the fake kernel")


class FakeBench:
    """Test-only: the fake CUDA and fake sageattention on CPU tensors, speed shapes cut 256-fold."""

    device = "cpu"

    def __init__(self, gpus: list[dict]):
        from sage_qual.testing import FakeCuda, FakeGpu, FakeSageAttention

        fakes = [FakeGpu(tuple(g["capability"]), g["name"]) for g in gpus]
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible:
            fakes = [fakes[int(i)] for i in visible.split(",")]
        self.sage = FakeSageAttention()
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(FakeCuda(fakes))
        self._stack.enter_context(self.sage.installed())

    def tokens(self, n: int) -> int:
        return max(16, n // 256)

    def extra_peak_bytes(self, fn):
        return fn(), 0

    def median_ms(self, fn, warmup: int, repeats: int) -> float:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1000

    def healthy(self) -> bool:
        return True

    def release(self) -> None:
        self.sage.behave()

    def noise(self) -> None:
        self.sage.return_value(lambda exact: exact + torch.randn_like(exact))


class Worker:
    def __init__(self, bench, faults: dict[str, str]):
        self.bench = bench
        self.faults = faults
        self._package = None

    def package(self):
        if self._package is None:
            self._package = sage_package.load()
        return self._package

    def run(self, task: dict) -> dict:
        try:
            self._inject(self.faults.get(task["id"]))
            return getattr(self, "_" + task["kind"])(task)
        except Exception as error:
            first_line = (str(error).strip().splitlines() or [""])[0]
            detail = f"{type(error).__name__}: {first_line}"[:500]
            if failures.is_out_of_memory(error):
                return {"outcome": "oom", "detail": detail}
            return {"outcome": "crash", "detail": detail, "traceback": traceback.format_exc()[-3000:]}
        finally:
            self.bench.release()

    def _inject(self, fault: str | None) -> None:
        if fault == "crash":
            print("test fault: aborting the worker", file=sys.stderr, flush=True)
            os.abort()
        elif fault == "hang":
            time.sleep(3600)
        elif fault == "oom":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 GiB (test fault)")
        elif fault == "noise":
            self.bench.noise()
        elif fault == "cuda-fault":
            torch._assert_async(torch.zeros((), dtype=torch.bool, device="cuda"))
            torch.cuda.synchronize()

    # Tasks ---------------------------------------------------------------------------------
    def _env(self, task: dict) -> dict:
        env = environment.collect()
        return {"outcome": "pass", "environment": dataclasses.asdict(env),
                "not_supported": _not_supported_here()}

    def _cell(self, task: dict) -> dict:
        variant = VARIANTS[task["variant"]]
        package = self.package()
        problem = sage_package.kernel_problem(package, variant)
        if problem:
            return {"outcome": "skip", "detail": problem}
        fixture = fileformat.load_fixture(task["fixture"], device=self.bench.device)
        q, k, v = fixture.q, fixture.k, fixture.v
        ref = measure.reference(q, k, v)
        out, extra = self.bench.extra_peak_bytes(lambda: measure.call_kernel(package, variant, q, k, v))
        acc = measure.accuracy(out, q, k, v, ref)
        del out
        bounds = fixture.bound(variant)
        per_element = extra / measure.elements(q, k, v)
        reasons = cell_reasons(acc, per_element, bounds, task.get("memory_bound", MEMORY_BOUND))
        result = {
            "outcome": "fail" if reasons else "pass",
            "reasons": reasons,
            "accuracy_class": variant.accuracy_class,
            "bounds": bounds,
            **_clean(acc.as_dict()),
            "extra_bytes_per_element": per_element,
        }
        if is_outlier(fixture.name):  # the wrapper's smoothing-off choice, checked where it matters
            rel_l2, cosine, finite = measure.compare(
                measure.call_kernel(package, variant, q, k, v, smooth_k=True), ref)
            result["smooth_k_on"] = _clean({"rel_l2": rel_l2, "worst_head_cosine": cosine, "finite": finite})
        return result

    def _target(self, task: dict) -> dict:
        """`certify --target`: an integration instead of a variant (its module runs the task)."""
        from sage_qual.qualification import target_cells

        return target_cells.run_task(task, self.bench)

    def _sdpa(self, task: dict) -> dict:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        chosen = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                  "efficient": SDPBackend.EFFICIENT_ATTENTION}
        q, k, v = self._tensors(task["shape"])
        gqa = q.shape[1] != k.shape[1]
        timings, refused = {}, {}
        for name in SDPA_BACKENDS:
            context = sdpa_kernel([chosen[name]]) if name in chosen else contextlib.nullcontext()
            try:
                with context:  # entered once, so its cost is not in the timed calls
                    timings[name] = self.bench.median_ms(
                        lambda: measure.TORCH_SDPA(q, k, v, enable_gqa=gqa), task["warmup"], task["repeats"])
            except (RuntimeError, NotImplementedError) as error:  # it does not take the shape (or memory)
                if not self.bench.healthy():
                    raise
                refused[name] = (str(error).strip().splitlines() or [""])[0][:300]
                self.bench.release()
        return {"outcome": "pass", "ms": timings, "refused": refused}

    def _speed(self, task: dict) -> dict:
        variant = VARIANTS[task["variant"]]
        package = self.package()
        problem = sage_package.kernel_problem(package, variant)
        if problem:
            return {"outcome": "skip", "detail": problem}
        q, k, v = self._tensors(task["shape"])
        ms = self.bench.median_ms(lambda: measure.call_kernel(package, variant, q, k, v),
                                  task["warmup"], task["repeats"])
        return {"outcome": "pass", "ms": ms}

    def _tensors(self, shape: dict):
        s = Shape(**shape)
        generator = torch.Generator(self.bench.device).manual_seed(0)
        dtype = getattr(torch, s.dtype)

        def make(heads, tokens):
            return torch.randn(s.batch, heads, self.bench.tokens(tokens), s.head_dim, dtype=dtype,
                               device=self.bench.device, generator=generator)

        return make(s.heads, s.q_tokens), make(s.kv_heads, s.kv_tokens), make(s.kv_heads, s.kv_tokens)


def is_outlier(fixture_name: str) -> bool:
    """Outlier fixtures (a Q/K channel far above the rest) are named so, as tests_gpu selects them."""
    return "outlier" in fixture_name


def _not_supported_here() -> dict[str, dict[str, list[str]]]:
    """Per visible GPU, each variant that cannot run on it and why (the parent has no CUDA)."""
    cuda = platform.current()
    try:
        package = sage_package.load()
    except sage_package.SageUnavailable as why:
        return {str(i): {name: [str(why)] for name in VARIANTS} for i in range(cuda.device_count())}
    answer = {}
    for index in range(cuda.device_count()):
        box = BoxFacts(cuda.capability(index), cuda.torch_cuda(), package.extensions,
                       sage_package.has_triton())
        reasons = {}
        for variant in VARIANTS.values():
            why = variant.not_supported_reasons(box)
            problem = None if why else sage_package.kernel_problem(package, variant)
            if why or problem:
                reasons[variant.name] = why or [problem]
        answer[str(index)] = reasons
    return answer


# The parent's side -----------------------------------------------------------------------------
class Process:
    """The parent's handle on one worker process; its stderr goes to `log_path`."""

    def __init__(self, env: dict, log_path: Path):
        self.log_path = log_path
        with open(log_path, "wb") as log:
            # Own session: a signal meant for the parent's terminal does not hit the worker, and
            # killing its process group also ends what it started (compilers, nvidia-smi).
            self.proc = subprocess.Popen([sys.executable, "-m", "sage_qual.qualification.worker"],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env,
                                         start_new_session=True)
        self.messages: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                self.messages.put(json.loads(line))
            except ValueError:  # a line torn by a dying worker
                continue
        self.messages.put(None)

    def start(self, tasks: list[dict], env: dict[str, str] | None = None) -> None:
        """Send the job; `env` is applied in the worker before anything touches CUDA or Triton."""
        try:
            self.proc.stdin.write((json.dumps({"tasks": tasks, "env": env or {}}) + "\n").encode())
            self.proc.stdin.flush()
        except OSError:  # it died before reading its job: the reader reports the end
            pass

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()

    def close(self) -> None:
        """End the worker: closing stdin lets an idle one exit; a busy one is killed."""
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.kill()

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


def run_tasks(tasks: list[dict], spawn: Callable[[], Process], timeout: float, startup_timeout: float,
              on_result: Callable[[str, dict], None], stop: threading.Event | None = None,
              max_failures: int = MAX_WORKER_FAILURES, env: dict[str, str] | None = None) -> None:
    """Run tasks in workers until each has a result or the run is stopped.

    A task that kills its worker (signal, exit) gets "crash" with the stderr tail; one that sends
    nothing for `timeout` seconds gets "timeout" and its worker is killed (the first task of a
    worker, which sets up CUDA and compiles kernels, gets `startup_timeout`). The other tasks go
    on in a fresh worker. After `max_failures` such endings the rest are skipped, so one broken
    variant cannot eat the time budget of the whole run.
    """
    pending = {task["id"]: task for task in tasks}
    failures = 0
    while pending and not (stop and stop.is_set()):
        process = spawn()
        process.start(list(pending.values()), env)
        how, current, progressed, waited = _follow(process, pending, timeout, startup_timeout, on_result,
                                                   stop)
        if how in ("done", "stopped"):
            process.close()
            break
        process.kill()
        tail = process.stderr_tail()
        ended = (f"it sent nothing for {waited:g} s and was killed" if how == "timeout"
                 else f"it died ({process.ended()})")
        if current is not None:
            pending.pop(current)
            on_result(current, {"outcome": "timeout" if how == "timeout" else "crash",
                                "detail": f"the worker ran this task when {ended}", "stderr_tail": tail})
        elif progressed:  # it reported its last task, then exited (a poisoned CUDA context): go on
            continue
        else:  # it never started a task: the rest would fail the same way
            for task_id in list(pending):
                on_result(task_id, {"outcome": "crash", "detail": f"a worker failed to start: {ended}",
                                    "stderr_tail": tail})
            break
        failures += 1
        if failures >= max_failures:
            for task_id in list(pending):
                on_result(task_id, {"outcome": "skip", "detail": f"not run: workers of this job crashed or "
                                                                 f"hung {failures} times"})
            break


def _follow(process: Process, pending: dict, timeout: float, startup_timeout: float,
            on_result: Callable, stop: threading.Event | None) -> tuple[str, str | None, bool, float]:
    """Feed the worker's results to on_result.

    Returns how it ended, the task it was in, whether it reported any result, and how long it
    was given for its last message.
    """
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
        kind = message["type"]
        allowed = startup_timeout if kind in ("ready", "start") and not progressed else timeout
        deadline = time.monotonic() + allowed
        if kind == "start":
            current = message["id"]
        elif kind == "result":
            pending.pop(message["id"], None)
            on_result(message["id"], {**message["result"], "seconds": message["seconds"]})
            current, progressed = None, True
        elif kind == "done":
            return "done", None, progressed, allowed


class WorkerError(RuntimeError):
    """A worker could not do what the parent needs before any measurement (the environment)."""


def collect_environment(log_path: Path, timeout: float) -> dict:
    """This machine's environment and unsupported variants, collected in a worker: collecting
    initializes CUDA, which the parent must not."""
    results = {}
    run_tasks([{"id": "env", "kind": "env"}], lambda: Process(worker_env(), log_path), timeout, timeout,
              results.__setitem__)
    result = results["env"]
    if result["outcome"] != "pass":
        tail = (result.get("stderr_tail") or result.get("traceback") or "").strip().splitlines()
        last = f" (last stderr line: {tail[-1]})" if tail else ""
        raise WorkerError(f"collecting this machine's environment failed: {result['outcome']}: "
                          f"{result.get('detail', '')}{last}")
    return result


class Pool:
    """Workers started ahead of need: each spends seconds importing torch while others work.
    They are all alike until their job (and its GPU and Triton cache) arrives."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.count = 0
        self.spares: list[Process] = []
        self.lock = threading.Lock()

    def _new(self) -> Process:
        with self.lock:
            self.count += 1
            path = self.log_dir / f"worker-{self.count}.log"
        return Process(worker_env(), path)

    def prefetch(self, count: int = 1) -> None:
        for _ in range(count):
            process = self._new()
            with self.lock:
                self.spares.append(process)

    def take(self, prefetch: bool = False) -> Process:
        with self.lock:
            process = self.spares.pop(0) if self.spares else None
        if prefetch:
            self.prefetch()
        return process or self._new()

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
    package_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    return env


def _clean(values: dict) -> dict:
    """JSON has no NaN or infinity: such numbers become null (`finite` says what happened)."""
    return {k: (None if isinstance(x, float) and not math.isfinite(x) else x) for k, x in values.items()}


def _exit_when_orphaned() -> None:
    # Raw reads: a daemon thread blocked in the buffered sys.stdin would abort interpreter exit.
    while os.read(0, 65536):
        pass
    os._exit(3)  # end of file: the parent is gone (or done with us)


def main() -> int:
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    line = sys.stdin.readline()
    if not line:  # a spare worker the parent did not need
        return 0
    job = json.loads(line)
    os.environ.update(job["env"])  # its GPU and Triton cache: before anything reads them
    first = job["tasks"][0]["id"] if job["tasks"] else "-"
    print(f"sage-qual worker {os.getpid()}: {len(job['tasks'])} task(s), first {first}, env {job['env']}",
          file=sys.stderr, flush=True)
    threading.Thread(target=_exit_when_orphaned, daemon=True).start()

    def send(message: dict) -> None:
        channel.write(json.dumps(message, allow_nan=False) + "\n")

    hook = json.loads(os.environ.get(TEST_HOOK) or "{}")
    bench = FakeBench(hook["gpus"]) if "gpus" in hook else GpuBench()
    worker = Worker(bench, hook.get("faults", {}))
    send({"type": "ready"})
    for task in job["tasks"]:
        send({"type": "start", "id": task["id"]})
        start = time.monotonic()
        result = worker.run(task)
        send({"type": "result", "id": task["id"], "seconds": round(time.monotonic() - start, 3),
              "result": result})
        if result["outcome"] == "crash" and not bench.healthy():
            print(f"sage-qual worker: the CUDA context is unusable after {task['id']}; exiting",
                  file=sys.stderr, flush=True)
            return EXIT_POISONED
    send({"type": "done"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
