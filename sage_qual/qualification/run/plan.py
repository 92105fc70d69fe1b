"""The plan of a run: every task it runs, built here and nowhere else, before any of them runs.

A run is planned once its machine is known (`Machine`: the GPUs the executor found, or the one
pseudo-device of the in-process executor, each with the subjects that cannot run there). The plan
holds the report's device entries (the cells that will not run already marked skip), the timed
shapes and, per device slot, its jobs: lists of tasks, each run by one worker in turn, and the
tasks run beside them from the start (`compile_ahead`: a Triton variant's kernels). Two rules
follow the evidence as it arrives, both functions of the report so far:

- `refinement`: after a variant's sweep on a GPU, more timing lengths around its crossover;
- `follow_up`: after the sweep, per GPU model, the span probes of what a verdict serves and every
  variant in every execution context.

A quick run (a pre-flight) follows up nothing: its thresholds are not the ones a profile keeps.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from sage_qual import limits, records
from sage_qual.fixtures import fileformat
from sage_qual.kernels.variants import VARIANTS
from sage_qual.qualification import families as families_mod
from sage_qual.qualification.decide.verdict import GpuDecision
from sage_qual.qualification.evidence import tasks
from sage_qual.qualification.evidence.report_model import (
    Cell,
    Device,
    DType,
    Outcome,
    Report,
    ShapeEntry,
    ShapeSpec,
    ShapeUse,
)
from sage_qual.qualification.families import GENERIC_HEADS, QUICK_SELF_TOKENS, SELF_TOKENS, Shape
from sage_qual.qualification.measure import span_probe
from sage_qual.qualification.measure.speed import intervals_to_refine, served_bar, speedup_bounds
from sage_qual.qualification.run.options import Integration, RunRequest
from sage_qual.qualification.selection import Selection
from sage_qual.verdicts.env_record import EnvironmentRecord, GpuInfo

# The generic sweep: self-attention of GENERIC_HEADS heads at SELF_TOKENS (families.py, where the
# verdict's evidence check reads them too) at both head sizes, and cross-attention on short keys
# (text encoders give 77 to 1024 tokens).
CROSS = [(q, k) for q in (4096, 16384) for k in (77, 256, 512, 1024)]
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
# Span probes: the rung's limit is the boundary's / 8 (2^28 elements, 0.5 GB of bf16), where the
# limit falls back to when a kernel is wrong below the boundary.
RUNG_FRACTION = 8


@dataclass(frozen=True)
class DeviceFacts:
    """One device the executor found: its identity and the subjects that cannot run there, with why."""
    gpu: GpuInfo
    not_supported: dict[str, list[str]]


@dataclass(frozen=True)
class Machine:
    """Where a run executes: the environment and its devices, in the report's order."""
    environment: EnvironmentRecord
    devices: list[DeviceFacts]


@dataclass(frozen=True)
class LongPlan:
    """A long call every variant is checked at."""
    shape: ShapeSpec
    uses: list[ShapeUse]  # the family calls and sweep points it stands for
    layouts: list[str]


@dataclass(frozen=True)
class Plan:
    """Everything a run will do, as data (module docstring)."""
    request: RunRequest
    selection: Selection
    subjects: list[str]  # the report's options.variants: the variants, or the integration's name
    devices: list[Device]  # the report's device entries before any result
    shapes: dict[str, ShapeEntry]
    jobs: list[list[list[tasks.Task]]]  # per device slot, its jobs in order; a job is one worker's
    follows_up: bool  # refinement and the follow-up after the sweep (full certify runs)
    # Per device slot, tasks run beside its jobs from the sweep's start: the kernels of its Triton
    # variants compiled ahead of their jobs (full runs; `compile_ahead`).
    ahead: list[list[tasks.Task]] = dataclasses.field(default_factory=list)

    @property
    def task_count(self) -> int:
        return sum(len(job) for slot in self.jobs for job in slot)


@dataclass(frozen=True)
class FollowUp:
    """What follows the sweep: the device lists whose checks begin (an empty list in the report says
    the check ran), and the jobs, each (device slot, tasks), run side by side."""
    begun: list[tuple[int, str]]
    jobs: list[tuple[int, list[tasks.Task]]]


