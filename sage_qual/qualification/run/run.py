"""One certify run, in every mode: select, find the machine, plan, execute, conclude.

`certify(request)` is the whole run. The request (`options.RunRequest`) names the subject (our
variants, or an integration with `certify --target`) and the executor (`worker_executor`: isolated worker
processes on the GPUs; `in_process`: the numerics model in this process, `certify --emulate`).
Everything but the execution is here, once for every mode: the selection, the plan, the report's
header, the one answer to an interrupt or an internal error, the verdicts (drawn twice at most:
after the sweep for its follow-up, and once at the end for the profile, the files, the summary and
JUnit XML), and the conclusion.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import shutil
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Protocol

from sage_qual.errors import UsageError
from sage_qual.qualification import names
from sage_qual.qualification import selection as selection_mod
from sage_qual.qualification.decide import checked, profile, verdict
from sage_qual.qualification.evidence import files, report_model
from sage_qual.qualification.evidence.report_model import Cell, LongCheck, Outcome, Report, SpanProbe
from sage_qual.qualification.render import junit, report, summary
from sage_qual.qualification.run import plan as plan_mod
from sage_qual.qualification.run.options import InProcess, Integration, RunRequest

INTERRUPTED = "interrupted (SIGINT or SIGTERM)"


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def certify(request: RunRequest) -> Report:
    """The run: its report on disk after every result, concluded once, also when interrupted (a
    partial report) or when the executor fails (a partial report naming the error, then the error).
    UsageError, before anything is left on disk, for a request that cannot run."""
    request.check()
    subjects, target = _subjects(request)
    chosen = selection_mod.select(request.families, request.fixture_dirs, request.quick)
    request.check_gpu_visible(target_resolved=True)  # bad input said first, then no GPU, before a worker
    in_process = isinstance(request.executor, InProcess)
    if not chosen.fixtures and in_process:
        raise UsageError("no fixtures selected: give --fixtures DIR with *.safetensors fixtures, or other "
                         "--families")
    executor = _executor(request)
    failure, phases = None, Phases()
    with output_directory(request.out, replacing=request.previous_run()):
        try:
            machine = executor.discover(request, subjects)
            phases.end("discovery")
            if not chosen.fixtures and not target:
                print("sage-qual certify: no fixtures selected: no family can be certified", file=sys.stderr)
            planned = plan_mod.build(request, chosen, machine, subjects, in_process)
            writer = files.Writer(request.out / "report.json",
                                  header(planned, machine, executor.predicted, target))
            progress = Progress(planned.task_count, lines=not executor.predicted)
            try:
                _execute(planned, executor, writer, progress, threading.Event(), phases)
            except KeyboardInterrupt:  # SIGINT, or SIGTERM through the command line's handler
                writer.replace(stopped=INTERRUPTED)
            except BaseException as error:  # said in the report, raised after the conclusion
                failure = error
                writer.replace(stopped=f"internal error: {error!r}")
            finally:
                progress.close()
            if not writer.report.stopped:
                writer.replace(complete=True, finished=now())
        finally:
            executor.close()  # before a refusal removes `out`: workers write their logs there
    conclude(planned, writes_profile=not in_process and not target)
    phases.end("conclusion")
    print(f"sage-qual certify: {phases}", file=sys.stderr)
    if failure is not None:
        raise failure
    return writer.report


def _subjects(request: RunRequest) -> tuple[list[str], str]:
    """What the report's options.variants names, and the report's `target` ("" for our variants)."""
    if isinstance(request.subject, Integration):
        from sage_qual.qualification.integrations import targets

        try:
            name = targets.resolve(request.subject.target).name
        except targets.TargetError as error:
            raise UsageError(str(error)) from None
        return [name], name
    return names.select_variants(request.subject.names), ""


class Executor(Protocol):
    """What runs a plan's tasks: in worker processes on the GPUs (`worker_executor.WorkerExecutor`) or in
    this process under the numerics model (`in_process.InProcessExecutor`). It appends each result to
    the writer's report. `start_ahead` and `run_side_by_side` serve a plan that follows up, which a
    prediction never is: the in-process executor has no start_ahead and refuses the other."""
    predicted: bool  # its numbers are a model's, not a GPU's

    def discover(self, request: RunRequest, subjects: list[str]) -> plan_mod.Machine:
        """The machine the plan is built for (UsageError when there is none to run on)."""

    def start_ahead(self, jobs: list[tuple[int, list]]) -> None:
        """Workers for jobs that will follow the sweep, started now."""

    def run_slots(self, jobs: list[list[list]], writer: files.Writer, progress: "Progress",
                  stop: threading.Event, refine: Callable | None = None, ahead: list[list] = ()) -> None:
        """Each device slot's jobs in order, the slots side by side (`ahead`: tasks beside them)."""

    def run_side_by_side(self, jobs: list[tuple[int, list]], writer: files.Writer, progress: "Progress",
                         stop: threading.Event) -> None:
        """Jobs after the sweep, all at once."""

    def close(self) -> None:
        """Its workers ended."""


