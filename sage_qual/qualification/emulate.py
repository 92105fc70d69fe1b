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

import datetime
import math
import socket
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from sage_qual import records
from sage_qual.errors import UsageError
from sage_qual.fixtures import fileformat
from sage_qual.qualification import budgets, certify, judge, long_check, measure, report, tasks, verdict
from sage_qual.qualification.report_model import ReasonKind
from sage_qual.serving import environment
from sage_qual.serving.variants import VARIANTS, Variant, capability_label

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


def predict_cell(variant: Variant, fixture: fileformat.Fixture, ref: torch.Tensor) -> dict:
    """One (variant, fixture) cell in certify's record layout, judged like a measured one."""
    start = time.monotonic()
    # The model's output (K smoothing off, as served) and the budget derived from it, computed once.
    out = budgets.prediction(variant, fixture)
    acc = measure.accuracy(out, fixture.q, fixture.k, fixture.v, ref)
    bounds = budgets.budget(variant, fixture)
    # Peak memory is a GPU measurement the model cannot make: no memory figure is stored, and the
    # judgement's memory term gets zero against no bound, so it cannot fire.
    reasons = judge.cell_reasons(acc, 0.0, bounds, math.inf)
    return records.dump(tasks.judged_cell(variant.name, fixture.name, acc.as_dict(), bounds, reasons,
                                          variant.accuracy_class, None, detail=PREDICTED,
                                          seconds=round(time.monotonic() - start, 3)))


def predict_long(variant: Variant, check: tasks.LongPlan, cache: dict) -> dict:
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
    return records.dump(replace(
        cache[key], shape=task.shape, uses=task.uses, layouts=task.layouts,
        identical={name: True for name in task.layouts if name != "contiguous"}, detail=PREDICTED,
        ran_heads=heads if heads != shape.heads else None))


