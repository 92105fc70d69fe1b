"""One certify run, for each of its three modes: select the fixtures, write the report's header,
execute the tasks on a backend that appends their records, then conclude once.

The backends differ only in how a task runs: `certify.GpuPool` (every variant on each GPU, in
isolated workers), `target_certify.TargetRun` (an integration, in the same workers) and
`emulate.Emulation` (each variant's numerics model, in this process). Everything else is here, once
for all three: which fixtures run, the header and device entries as `report_model` records, the
environment of a worker on one GPU, the one answer to an interrupt or an internal error, the finish,
and the conclusion (the profile of a complete run, report.md/html, the summary, JUnit XML).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import shutil
import socket
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch

from sage_qual import limits
from sage_qual.errors import UsageError
from sage_qual.fixtures import fileformat
from sage_qual.qualification import families as families_mod
from sage_qual.qualification import junit, pool, profile, report, report_model, summary, verdict
from sage_qual.qualification.report_model import Cell, Device, LongCheck, Outcome, Report, SpanProbe
from sage_qual.qualification.run_options import requested_devices
from sage_qual.serving.env_record import EnvironmentRecord, GpuInfo
from sage_qual.serving.variants import VARIANTS

INTERRUPTED = "interrupted (SIGINT or SIGTERM)"


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


# Selecting -------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Plan:
    """What a run was asked to do, checked and selected before any worker starts or file is written."""
    out: Path
    command: str
    variants: list[str]  # certify --target: the integration's name
    families: list[families_mod.Family]
    fixture_dirs: list[str]
    fixtures: list[fileformat.Fixture]
    quick: bool
    timeout: float  # seconds a task may run (0: no worker runs, certify --emulate)
    junit_xml: Path | None = None


def plan(out, command: str, variants: list[str], families: list[str] | None, directories: list[str] | None,
         quick: bool, timeout: float = 0.0, junit_xml: Path | None = None) -> Plan:
    chosen = select_families(families)
    directories = fixture_dirs(directories)
    fixtures = select_fixtures(directories, chosen, families is None, quick)
    return Plan(Path(out), command, variants, chosen, directories, fixtures, quick, timeout, junit_xml)


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


def device_indices(text: str, count: int) -> list[int]:
    indices = requested_devices(text)
    if indices is None:
        return list(range(count))
    for index in indices:
        if index >= count:
            raise UsageError(f"there is no cuda:{index}: this machine shows {count} GPU(s) (cuda:0 to "
                             f"cuda:{count - 1})")
    return indices


# The report's records --------------------------------------------------------------------------
def fixture_record(fixture: fileformat.Fixture) -> report_model.FixtureRecord:
    return report_model.FixtureRecord(
        name=fixture.name, family=fixture.family, kind=report_model.FixtureKind(fixture.kind),
        dtype=report_model.DType(str(fixture.dtype).replace("torch.", "")), q=list(fixture.q.shape),
        k=list(fixture.k.shape), sha256=fixture.sha256, bounds=fixture.bounds, provenance=fixture.provenance)


def gpu_device(gpu: GpuInfo, not_supported: dict[str, list[str]], cells: list[report_model.Cell],
               long: list[report_model.LongCheck] | None) -> Device:
    """A GPU's entry, before its results: the variants it cannot run, with their skipped cells."""
    return Device(index=gpu.index, name=gpu.name, capability=list(gpu.capability), memory_gib=gpu.memory_gib,
                  not_supported=not_supported, cells=cells, speed=[], long=long)


def header(plan: Plan, backend: Backend, machine: Machine) -> Report:
    """The report before its first result: complete=false, every device entry in place."""
    return Report(
        kind=report_model.KIND, schema_version=report_model.SCHEMA_VERSION, complete=False, stopped="",
        started=now(), finished=None, host=socket.gethostname(), command=plan.command,
        options=report_model.Options(devices=[d.index for d in machine.devices], variants=plan.variants,
                                     families=[f.name for f in plan.families], fixture_dirs=plan.fixture_dirs,
                                     quick=plan.quick, timeout_s=plan.timeout),
        environment=machine.environment, fixtures=[fixture_record(f) for f in plan.fixtures],
        shapes=machine.shapes, devices=machine.devices, predicted=backend.predicted, target=backend.target)


