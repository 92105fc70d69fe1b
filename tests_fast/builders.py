"""Builders shared by the fast suite's test modules (test modules import this, never each other):
serving profiles and the machine they are matched against (test_profile and the modules reading
profiles), and certify reports built through the report's own records (`report_model`) and written
with `records.dump`, so a report a test builds is one certify could write, and the test names only
what it is about: every builder takes keyword overrides of its defaults. A test of a malformed
report builds a valid one here and then breaks the dumped dict, so it shows which key is wrong."""

import dataclasses
import hashlib
import json
import math
from pathlib import Path

import torch

from sage_qual import limits, records
from sage_qual.kernels.variants import VARIANTS
from sage_qual.qualification import families
from sage_qual.qualification.evidence import tasks
from sage_qual.qualification.evidence.report_model import (
    METRIC_NAMES,
    SCHEMA_VERSION,
    AccuracyClass,
    Budget,
    Cell,
    Device,
    DType,
    EnvironmentRecord,
    FixtureKind,
    FixtureRecord,
    GpuInfo,
    LongCheck,
    Metrics,
    Options,
    Outcome,
    PublishedBound,
    Reason,
    ReasonKind,
    Report,
    ShapeSpec,
    ShapeUse,
    Speed,
)
from sage_qual.qualification.measure import long_check as long_check_mod
from sage_qual.qualification.run import options
from sage_qual.serving import profile_matching as matching
from sage_qual.testing import FakeGpu
from sage_qual.verdicts import profile
from sage_qual.verdicts.fitness import FitnessBound
from sage_qual.verdicts.served import Served

SAMPLE = Path(__file__).parent / "data" / "sample_h200_2gpu.json"
H200 = FakeGpu((9, 0), "Fake H200", 141.0)
H100 = FakeGpu((9, 0), "Fake H100", 80.0)
RTX4090 = FakeGpu((8, 9), "Fake RTX 4090", 24.0)


# Serving profiles ---------------------------------------------------------------------------------
def make_entry(
    variant="sm89-fp8-cuda", min_q=2048, min_k=512, head_dims=(128,), reasons=(), **served
) -> dict:
    """A profile entry serving `variant` from these lengths (and any other `Served` field), or
    (variant None) nothing, for `reasons`."""
    return records.dump(profile.Entry(
        Served(variant, min_q, min_k, list(head_dims), **served) if variant else None, list(reasons)))


def flat_entry(
    variant="sm89-fp8-cuda", min_q=2048, min_k=512, head_dims=(128,), reasons=(), **served
) -> dict:
    """make_entry()'s entry as profiles of versions 1 and 2 wrote it: every field flat, variant null
    (and every threshold null) for nothing."""
    entry = make_entry(variant, min_q, min_k, head_dims, reasons, **served)
    return {
        **(entry["served"] or dict(variant=None, min_query_tokens=None, min_key_tokens=None, head_dims=None)),
        "reasons": entry["reasons"],
    }


def edited(entry: dict, **served) -> dict:
    """A make_entry() entry with fields of what it serves replaced (a test's broken one)."""
    return {**entry, "served": {**entry["served"], **served}}


def make_gpu(gpu=H200, entry=None, families=None, torch_version=None, sageattention="2.2.0",
             torch_cuda="13.0") -> dict:
    environment = profile.ProfileEnvironment(torch_version or torch.__version__, torch_cuda, "580.159.04",
                                             sageattention, "3.6.0")
    entries = {name: read(profile.Entry, e) for name, e in (families or {}).items()}
    return records.dump(profile.ProfileGpu(gpu.name, list(gpu.capability), gpu.memory_gib, environment,
                                           read(profile.Entry, entry or make_entry()), entries))


def make_profile(*gpus, **one) -> dict:
    """A profile of `gpus` (make_gpu's), or of one make_gpu(**one)."""
    certified = [read(profile.ProfileGpu, gpu) for gpu in gpus or [make_gpu(**one)]]
    return records.dump(
        profile.Profile(
            "sage-qual-profile", profile.SCHEMA_VERSION, "2026-11-29T20:00:00+00:00", "test", {}, certified
        )
    )


