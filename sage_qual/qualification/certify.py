"""`sage-qual certify`: every runnable variant on every fixture, and a speed sweep, on each GPU.

This process never initializes CUDA. Every measurement runs in a worker process
(`sage_qual.qualification.worker`) with its own Triton cache and a watchdog: per GPU one worker times the SDPA
backends, then one worker per variant runs its fixtures and its speed sweep. A crash, a hang or
an out-of-memory costs one result; GPUs run in parallel, one worker each at a time. report.json
is rewritten after every result, so a killed run leaves a partial report that says so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import math
import os
import shutil
import socket
import sys
import tempfile
import threading
from pathlib import Path

import torch

from sage_qual import limits, records
from sage_qual.errors import UsageError
from sage_qual.fixtures import fileformat
from sage_qual.qualification import families as families_mod
from sage_qual.qualification import junit, long_check, profile, report, span_check, verdict
from sage_qual.qualification import pool as workers
from sage_qual.qualification import tasks as tasks_mod
from sage_qual.qualification.speed import intervals_to_refine, speedup_bounds
from sage_qual.serving.variants import VARIANTS

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
class Options:
    out: Path
    devices: str = "all"
    variants: list[str] | None = None
    families: list[str] | None = None
    fixture_dirs: list[str] | None = None
    quick: bool = False
    timeout: float = limits.TASK_TIMEOUT
    command: str = "sage_qual.qualification.certify.run()"
    junit_xml: Path | None = None  # also write JUnit XML, one test case per GPU model and family


# The longest --timeout taken: an hour without a result is a hang by any measure (the slowest task
# measured took 8.6 s, docs/results/run2-h200-certify-full/report.json).
MAX_TIMEOUT_S = 3600.0


# Planning --------------------------------------------------------------------------------------
def select_variants(names: list[str] | None) -> list[str]:
    for name in names or ():
        if name not in VARIANTS:
            raise UsageError(f"unknown variant {name!r} (known: {', '.join(VARIANTS)})")
    return list(dict.fromkeys(names)) if names else list(VARIANTS)


def select_families(names: list[str] | None) -> list[families_mod.Family]:
    if not names:
        return list(families_mod.FAMILIES)
    try:
        return list(dict.fromkeys(families_mod.find(n) for n in names))
    except KeyError as error:
        raise UsageError(error.args[0]) from None


def fixture_dirs(directories: list[str] | None) -> list[str]:
    """The directories given, or the repository's fixtures/ when none were."""
    if directories is not None:
        return directories
    shipped = fileformat.shipped_dir()
    return [str(shipped)] if shipped else []


def select_fixtures(directories: list[str], chosen: list[families_mod.Family], all_families: bool,
                    quick: bool) -> list[fileformat.Fixture]:
    """Fixtures of the chosen families (and family-less ones when no family was named);
    with --quick the smallest per family."""
    fixtures, seen = [], {}
    for directory in directories:
        try:
            paths = fileformat.list_fixtures(directory)
        except fileformat.FixtureError as error:
            raise UsageError(str(error)) from None
        for path in paths:
            try:
                fixture = fileformat.load_fixture(path)
            except fileformat.FixtureError as error:
                raise UsageError(str(error)) from None
            check_finite(fixture, path)
            if fixture.name in seen:
                raise UsageError(f"two fixtures named {fixture.name}: {seen[fixture.name]} and {path}")
            seen[fixture.name] = path
            if all_families or any(families_mod.counts_for(family, fixture.family) for family in chosen):
                fixtures.append(fixture)
    if quick:
        smallest = {}
        for fixture in sorted(fixtures, key=lambda f: (f.q.numel() + 2 * f.k.numel(), f.name)):
            smallest.setdefault(families_mod.normalize(fixture.family), fixture)
        fixtures = sorted(smallest.values(), key=lambda f: f.name)
    return fixtures