# The plan ---------------------------------------------------------------------------------------
def build(request: RunRequest, selection: Selection, machine: Machine, subjects: list[str],
          in_process: bool) -> Plan:
    """The plan of a certify run of `subjects` on `machine` (in_process: the numerics model in this
    process, which neither times nor follows up)."""
    fixtures = selection.fixtures
    target = isinstance(request.subject, Integration)
    sweeps = not (target or in_process)  # times kernels, refines and follows up
    shapes = speed_shapes(selection.families, request.quick) if sweeps else {}
    checks = {} if target else _long_checks(selection, request.quick)
    devices, jobs, ahead = [], [], []
    full = sweeps and not request.quick
    for facts in machine.devices:
        gpu = facts.gpu
        not_supported = {name: why for name, why in facts.not_supported.items() if name in subjects}
        skips = [Cell(variant=name, fixture=f.name, outcome=Outcome.SKIP, detail="; ".join(why))
                 for name, why in not_supported.items() for f in fixtures if runs(name, f)]
        devices.append(Device(index=gpu.index, name=gpu.name, capability=list(gpu.capability),
                              memory_gib=gpu.memory_gib, not_supported=not_supported, cells=skips,
                              speed=[], long=None if target else [], sm_count=gpu.sm_count))
        runnable = [name for name in subjects if name not in not_supported]
        if target:
            jobs.append([_target_cells(runnable[0], gpu, fixtures)] if runnable else [])
        elif in_process:
            jobs.append([_predicted(runnable, fixtures, checks)])
        else:
            if request.quick and request.subject.names is None:
                # A pre-flight runs the kernel the wrapper would use on this GPU: all eight variants took
                # 67 s with --quick on two H200s (device run 3), one is a worker's start and a few calls.
                runnable = [name for name in runnable if name == gpu.kernel]
            jobs.append(_sweep(runnable, fixtures, shapes, checks, request.quick))
        ahead.append(compile_ahead(runnable, fixtures, shapes, checks) if full else [])
    return Plan(request, selection, subjects, devices, shapes, jobs, follows_up=full, ahead=ahead)


def _sweep(variants: list[str], fixtures: list[fileformat.Fixture], shapes: dict[str, ShapeEntry],
           checks: dict[str, LongPlan], quick: bool) -> list[list[tasks.Task]]:
    """One GPU's jobs: the SDPA baseline, then per variant its fixtures, speed sweep and long checks."""
    timing = {key: _timing(entry.shape, quick) for key, entry in shapes.items()}
    jobs: list[list[tasks.Task]] = [[tasks.SdpaTask(f"sdpa@{key}", key, shapes[key].shape, warmup, repeats)
                                     for key, (warmup, repeats) in timing.items()]]
    for variant in variants:
        jobs.append([_cell_task(variant, f) for f in fixtures if runs(variant, f)]
                    + [tasks.SpeedTask(f"{variant}@{key}", variant, key, shapes[key].shape, warmup, repeats)
                       for key, (warmup, repeats) in timing.items()]
                    + [_long_task(variant, key, check) for key, check in checks.items()])
    return jobs


def compile_ahead(variants: list[str], fixtures: list[fileformat.Fixture], shapes: dict[str, ShapeEntry],
                  checks: dict[str, LongPlan]) -> list[tasks.Task]:
    """For each variant whose kernels are Triton's (compiled at their first call of each
    specialization: `worker.Worker.compile`), the task compiling each call its sweep job makes (as
    `_sweep` plans it): its fixtures', its timed shapes' and its long checks' in each layout."""
    # No Triton variant takes a mask, so none runs a masked fixture (`runs`).
    planned = [tasks.KernelCall(_fixture_shape(f), "contiguous") for f in fixtures if f.mask is None]
    planned += [tasks.KernelCall(entry.shape, "contiguous") for entry in shapes.values()]
    for check in checks.values():
        planned += [tasks.KernelCall(check.shape, layout) for layout in ("contiguous", *check.layouts)]
    distinct = list(dict.fromkeys(planned))
    return [tasks.CompileTask(f"compile:{name}", name, distinct) for name in variants
            if VARIANTS[name].needs_triton]


