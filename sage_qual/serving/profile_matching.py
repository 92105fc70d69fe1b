"""Matching a profile's entries to the devices here: the entry each visible device gets, by the
rules of `machine` (`nearest`), and the `WrapperConfig` it gives (`device_configs`). A device whose
model and software match an entry gets that entry's variant and thresholds; any other device keeps
the default table and thresholds, and its note says why (nothing in the profile was measured on it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Mapping

from sage_qual.limits import one_line
from sage_qual.serving.config import DEFAULT_CONFIG, WrapperConfig
from sage_qual.verdicts import machine
from sage_qual.verdicts.machine import Difference, Kind, Machine
from sage_qual.verdicts.profile import Entry, Profile, ProfileGpu, entry, family_entry, load, served_families
from sage_qual.verdicts.served import Served


def apply(base: WrapperConfig, capability: tuple[int, int], chosen: Entry,
          max_span_elements: int | None = None) -> WrapperConfig:
    """`base` with this capability served as the entry serves (`served_config`), or by nothing."""
    if chosen.served is None:
        return served_nothing(base, capability)
    return served_config(chosen.served, base, capability, max_span_elements)


def served_config(served: Served, base: WrapperConfig, capability: tuple[int, int],
                  max_span_elements: int | None = None) -> WrapperConfig:
    """`base` with this capability served by `served`'s variant from its thresholds to its verified
    range, in its layouts and contexts, within its bounds, and the GPU's certified span limit (None:
    `base`'s)."""
    table = {**base.kernel_table, capability: (served.variant,)}
    return dataclasses.replace(
        base,
        kernel_table=table,
        min_query_tokens=served.min_query_tokens,
        min_key_tokens=served.min_key_tokens,
        head_dims=tuple(served.head_dims),
        max_query_tokens=served.max_query_tokens,
        max_key_tokens=served.max_key_tokens,
        layouts=None if served.layouts is None else tuple(served.layouts),
        contexts=None if served.contexts is None else tuple(served.contexts),
        bounds=tuple(served.bounds),
        masks=served.masks,
        max_span_elements=max_span_elements or base.max_span_elements,
    )


def served_nothing(base: WrapperConfig, capability: tuple[int, int]) -> WrapperConfig:
    """`base` with no variant for this capability: every call there goes to torch."""
    return dataclasses.replace(base, kernel_table={**base.kernel_table, capability: ()})


@dataclass(frozen=True)
class LocalDevice:
    """What defines one visible device, as a profile entry must match it."""
    name: str
    capability: tuple[int, int]
    memory_gib: float
    torch: str
    torch_cuda: str
    sageattention: str
    sageattention_source: str = ""  # "" when unknown: not compared
    sm_count: int | None = None  # None when unknown: not compared
    other_sources: Mapping[str, str] = field(default_factory=dict)  # the other providers' builds here


def machine_of(gpu: ProfileGpu) -> Machine:
    """The machine an entry was certified on."""
    env = gpu.environment
    return Machine(gpu.name, tuple(gpu.capability), gpu.memory_gib, gpu.sm_count, env.torch, env.torch_cuda,
                   env.driver, env.triton, env.sageattention,
                   machine.builds(env.sageattention_source, env.other_providers.items()))


def machine_here(device: LocalDevice) -> Machine:
    """A visible device as the machine an entry must match (the driver and Triton are not read)."""
    return Machine(device.name, tuple(device.capability), device.memory_gib, device.sm_count, device.torch,
                   device.torch_cuda, sageattention=device.sageattention,
                   builds=machine.builds(device.sageattention_source, device.other_sources.items()))


def entry_differences(gpu: ProfileGpu, device: LocalDevice) -> list[Difference]:
    """What differs between the machine an entry was certified on and this device (`machine`)."""
    return machine.differences(machine_of(gpu), machine_here(device))