# Running ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class GpuMachine:
    """This machine as the worker saw it: its environment, the GPUs --devices chose, and per GPU
    index the variants that cannot run there, with why."""
    environment: EnvironmentRecord
    indices: list[int]
    not_supported: dict[str, dict[str, list[str]]]


def logs_directory(out: Path) -> Path:
    """`out/logs`, where every worker writes its log."""
    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    return logs


def gpu_machine(plan: Plan, devices: str, purpose: str, needs_sageattention: bool, workers: pool.Pool,
                per_gpu: int) -> GpuMachine:
    """The GPUs a worker backend runs on, collected in a worker (collecting initializes CUDA, which
    this process must not); UsageError, saying `purpose`, when there is none, and when
    `needs_sageattention` and sageattention cannot run. `per_gpu` of `workers` are started ahead of
    need for each chosen GPU, the first GPU's while the environment is collected (a worker's start
    took about 7 s on the H200 host: docs/results/run9-h200x2-startup/worker-phases.txt)."""
    workers.prefetch(per_gpu)
    try:
        collected = pool.collect_environment(plan.out / "logs" / "environment.log",
                                             limits.startup_timeout(plan.timeout))
    except pool.WorkerError as error:
        raise UsageError(str(error)) from None
    env = collected.environment
    if not env.gpus:
        raise UsageError("no CUDA GPU is visible here (CPU-only torch, no driver, or CUDA_VISIBLE_DEVICES "
                         f"empty): {purpose}")
    if needs_sageattention and env.sageattention_problem:
        raise UsageError(f"sageattention cannot run here: {env.sageattention_problem}")
    indices = device_indices(devices, len(env.gpus))
    workers.prefetch(per_gpu * (len(indices) - 1))
    return GpuMachine(env, indices, collected.not_supported)


@dataclasses.dataclass(frozen=True)
class Machine:
    """Where a backend runs: the environment and the device entries the report starts with."""
    environment: EnvironmentRecord
    devices: list[Device]
    shapes: dict[str, report_model.ShapeEntry] = dataclasses.field(default_factory=dict)


class Backend(Protocol):
    """How a run's tasks execute; `run()` does everything else."""
    predicted: bool  # the report's `predicted`
    target: str  # the report's `target`
    writes_profile: bool  # a complete run's profile.json (certify only: the others time nothing)

    def prepare(self, plan: Plan) -> Machine:
        """The machine this run certifies; UsageError when it cannot (nothing is left on disk)."""

    def execute(self, plan: Plan, writer: report.Writer, stop: threading.Event) -> None:
        """Every task, each result appended through `writer`; returns early once `stop` is set."""

    def close(self) -> None:
        """Ends what `prepare` started (workers), also after an error."""


def run(plan: Plan, backend: Backend) -> Report:
    """The run: its report on disk after every result, concluded once, also when interrupted (a
    partial report) or when a backend fails (a partial report naming the error, then the error)."""
    failure = None
    with output_directory(plan.out):
        try:
            writer = report.Writer(plan.out / "report.json", header(plan, backend, backend.prepare(plan)))
            try:
                backend.execute(plan, writer, threading.Event())
            except KeyboardInterrupt:  # SIGINT, or SIGTERM through the command line's handler
                writer.replace(stopped=INTERRUPTED)
            except BaseException as error:  # said in the report, raised after the conclusion
                failure = error
                writer.replace(stopped=f"internal error: {error!r}")
            if not writer.report.stopped:
                writer.replace(complete=True, finished=now())
        finally:
            backend.close()  # before a refusal removes `out`: workers write their logs there
    conclude(writer.report, plan, backend)
    if failure is not None:
        raise failure
    return writer.report


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