def _fixture_shape(fixture: fileformat.Fixture) -> ShapeSpec:
    batch, heads, q_tokens, head_dim = fixture.q.shape
    return ShapeSpec(heads, fixture.k.shape[1], q_tokens, fixture.k.shape[2], head_dim,
                     DType(str(fixture.dtype).removeprefix("torch.")), batch)


def _predicted(variants: list[str], fixtures: list[fileformat.Fixture],
               checks: dict[str, LongPlan]) -> list[tasks.Task]:
    """The in-process job: fixture by fixture (one float32 reference each), every variant's cell, then
    every variant's long checks."""
    return ([_cell_task(variant, f) for f in fixtures for variant in variants if runs(variant, f)]
            + [_long_task(variant, key, check) for variant in variants for key, check in checks.items()])


def runs(variant: str, fixture: fileformat.Fixture) -> bool:
    """Whether a variant's cells run the fixture: a masked call only where the variant takes a mask
    (the wrapper keeps masked calls from the others on torch: they are no evidence about them)."""
    return fixture.mask is None or VARIANTS[variant].takes_mask


def _long_checks(selection: Selection, quick: bool) -> dict[str, LongPlan]:
    longest = max((f.q.shape[2] for f in selection.fixtures), default=0)
    return long_checks(selection.families, longest, quick)


def _cell_task(variant: str, fixture: fileformat.Fixture) -> tasks.CellTask:
    return tasks.CellTask(f"{variant}|{fixture.name}", variant, fixture.name, str(fixture.path),
                          families_mod.memory_bound(fixture.family))


def _long_task(variant: str, key: str, check: LongPlan) -> tasks.LongTask:
    return tasks.LongTask(f"{variant}~{key}", variant, check.shape, check.uses, check.layouts)


def _target_cells(target: str, gpu: GpuInfo, fixtures: list[fileformat.Fixture]) -> list[tasks.Task]:
    """An integration's cells, on its unmasked calls (a masked one is served only where a profile
    certified masks: the wrapper's rules, not the integration's)."""
    return [tasks.TargetCellTask(f.name, target, f.name, str(f.path), list(gpu.capability),
                                 families_mod.memory_bound(f.family)) for f in fixtures if f.mask is None]


def machine_check(target: str) -> tasks.TargetMachineTask:
    """`certify --target`: the task asking a GPU's worker why the integration cannot run there."""
    return tasks.TargetMachineTask("machine", target)


def environment_check() -> tasks.EnvTask:
    """The task asking a worker for this machine's environment and what cannot run on each GPU."""
    return tasks.EnvTask("env")


# Timed shapes -----------------------------------------------------------------------------------
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


def _spec(shape: Shape) -> ShapeSpec:
    return records.parse(ShapeSpec, shape.as_dict(), "a planned shape", "a sage-qual bug")


def _timing(shape: ShapeSpec, quick: bool) -> tuple[int, int]:
    if quick:
        return TIMING["quick"]
    return TIMING["large" if Shape(**records.dump(shape)).flops > LARGE_FLOPS else "small"]


def refined_lengths(points: list[tuple[int, float, float]], min_speedups=(1.0,)) -> list[int]:
    """Token counts to time between neighbouring sweep lengths where the speedup's lower bound
    crosses a family's `min_speedup` or an end lies near it (`speed.intervals_to_refine`); `points`
    are (tokens, lower bound, median) of one variant at one head size."""
    lengths = set()
    for min_speedup in set(min_speedups):
        for low, high in intervals_to_refine(points, served_bar(min_speedup)):
            step = (high / low) ** (1 / (REFINE_POINTS + 1))
            for i in range(1, REFINE_POINTS + 1):
                tokens = round(low * step ** i / TOKEN_GRANULE) * TOKEN_GRANULE
                if low < tokens < high:
                    lengths.add(tokens)
    return sorted(lengths)