def _executor(request: RunRequest) -> Executor:
    if isinstance(request.executor, InProcess):
        from sage_qual.qualification.run import in_process

        return in_process.InProcessExecutor()
    from sage_qual.qualification.run import worker_executor

    return worker_executor.WorkerExecutor(request)


def _execute(planned: plan_mod.Plan, executor, writer: files.Writer, progress: Progress,
             stop: threading.Event, phases: Phases) -> None:
    """The plan's jobs (with the timing refinement after each of them in a full run), then what
    follows the sweep, decided on the sweep's verdicts; the follow-up's context checks, which no
    verdict changes, get their workers started with the sweep."""
    if planned.follows_up:
        executor.start_ahead(plan_mod.context_jobs(planned.devices, planned.subjects))
    executor.run_slots(planned.jobs, writer, progress, stop,
                       refine=plan_mod.refinement if planned.follows_up else None, ahead=planned.ahead)
    phases.end("sweep")
    if not planned.follows_up or stop.is_set():
        return
    swept = dataclasses.replace(writer.report, complete=True, finished=now())
    following = plan_mod.follow_up(swept, verdict.decide(swept), planned.subjects)
    for slot, field in following.begun:
        writer.append(slot, field)
    progress.grow(sum(len(job) for _, job in following.jobs))
    executor.run_side_by_side(following.jobs, writer, progress, stop)
    phases.end("follow-up")


def header(planned: plan_mod.Plan, machine: plan_mod.Machine, predicted: bool, target: str) -> Report:
    """The report before its first result: complete=false, every device entry in place."""
    request, chosen = planned.request, planned.selection
    timeout = 0.0 if isinstance(request.executor, InProcess) else request.executor.timeout
    return Report(
        kind=report_model.KIND, schema_version=report_model.SCHEMA_VERSION, complete=False, stopped="",
        started=now(), finished=None, host=socket.gethostname(), command=request.command,
        options=report_model.Options(devices=[d.index for d in planned.devices], variants=planned.subjects,
                                     families=[f.name for f in chosen.families],
                                     fixture_dirs=chosen.fixture_dirs,
                                     quick=request.quick, timeout_s=timeout),
        environment=machine.environment, fixtures=[selection_mod.fixture_record(f) for f in chosen.fixtures],
        shapes=planned.shapes, devices=planned.devices, predicted=predicted, target=target,
        fitness_judged=True)


