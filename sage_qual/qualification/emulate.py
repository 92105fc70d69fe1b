"""`sage-qual certify --emulate`: what every variant would do on the fixtures, predicted on the CPU.

No GPU runs: each variant's numerics model (its INT8 Q/K groups, FP8 or FP16 P.V and V scaling,
`sage_qual.fixtures.numerics`) computes its output on every selected fixture, and the same
judgement as certify (`judge.cell_reasons` against the cell's budget, `budgets.budget`) says
whether it would pass. The budget is derived from this same model with the suite's margin, so a
prediction fails where the model's own output does: non-finite (an fp16 accumulator overflowing,
a zero V channel under FP8). The report has certify's layout and is marked predicted everywhere:
one pseudo-device, "numerics model (CPU)", no speed section, no memory figures (the model
allocates nothing like the kernel), and `sage-qual gate` refuses it.

The long checks certify plans (`long_check.plan`) are predicted too, at their full length: the model
stands for the kernel on the sampled rows (so only a non-finite prediction can fail), every layout
is identical by construction (the model reads values, not memory), and one K/V group of heads
stands for all of them (each head's arithmetic is independent of the others'), on EMULATE_BLOCKS
sampled row blocks, to keep the CPU cost at seconds per check.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from sage_qual.errors import UsageError
from sage_qual.fixtures import fileformat
from sage_qual.qualification import budgets, certify, certify_run, judge, long_check, measure, report, tasks
from sage_qual.qualification.report_model import Cell, Device, LongCheck, Report
from sage_qual.serving import environment
from sage_qual.serving.variants import VARIANTS, Variant

PREDICTED = "predicted by the CPU numerics model (sage_qual.fixtures.numerics), not measured on a GPU"
EMULATE_BLOCKS = 2  # sampled row blocks per predicted long check: the first and the last
DEVICE_NAME = "numerics model (CPU, predicted)"


@dataclass
class Options:
    out: Path
    variants: list[str] | None = None
    families: list[str] | None = None
    fixture_dirs: list[str] | None = None
    quick: bool = False
    command: str = "sage_qual.qualification.emulate.run()"


def predict_cell(variant: Variant, fixture: fileformat.Fixture, ref: torch.Tensor) -> Cell:
    """One (variant, fixture) cell as certify records it, judged like a measured one."""
    start = time.monotonic()
    # The model's output (K smoothing off, as served) and the budget derived from it, computed once.
    out = budgets.prediction(variant, fixture)
    acc = measure.accuracy(out, fixture.q, fixture.k, fixture.v, ref)
    bounds = budgets.budget(variant, fixture)
    # Peak memory is a GPU measurement the model cannot make: no memory figure is stored, and the
    # judgement's memory term gets zero against no bound, so it cannot fire.
    reasons = judge.cell_reasons(acc, 0.0, bounds, math.inf)
    return tasks.judged_cell(variant.name, fixture.name, acc.as_dict(), bounds, reasons,
                             variant.accuracy_class, None, detail=PREDICTED,
                             seconds=round(time.monotonic() - start, 3))


def predict_long(variant: Variant, check: tasks.LongPlan, cache: dict) -> LongCheck:
    """One planned long check predicted (module docstring); calls alike after the head reduction
    are computed once (`cache`)."""
    task = tasks.long_task(f"{variant.name}~predicted", variant.name, check)
    shape = task.shape
    heads = shape.heads // shape.kv_heads
    key = (variant.name, heads, shape.q_tokens, shape.kv_tokens, shape.head_dim, shape.dtype)
    if key not in cache:
        start = time.monotonic()
        q, k, v = long_check.synthetic(shape, "cpu", heads=heads)
        result = long_check.check(task, q, k, v, None, blocks=EMULATE_BLOCKS)
        cache[key] = replace(result, seconds=round(time.monotonic() - start, 3))
    return replace(cache[key], shape=task.shape, uses=task.uses, layouts=task.layouts,
                   identical={name: True for name in task.layouts if name != "contiguous"}, detail=PREDICTED,
                   ran_heads=heads if heads != shape.heads else None)


def run(options: Options) -> Report:
    plan = certify_run.plan(options.out, options.command, certify_run.select_variants(options.variants),
                            options.families, options.fixture_dirs, options.quick)
    if not plan.fixtures:
        raise UsageError("no fixtures selected: give --fixtures DIR with *.safetensors fixtures, or other "
                         "--families")
    return certify_run.run(plan, Emulation())


class Emulation:
    """The backend of `certify --emulate`: every variant's numerics model, in this process, on one
    pseudo-device."""
    predicted, target, writes_profile = True, "", False

    def prepare(self, plan: certify_run.Plan) -> certify_run.Machine:
        device = Device(index=0, name=DEVICE_NAME, capability=[0, 0], memory_gib=0.0, not_supported={},
                        cells=[], speed=[], long=[])
        return certify_run.Machine(environment.collect(), [device])

    def execute(self, plan: certify_run.Plan, writer: report.Writer, stop: threading.Event) -> None:
        """Cells, then long checks; an interrupt (KeyboardInterrupt in this thread) stops between two."""
        checks = certify.long_checks(plan.families, plan.fixtures, plan.quick)
        progress = certify_run.Progress(len(plan.variants) * (len(plan.fixtures) + len(checks)), lines=False)
        try:
            for fixture in plan.fixtures:
                ref = measure.reference(fixture.q, fixture.k, fixture.v)
                for name in plan.variants:
                    cell = predict_cell(VARIANTS[name], fixture, ref)
                    writer.append(0, "cells", cell)
                    progress.tick("cpu", cell)
            predicted: dict[tuple, dict] = {}
            for name in plan.variants:
                for check in checks.values():
                    record = predict_long(VARIANTS[name], check, predicted)
                    writer.append(0, "long", record)
                    progress.tick("cpu", record)
        finally:
            progress.close()

    def close(self) -> None:
        """Nothing to end: no worker ran."""
