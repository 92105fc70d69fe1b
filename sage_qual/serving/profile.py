"""The per-GPU profile certify writes, and the wrapper configuration it gives each device.

A profile holds one entry per certified GPU model, each with what defines the machine it was
measured on (GPU name, compute capability, memory, torch with its CUDA, sageattention) and, per
family and by default for all of them, the fastest variant that passed every fixture there (or
none), with the head sizes and the query and key lengths from which it measured faster than the
fastest SDPA backend. `device_configs()` gives every visible device its own `WrapperConfig`: a
device whose model and software match an entry gets that entry's variant and thresholds; any
other device keeps the default table and thresholds, and its note says why (nothing in the
profile was measured on it).

    {"kind": "sage-qual-profile", "schema_version": 3, "created": ..., "host": ...,
     "fixtures": {name: sha256},
     "gpus": [{"name": "NVIDIA H200", "capability": [9, 0], "memory_gib": 139.8, "sm_count": 132,
               "environment": {"torch": ..., "torch_cuda": ..., "driver": ..., "sageattention": ...,
                               "triton": ..., "sageattention_source": ...},
               "max_span_elements": int or null,
               "default": ENTRY, "families": {"FLUX.1": ENTRY, ...}}]}
    ENTRY = {"served": SERVED or null, "reasons": [{"kind", "detail"}]}

SERVED is `served.Served`: the variant, its thresholds and head sizes, and (null in a profile from
a report without long or context checks: no upper bound, any layout, the built-in contexts) its
verified range, layouts and contexts, with its bounds (calls kept on torch whatever the
thresholds, `config.Bound`). A GPU's `max_span_elements` is the largest element span and count of
one tensor its kernels were shown to take (null: `limits.MAX_SPAN_ELEMENTS`).

Schema version 2 (each entry's fields flat, with `variant` null for nothing) and version 1 (one GPU
model at the top level, no memory) still read: they are upgraded as read.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Literal, Mapping

from sage_qual import jsonfile, limits, records
from sage_qual.limits import one_line
from sage_qual.serving import machine
from sage_qual.serving.config import DEFAULT_CONFIG, WrapperConfig
from sage_qual.serving.env_record import Reason
from sage_qual.serving.machine import Difference, Kind, Machine
from sage_qual.serving.providers import THU_ML
from sage_qual.serving.served import Served, served_nothing
from sage_qual.serving.variants import VARIANTS, capability_label, gpu_label

KIND = "sage-qual-profile"
SCHEMA_VERSION = 3

FIX = "use the profile.json `sage-qual certify` wrote, or certify again"


class ProfileError(ValueError):
    """A profile that cannot be read or used; the message says why."""


@dataclass(frozen=True)
class Entry:
    """What the wrapper serves on a certified GPU model for one family (or by default): `served`, or
    nothing (null), with the reasons it serves no more."""
    served: Served | None
    reasons: list[Reason] = field(default_factory=list)

    @property
    def variant(self) -> str | None:
        return self.served.variant if self.served else None


@dataclass(frozen=True)
class ProfileEnvironment:
    torch: str
    torch_cuda: str
    driver: str
    sageattention: str
    triton: str
    # The build certified (sage_package.source_digest); "" or absent: not recorded, not compared.
    sageattention_source: str = ""
    # The other providers' builds certified beside it (provider -> source digest, "comfy-kitchen"):
    # each binds the entry as sageattention's build does; a provider absent here is not compared.
    other_providers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ProfileGpu:
    """One certified GPU model and the software it was measured with."""
    name: str
    capability: list[int] = field(metadata={"length": 2, "minimum": 0})
    memory_gib: float | None = field(metadata={"minimum": 0,
                                               "description": "null: any (schema version 1 profiles)"})
    environment: ProfileEnvironment
    default: Entry
    families: dict[str, Entry]
    # At most 2^31 - 1: certify never writes more (decide/profile.py says why), and past it the
    # kernels' 32-bit offsets overflow: a hand-edited 2^40 would hand them views they fault on.
    max_span_elements: int | None = field(default=None, metadata={
        "minimum": 1, "maximum": limits.MAX_SPAN_ELEMENTS,
        "description": "largest element span and count of one tensor certified on this GPU, at most "
                       "2^31 - 1; null or absent: that default limit"})
    sm_count: int | None = field(default=None, metadata={
        "minimum": 1, "description": "its streaming multiprocessors; null or absent: not compared"})

    @property
    def label(self) -> str:
        return gpu_label(self.name, self.capability)

    def check(self) -> list[tuple[str, str]]:
        # An entry serving a variant this capability cannot run (sm90-fp8-cuda on an sm_89) would fail
        # its first call on every device; certify writes only variants that ran there.
        capability = tuple(self.capability)
        for where, chosen in [("default", self.default), *(("families." + name, entry)
                                                           for name, entry in self.families.items())]:
            variant = VARIANTS.get(chosen.variant) if chosen.variant else None
            if variant and variant.capability_reasons(capability):
                return [(f"{where}.variant", f"{variant.name} does not run on {capability_label(capability)} "
                                             f"(capability {list(capability)})")]
        return []


@dataclass(frozen=True)
class Profile:
    kind: Literal["sage-qual-profile"]
    schema_version: Literal[3]
    created: str
    host: str
    fixtures: dict[str, str]
    gpus: list[ProfileGpu]

    def check(self) -> list[tuple[str, str]]:
        if not self.gpus:
            return [("gpus", "empty: a profile certifies at least one GPU model")]
        # Two entries for one machine (model, memory, SM count and software) would leave which one
        # serves to their order (issue 28).
        first: dict[tuple, int] = {}
        for n, gpu in enumerate(self.gpus):
            software = json.dumps(records.dump(gpu.environment), sort_keys=True)
            key = (gpu.label, gpu.memory_gib, gpu.sm_count, software)
            if key in first:
                return [(f"gpus[{n}]", f"{gpu.label} with this memory, SM count and software is "
                                       f"gpus[{first[key]}] already: keep one entry per machine (merge the "
                                       "reports instead)")]
            first[key] = n
        return []


def json_schema() -> dict:
    return records.schema(Profile, f"sage-qual profile, schema version {SCHEMA_VERSION}",
                          "profile.json, written by `sage-qual certify` and read by install(profile=...)",
                          f"https://sage-qual.invalid/profile/{SCHEMA_VERSION}")


# Older versions, upgraded as read -------------------------------------------------------------------
V1_KEYS = (
    "kind",
    "schema_version",
    "created",
    "host",
    "fixtures",
    "gpu",
    "environment",
    "default",
    "families",
)


def _from_version_1(data: dict, where: str) -> dict:
    """A version 1 profile as version 2: its one GPU model, with memory null (any)."""
    unknown = sorted(set(data) - set(V1_KEYS))
    if unknown:
        raise ProfileError(f"{where}: {unknown[0]}: unknown key; {FIX}")
    gpu = data.get("gpu")
    if not isinstance(gpu, dict):
        raise ProfileError(f"{where}: gpu: expected an object with the GPU's name and capability; {FIX}")
    return {
        **{k: data.get(k) for k in ("kind", "created", "host", "fixtures")},
        "schema_version": 2,
        "gpus": [
            {**gpu, "memory_gib": None, **{k: data.get(k) for k in ("environment", "default", "families")}}
        ],
    }


def _from_version_2(data: dict, where: str) -> dict:
    """A version 2 profile as version 3: each flat entry split into `served` (null when `variant`
    was) and `reasons`."""
    gpus = data.get("gpus")
    upgraded = []
    for n, gpu in enumerate(gpus if isinstance(gpus, list) else []):
        if not isinstance(gpu, dict):
            upgraded.append(gpu)
            continue
        families = gpu.get("families")
        upgraded.append(
            {
                **gpu,
                "default": _entry_from_version_2(gpu.get("default"), f"{where}: gpus[{n}].default"),
                "families": {
                    name: _entry_from_version_2(entry, f"{where}: gpus[{n}].families.{name}")
                    for name, entry in families.items()
                }
                if isinstance(families, dict)
                else families,
            }
        )
    return {**data, "schema_version": SCHEMA_VERSION, "gpus": upgraded if isinstance(gpus, list) else gpus}


def _key_as_written(key: str, version: int) -> str:
    """A key of the upgraded profile as an older file spells it: entries flat, and in version 1 one
    GPU model at the top level ("gpus[0].default.served.variant" is "default.variant" there)."""
    key = re.sub(r"\.served(?=\.|$)", "", key)
    if version == 1:
        key = re.sub(r"^gpus\[0\]\.(default|families|environment)", r"\1", key)
        key = re.sub(r"^gpus\[0\]", "gpu", key)
    return key


def _entry_from_version_2(entry, where: str):
    if not isinstance(entry, dict):
        return entry  # refused, with its key, by the parse that follows
    flat = dict(entry)
    reasons = flat.pop("reasons", [])
    if flat.get("variant") is None:
        given = sorted(key for key, value in flat.items() if value is not None)
        if given:
            raise ProfileError(f"{where}.variant: null, but {given[0]} is given: a profile serves nothing "
                               f"without a variant; {FIX}")
        return {"served": None, "reasons": reasons}
    if flat.get("bounds") is None:
        flat.pop("bounds", None)  # null or absent: none
    return {"served": flat, "reasons": reasons}


def load(source, where: str = "profile", fix: str = FIX) -> Profile:
    """A profile from a path or an already parsed dict (`where` names the dict, `fix` what to do about
    it); ProfileError (one line: where, key, fix)."""
    if isinstance(source, Profile):
        return source
    if isinstance(source, Mapping):
        data = dict(source)
    else:
        where = str(source)
        data = jsonfile.read(source, ProfileError, unreadable="cannot read profile {path}: {reason}",
                             not_json="profile {path} is not JSON, or cut short: {reason}; " + FIX)
    if not isinstance(data, dict) or data.get("kind") != KIND:
        raise ProfileError(f"{where} is not a sage-qual profile (written by `sage-qual certify`)")
    version = data.get("schema_version")
    if isinstance(version, bool) or version not in (1, 2, SCHEMA_VERSION):
        raise ProfileError(f"{where} has profile schema version {version!r}; this sage-qual reads versions 1 "
                           f"to {SCHEMA_VERSION}: certify again (or upgrade sage-qual)")
    if version == 1:
        data = _from_version_1(data, where)
    if version in (1, 2):
        data = _from_version_2(data, where)
    try:
        return records.parse(Profile, data, where, fix)
    except records.RecordError as error:
        key = error.key if version == SCHEMA_VERSION else _key_as_written(error.key, version)
        raise ProfileError(str(records.RecordError(error.where, key, error.problem, error.fix))) from None


def _normalize(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def entry(gpu: ProfileGpu, family: str | None = None) -> Entry:
    chosen = family_entry(gpu, family)
    if chosen is None:
        raise ProfileError(f"the profile has no entry for family {family} on {gpu.label} (it has: "
                           f"{', '.join(gpu.families) or 'none'}): certify that family")
    return chosen


def family_entry(gpu: ProfileGpu, family: str | None) -> Entry | None:
    """The entry for `family` (the default entry for None); None when the GPU has none for it."""
    if family is None:
        return gpu.default
    return next((chosen for name, chosen in gpu.families.items() if _normalize(name) == _normalize(family)),
                None)


def apply(base: WrapperConfig, capability: tuple[int, int], chosen: Entry,
          max_span_elements: int | None = None) -> WrapperConfig:
    """`base` with this capability served as the entry serves (`Served.config`), or by nothing."""
    if chosen.served is None:
        return served_nothing(base, capability)
    return chosen.served.config(base, capability, max_span_elements)


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
                   ((THU_ML.name, env.sageattention_source), *sorted(env.other_providers.items())))


def machine_here(device: LocalDevice) -> Machine:
    """A visible device as the machine an entry must match (the driver and Triton are not read)."""
    return Machine(device.name, tuple(device.capability), device.memory_gib, device.sm_count, device.torch,
                   device.torch_cuda, sageattention=device.sageattention,
                   builds=((THU_ML.name, device.sageattention_source), *sorted(device.other_sources.items())))


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


def served_families(gpu: ProfileGpu) -> list[str]:
    return [name for name, chosen in gpu.families.items() if chosen.variant]


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