def with_default(entry) -> dict:
    """make_profile() with its default entry replaced by `entry` as given (a test's broken one)."""
    data = make_profile()
    data["gpus"][0]["default"] = entry
    return data


def refusal(entry) -> str:
    """What `profile.load` says of a profile whose default entry is `entry` (it must refuse it)."""
    try:
        profile.load(with_default(entry))
    except profile.ProfileError as refused:
        return str(refused)
    raise AssertionError(f"the profile with entry {entry!r} was accepted")


def machine(gpu, torch_version=None, sageattention="2.2.0", torch_cuda="13.0", source="", sm_count=None):
    return matching.LocalDevice(gpu.name, gpu.capability, gpu.memory_gib, torch_version or torch.__version__,
                           torch_cuda, sageattention, source, sm_count)


# Report records ---------------------------------------------------------------------------------
FIXTURE_BOUNDS = {AccuracyClass.FP16: PublishedBound(max_rel_l2=0.05, min_cosine=0.99),
                  AccuracyClass.FP8: PublishedBound(max_rel_l2=0.12, min_cosine=0.98)}
# A fitness bound nothing passes over, for tests of the conformance judge alone.
CONFORMANCE_ONLY = FitnessBound(math.inf, None, "a test of conformance alone", "a test of conformance alone")
H200_DEVICE = ("NVIDIA H200", [9, 0], 139.8)  # name, capability, memory_gib as torch reports them
MEASURED = (Outcome.PASS, Outcome.FAIL)


def read(cls, data: dict):
    """`data` (JSON as certify writes it, e.g. `plan.speed_shapes`' entries) as a `cls` record."""
    return records.parse(cls, data, "tests_fast/builders.py", "fix the test's data")


def reason(kind: str, detail: str) -> Reason:
    return Reason(ReasonKind(kind), detail)


def budget_of(**limits) -> Budget:
    """A budget holding only the limits given, the others null (as a report that predates them)."""
    return budget(**{"max_rel_l2": None, "min_cosine": None, **limits})


def budget(max_rel_l2=0.06, min_cosine=0.99, **limits) -> Budget:
    """A budget of these limits; a limit not named is null (not checked, as in an older report)."""
    nulls = {f.name: None for f in dataclasses.fields(Budget)}
    return Budget(**{**nulls, "max_rel_l2": max_rel_l2, "min_cosine": min_cosine, **limits})


def metrics(finite=True, **numbers) -> Metrics:
    """An output's metrics: these numbers, the others null (not measured)."""
    nulls = {f.name: None for f in dataclasses.fields(Metrics)}
    return Metrics(**{**nulls, "finite": finite, **numbers})


def fixture(name="fx0", family="flux.1", **fields) -> FixtureRecord:
    values = {"kind": FixtureKind.REPLICA, "dtype": DType.BFLOAT16, "q": [1, 2, 256, 128],
              "k": [1, 2, 256, 128], "sha256": hashlib.sha256(name.encode()).hexdigest(),
              "bounds": FIXTURE_BOUNDS, "provenance": "tests_fast/builders.py", **fields}
    return FixtureRecord(name=name, family=family, **values)


def cell(variant: str, fixture_: FixtureRecord, outcome="pass", **fields) -> Cell:
    """`variant` on `fixture_`: measured (pass, fail) halfway inside the fixture's bounds for the
    variant's accuracy class, else a cell that did not run, with a detail. A `Metrics` field named in
    `fields` (rel_l2=..., finite=...) goes into the cell's metrics."""
    outcome = Outcome(outcome)
    numbers = {name: fields.pop(name) for name in METRIC_NAMES if name in fields}
    if outcome in MEASURED:
        accuracy = VARIANTS[variant].accuracy_class
        published = fixture_.bounds[AccuracyClass(accuracy)]
        numbers = {"rel_l2": published.max_rel_l2 / 2, "worst_head_cosine": (1 + published.min_cosine) / 2,
                   **numbers}
        values = {"accuracy_class": AccuracyClass(accuracy),
                  "budget": budget(published.max_rel_l2, published.min_cosine),
                  "metrics": metrics(**numbers), "extra_bytes_per_element": 1.5}
    else:
        values = {"detail": f"test {outcome.value}", "metrics": metrics(**numbers) if numbers else None}
    return Cell(variant, fixture_.name, outcome, **{**values, **fields})