def check_finite(fixture: fileformat.Fixture, path) -> None:
    """The float32 reference needs finite q, k and v: with NaN or infinity in them, accuracy is
    measured on the finite rows only and a broken kernel can pass on what is left."""
    for name in ("q", "k", "v"):
        tensor = getattr(fixture, name)
        bad = int((~torch.isfinite(tensor)).sum())
        if bad:
            raise UsageError(f"{path}: tensor {name}: {bad} of {tensor.numel()} values are not finite; the "
                             "reference needs finite inputs: re-create the fixture from finite activations")


def speed_shapes(chosen: list[families_mod.Family], quick: bool) -> dict[str, dict]:
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
    shapes: dict[str, dict] = {}
    for family, label, shape in uses:
        entry = shapes.setdefault(shape.key, {"shape": shape.as_dict(), "uses": []})
        entry["uses"].append({"family": family, "label": label})
    return shapes


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


def _timing(shape: dict, quick: bool) -> tuple[int, int]:
    if quick:
        return TIMING["quick"]
    return TIMING["large" if families_mod.Shape(**shape).flops > LARGE_FLOPS else "small"]


def _fixture_record(fixture: fileformat.Fixture) -> dict:
    return {"name": fixture.name, "family": fixture.family, "kind": fixture.kind,
            "dtype": str(fixture.dtype).replace("torch.", ""), "q": list(fixture.q.shape),
            "k": list(fixture.k.shape), "sha256": fixture.sha256, "bounds": fixture.bounds,
            "provenance": fixture.provenance}


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


# Running ---------------------------------------------------------------------------------------
def check_numbers(options: Options) -> None:
    """UsageError for a number out of range, before any worker starts or any file is written."""
    timeout = options.timeout
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout) \
            or not 0 < timeout <= MAX_TIMEOUT_S:
        raise UsageError(f"--timeout is {timeout!r}: give seconds above 0 and at most {MAX_TIMEOUT_S:g}")
    _requested_devices(options.devices)


def run(options: Options) -> dict:
    check_numbers(options)
    variants = select_variants(options.variants)
    chosen = select_families(options.families)
    options = dataclasses.replace(options, fixture_dirs=fixture_dirs(options.fixture_dirs))
    fixtures = select_fixtures(options.fixture_dirs, chosen, options.families is None, options.quick)
    out = Path(options.out)
    with output_directory(out) as logs:
        pool = workers.Pool(logs)
        pool.prefetch(SPARES_PER_GPU)  # the first GPU's workers import while the environment is collected
        try:
            return _run(options, variants, chosen, fixtures, out, pool)
        finally:
            pool.close()  # before a refusal removes `out`: its workers write their logs there


@contextlib.contextmanager
def output_directory(out: Path):
    """`out/logs`, created for the run; a UsageError before report.json was written removes what was
    created, so a refused run leaves nothing behind (certify and certify --target)."""
    new = None if out.exists() else _first_missing(out)
    logs = out / "logs"
    try:
        logs.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UsageError(f"cannot write to {out}: {error.strerror or error}") from None
    try:
        yield logs
    except UsageError:
        if new is not None and not (out / "report.json").exists():
            shutil.rmtree(new, ignore_errors=True)
        raise


def _first_missing(path: Path) -> Path:
    """The outermost directory of `path` that does not exist yet (what mkdir(parents=True) creates)."""
    while not path.parent.exists():
        path = path.parent
    return path