def refinement(report: Report, slot: int,
               job: list[tasks.Task]) -> tuple[dict[str, ShapeEntry], list[tasks.Task]]:
    """After a job that swept a variant's speed: timing at refined lengths of generic self-attention
    around its crossover, with SDPA at those lengths where this GPU has not timed it yet; (the new
    shapes, the tasks)."""
    variants = {task.variant for task in job if isinstance(task, tasks.SpeedTask)}
    if not variants:
        return {}, []
    (variant,) = variants
    by = {(r.kernel, r.shape): r for r in report.devices[slot].speed}
    by_dim: dict[int, list[tuple[int, float, float]]] = {}
    for key, entry in report.shapes.items():
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
    refined = []
    for key, entry in new.items():
        if (variant, key) in by:
            continue
        warmup, repeats = _timing(entry.shape, quick=False)
        # Paired near the crossover: both timed in turn in one worker; else another variant's
        # refinement timed SDPA here already.
        if ("sdpa", key) not in by:
            refined.append(tasks.PairedTask(f"{variant}+sdpa@{key}", variant, key, entry.shape, warmup,
                                            repeats))
        else:
            refined.append(tasks.SpeedTask(f"{variant}@{key}", variant, key, entry.shape, warmup, repeats))
    return new, refined


# Long checks ------------------------------------------------------------------------------------
def long_checks(chosen: list[families_mod.Family], longest_fixture: int, quick: bool,
                sweep_tokens=None) -> dict[str, LongPlan]:
    """The long checks every variant runs, by shape key (`long_check` says what one checks).

    Each chosen family's longest call in its declared layouts, and each generic sweep length
    (`sweep_tokens`, default the run's sweep) past the longest selected fixture (below it, the
    fixtures verified the kernel; head_dim 128, 24 heads, as the sweep times it) in every layout a
    chosen family declares. Families sharing a shape share its check. quick (a pre-flight, which
    times no family shape, so only its default entry can be enabled): the longest of the families'
    calls only."""
    if sweep_tokens is None:
        sweep_tokens = QUICK_SELF_TOKENS if quick else SELF_TOKENS
    shapes: dict[str, Shape] = {}
    uses: dict[str, list[ShapeUse]] = {}
    wanted: dict[str, set[str]] = {}

    def add(shape: Shape, family: str | None, label: str, layouts) -> None:
        shapes.setdefault(shape.key, shape)
        uses.setdefault(shape.key, []).append(ShapeUse(family, label))
        wanted.setdefault(shape.key, set()).update(layouts)
        if shape.q_tokens != shape.kv_tokens:  # one fused projection gives as many queries as keys
            wanted[shape.key].discard("fused_qkv")

    every = {name for family in chosen for name in family.layouts} or {"contiguous"}
    for tokens in sweep_tokens:
        if tokens > longest_fixture:
            add(families_mod.self_attention(GENERIC_HEADS, tokens), None, f"self {tokens}, head_dim 128",
                every)
    with_calls = [family for family in chosen if family.calls]
    if quick and with_calls:
        with_calls = [max(with_calls, key=lambda f: (f.longest.q_tokens, f.longest.kv_tokens))]
    for family in with_calls:
        longest = family.longest
        add(longest, family.name, f"longest call: {longest.q_tokens} query / {longest.kv_tokens} key tokens",
            family.layouts)
    return {key: LongPlan(tasks.shape_spec(shape.as_dict()), uses[key],
                          [name for name in families_mod.LAYOUTS if name in wanted[key]])
            for key, shape in shapes.items()}