@contextlib.contextmanager
def output_directory(out: Path, replacing: list[Path]):
    """`out`, created for the run, without what a previous run left there (`replacing`, which
    --force asked to replace); a UsageError before report.json was written removes what was created,
    so a refused run leaves nothing behind."""
    new = None if out.exists() else _first_missing(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        for path in replacing:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
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
def conclude(planned: plan_mod.Plan, writes_profile: bool) -> None:
    """The run's report read back, decided once: the profile (of a finished certify run on GPUs),
    report.md/html, the summary and the JUnit XML."""
    out = planned.request.out
    path = str(out / "report.json")
    try:  # what this run wrote must read back, the rules across results included: a bug, in one line
        written = checked.load(path)
    except report_model.ReportError as error:
        raise UsageError(f"the run's own report does not read back, a sage-qual bug ({error}); report.json "
                         "keeps every measurement") from None
    decisions = verdict.decide(written)
    if written.complete and writes_profile:
        profile.save(profile.build(written, decisions), out / "profile.json")
    report.render(written, out, decisions, planned.selection.left_out)
    print(summary.text(written, out, decisions, planned.selection.left_out))
    if planned.request.junit_xml:
        junit.write(planned.request.junit_xml, f"sage-qual certify {written.host}",
                    [junit.case(gpu.model, decision) for gpu in decisions for decision in gpu.families])


class Phases:
    """Where a run's time went, phase by phase (discovery, sweep, follow-up, conclusion), said in one
    line at its end: certify's budget is 150 s on the H200 (issue 40)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock, self.last, self.seconds = clock, clock(), {}

    def end(self, phase: str) -> None:
        now = self.clock()
        self.seconds[phase], self.last = now - self.last, now

    def __str__(self) -> str:
        each = ", ".join(f"{phase} {seconds:.1f} s" for phase, seconds in self.seconds.items())
        return f"{sum(self.seconds.values()):.1f} s ({each})"


# Progress --------------------------------------------------------------------------------------
class Progress:
    """A tqdm bar on a terminal; else plain lines for a CI log (or without tqdm): one per result, or
    with `lines=False` (a prediction: hundreds of results in minutes, the summary names them) one at
    each tenth of the run, so that a log shows it moving (issue 28: a full `certify --emulate` was
    silent for 37 minutes). Each line says the seconds since the run began, so that a CI log is also
    the run's time profile (where certify's time went, issue 40)."""

    def __init__(self, total: int, lines: bool = True, clock: Callable[[], float] = time.monotonic):
        self.total, self.done, self.lines = total, 0, lines
        self.clock, self.began = clock, clock()
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
                count = f"[{self.done}/{self.total}, {self.clock() - self.began:.1f} s]"
                if self.lines:
                    print(f"{count} {line}", flush=True)
                elif self.done * 10 // (total := max(self.total, 1)) > (self.done - 1) * 10 // total:
                    print(f"{count} {self.done * 100 // total} % done, last: {line}", flush=True)
                return
            self.bar.update(1)
            self.bar.set_postfix_str(line[:60])
            if self.lines and record.outcome not in (Outcome.PASS, Outcome.SKIP):
                self.bar.write(line)

    def note(self, line: str) -> None:
        """A line about the run that is no result (the bar's count stays)."""
        with self.lock:
            if self.bar is None:
                print(f"[{self.clock() - self.began:.1f} s] {line}", flush=True)
            else:
                self.bar.write(line)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def describe(record: Cell | LongCheck | report_model.Speed | SpanProbe | report_model.ContextCheck) -> str:
    """One result in a line: what ran where, its outcome and, unless it passed, why."""
    if isinstance(record, report_model.ContextCheck):
        what = f"{record.variant} in every context: {record.decided()}"
    elif isinstance(record, SpanProbe):
        what = (f"{record.variant} span {record.span:,} ({record.layout}, {record.side} {record.limit:,}): "
                f"{record.outcome.value}")
    elif isinstance(record, (Cell, LongCheck)):
        where = record.fixture if isinstance(record, Cell) else \
            f"{record.shape.q_tokens} tokens ({', '.join(record.layouts)})"
        what = f"{record.variant} x {where}: {record.outcome.value}"
        if isinstance(record, Cell) and record.metrics and record.metrics.rel_l2 is not None:
            what += (f" (rel L2 {record.metrics.rel_l2:.3g}, "
                     f"worst cos {_number(record.metrics.worst_head_cosine)})")
    else:
        name = f"sdpa/{record.best_backend}" if record.best_backend else record.kernel
        timing = f"{record.ms:.3g} ms" if record.ms else record.outcome.value
        what = f"{name} @ {record.shape}: {timing}"
    reasons = getattr(record, "reasons", [])
    detail = "; ".join(r.detail for r in reasons) or record.detail
    return what + (f" -- {detail}" if detail and record.outcome != Outcome.PASS else "")


def _number(x) -> str:
    return "-" if x is None else f"{x:.4g}"