def _run(options: Options, variants: list[str], chosen: list, fixtures: list, out: Path,
         pool: workers.Pool) -> dict:
    try:
        collected = workers.collect_environment(out / "logs" / "environment.log",
                                                limits.startup_timeout(options.timeout))
    except workers.WorkerError as error:
        raise UsageError(str(error)) from None
    env = collected["environment"]
    if not env["gpus"]:
        raise UsageError("no CUDA GPU is visible here (CPU-only torch, no driver, or CUDA_VISIBLE_DEVICES "
                         "empty): certify needs the GPU it certifies")
    if env["sageattention_problem"]:
        raise UsageError(f"sageattention cannot run here: {env['sageattention_problem']}")
    devices = _device_indices(options.devices, len(env["gpus"]))
    pool.prefetch(SPARES_PER_GPU * (len(devices) - 1))
    if not fixtures:
        print("sage-qual certify: no fixtures selected: no family can be certified", file=sys.stderr)
    shapes = speed_shapes(chosen, options.quick)
    checks = long_checks(chosen, fixtures, options.quick)
    data = _new_report(options, variants, chosen, fixtures, collected, devices, shapes)
    writer = report.Writer(out / "report.json", data)
    runs = [_DeviceRun(d["index"], _variants_to_run(d, env["gpus"][d["index"]], variants, options), fixtures,
                       shapes, options, writer, n, checks) for n, d in enumerate(data["devices"])]
    progress = _Progress(sum(r.task_count for r in runs))
    stop = threading.Event()
    threads = [threading.Thread(target=r.run, args=(pool, progress, stop), daemon=True) for r in runs]
    for thread in threads:
        thread.start()
    try:
        _wait(threads)
        if not options.quick and not any(r.error for r in runs):  # --quick: a pre-flight, no probes
            threads += _span_threads(data, writer, pool, options, progress, stop)
            _wait(threads)
    except KeyboardInterrupt:
        stop.set()
        for thread in threads:
            thread.join()
        writer.update(lambda d: d.update(stopped="interrupted (SIGINT or SIGTERM)"))
    progress.close()
    errors = [r.error for r in runs if r.error]
    if errors and not data["stopped"]:
        writer.update(lambda d: d.update(stopped=f"internal error: {errors[0]!r}"))
    if not data["stopped"]:
        writer.update(_finish)
    try:
        _conclude(data, out, options)
    except report.ReportError as error:  # what this run wrote must read back: a bug, said in one line
        raise UsageError(f"the run's own report does not read back, a sage-qual bug ({error}); report.json "
                         "keeps every measurement") from None
    if errors:
        raise errors[0]
    return data


def _wait(threads: list[threading.Thread]) -> None:
    while any(t.is_alive() for t in threads):
        for thread in threads:
            thread.join(timeout=0.5)


def _span_threads(data: dict, writer: report.Writer, pool: workers.Pool, options: Options,
                  progress: "_Progress", stop: threading.Event) -> list[threading.Thread]:
    """After the sweep, per GPU model on its first device: the span probes (`span_check`) of its
    default kernel and of every variant a verdict serves, each job in workers of its own, side by side."""
    decisions = verdict.decide(report.parse({**data, "complete": True, "finished": _now()}, "report.json"))
    threads = []
    for gpu in decisions:
        index = gpu.devices[0]
        position = next(n for n, d in enumerate(data["devices"]) if d["index"] == index)
        served = {d.variant for d in gpu.families + [gpu.default] if d.variant}
        kernel = data["environment"]["gpus"][index]["kernel"]
        default = gpu.variants.get(kernel)
        probed = sorted(served | ({kernel} if default and default.runnable else set()))
        writer.update(lambda d, n=position: d["devices"][n].setdefault("span", []))
        for variant in probed:
            for tasks in span_check.jobs(variant, span_check.cases()):
                progress.grow(len(tasks))
                job = (tasks, index, position, writer, pool, options, progress, stop)
                threads.append(threading.Thread(target=_span_job, args=job, daemon=True))
    for thread in threads:
        thread.start()
    return threads


def _span_job(job: list, index: int, position: int, writer: report.Writer, pool: workers.Pool,
              options: Options, progress: "_Progress", stop: threading.Event) -> None:
    parent_visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = parent_visible.split(",")[index] if parent_visible else str(index)
    cache = tempfile.mkdtemp(prefix=f"sage-qual-triton-span-cuda{index}-")  # one writer per cache
    def record(task, result) -> None:
        probe = records.dump(result)
        writer.update(lambda d: d["devices"][position]["span"].append(probe))
        progress.tick(f"cuda:{index}", probe)

    try:
        workers.run_tasks(job, pool.take, options.timeout, limits.startup_timeout(options.timeout), record,
                          stop, env={"CUDA_VISIBLE_DEVICES": visible, "TRITON_CACHE_DIR": cache})
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def _conclude(data: dict, out: Path, options: Options) -> None:
    """The profile (of a finished run), report.md/html, the summary and the JUnit XML."""
    decisions = verdict.decide(report.parse(data, str(out / "report.json")))
    if data["complete"]:
        profile.save(profile.build(report.parse(data, str(out / "report.json")), decisions),
                     out / "profile.json")
    report.render(data, out)
    print(summary(data, out))
    if options.junit_xml:
        junit.write(options.junit_xml, f"sage-qual certify {data['host']}",
                    [junit.case(gpu.model, decision) for gpu in decisions for decision in gpu.families])