@contextlib.contextmanager
def output_directory(out: Path):
    """`out`, created for the run; a UsageError before report.json was written removes what was
    created, so a refused run leaves nothing behind."""
    new = None if out.exists() else _first_missing(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UsageError(f"cannot write to {out}: {error.strerror or error}") from None
    try:
        yield
    except UsageError:
        if new is not None and not (out / "report.json").exists():
            shutil.rmtree(new, ignore_errors=True)
        raise


def _first_missing(path: Path) -> Path:
    """The outermost directory of `path` that does not exist yet (what mkdir(parents=True) creates)."""
    while not path.parent.exists():
        path = path.parent
    return path


# Concluding ------------------------------------------------------------------------------------
def conclude(written: Report, plan: Plan, backend: Backend) -> None:
    """The profile (of a finished certify run), report.md/html, the summary and the JUnit XML."""
    path = str(plan.out / "report.json")
    try:  # what this run wrote must read back, the rules across results included: a bug, in one line
        written = report.load(path)
    except report.ReportError as error:
        raise UsageError(f"the run's own report does not read back, a sage-qual bug ({error}); report.json "
                         "keeps every measurement") from None
    decisions = verdict.decide(written)
    if written.complete and backend.writes_profile:
        profile.save(profile.build(written, decisions), plan.out / "profile.json")
    report.render(written, plan.out)
    print(summary.text(written, plan.out, decisions))
    if plan.junit_xml:
        junit.write(plan.junit_xml, f"sage-qual certify {written.host}",
                    [junit.case(gpu.model, decision) for gpu in decisions for decision in gpu.families])


# Progress --------------------------------------------------------------------------------------
class Progress:
    """A tqdm bar on a terminal; one plain line per result in a CI log (or without tqdm), or none
    (`lines=False`: the summary says it all)."""

    def __init__(self, total: int, lines: bool = True):
        self.total, self.done, self.lines = total, 0, lines
        self.lock = threading.Lock()
        self.bar = None
        if sys.stderr.isatty():
            try:
                from tqdm import tqdm  # comes with the [report] and [test] extras

                self.bar = tqdm(total=total, unit="task", dynamic_ncols=True, file=sys.stderr)
            except ImportError:
                pass

    def grow(self, tasks: int) -> None:
        with self.lock:
            self.total += tasks
            if self.bar is not None:
                self.bar.total = self.total
                self.bar.refresh()

    def tick(self, device: str, record) -> None:
        line = f"{device} {describe(record)}"
        with self.lock:
            self.done += 1
            if self.bar is None:
                if self.lines:
                    print(f"[{self.done}/{self.total}] {line}", flush=True)
                return
            self.bar.update(1)
            self.bar.set_postfix_str(line[:60])
            if self.lines and record.outcome not in (Outcome.PASS, Outcome.SKIP):
                self.bar.write(line)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def describe(record: Cell | LongCheck | report_model.Speed | SpanProbe | report_model.ContextCheck) -> str:
    """One result in a line: what ran where, its outcome and, unless it passed, why."""
    if isinstance(record, report_model.ContextCheck):
        safe = ", ".join(record.safe_contexts) or "none"
        what = f"{record.variant} in every context: {record.outcome.value} (safe in: {safe})"
    elif isinstance(record, SpanProbe):
        what = (f"{record.variant} span {record.span:,} ({record.layout}, {record.side} {record.limit:,}): "
                f"{record.outcome.value}")
    elif isinstance(record, (Cell, LongCheck)):
        where = record.fixture if isinstance(record, Cell) else \
            f"{record.shape.q_tokens} tokens ({', '.join(record.layouts)})"
        what = f"{record.variant} x {where}: {record.outcome.value}"
        if isinstance(record, Cell) and record.rel_l2 is not None:
            what += f" (rel L2 {record.rel_l2:.3g}, worst cos {_number(record.worst_head_cosine)})"
    else:
        name = f"sdpa/{record.best_backend}" if record.best_backend else record.kernel
        timing = f"{record.ms:.3g} ms" if record.ms else record.outcome.value
        what = f"{name} @ {record.shape}: {timing}"
    reasons = getattr(record, "reasons", [])
    detail = "; ".join(r.detail for r in reasons) or record.detail
    return what + (f" -- {detail}" if detail and record.outcome != Outcome.PASS else "")


def _number(x) -> str:
    return "-" if x is None else f"{x:.4g}"
