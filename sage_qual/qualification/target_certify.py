"""`sage-qual certify --target NAME`: the fixtures, budgets and verdicts of certify, run on an
integration (`targets.resolve(NAME)`) instead of on our variants.

Each cell runs in certify's isolated workers (task kind "target_cell", `target_cells.run_cell`): the target is
enabled as its app enables it, called on the fixture in SDPA's layout, and judged by the same
`judge.cell_reasons` against the fixture's bounds for the kernel class the integration runs on
that GPU. A call the integration claims not to take is a skip with its claim
(`head_dim=96 (supported: 64, 128)`); a call it takes but does not serve on SageAttention is a skip
with why, so a family is never enabled on a call SageAttention never saw. No speed sweep: the
question is whether the integration is safe on this GPU, per family.

In the report the target stands where a variant stands (`options.variants == [NAME]`, the cells'
`variant`), and the report's `target` names it.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from pathlib import Path

from sage_qual import limits
from sage_qual.errors import UsageError
from sage_qual.qualification import certify_run, pool, report, run_options, targets, tasks
from sage_qual.qualification import families as families_mod
from sage_qual.qualification.report_model import Cell, Outcome, Report

WORKERS_PER_GPU = 2  # started ahead per GPU: the target's machine check and its cells take one each


@dataclasses.dataclass
class Options(run_options.WorkerRunOptions):
    out: Path
    target: str
    command: str = "sage_qual.qualification.target_certify.run()"


def resolve(name: str) -> targets.Target:
    try:
        return targets.resolve(name)
    except targets.TargetError as error:
        raise UsageError(str(error)) from None


def run(options: Options) -> Report:
    run_options.check_numbers(options.timeout, options.devices)
    target = resolve(options.target)
    plan = certify_run.plan(options.out, options.command, [target.name], options.families,
                            options.fixture_dirs, options.quick, options.timeout, options.junit_xml)
    return certify_run.run(plan, TargetRun(target.name, options.devices))


class TargetRun:
    """The backend of `certify --target`: per GPU, the target's machine check, then each fixture in
    a worker."""
    predicted, writes_profile = False, False

    def __init__(self, target: str, devices: str):
        self.target, self.devices = target, devices
        self.workers: pool.Pool | None = None

    def prepare(self, plan: certify_run.Plan) -> certify_run.Machine:
        self.workers = pool.Pool(certify_run.logs_directory(plan.out))
        collected = certify_run.gpu_machine(
            plan, self.devices, "certify --target needs the GPU it qualifies the integration on",
            needs_sageattention=False, workers=self.workers, per_gpu=WORKERS_PER_GPU)
        gpus = collected.environment.gpus
        return certify_run.Machine(collected.environment,
                                   [certify_run.gpu_device(gpus[i], {}, [], None) for i in collected.indices])

    def execute(self, plan: certify_run.Plan, writer: report.Writer, stop: threading.Event) -> None:
        progress = certify_run.Progress(len(plan.fixtures) * len(writer.report.devices))
        try:
            certify_run.parallel([functools.partial(self._device_cells, n, plan, writer, progress, stop)
                                  for n in range(len(writer.report.devices))], stop)
        finally:
            progress.close()

    def close(self) -> None:
        if self.workers is not None:
            self.workers.close()

    def _device_cells(self, position: int, plan: certify_run.Plan, writer: report.Writer,
                      progress: certify_run.Progress, stop: threading.Event) -> None:
        """One GPU's cells, each in a worker."""
        device = writer.report.devices[position]
        name = self.target
        results: list[tasks.MachineResult] = []
        with certify_run.gpu_env(device.index) as env:
            run = functools.partial(pool.run_tasks, spawn=self.workers.take, timeout=plan.timeout,
                                    startup_timeout=limits.startup_timeout(plan.timeout), stop=stop, env=env)
            run([tasks.TargetMachineTask("machine", name)],
                on_result=lambda task, result: results.append(result))
            if not results:  # stopped before the machine check answered
                return
            (machine,) = results
            reasons = machine.reasons if machine.outcome == Outcome.PASS else [machine.detail]
            if reasons:
                skips = [Cell(variant=name, fixture=f.name, outcome=Outcome.SKIP, detail="; ".join(reasons))
                         for f in plan.fixtures]
                writer.replace_device(position, not_supported={name: reasons}, cells=skips)
                return
            cells = [tasks.TargetCellTask(f.name, name, f.name, str(f.path), list(device.capability),
                                          families_mod.memory_bound(f.family)) for f in plan.fixtures]

            def record(task, cell: Cell) -> None:
                writer.append(position, "cells", cell)
                progress.tick(f"cuda:{device.index}", cell)

            run(cells, on_result=record)