def _variants_to_run(device: dict, gpu: dict, variants: list[str], options: Options) -> list[str]:
    runnable = [v for v in variants if v not in device["not_supported"]]
    if options.quick and options.variants is None:
        # A pre-flight runs the kernel the wrapper would use on this GPU: all eight variants took
        # 67 s with --quick on two H200s (device run 3), one is a worker's start and a few calls.
        return [v for v in runnable if v == gpu["kernel"]]
    return runnable


def _new_report(options: Options, variants: list[str], chosen: list, fixtures: list, collected: dict,
                devices: list[int], shapes: dict) -> dict:
    env = collected["environment"]
    data = {
        "kind": report.KIND, "schema_version": report.SCHEMA_VERSION, "complete": False, "stopped": "",
        "started": _now(), "finished": None, "host": socket.gethostname(), "command": options.command,
        "options": {"devices": devices, "variants": variants, "families": [f.name for f in chosen],
                    "fixture_dirs": options.fixture_dirs,
                    "quick": options.quick, "timeout_s": options.timeout},
        "environment": env,
        "fixtures": [_fixture_record(f) for f in fixtures],
        "shapes": shapes,
        "devices": [],
    }
    for index in devices:
        gpu = env["gpus"][index]
        here = collected["not_supported"].get(str(index), {})
        not_supported = {v: reasons for v, reasons in here.items() if v in variants}
        data["devices"].append({
            "index": index, "name": gpu["name"], "capability": gpu["capability"],
            "memory_gib": gpu["memory_gib"], "not_supported": not_supported,
            "cells": [{"variant": v, "fixture": f.name, "outcome": "skip", "detail": "; ".join(reasons)}
                      for v, reasons in not_supported.items() for f in fixtures],
            "speed": [],
            "long": [],
        })
    return data


def _finish(data: dict) -> None:
    data["complete"] = True
    data["finished"] = _now()


def _requested_devices(text: str) -> list[int] | None:
    """The GPU indices --devices names (None: all), checked for form before anything runs."""
    if text == "all":
        return None
    try:
        indices = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--devices takes GPU indices such as 0,1 or 'all', not {text!r}") from None
    negative = [i for i in indices if i < 0]
    if negative:
        raise UsageError(f"--devices: {negative[0]} is not a GPU index (they count from 0)")
    if not indices:
        raise UsageError("--devices names no GPU")
    return list(dict.fromkeys(indices))


def _device_indices(text: str, count: int) -> list[int]:
    indices = _requested_devices(text)
    if indices is None:
        return list(range(count))
    for index in indices:
        if index >= count:
            raise UsageError(f"there is no cuda:{index}: this machine shows {count} GPU(s) (cuda:0 to "
                             f"cuda:{count - 1})")
    return indices