def run(options: Options) -> dict:
    variants = certify.select_variants(options.variants)
    chosen = certify.select_families(options.families)
    directories = certify.fixture_dirs(options.fixture_dirs)
    fixtures = certify.select_fixtures(directories, chosen, options.families is None, options.quick)
    if not fixtures:
        raise UsageError("no fixtures selected: give --fixtures DIR with *.safetensors fixtures, or other "
                         "--families")
    out = Path(options.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UsageError(f"cannot write to {out}: {error.strerror or error}") from None
    data = _new_report(options, variants, chosen, fixtures, directories)
    writer = report.Writer(out / "report.json", data)
    cells = data["devices"][0]["cells"]
    with _progress(len(variants) * len(fixtures)) as tick:
        for fixture in fixtures:
            ref = measure.reference(fixture.q, fixture.k, fixture.v)
            for name in variants:
                cell = predict_cell(VARIANTS[name], fixture, ref)
                cells.append(cell)
                tick(f"{name} x {fixture.name}: {cell['outcome']} (rel L2 {_number(cell['rel_l2'])})")
    checks = certify.long_checks(chosen, fixtures, options.quick)
    predicted: dict[tuple, dict] = {}
    with _progress(len(variants) * len(checks)) as tick:
        for name in variants:
            for check in checks.values():
                record = predict_long(VARIANTS[name], check, predicted)
                data["devices"][0]["long"].append(record)
                tick(f"{name} at {check.shape.q_tokens} tokens: {record['outcome']}")
    writer.update(_finish)
    report.render(data, out)
    print(summary(data), end="")
    print(f"sage-qual certify --emulate: PREDICTED report in {out / 'report.md'} (`sage-qual gate` "
          "refuses it: certify on the GPU to enable a family)")
    return data


def _new_report(options: Options, variants: list[str], chosen: list, fixtures: list,
                directories: list) -> dict:
    now = _now()
    return {
        "kind": report.KIND, "schema_version": report.SCHEMA_VERSION, "complete": False, "stopped": "",
        "predicted": True, "started": now, "finished": None, "host": socket.gethostname(),
        "command": options.command,
        "options": {"devices": [0], "variants": variants, "families": [f.name for f in chosen],
                    "fixture_dirs": directories, "quick": options.quick, "timeout_s": 0.0},
        "environment": asdict(environment.collect()),
        "fixtures": [certify._fixture_record(f) for f in fixtures],
        "shapes": {},
        "devices": [{"index": 0, "name": DEVICE_NAME, "capability": [0, 0], "memory_gib": 0.0,
                     "not_supported": {}, "cells": [], "speed": [], "long": []}],
    }


def _finish(data: dict) -> None:
    data["complete"] = True
    data["finished"] = _now()


def family_matrix(data: dict) -> dict[str, dict[str, list[str]]]:
    """Per family with fixtures in the run, per variant: why it would fail (from `verdict.decide()`,
    the verdict gate and report.md give; [] = would pass every fixture of the family)."""
    matrix: dict[str, dict[str, list[str]]] = {}
    for gpu in verdict.decide(report.parse(data, "predicted report")):
        for family in gpu.families:
            if all(r.kind == ReasonKind.NO_FIXTURES for r in family.reasons) and family.reasons:
                continue
            matrix[family.label] = {v: [r.detail for r in family.rejected.get(v, [])]
                                    for v in data["options"]["variants"]}
    return matrix


def summary(data: dict) -> str:
    """The terminal table: per variant (and the GPUs that run it by default), which families it
    would pass or fail (predicted), then every predicted failure with its reason."""
    matrix = family_matrix(data)
    variants = data["options"]["variants"]
    lines = [f"PREDICTED (CPU numerics model, no GPU ran): {len(data['fixtures'])} fixture(s), "
             f"{len(variants)} variant(s); FAIL = would fail at least one fixture of the family"]
    width = max(map(len, variants)) + 2
    lines.append("variant".ljust(width) + "default on".ljust(16) + " ".join(f.ljust(10) for f in matrix))
    for variant in variants:
        native = ",".join(map(capability_label, VARIANTS[variant].native_on)) or "-"
        row = " ".join(("FAIL" if matrix[f][variant] else "pass").ljust(10) for f in matrix)
        lines.append(variant.ljust(width) + native[:15].ljust(16) + row)
    for family, row in matrix.items():
        for reasons in row.values():
            # One line per variant and fixture: its reasons share the "VARIANT on FIXTURE (...): " prefix.
            grouped: dict[str, list[str]] = {}
            # A non-finite output leaves every metric "not measured": the first reason says it all.
            reasons = [r for r in reasons if not r.endswith("not measured")] or reasons
            for reason in reasons:
                where, _, what = reason.partition("): ")
                # The one pseudo-device is the model, not a GPU: its "(cuda:0)" says nothing.
                grouped.setdefault(where.removesuffix(" (cuda:0") if what else "", []).append(what or reason)
            lines += [f"  would fail {family}: {where}: {'; '.join(whats)}" if where else
                      f"  would fail {family}: {'; '.join(whats)}" for where, whats in grouped.items()]
    skipped = sorted(set(data["options"]["families"]) - set(matrix))
    if skipped:
        lines.append(f"  no fixtures, not predicted: {', '.join(skipped)}")
    return "\n".join(lines) + "\n"


class _progress:
    """A tqdm bar on a terminal; nothing per cell in a log (the summary follows)."""

    def __init__(self, total: int):
        self.bar = None
        if sys.stderr.isatty():
            try:
                from tqdm import tqdm
            except ImportError:  # tqdm comes with the [report] and [test] extras
                return
            self.bar = tqdm(total=total, unit="cell", desc="emulating", dynamic_ncols=True, file=sys.stderr)

    def __enter__(self):
        def tick(line: str) -> None:
            if self.bar is not None:
                self.bar.update(1)
                self.bar.set_postfix_str(line[:60])

        return tick

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.close()


def _number(x) -> str:
    return "-" if x is None else f"{x:.3g}"


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
