"""`sage-qual certify`: every runnable variant on every fixture, and a speed sweep, on each GPU.

The GPU pool backend of the one certify run (`certify_run`). This process never initializes CUDA.
Every measurement runs in a worker process (`sage_qual.qualification.worker`) with its own Triton
cache and a watchdog: per GPU one worker times the SDPA backends, then one worker per variant runs
its fixtures, its speed sweep and its long checks; after the sweep, the span probes. A crash, a hang
or an out-of-memory costs one result; GPUs run in parallel, one worker each at a time.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import threading
from pathlib import Path

from sage_qual import limits, records
from sage_qual.fixtures import fileformat
from sage_qual.qualification import certify_run, long_check, report, run_options, span_check, verdict
from sage_qual.qualification import families as families_mod
from sage_qual.qualification import pool as workers
from sage_qual.qualification import tasks as tasks_mod
from sage_qual.qualification.report_model import (
    Cell,
    Outcome,
    Report,
    ShapeEntry,
    ShapeSpec,
    ShapeUse,
)
from sage_qual.qualification.speed import intervals_to_refine, speedup_bounds

# The generic sweep: self-attention of 24 heads from 1k to 32k tokens at both head sizes, and
# cross-attention on short keys (text encoders give 77 to 1024 tokens).
SELF_TOKENS = (1024, 2048, 4096, 8192, 16384, 32768)
CROSS = [(q, k) for q in (4096, 16384) for k in (77, 256, 512, 1024)]
QUICK_SELF_TOKENS = (1024, 4096, 16384)
QUICK_CROSS = [(4096, 77), (4096, 512)]
# Refinement (full runs): between the last sweep length at which a variant's lower 95 % bound was
# no faster than SDPA and the first at which it was, and in every interval with an end whose median
# lies within 10 % of a family's bar (speed.NEAR_FACTOR: where another run may cross), REFINE_POINTS
# more lengths, evenly spaced on a log scale and rounded to TOKEN_GRANULE, so a threshold moves in
# steps of about 2^(1/8) = 1.09x instead of the sweep's 2x: two runs that land one step apart still
# agree within 10 %.
REFINE_POINTS = 7
TOKEN_GRANULE = 128
# Timing repeats: (warm-up, repeats); big shapes get fewer, so the full run fits in minutes.
TIMING = {"quick": (2, 5), "small": (5, 20), "large": (3, 10)}
LARGE_FLOPS = 1e12
# Workers kept starting ahead per GPU: one's imports (`worker --preload`) take about 7 s on the H200
# host (docs/results/run9-h200x2-startup/worker-phases.txt), longer than most variants' jobs.
SPARES_PER_GPU = 2


@dataclasses.dataclass
class Options(run_options.WorkerRunOptions):
    out: Path
    variants: list[str] | None = None
    command: str = "sage_qual.qualification.certify.run()"


def run(options: Options) -> Report:
    run_options.check_numbers(options.timeout, options.devices)
    plan = certify_run.plan(options.out, options.command, certify_run.select_variants(options.variants),
                            options.families, options.fixture_dirs, options.quick, options.timeout,
                            options.junit_xml)
    return certify_run.run(plan, GpuPool(options))


# Planning --------------------------------------------------------------------------------------
def speed_shapes(chosen: list[families_mod.Family], quick: bool) -> dict[str, ShapeEntry]:
    """Timed shapes by key, each with the sweep points and family calls it stands for."""
    uses = []
    for tokens in QUICK_SELF_TOKENS if quick else SELF_TOKENS:
        for head_dim in (128,) if quick else (128, 64):
            uses.append((None, f"self {tokens}, head_dim {head_dim}",
                         families_mod.self_attention(24, tokens, head_dim)))
    for q_tokens, kv_tokens in QUICK_CROSS if quick else CROSS:
        uses.append((None, f"cross {q_tokens} x {kv_tokens} keys",
                     families_mod.cross_attention(24, q_tokens, kv_tokens)))
    if not quick:
        uses += [(family.name, label, shape) for family in chosen for label, shape in family.shapes]
    shapes: dict[str, ShapeEntry] = {}
    for family, label, shape in uses:
        entry = shapes.setdefault(shape.key, ShapeEntry(_spec(shape), []))
        entry.uses.append(ShapeUse(family, label))
    return shapes


def _spec(shape: families_mod.Shape) -> ShapeSpec:
    return records.parse(ShapeSpec, shape.as_dict(), "a planned shape", "a sage-qual bug")


def refined_lengths(points: list[tuple[int, float, float]], min_speedups=(1.0,)) -> list[int]:
    """Token counts to time between neighbouring sweep lengths where the speedup's lower bound
    crosses a family's `min_speedup` or an end lies near it (`speed.intervals_to_refine`); `points`
    are (tokens, lower bound, median) of one variant at one head size."""
    lengths = set()
    for min_speedup in set(min_speedups):
        for low, high in intervals_to_refine(points, min_speedup):
            step = (high / low) ** (1 / (REFINE_POINTS + 1))
            for i in range(1, REFINE_POINTS + 1):
                tokens = round(low * step ** i / TOKEN_GRANULE) * TOKEN_GRANULE
                if low < tokens < high:
                    lengths.add(tokens)
    return sorted(lengths)


def long_checks(chosen: list[families_mod.Family], fixtures: list[fileformat.Fixture], quick: bool) -> dict:
    """The long checks every variant runs (`long_check.plan`): past the longest selected fixture."""
    longest = max((f.q.shape[2] for f in fixtures), default=0)
    return long_check.plan(chosen, QUICK_SELF_TOKENS if quick else SELF_TOKENS, longest, quick)


def _timing(shape: ShapeSpec, quick: bool) -> tuple[int, int]:
    if quick:
        return TIMING["quick"]
    return TIMING["large" if families_mod.Shape(**records.dump(shape)).flops > LARGE_FLOPS else "small"]


# Running ---------------------------------------------------------------------------------------
class GpuPool:
    """The backend of `sage-qual certify` (module docstring)."""
    predicted, target, writes_profile = False, "", True

    def __init__(self, options: Options):
        self.options = options
        self.pool: workers.Pool | None = None
        self.checks: dict = {}

    def prepare(self, plan: certify_run.Plan) -> certify_run.Machine:
        self.pool = workers.Pool(certify_run.logs_directory(plan.out))
        collected = certify_run.gpu_machine(plan, self.options.devices, "certify needs the GPU it certifies",
                                            needs_sageattention=True, workers=self.pool,
                                            per_gpu=SPARES_PER_GPU)
        if not plan.fixtures:
            print("sage-qual certify: no fixtures selected: no family can be certified", file=sys.stderr)
        self.checks = long_checks(plan.families, plan.fixtures, plan.quick)
        devices = []
        for index in collected.indices:
            here = collected.not_supported.get(str(index), {})
            not_supported = {v: reasons for v, reasons in here.items() if v in plan.variants}
            skips = [Cell(variant=v, fixture=f.name, outcome=Outcome.SKIP, detail="; ".join(reasons))
                     for v, reasons in not_supported.items() for f in plan.fixtures]
            gpu = collected.environment.gpus[index]
            devices.append(certify_run.gpu_device(gpu, not_supported, skips, []))
        shapes = speed_shapes(plan.families, plan.quick)
        return certify_run.Machine(collected.environment, devices, shapes)

    def execute(self, plan: certify_run.Plan, writer: report.Writer, stop: threading.Event) -> None:
        built = writer.report
        runs = [_DeviceRun(d.index, self._variants_to_run(d, built, plan), plan.fixtures, built.shapes,
                           self.options, writer, n, self.checks) for n, d in enumerate(built.devices)]
        progress = certify_run.Progress(sum(r.task_count for r in runs))
        try:
            certify_run.parallel([functools.partial(r.run, self.pool, progress, stop) for r in runs], stop)
            if not plan.quick:  # a pre-flight runs no span probes and no context checks
                certify_run.parallel(self._span_jobs(writer, progress, stop)
                                     + self._context_jobs(writer, plan, progress, stop), stop)
        finally:
            progress.close()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()

    def _variants_to_run(self, device, built: Report, plan: certify_run.Plan) -> list[str]:
        runnable = [v for v in plan.variants if v not in device.not_supported]
        if plan.quick and self.options.variants is None:
            # A pre-flight runs the kernel the wrapper would use on this GPU: all eight variants took
            # 67 s with --quick on two H200s (device run 3), one is a worker's start and a few calls.
            return [v for v in runnable if v == built.environment.gpus[device.index].kernel]
        return runnable

    def _span_jobs(self, writer: report.Writer, progress: certify_run.Progress,
                   stop: threading.Event) -> list:
        """After the sweep, per GPU model on its first device: the span probes (`span_check`) of its
        default kernel and of every variant a verdict serves, each job in workers of its own, side by
        side."""
        built = writer.report
        jobs = []
        for gpu in verdict.decide(dataclasses.replace(built, complete=True, finished=certify_run.now())):
            index = gpu.devices[0]
            position = next(n for n, d in enumerate(built.devices) if d.index == index)
            served = {d.variant for d in gpu.families + [gpu.default] if d.variant}
            kernel = built.environment.gpus[index].kernel
            default = gpu.variants.get(kernel)
            probed = sorted(served | ({kernel} if default and default.runnable else set()))
            writer.append(position, "span")
            for variant in probed:
                for tasks in span_check.jobs(variant, span_check.cases()):
                    progress.grow(len(tasks))
                    jobs.append(functools.partial(_worker_job, tasks, index, position, writer, self.pool,
                                                  self.options, progress, stop))
        return jobs


    def _context_jobs(self, writer: report.Writer, plan: certify_run.Plan, progress: certify_run.Progress,
                      stop: threading.Event) -> list:
        """After the sweep, per GPU model on its first device: every variant it ran in every execution
        context (`context_check`), each in a worker of its own, side by side with the span probes."""
        built = writer.report
        jobs, models = [], set()
        for position, device in enumerate(built.devices):
            if device.model in models:
                continue
            models.add(device.model)
            writer.append(position, "contexts")
            for variant in self._variants_to_run(device, built, plan):
                task = tasks_mod.ContextTask(f"{variant}#contexts", variant, list(limits.CONTEXT_CHECK_SHAPE),
                                             "bfloat16")
                progress.grow(1)
                jobs.append(functools.partial(_worker_job, [task], device.index, position, writer, self.pool,
                                              self.options, progress, stop))
        return jobs


def _worker_job(job: list, index: int, position: int, writer: report.Writer, pool: workers.Pool,
                options: Options, progress: certify_run.Progress, stop: threading.Event) -> None:
    """A job after the sweep (span probes, context checks) in workers of its own, its records appended
    where `tasks.report_entries` puts them."""
    def record(task, result) -> None:
        for field, entry in tasks_mod.report_entries(result):
            writer.append(position, field, entry)
        progress.tick(f"cuda:{index}", result)

    with certify_run.gpu_env(index) as env:  # a cache per job: the jobs of one GPU run side by side
        workers.run_tasks(job, pool.take, options.timeout, limits.startup_timeout(options.timeout), record,
                          stop, env=env)


class _DeviceRun:
    """One GPU: the SDPA baseline, then each variant's fixtures and speed sweep, each in a worker."""

    def __init__(self, index: int, variants: list[str], fixtures: list, shapes: dict[str, ShapeEntry],
                 options: Options, writer: report.Writer, position: int, checks: dict | None = None):
        self.index, self.writer, self.position = index, writer, position
        self.timeout, self.quick = options.timeout, options.quick
        speed = {key: _timing(entry.shape, options.quick) for key, entry in shapes.items()}
        self.jobs = [[tasks_mod.SdpaTask(f"sdpa@{key}", key, shapes[key].shape, w, r)
                      for key, (w, r) in speed.items()]]
        for variant in variants:
            self.jobs.append(
                [tasks_mod.CellTask(f"{variant}|{f.name}", variant, f.name, str(f.path),
                                    families_mod.memory_bound(f.family)) for f in fixtures]
                + [tasks_mod.SpeedTask(f"{variant}@{key}", variant, key, shapes[key].shape, w, r)
                   for key, (w, r) in speed.items()]
                + [tasks_mod.long_task(f"{variant}~{key}", variant, check)
                   for key, check in (checks or {}).items()])
        self.task_count = sum(len(job) for job in self.jobs)

    def run(self, pool: workers.Pool, progress: certify_run.Progress, stop: threading.Event) -> None:
        with certify_run.gpu_env(self.index) as env:
            for n, job in enumerate(self.jobs):
                for tasks in (job, None):
                    if tasks is None:  # after a variant's sweep: time more lengths around its crossover
                        tasks = self._refinement(job)
                        progress.grow(len(tasks))
                    if not tasks:
                        continue
                    # While this worker runs, the next ones import torch: SPARES_PER_GPU started
                    # with the run, and one more per job taken while a job beyond them is left. A
                    # full run always starts one (refinements and span probes follow); a quick run's
                    # jobs are all known, so no spare is left unused (each cost a 1.5 s import on
                    # two test cores, 7 s on the H200 host).
                    spawn = functools.partial(pool.take, prefetch=n + SPARES_PER_GPU < len(self.jobs)
                                              or not self.quick)
                    record = functools.partial(self._record, progress=progress)
                    workers.run_tasks(tasks, spawn, self.timeout, limits.startup_timeout(self.timeout),
                                      record, stop, env=env)
                    if stop.is_set():
                        return

    def _refinement(self, job: list) -> list:
        """Timing tasks at refined lengths of generic self-attention around the crossover of the
        variant this job swept, with SDPA at those lengths where this GPU has not timed it yet."""
        variants = {task.variant for task in job if isinstance(task, tasks_mod.SpeedTask)}
        if not variants or self.quick:  # a pre-flight's thresholds are not the ones a profile keeps
            return []
        (variant,) = variants
        with self.writer.lock:
            shapes = dict(self.writer.report.shapes)
            speed = list(self.writer.report.devices[self.position].speed)
        by = {(r.kernel, r.shape): r for r in speed}
        by_dim: dict[int, list[tuple[int, float, float]]] = {}
        for key, entry in shapes.items():
            shape = entry.shape
            base, ours = by.get(("sdpa", key)), by.get((variant, key))
            if any(u.family for u in entry.uses) or shape.q_tokens != shape.kv_tokens \
                    or not base or not base.ms or not ours:
                continue
            lower, median = 0.0, 0.0  # failed there: counts as never faster
            if ours.ms:
                lower, median, _ = speedup_bounds(base.ms, base.samples_ms, ours.ms, ours.samples_ms)
            by_dim.setdefault(shape.head_dim, []).append((shape.q_tokens, lower, median))
        new = {}
        bars = {family.min_speedup for family in families_mod.FAMILIES}
        for head_dim, points in by_dim.items():
            for tokens in refined_lengths(points, bars):
                shape = families_mod.self_attention(24, tokens, head_dim)
                label = f"refined self {tokens}, head_dim {head_dim}"
                new[shape.key] = ShapeEntry(_spec(shape), [ShapeUse(None, label)])
        self.writer.add_shapes(new)
        refined = []
        for key, entry in new.items():
            warmup, repeats = _timing(entry.shape, self.quick)
            if (variant, key) in by:
                continue
            timing = tasks_mod.PairedTask if ("sdpa", key) not in by else tasks_mod.SpeedTask
            # Paired near the crossover: both timed in turn in one worker; else another variant's
            # refinement timed SDPA here already.
            task_id = f"{variant}+sdpa@{key}" if timing is tasks_mod.PairedTask else f"{variant}@{key}"
            refined.append(timing(task_id, variant, key, entry.shape, warmup, repeats))
        return refined

    def _record(self, task, result, progress: certify_run.Progress) -> None:
        """The task's report records (`tasks.report_entries`) appended to this device's lists."""
        for field, record in tasks_mod.report_entries(result):
            self.writer.append(self.position, field, record)
        progress.tick(f"cuda:{self.index}", record)