class _DeviceRun:
    """One GPU: the SDPA baseline, then each variant's fixtures and speed sweep, each in a worker."""

    def __init__(self, index: int, variants: list[str], fixtures: list, shapes: dict, options: Options,
                 writer: report.Writer, position: int, checks: dict | None = None):
        self.index, self.writer, self.position = index, writer, position
        self.timeout, self.quick = options.timeout, options.quick
        self.error: BaseException | None = None
        speed = {key: _timing(entry["shape"], options.quick) for key, entry in shapes.items()}
        spec = {key: tasks_mod.shape_spec(entry["shape"]) for key, entry in shapes.items()}
        self.jobs = [[tasks_mod.SdpaTask(f"sdpa@{key}", key, spec[key], w, r)
                      for key, (w, r) in speed.items()]]
        for variant in variants:
            self.jobs.append(
                [tasks_mod.CellTask(f"{variant}|{f.name}", variant, f.name, str(f.path),
                                families_mod.memory_bound(f.family)) for f in fixtures]
                + [tasks_mod.SpeedTask(f"{variant}@{key}", variant, key, spec[key], w, r)
                   for key, (w, r) in speed.items()]
                + [tasks_mod.long_task(f"{variant}~{key}", variant, check)
                   for key, check in (checks or {}).items()])
        self.task_count = sum(len(job) for job in self.jobs)

    def run(self, pool: workers.Pool, progress: "_Progress", stop: threading.Event) -> None:
        parent_visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        visible = parent_visible.split(",")[self.index] if parent_visible else str(self.index)
        # One Triton cache per GPU and run: no other process writes it at the same time, and the
        # user's cache can neither serve a stale kernel nor be corrupted by a crashing worker.
        cache = tempfile.mkdtemp(prefix=f"sage-qual-triton-cuda{self.index}-")
        env = {"CUDA_VISIBLE_DEVICES": visible, "TRITON_CACHE_DIR": cache}
        try:
            for n, job in enumerate(self.jobs):
                for part, tasks in enumerate((job, None)):
                    if tasks is None:  # after a variant's sweep: time more lengths around its crossover
                        tasks = self._refinement(job)
                        progress.grow(len(tasks))
                    if not tasks:
                        continue
                    # While this worker runs, the next one imports torch (when there is a next job;
                    # in a full run, the span probes' first worker after the last).
                    spawn = functools.partial(pool.take, prefetch=n + 1 < len(self.jobs) or part == 0
                                              or not self.quick)
                    record = functools.partial(self._record, progress=progress)
                    workers.run_tasks(tasks, spawn, self.timeout, limits.startup_timeout(self.timeout),
                                      record, stop, env=env)
                    if stop.is_set():
                        return
        except BaseException as error:  # surfaced by the main thread after the report is written
            self.error = error
        finally:
            shutil.rmtree(cache, ignore_errors=True)

    def _refinement(self, job: list) -> list:
        """Timing tasks at refined lengths of generic self-attention around the crossover of the
        variant this job swept, with SDPA at those lengths where this GPU has not timed it yet."""
        variants = {task.variant for task in job if isinstance(task, tasks_mod.SpeedTask)}
        if not variants or self.quick:  # a pre-flight's thresholds are not the ones a profile keeps
            return []
        (variant,) = variants
        with self.writer.lock:
            shapes = self.writer.data["shapes"]
            speed = list(self.writer.data["devices"][self.position]["speed"])
        by = {(r["kernel"], r["shape"]): r for r in speed}
        by_dim: dict[int, list[tuple[int, float]]] = {}
        for key, entry in shapes.items():
            shape = entry["shape"]
            base, ours = by.get(("sdpa", key)), by.get((variant, key))
            if any(u["family"] for u in entry["uses"]) or shape["q_tokens"] != shape["kv_tokens"] \
                    or not base or not base.get("ms") or not ours:
                continue
            lower, median = 0.0, 0.0  # failed there: counts as never faster
            if ours.get("ms"):
                lower, median, _ = speedup_bounds(base["ms"], base.get("samples_ms", []), ours["ms"],
                                                  ours.get("samples_ms", []))
            by_dim.setdefault(shape["head_dim"], []).append((shape["q_tokens"], lower, median))
        new = {}
        bars = {family.min_speedup for family in families_mod.FAMILIES}
        for head_dim, points in by_dim.items():
            for tokens in refined_lengths(points, bars):
                shape = families_mod.self_attention(24, tokens, head_dim)
                label = f"refined self {tokens}, head_dim {head_dim}"
                new[shape.key] = {"shape": shape.as_dict(), "uses": [{"family": None, "label": label}]}

        def add(data: dict) -> None:
            for key, entry in new.items():
                data["shapes"].setdefault(key, entry)

        self.writer.update(add)
        refined = []
        for key, entry in new.items():
            warmup, repeats = _timing(entry["shape"], self.quick)
            if (variant, key) in by:
                continue
            timing = tasks_mod.PairedTask if ("sdpa", key) not in by else tasks_mod.SpeedTask
            # Paired near the crossover: both timed in turn in one worker; else another variant's
            # refinement timed SDPA here already.
            task_id = f"{variant}+sdpa@{key}" if timing is tasks_mod.PairedTask else f"{variant}@{key}"
            shape = tasks_mod.shape_spec(entry["shape"])
            refined.append(timing(task_id, variant, key, shape, warmup, repeats))
        return refined

    def _record(self, task, result, progress: "_Progress") -> None:
        """The task's report records (`tasks.report_entries`) appended to this device's lists."""
        device = self.position
        for field, record in tasks_mod.report_entries(result):
            entry = records.dump(record)
            self.writer.update(lambda d, into=field, entry=entry: d["devices"][device][into].append(entry))
        progress.tick(f"cuda:{self.index}", entry)


