"""Where a verdict holds: the machine evidence was measured on, what differs on another, and what
each kind of difference does.

`gate` (a report against this machine) and the wrapper's profile matcher (a profile entry against a
visible GPU) ask one question: does evidence measured there apply here? Both build a `Machine` of
each side and read `differences()` and the one table `RULES`, so they cannot disagree: where gate
calls a report stale, `install(profile=...)` of that run's profile does not apply its entry either,
and a near match is one to both (applied, with the difference said). Torch-free: gate reads it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from packaging.version import InvalidVersion, Version

from sage_qual.kernels.providers import THU_ML
from sage_qual.kernels.variants import gpu_label

# Memory as nvidia-smi and torch report it differs by driver reservations; within this many GiB
# it is the same card (an H200 shows 139.8, an H100 79.6 or 93.1 GiB: far apart).
MEMORY_TOLERANCE_GIB = 1.0
# One model name can hide cut-down dies: within this share of SMs it is the same card, as
# comfy-kitchen's per-GPU tuning table binds an entry to the SM version and SM count within 10 %.
SM_COUNT_TOLERANCE = 0.10


class Kind(str, enum.Enum):
    GPU = "gpu"  # name or compute capability
    MEMORY = "memory"
    SM_COUNT = "sm_count"
    CUDA = "cuda"  # torch's CUDA
    TORCH = "torch"  # another release or build of torch
    TORCH_PATCH = "torch_patch"  # another patch release of the same torch build
    DRIVER = "driver"
    TRITON = "triton"
    SAGEATTENTION = "sageattention"  # thu-ml's version
    BUILD = "build"  # a provider's build (thu-ml's or another's) under one version


class Effect(str, enum.Enum):
    NO_MATCH = "no match"  # the evidence does not apply: gate says stale, the wrapper keeps its defaults
    NEAR = "near match"  # it applies, and the difference is said (gate's output, the wrapper's INFO note)
    SAID = "said"  # it applies; the difference is listed where differences are, not counted


# The kinds that make another part, and those that make other kernels: the built-in defaults bind the
# first only and say the second (one WARNING), since they are the only profile a user did not make.
HARDWARE = frozenset({Kind.GPU, Kind.MEMORY, Kind.SM_COUNT})
KERNELS = frozenset({Kind.SAGEATTENTION, Kind.BUILD})


@dataclass(frozen=True)
class Rule:
    effect: Effect
    why: str


# Every kind of difference, what it does to gate and the wrapper alike, and why (docs/certify.md,
# "Where a verdict holds"). compare and merge list every difference, whatever its effect.
RULES = {
    Kind.GPU: Rule(Effect.NO_MATCH, "another GPU model runs other kernels at other speeds: run 42's H100 "
                                    "served from 11,648 tokens where the H200s served from 13,824"),
    Kind.MEMORY: Rule(Effect.NO_MATCH, "one name with other memory is another part (H100 PCIe, NVL): other "
                                       "bandwidth, so other break-evens"),
    Kind.SM_COUNT: Rule(Effect.NO_MATCH, "fewer SMs is a cut-down part: other speeds, other break-evens"),
    Kind.CUDA: Rule(Effect.NO_MATCH, "torch's CUDA builds torch's SDPA backends, the baseline every speedup "
                                     "is measured against"),
    Kind.TORCH: Rule(Effect.NO_MATCH, "another torch release may bring other SDPA backends, the baseline"),
    Kind.TORCH_PATCH: Rule(Effect.NEAR, "a patch release of one torch build keeps its SDPA backends and the "
                                        "kernels are the same binaries"),
    Kind.DRIVER: Rule(Effect.SAID, "the kernels and torch are the same binaries under another driver, and "
                                   "the wrapper cannot read the driver's release from torch; no run here "
                                   "measured a driver change: a policy"),
    Kind.TRITON: Rule(Effect.SAID, "the wrapper does not read Triton's version; certify records it. A policy "
                                   "until a run measures a Triton change"),
    Kind.SAGEATTENTION: Rule(Effect.NO_MATCH, "another sageattention version is other kernels"),
    Kind.BUILD: Rule(Effect.NO_MATCH, "another build of one version (a fork, an older build) is another "
                                      "kernel; every provider's counts, served or not, because the verdict "
                                      "chose among all the variants that ran"),
}


@dataclass(frozen=True)
class Machine:
    """One GPU model and the software evidence was measured with (or a visible GPU's). Memory, SM
    count, driver, Triton and a build that are None or "" are unknown, and not compared."""
    gpu: str
    capability: tuple[int, int]
    memory_gib: float | None = None
    sm_count: int | None = None
    torch: str = ""
    cuda: str = ""
    driver: str = ""
    triton: str = ""
    sageattention: str = ""
    builds: tuple[tuple[str, str], ...] = ()  # (provider, build digest), thu-ml's included

    @property
    def model(self) -> str:
        return gpu_label(self.gpu, self.capability)


def builds(thu_ml_source: str, others) -> tuple[tuple[str, str], ...]:
    """`Machine.builds` from thu-ml's build digest and the other providers' ((provider, digest) pairs)."""
    return ((THU_ML.name, thu_ml_source), *sorted(others))


@dataclass(frozen=True)
class Difference:
    """One thing that differs: its kind, what it is ("torch"), and its value on each side."""
    kind: Kind
    what: str
    measured: str
    here: str
    why: str = ""  # what such a difference usually is, said after it

    @property
    def effect(self) -> Effect:
        return RULES[self.kind].effect

    @property
    def text(self) -> str:
        """"torch 2.11.0+cu130 measured, 2.11.1+cu130 here": the one phrasing (gate, the wrapper)."""
        said = f"{self.what} {self.measured} measured, {self.here} here"
        return f"{said} ({self.why})" if self.why else said

    def between(self) -> str:
        """"torch 2.11.0+cu130 vs 2.11.1+cu130": between two runs (compare)."""
        return f"{self.what} {self.measured} vs {self.here}"


def same_gpu_name(a: str, b: str) -> bool:
    """GPU names as one model: without case or surrounding space ("nvidia h200 " is "NVIDIA H200")."""
    return a.strip().casefold() == b.strip().casefold()


def same_model(measured: Machine, here: Machine) -> bool:
    return same_gpu_name(measured.gpu, here.gpu) and tuple(measured.capability) == tuple(here.capability)


def differences(measured: Machine, here: Machine) -> list[Difference]:
    """Everything that differs between the machine evidence was measured on and this one, hardware
    first; each with its kind (whose effect `RULES` gives)."""
    found = []
    if not same_model(measured, here):
        found.append(Difference(Kind.GPU, "GPU", measured.model, here.model))
    elif _known(measured.memory_gib, here.memory_gib) and \
            abs(measured.memory_gib - here.memory_gib) > MEMORY_TOLERANCE_GIB:
        found.append(Difference(Kind.MEMORY, "memory", f"{measured.memory_gib:g} GiB",
                                f"{here.memory_gib:g}"))
    elif _known(measured.sm_count, here.sm_count) and \
            abs(measured.sm_count - here.sm_count) > SM_COUNT_TOLERANCE * max(measured.sm_count,
                                                                              here.sm_count):
        found.append(Difference(Kind.SM_COUNT, "SM count", str(measured.sm_count), str(here.sm_count)))
    # sageattention, CUDA and torch are always known: "" is none installed (no CUDA: a CPU build).
    for kind, label in ((Kind.SAGEATTENTION, "sageattention"), (Kind.CUDA, "CUDA")):
        ours, theirs = getattr(measured, kind.value), getattr(here, kind.value)
        if ours != theirs:
            found.append(Difference(kind, label, ours or "none", theirs or "none"))
    if measured.torch != here.torch:
        patch = _torch_release(measured.torch) == _torch_release(here.torch)
        found.append(Difference(Kind.TORCH_PATCH if patch else Kind.TORCH, "torch", measured.torch or "none",
                                here.torch or "none"))
    for kind, label in ((Kind.DRIVER, "NVIDIA driver"), (Kind.TRITON, "Triton")):
        ours, theirs = getattr(measured, kind.value), getattr(here, kind.value)
        if _known(ours, theirs) and ours != theirs:
            found.append(Difference(kind, label, ours, theirs))
    builds_here = dict(here.builds)
    for provider, build in sorted(measured.builds):
        theirs = builds_here.get(provider, "")
        if _known(build, theirs) and build != theirs:
            label = "sageattention" if provider == THU_ML.name else provider
            found.append(Difference(Kind.BUILD, f"{label} build", build, theirs,
                                    "another source under one version: a fork or an older build"))
    return found


def from_record(environment, gpu) -> Machine:
    """The machine of an `EnvironmentRecord` (a report's, or this one's as gate collects it) and one of
    its GPUs (a report's device or a GpuInfo: name, capability, memory_gib, sm_count)."""
    return Machine(gpu.name, tuple(gpu.capability), gpu.memory_gib, gpu.sm_count, environment.torch,
                   environment.torch_cuda, environment.driver, environment.triton, environment.sageattention,
                   builds(environment.sageattention_source,
                          ((other.provider, other.source) for other in environment.other_providers)))


def binding(found: list[Difference]) -> list[Difference]:
    """The differences that keep evidence from applying (`Effect.NO_MATCH`)."""
    return [d for d in found if d.effect == Effect.NO_MATCH]


def near(found: list[Difference]) -> list[Difference]:
    """The differences said where evidence applies as a near match (`Effect.NEAR`)."""
    return [d for d in found if d.effect == Effect.NEAR]


def allowed(found: list[Difference]) -> list[Difference]:
    """The differences evidence applies despite (near matches and those only said)."""
    return [d for d in found if d.effect != Effect.NO_MATCH]


def _known(a, b) -> bool:
    return a not in (None, "") and b not in (None, "")


def _torch_release(version: str) -> tuple:
    """(major, minor, local build tag) of a torch version: equal for two patch releases of one build."""
    try:
        parsed = Version(version)
    except InvalidVersion:
        return (version,)
    return (*parsed.release[:2], parsed.local)