def timing(kernel: str, shape: str, ms=1.0, outcome="pass", **fields) -> Speed:
    """`kernel` at the shape keyed `shape` taking `ms` (None: it did not run)."""
    return Speed(kernel, shape, Outcome(outcome), ms, **fields)


def device(cells=(), speed=(), index=0, gpu=H200_DEVICE, **fields) -> Device:
    name, capability, memory_gib = gpu
    return Device(index, name, list(capability), memory_gib, **{"not_supported": {}, "cells": list(cells),
                                                                "speed": list(speed), **fields})


def environment(devices, **fields) -> EnvironmentRecord:
    """The machine record of a box holding `devices`, every variant runnable on each."""
    gpus = [GpuInfo(d.index, d.name, d.capability, d.memory_gib, runnable_variants=list(VARIANTS))
            for d in devices]
    values = {"sage_qual": "0.1.0", "python": "3.11", "os": "Linux", "torch": "2.11.0+cu130",
              "torch_cuda": "13.0", "cudnn": "91900", "driver": "580.159.04", "triton": "3.6.0",
              "sageattention": "2.2.0", "sageattention_problem": "", "extensions": {}, **fields}
    return EnvironmentRecord(gpus=gpus, **values)


def report(devices, fixtures, shapes=None, variants=None, families_=("FLUX.1",), **fields) -> Report:
    """A complete report of `devices` (`shapes`: key -> ShapeEntry, every key their timings name);
    `variants` defaults to those their cells and timings ran, in that order."""
    devices = list(devices)
    if variants is None:
        variants = list(dict.fromkeys([c.variant for d in devices for c in d.cells]
                                      + [t.kernel for d in devices for t in d.speed if t.kernel != "sdpa"]))
    options = Options(devices=[d.index for d in devices], variants=list(variants), families=list(families_),
                      fixture_dirs=[], quick=False, timeout_s=90.0)
    values = {"kind": "sage-qual-report", "schema_version": SCHEMA_VERSION, "complete": True, "stopped": "",
              "started": "2026-11-30T10:00:00+00:00", "finished": "2026-11-30T10:05:00+00:00",
              "host": "test-box", "command": "tests_fast/builders.py", "options": options,
              "environment": environment(devices), "fixtures": list(fixtures), "shapes": shapes or {},
              "devices": devices, **fields}
    return Report(**values)


# Long-check records ------------------------------------------------------------------------------
GOOD = {"rel_l2": 0.05, "worst_head_cosine": 0.999}


def long_check(variant, heads, tokens, families_, layouts, outcome="pass", numbers=GOOD,
               identical=None) -> dict:
    """A LongCheck record's JSON: `variant` at `tokens` with `heads`, for `families_` (none: the
    sweep), `layouts` bit-identical unless `identical` says otherwise."""
    shape = read(ShapeSpec, families.self_attention(heads, tokens).as_dict())
    uses = [ShapeUse(f, "test") for f in families_] or [ShapeUse(None, "sweep")]
    values = {"detail": "the worker ran this task when it died (killed by SIGSEGV)"}
    if Outcome(outcome) in MEASURED:
        same = {name: True for name in layouts if name != "contiguous"} if identical is None else identical
        values = {"budget": budget(), "metrics": metrics(**numbers), "identical": same,
                  "rows": long_check_mod.sample_starts(tokens), "row_block": long_check_mod.SAMPLE_ROWS}
    return records.dump(LongCheck(variant, shape, uses, list(layouts), Outcome(outcome), **values))


