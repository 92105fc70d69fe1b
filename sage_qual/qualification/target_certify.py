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
import datetime
import functools
import os
import shutil
import socket
import tempfile
import threading
from pathlib import Path

from sage_qual import limits, records
from sage_qual.errors import UsageError
from sage_qual.qualification import certify, pool, report, targets, tasks, verdict
from sage_qual.qualification import families as families_mod
from sage_qual.qualification.report_model import Outcome, ReasonKind


@dataclasses.dataclass
class Options:
    out: Path
    target: str
    devices: str = "all"
    families: list[str] | None = None
    fixture_dirs: list[str] | None = None
    quick: bool = False
    timeout: float = limits.TASK_TIMEOUT
    command: str = "sage_qual.qualification.target_certify.run()"


# The parent's side ------------------------------------------------------------------------------
def resolve(name: str) -> targets.Target:
    try:
        return targets.resolve(name)
    except targets.TargetError as error:
        raise UsageError(str(error)) from None


def run(options: Options) -> dict:
    certify.check_numbers(options)
    target = resolve(options.target)
    chosen = certify.select_families(options.families)
    directories = certify.fixture_dirs(options.fixture_dirs)
    fixtures = certify.select_fixtures(directories, chosen, options.families is None, options.quick)
    out = Path(options.out)
    with certify.output_directory(out) as logs:
        workers = pool.Pool(logs)
        try:
            try:
                collected = pool.collect_environment(logs / "environment.log",
                                                     limits.startup_timeout(options.timeout))
            except pool.WorkerError as error:
                raise UsageError(str(error)) from None
            return _run(options, target, chosen, fixtures, directories, collected, out, workers)
        finally:
            workers.close()


def _run(options: Options, target: targets.Target, chosen: list, fixtures: list, directories: list,
         collected: dict, out: Path, workers: pool.Pool) -> dict:
    env = collected["environment"]
    if not env["gpus"]:
        raise UsageError("no CUDA GPU is visible here (CPU-only torch, no driver, or CUDA_VISIBLE_DEVICES "
                         "empty): certify --target needs the GPU it qualifies the integration on")
    devices = certify._device_indices(options.devices, len(env["gpus"]))
    data = {
        "kind": report.KIND, "schema_version": report.SCHEMA_VERSION, "complete": False, "stopped": "",
        "target": target.name, "started": _now(), "finished": None, "host": socket.gethostname(),
        "command": options.command,
        "options": {"devices": devices, "variants": [target.name], "families": [f.name for f in chosen],
                    "fixture_dirs": directories, "quick": options.quick, "timeout_s": options.timeout},
        "environment": env, "fixtures": [certify._fixture_record(f) for f in fixtures], "shapes": {},
        "devices": [{"index": i, "name": env["gpus"][i]["name"], "capability": env["gpus"][i]["capability"],
                     "memory_gib": env["gpus"][i]["memory_gib"], "not_supported": {}, "cells": [],
                     "speed": []}
                    for i in devices],
    }
    writer = report.Writer(out / "report.json", data)
    stop, errors = threading.Event(), []
    threads = [threading.Thread(target=_device_run, daemon=True,
                                args=(n, target, fixtures, options, writer, workers, stop, errors))
               for n in range(len(devices))]
    for thread in threads:
        thread.start()
    try:
        while any(thread.is_alive() for thread in threads):
            for thread in threads:
                thread.join(timeout=0.5)
    except KeyboardInterrupt:  # SIGINT, or SIGTERM through the command line's handler
        stop.set()
        for thread in threads:
            thread.join()
        writer.update(lambda d: d.update(stopped="interrupted (SIGINT or SIGTERM)"))
    if errors and not data["stopped"]:
        writer.update(lambda d: d.update(stopped=f"internal error: {errors[0]!r}"))
    if not data["stopped"]:
        writer.update(_finish)
    report.render(data, out)
    print(summary(data, out), end="")
    if errors:
        raise errors[0]
    return data


def _device_run(position: int, target: targets.Target, fixtures: list, options: Options,
                writer: report.Writer, workers: pool.Pool, stop: threading.Event, errors: list) -> None:
    """One GPU's cells, each in a worker; an error of this thread is handed to the main thread."""
    try:
        _device_cells(position, target, fixtures, options, writer, workers, stop)
    except BaseException as error:
        errors.append(error)


def _device_cells(position: int, target: targets.Target, fixtures: list, options: Options,
                  writer: report.Writer, workers: pool.Pool, stop: threading.Event) -> None:
    device = writer.data["devices"][position]
    parent_visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = parent_visible.split(",")[device["index"]] if parent_visible else str(device["index"])
    cache = tempfile.mkdtemp(prefix=f"sage-qual-triton-cuda{device['index']}-")
    env = {"CUDA_VISIBLE_DEVICES": visible, "TRITON_CACHE_DIR": cache}
    results: list[tasks.MachineResult] = []
    try:
        run = functools.partial(pool.run_tasks, spawn=workers.take, timeout=options.timeout,
                                startup_timeout=limits.startup_timeout(options.timeout), stop=stop, env=env)
        run([tasks.TargetMachineTask("machine", target.name)],
            on_result=lambda task, result: results.append(result))
        (machine,) = results
        reasons = machine.reasons if machine.outcome == Outcome.PASS else [machine.detail]
        if reasons:
            def skip(d):
                d["devices"][position]["not_supported"][target.name] = reasons
                d["devices"][position]["cells"] += [
                    {"variant": target.name, "fixture": f.name, "outcome": "skip",
                     "detail": "; ".join(reasons)}
                    for f in fixtures]

            writer.update(skip)
            return
        cells = [tasks.TargetCellTask(f.name, target.name, f.name, str(f.path), device["capability"],
                                      families_mod.memory_bound(f.family)) for f in fixtures]

        def record(task, cell):
            entry = records.dump(cell)
            writer.update(lambda d: d["devices"][position]["cells"].append(entry))
            print(f"cuda:{device['index']} {target.name} x {task.id}: {cell.outcome.value}"
                  + (f" -- {cell.detail}" if cell.detail else ""), flush=True)

        run(cells, on_result=record)
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def _finish(data: dict) -> None:
    data["complete"] = True
    data["finished"] = _now()


def summary(data: dict, out: Path) -> str:
    """Per GPU and family, from `verdict.decide()` (the verdict gate and report.md give): safe when
    the integration passed every fixture of the family, NOT SAFE with every reason when one failed,
    crashed or ran out of time or memory, not qualified when it has no evidence (no fixtures, or
    calls it does not take or did not serve)."""
    name = data["target"]
    lines = [f"sage-qual certify --target {name}: report in {out / 'report.md'}"]
    for gpu in verdict.decide(report.parse(data, str(out / "report.json"))):
        for family in gpu.families:
            if name in family.certified:
                state = "safe: every fixture of the family passed"
            else:
                reasons = family.rejected.get(name) or family.reasons
                # Skips (calls the integration does not take or did not serve) and missing fixtures
                # are no evidence either way; anything measured or crashed is.
                unproven = all(r.kind in (ReasonKind.NO_FIXTURES, ReasonKind.SKIP) for r in reasons)
                verdict_word = "not qualified: " if unproven else "NOT SAFE: "
                state = verdict_word + "; ".join(r.detail for r in reasons)
            lines.append("  %s  %-12s %s" % (gpu.model, family.label, state))
    return "\n".join(lines) + "\n"


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