# After the sweep --------------------------------------------------------------------------------
# Certify's span probes (issue 16): each served variant's largest safe element span, measured in workers.
#
# Past 2^31 elements the kernels' 32-bit offsets overflow (`limits.MAX_SPAN_ELEMENTS`): on the H200 a
# fused-projection view made every variant hit an illegal memory access, which poisons the process's
# CUDA context, and a contiguous tensor made the sm90 extension abort the process. Certify runs
# `span_probe`'s cases as worker tasks (kind "span"), so a fault or an abort costs one worker: the
# case gets a "crash" result with the worker's stderr tail (the assertion, the signal), and the pool
# goes on in a fresh worker. The report keeps every case (`report_model.SpanProbe`); the profile's
# `max_span_elements` is `profile_limit()` of them.
#
# The cases, per layout (contiguous; fused_qkv, views into one fused projection): a rung near
# limit / 8, then the boundary's `below` case (the longest query the wrapper serves under the
# limit) and `above` case (the shortest past it). The rung is where the limit falls back to when a
# kernel is wrong below the boundary. The variants: after the sweep, on the first device of each GPU
# model, the wrapper's default kernel there and every variant a verdict serves (the profile's limit
# must have been measured for what it serves); other variants are not probed, to save time.
#
# Cost, measured: the sm90 kernel's six cases returned 3.0-5.3 s after the sweep ended, beside the
# context checks, in a follow-up of 7.3 s (docs/results/run33-h200/certify.log.gz). At most 12 GB of GPU
# memory per worker (span_probe).


def follow_up(report: Report, decisions: list[GpuDecision], subjects: list[str]) -> FollowUp:
    """Per GPU model on its first device: the span probes of its default kernel and of every variant
    a verdict serves (`span_cases`), and every variant it ran in every execution context."""
    begun, jobs = [], []
    slots = {device.index: slot for slot, device in enumerate(report.devices)}
    for gpu in decisions:
        index = gpu.devices[0]
        served = {d.variant for d in gpu.families + [gpu.default] if d.variant}
        kernel = report.environment.gpus[index].kernel
        default = gpu.variants.get(kernel)
        begun.append((slots[index], "span"))
        for variant in sorted(served | ({kernel} if default and default.runnable else set())):
            jobs += [(slots[index], job) for job in span_jobs(variant, span_cases())]
    begun += [(slot, "contexts") for slot in _first_of_each_model(report.devices)]
    return FollowUp(begun, jobs + context_jobs(report.devices, subjects))


def context_jobs(devices: list[Device], subjects: list[str]) -> list[tuple[int, list[tasks.Task]]]:
    """Every variant a GPU model runs, in every execution context, on its first device: (device slot,
    job). No verdict changes them, so their workers can start during the sweep (`start_ahead`)."""
    return [(slot, [tasks.ContextTask(f"{variant}#contexts", variant, list(limits.CONTEXT_CHECK_SHAPE),
                                      "bfloat16")])
            for slot in _first_of_each_model(devices)
            for variant in subjects if variant not in devices[slot].not_supported]


def _first_of_each_model(devices: list[Device]) -> list[int]:
    """The slot of each GPU model's first device."""
    first: dict[str, int] = {}
    for slot, device in enumerate(devices):
        first.setdefault(device.model, slot)
    return list(first.values())


def span_cases(limit: int = limits.MAX_SPAN_ELEMENTS) -> list[tuple[span_probe.SpanCase, int]]:
    """(case, the limit it sits at): the rung's below cases, then the boundary's below and above
    cases (`span_probe.boundary_cases`). Why these: `span_probe`."""
    rung = limit // RUNG_FRACTION
    return ([(c, rung) for c in span_probe.boundary_cases(rung) if c.side == "below"]
            + [(c, limit) for c in span_probe.boundary_cases(limit)])


def span_jobs(variant: str, planned: list[tuple[span_probe.SpanCase, int]]) -> list[list[tasks.SpanTask]]:
    """Worker jobs for one variant: every below case and the first above case in one job (a fault
    there ends its worker, with nothing after it), each further above case in a job of its own, so
    one that aborts costs its own worker only and the jobs run side by side."""
    def task(case: span_probe.SpanCase, limit: int) -> tasks.SpanTask:
        return tasks.SpanTask(f"{variant}^span {case.layout} {case.side} {case.span}", variant, limit,
                              **dataclasses.asdict(case))

    below = [task(*c) for c in planned if c[0].side == "below"]
    above = [task(*c) for c in planned if c[0].side != "below"]
    return [below + above[:1]] + [[t] for t in above[1:]]