def long_records(variant, fail_at=None, how="accuracy"):
    """Every check certify plans for the sample's families, for one variant; the one at `fail_at`
    tokens fails `how`: accuracy, crash, or a transposed view that differs (layout)."""
    everything = list(families.LAYOUTS)
    planned = [(24, 8192, [], everything), (24, 16384, [], everything), (24, 32768, [], everything),
               (24, 16896, ["FLUX.1", "Qwen-Image"], everything), (40, 75600, ["Wan 2.2"], everything)]
    checks = []
    for heads, tokens, users, layouts in planned:
        if tokens != fail_at:
            checks.append(long_check(variant, heads, tokens, users, layouts))
        elif how == "accuracy":
            checks.append(long_check(variant, heads, tokens, users, layouts, "fail", {**GOOD, "rel_l2": 0.2}))
        elif how == "layout":
            checks.append(long_check(variant, heads, tokens, users, layouts, "fail",
                                     identical={"transposed": False, "fused_qkv": True, "nhd": True}))
        else:
            checks.append(long_check(variant, heads, tokens, users, layouts, how))
    return checks


def long_task(shape: families.Shape, layouts, variant: str = "sm90-fp8-cuda") -> tasks.LongTask:
    """A long check's task at `shape` in `layouts`, standing for one test call."""
    return tasks.LongTask(f"{variant}~{shape.key}", variant, tasks.shape_spec(shape.as_dict()),
                          [ShapeUse(None, "a test's call")], list(layouts))


# Run requests -------------------------------------------------------------------------------------
def gpu_request(out, variants=None, *, devices="all", timeout=limits.TASK_TIMEOUT, families=None,
                fixture_dirs=None, quick=False, junit_xml=None) -> options.RunRequest:
    """`sage-qual certify` of our variants in workers (on the fake GPUs of the test hooks)."""
    return options.RunRequest(out=out, subject=options.Variants(variants),
                              executor=options.Workers(devices, timeout), families=families,
                              fixture_dirs=fixture_dirs, quick=quick, junit_xml=junit_xml)


def emulate_request(out, variants=None, families=None, fixture_dirs=None, quick=False) -> options.RunRequest:
    """`sage-qual certify --emulate`: the numerics model in this process."""
    return options.RunRequest(out=out, subject=options.Variants(variants), executor=options.InProcess(),
                              families=families, fixture_dirs=fixture_dirs, quick=quick)


def target_request(out, target, *, devices="all", timeout=limits.TASK_TIMEOUT, families=None,
                   fixture_dirs=None, quick=False, junit_xml=None) -> options.RunRequest:
    """`sage-qual certify --target NAME` in workers."""
    return options.RunRequest(out=out, subject=options.Integration(target),
                              executor=options.Workers(devices, timeout), families=families,
                              fixture_dirs=fixture_dirs, quick=quick, junit_xml=junit_xml)


def rendered(typed: Report, out: Path, left_out=()) -> list[Path]:
    """report.md and report.html of `typed`, with the verdicts drawn from it as certify draws them."""
    from sage_qual.qualification.decide import verdict
    from sage_qual.qualification.render import report as report_view

    return report_view.render(typed, out, verdict.decide(typed), left_out)


def summarized(typed: Report, out: Path) -> str:
    """The summary certify prints for `typed`, with the verdicts drawn from it as certify draws them."""
    from sage_qual.qualification.decide import verdict
    from sage_qual.qualification.render import summary

    return summary.text(typed, out, verdict.decide(typed))


def certify_profile(folder: Path, name: str, entry: dict, families: dict, capability=(8, 9),
                    torch_version="2.13.0") -> Path:
    """A certify run's profile.json of one GPU model (make_gpu's) in `folder`, each file created a day
    after the one before it (the builder of the built-in defaults orders runs by that)."""
    gpu = make_gpu(FakeGpu(capability, name, 24.0), entry, families, torch_version)
    count = len(list(folder.iterdir()))
    path = folder / f"{name}-{count}.json"
    path.write_text(json.dumps({**make_profile(gpu), "created": f"2026-12-{count + 1:02d}T00:00:00+00:00"}))
    return path