def nearest(profile: Profile, device: LocalDevice) -> ProfileGpu:
    """The entry closest to this device: one that matches in everything that binds it (`machine.RULES`)
    first, with fewer near-match differences, then the same GPU model, memory, SM count, sageattention,
    its build, CUDA, torch's release and torch itself; the first in the file among equals."""
    here = machine_here(device)

    def closeness(gpu: ProfileGpu):
        found = machine.differences(machine_of(gpu), here)
        kinds = {d.kind for d in found}
        ranked = (Kind.SAGEATTENTION, Kind.BUILD, Kind.CUDA, Kind.TORCH, Kind.TORCH_PATCH)
        tolerance = machine.MEMORY_TOLERANCE_GIB
        memory = gpu.memory_gib is None or abs(gpu.memory_gib - device.memory_gib) <= tolerance
        return (not machine.binding(found), -len(machine.near(found)), Kind.GPU not in kinds,
                tuple(gpu.capability) == device.capability, memory, Kind.SM_COUNT not in kinds,
                *(kind not in kinds for kind in ranked))
    return max(profile.gpus, key=closeness)


@dataclass(frozen=True)
class DeviceConfig:
    config: WrapperConfig
    note: str  # which profile entry applies, or why none does: one line (limits.STATUS_LINE_LIMIT)
    reasons: tuple[str, ...] = ()  # every reason the applied entry gives for serving nothing, in full
    matched: bool = True  # False: no entry describes this device, or the defaults were another build's: warn


def _entry_note(gpu: ProfileGpu, chosen: Entry, family: str | None, near: str) -> str:
    scope = f", family {family}" if family else ""
    if chosen.served:
        return one_line(f"{near}profile entry {gpu.label}{scope}: {chosen.served.short()}")
    count = len(chosen.reasons)
    first = chosen.reasons[0].detail if chosen.reasons else "no reason recorded"
    enabled = served_families(gpu) if family is None else []
    if enabled:  # the profile serves some families here: which, and how to pick one, before why not all
        listed = ", ".join(enabled[:4]) + (f" and {len(enabled) - 4} more" if len(enabled) > 4 else "")
        return one_line(f"{near}the profile enables only {listed} here, pick one: install(profile=..., "
                        f"family=\"{enabled[-1]}\"); why not all: {count} reasons in profile_reasons")
    why = f"{count} reasons in profile_reasons, first: {first}" if count > 1 else first
    return one_line(f"{near}the profile certifies no SageAttention variant on {gpu.label}{scope}: {why}")


def device_configs(profile, machines: list[LocalDevice], family: str | None = None,
                   base: WrapperConfig | list[WrapperConfig] = DEFAULT_CONFIG) -> list[DeviceConfig]:
    """Each device's configuration: its matching entry applied to `base` (one config, or one per
    device), else `base` with a note naming the nearest entry and what differs; a family that the
    nearest entry keeps off stays off. ProfileError when the profile cannot be read or a matching
    entry lacks the family."""
    profile = load(profile)
    bases = base if isinstance(base, list) else [base] * len(machines)
    return [_device_config(profile, device, family, own)
            for device, own in zip(machines, bases, strict=True)]


def _device_config(profile: Profile, device: LocalDevice, family: str | None,
                   base: WrapperConfig) -> DeviceConfig:
    gpu = nearest(profile, device)
    found = entry_differences(gpu, device)
    differ = [d.text for d in machine.binding(found)]
    if not differ:
        chosen = entry(gpu, family)
        said = machine.near(found)
        near = f"near match ({'; '.join(d.text for d in said)}): " if said else ""
        return DeviceConfig(apply(base, device.capability, chosen, gpu.max_span_elements),
                            _entry_note(gpu, chosen, family, near),
                            tuple(r.detail for r in chosen.reasons) if not chosen.variant else ())
    nearest_entry = f"nearest {gpu.label} differs: {'; '.join(differ)}"
    kept_off = family_entry(gpu, family)
    if kept_off is not None and not kept_off.variant:  # never let the defaults serve what it keeps off
        what = f"family {family}" if family else "all families"
        note = f"no profile entry matches, and the nearest keeps {what} off, so off here; {nearest_entry}"
        return DeviceConfig(apply(base, device.capability, kept_off), one_line(note),
                            tuple(r.detail for r in kept_off.reasons), matched=False)
    thresholds = f"{base.min_query_tokens}/{base.min_key_tokens} tokens"
    note = f"no profile entry matches: defaults here ({thresholds}); {nearest_entry}"
    return DeviceConfig(base, one_line(note), matched=False)