class _Progress:
    """A tqdm bar on a terminal; one plain line per result in a CI log (or without tqdm)."""

    def __init__(self, total: int):
        self.total, self.done = total, 0
        self.lock = threading.Lock()
        self.bar = None
        if sys.stderr.isatty():
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, unit="task", dynamic_ncols=True, file=sys.stderr)
            except ImportError:
                pass

    def grow(self, tasks: int) -> None:
        with self.lock:
            self.total += tasks
            if self.bar is not None:
                self.bar.total = self.total
                self.bar.refresh()

    def tick(self, device: str, record: dict) -> None:
        line = f"{device} {_describe(record)}"
        with self.lock:
            self.done += 1
            if self.bar is None:
                print(f"[{self.done}/{self.total}] {line}", flush=True)
                return
            self.bar.update(1)
            self.bar.set_postfix_str(line[:60])
            if record["outcome"] not in ("pass", "skip"):
                self.bar.write(line)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _describe(record: dict) -> str:
    if "side" in record:  # a span probe
        what = (f"{record['variant']} span {record['span']:,} ({record['layout']}, {record['side']} "
                f"{record['limit']:,}): {record['outcome']}")
    elif "fixture" in record or "layouts" in record:
        where = record.get("fixture") or (f"{record['shape']['q_tokens']} tokens "
                                          f"({', '.join(record['layouts'])})")
        what = f"{record['variant']} x {where}: {record['outcome']}"
        if record.get("rel_l2") is not None:
            what += f" (rel L2 {record['rel_l2']:.3g}, worst cos {record['worst_head_cosine']:.4g})"
    else:
        name = f"sdpa/{record['best_backend']}" if record.get("best_backend") else record["kernel"]
        timing = f"{record['ms']:.3g} ms" if record.get("ms") else record["outcome"]
        what = f"{name} @ {record['shape']}: {timing}"
    detail = "; ".join(r["detail"] for r in record.get("reasons", [])) or record.get("detail", "")
    return what + (f" -- {detail}" if detail and record["outcome"] != "pass" else "")


def summary(data: dict, out: Path) -> str:
    """What the run decided (verdict.decide on the report as written), one line per GPU model and
    family: the lines two runs are compared on (`sage-qual compare` does it for the files)."""
    lines = [f"sage-qual certify: {'complete' if data['complete'] else 'PARTIAL: ' + data['stopped']}; "
             f"report in {out / 'report.md'}"]
    for gpu in verdict.decide(report.parse(data, str(out / "report.json"))):
        for decision in gpu.families + [gpu.default]:
            if decision.verdict == verdict.Verdict.ENABLE:
                state = f"enable {decision.variant} {decision.served_range()}"
            else:
                reasons = decision.reasons
                state = f"{decision.verdict.value} ({len(reasons)} reason(s), first: {reasons[0].detail})"
            lines.append(f"  {gpu.model}  {decision.label:<12} {state}")
    return "\n".join(lines)
