"""The per-GPU profile certify writes, and the wrapper configuration it gives each device.

A profile holds one entry per certified GPU model, each with what defines the machine it was
measured on (GPU name, compute capability, memory, torch with its CUDA, sageattention) and, per
family and by default for all of them, the fastest variant that passed every fixture there (or
none), with the head sizes and the query and key lengths from which it measured faster than the
fastest SDPA backend. `device_configs()` gives every visible device its own `WrapperConfig`: a
device whose model and software match an entry gets that entry's variant and thresholds; any
other device keeps the default table and thresholds, and its note says why (nothing in the
profile was measured on it).

    {"kind": "sage-qual-profile", "schema_version": 2, "created": ..., "host": ...,
     "fixtures": {name: sha256},
     "gpus": [{"name": "NVIDIA H200", "capability": [9, 0], "memory_gib": 139.8,
               "environment": {"torch": ..., "torch_cuda": ..., "driver": ..., "sageattention": ...,
                               "triton": ...},
               "default": ENTRY, "families": {"FLUX.1": ENTRY, ...}}]}
    ENTRY = {"variant": name or null, "min_query_tokens": int or null, "min_key_tokens": int or null,
             "head_dims": [int] or null, "reasons": [{"kind", "detail"}],
             "max_query_tokens": int or null, "max_key_tokens": int or null, "layouts": [name] or null,
             "contexts": [name] or null, "bounds": [{"side": "query" or "key", "below": int,
                                                     "reason": text}] or null}

Optional, absent in older profiles (then: no upper bound, any layout, the default span limit):
an entry's verified range (`max_query_tokens`, `max_key_tokens`), `layouts` (names from
`config.LAYOUTS`) and `contexts` (the execution contexts certified, names from
`contexts.CONTEXTS`; absent: the variant's built-in rule), its `bounds` (calls kept on torch whatever
the thresholds, `config.Bound`; absent: none), and a GPU's `max_span_elements`, the
largest element span and count of one tensor its kernels were shown to take (default
`limits.MAX_SPAN_ELEMENTS`).

Schema version 1 (one GPU model at the top level, no memory) still reads.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Literal, Mapping

import torch
from packaging.version import InvalidVersion, Version

from sage_qual import jsonfile, limits, records
from sage_qual.limits import one_line
from sage_qual.serving import platform, sage_package
from sage_qual.serving.config import DEFAULT_CONFIG, LAYOUTS, Bound, WrapperConfig, served_from
from sage_qual.serving.contexts import CONTEXTS
from sage_qual.serving.env_record import Reason
from sage_qual.serving.variants import VARIANTS, capability_label, gpu_label

KIND = "sage-qual-profile"
SCHEMA_VERSION = 2
# Head sizes the kernels take (the wrapper's default; upstream pads others, which it refuses).
KERNEL_HEAD_DIMS = DEFAULT_CONFIG.head_dims
# Memory as nvidia-smi and torch report it differs by driver reservations; within this many GiB
# it is the same card (an H200 shows 139.8, an H100 79.6 or 93.1 GiB: far apart).
MEMORY_TOLERANCE_GIB = 1.0
# One model name can hide cut-down dies: within this share of SMs it is the same card, as
# comfy-kitchen's per-GPU tuning table binds an entry to the SM version and SM count within 10 %.
SM_COUNT_TOLERANCE = 0.10
FIX = "use the profile.json `sage-qual certify` wrote, or certify again"


class ProfileError(ValueError):
    """A profile that cannot be read or used; the message says why."""


@dataclass(frozen=True)
class Entry:
    """What the wrapper serves on a certified GPU model: a variant from these lengths, or nothing."""
    variant: str | None
    min_query_tokens: int | None
    min_key_tokens: int | None
    head_dims: list[int] | None
    reasons: list[Reason] = field(default_factory=list)
    # The verified range and layouts (null: no upper bound, any layout; absent in older profiles).
    max_query_tokens: int | None = None
    max_key_tokens: int | None = None
    layouts: list[str] | None = None
    # The execution contexts certify verified the variant in (names in contexts.CONTEXTS; null or
    # absent: the variant's built-in rule, `contexts.builtin_safe`).
    contexts: list[str] | None = None
    # Calls kept on torch whatever the thresholds (null or absent: none).
    bounds: list[Bound] | None = None

    def check(self) -> list[tuple[str, str]]:
        thresholds = (self.min_query_tokens, self.min_key_tokens, self.head_dims, self.max_query_tokens,
                      self.max_key_tokens, self.layouts, self.contexts, self.bounds)
        if self.variant is None:
            if any(x is not None for x in thresholds):
                return [("variant", "null, but thresholds are given: a profile serves nothing without a "
                                    "variant")]
            return []
        if self.variant not in VARIANTS:
            return [("variant", f"{self.variant!r} is not a SageAttention variant sage-qual knows "
                                f"({', '.join(VARIANTS)})")]
        for name in ("min_query_tokens", "min_key_tokens"):
            value = getattr(self, name)
            if value is None or value < 1:
                return [(name, f"is {value!r}, expected a token count of at least 1")]
        if not self.head_dims:
            return [("head_dims", "empty or null: name the head sizes served")]
        wrong = [d for d in self.head_dims if d not in KERNEL_HEAD_DIMS]
        if wrong:
            return [("head_dims", f"{wrong[0]} is not a head size the kernels take "
                                  f"({', '.join(map(str, KERNEL_HEAD_DIMS))})")]
        return self._check_range()

    def _check_range(self) -> list[tuple[str, str]]:
        for name, lowest in (("max_query_tokens", self.min_query_tokens),
                             ("max_key_tokens", self.min_key_tokens)):
            value = getattr(self, name)
            if value is not None and value < lowest:
                return [(name, f"is {value}, below min_{name[4:]} {lowest}: the verified range is empty")]
        if self.layouts is not None:
            if not self.layouts:
                return [("layouts", "empty: name the verified layouts, or null for any")]
            unknown = [name for name in self.layouts if name not in LAYOUTS]
            if unknown:
                return [("layouts", f"{unknown[0]!r} is not a layout sage-qual knows ({', '.join(LAYOUTS)})")]
        if self.contexts is not None:
            unknown = [name for name in self.contexts if name not in CONTEXTS]
            if unknown or len(set(self.contexts)) != len(self.contexts):
                what = f"{unknown[0]!r} is not" if unknown else "names a context twice, not"
                return [("contexts", f"{what} a list of execution contexts sage-qual knows "
                                     f"({', '.join(CONTEXTS)}); [] for none, null for the built-in rule")]
        return []


@dataclass(frozen=True)
class ProfileEnvironment:
    torch: str
    torch_cuda: str
    driver: str
    sageattention: str
    triton: str
    # The build certified (sage_package.source_digest); "" or absent: not recorded, not compared.
    sageattention_source: str = ""


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
    schema_version: Literal[2]
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
            key = (gpu.label, gpu.memory_gib, gpu.sm_count, gpu.environment)
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


@dataclass(frozen=True)
class GpuV1:
    name: str
    capability: list[int] = field(metadata={"length": 2, "minimum": 0})


@dataclass(frozen=True)
class ProfileV1:
    """Schema version 1: one GPU model at the top level, without its memory."""
    kind: Literal["sage-qual-profile"]
    schema_version: Literal[1]
    created: str
    host: str
    fixtures: dict[str, str]
    gpu: GpuV1
    environment: ProfileEnvironment
    default: Entry
    families: dict[str, Entry]


def _upgrade(old: ProfileV1) -> Profile:
    """A version 1 profile as version 2: its one GPU model, with memory null (any)."""
    gpu = ProfileGpu(old.gpu.name, old.gpu.capability, None, old.environment, old.default, old.families)
    return Profile(KIND, SCHEMA_VERSION, old.created, old.host, old.fixtures, [gpu])


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
    if isinstance(version, bool) or version not in (1, SCHEMA_VERSION):
        raise ProfileError(f"{where} has profile schema version {version!r}; this sage-qual reads versions 1 "
                           f"and {SCHEMA_VERSION}: certify again (or upgrade sage-qual)")
    try:
        if version == 1:
            return _upgrade(records.parse(ProfileV1, data, where, fix))
        return records.parse(Profile, data, where, fix)
    except records.RecordError as error:
        raise ProfileError(str(error)) from None


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
    """`base` with this capability served by the entry's variant (or none), its thresholds, head sizes,
    verified range and layouts, and the GPU's certified span limit (None: `base`'s)."""
    table = dict(base.kernel_table)
    table[capability] = (chosen.variant,) if chosen.variant else ()
    if not chosen.variant:
        return dataclasses.replace(base, kernel_table=table)
    return dataclasses.replace(base, kernel_table=table, min_query_tokens=chosen.min_query_tokens,
                               min_key_tokens=chosen.min_key_tokens, head_dims=tuple(chosen.head_dims),
                               max_query_tokens=chosen.max_query_tokens, max_key_tokens=chosen.max_key_tokens,
                               layouts=None if chosen.layouts is None else tuple(chosen.layouts),
                               contexts=None if chosen.contexts is None else tuple(chosen.contexts),
                               bounds=tuple(chosen.bounds or ()),
                               max_span_elements=max_span_elements or base.max_span_elements)


@dataclass(frozen=True)
class Machine:
    """What defines one visible device, as a profile entry must match it."""
    name: str
    capability: tuple[int, int]
    memory_gib: float
    torch: str
    torch_cuda: str
    sageattention: str
    sageattention_source: str = ""  # "" when unknown: not compared
    sm_count: int | None = None  # None when unknown: not compared


def same_gpu_name(a: str, b: str) -> bool:
    """GPU names as one model: without case or surrounding space ("nvidia h200 " is "NVIDIA H200")."""
    return a.strip().casefold() == b.strip().casefold()


def _torch_release(version: str) -> tuple:
    """(major, minor, local build tag) of a torch version: equal for two patch releases of one build."""
    try:
        parsed = Version(version)
    except InvalidVersion:
        return (version,)
    return (*parsed.release[:2], parsed.local)


def differences(gpu: ProfileGpu, device: Machine) -> list[str]:
    """What differs between the machine an entry was certified on and this device, hardware first."""
    found = []
    if not same_gpu_name(gpu.name, device.name) or tuple(gpu.capability) != device.capability:
        found.append("GPU %s, %s here" % (device.name, capability_label(device.capability)))
    elif gpu.memory_gib is not None and abs(gpu.memory_gib - device.memory_gib) > MEMORY_TOLERANCE_GIB:
        found.append(f"memory {gpu.memory_gib:g} GiB, {device.memory_gib:g} here")
    elif not _same_sm_count(gpu.sm_count, device.sm_count):
        found.append(f"{gpu.sm_count} SMs, {device.sm_count} here")
    env = gpu.environment
    for label, certified, here in (("sageattention", env.sageattention, device.sageattention),
                                   ("CUDA", env.torch_cuda, device.torch_cuda),
                                   ("torch", env.torch, device.torch)):
        if certified != here:
            found.append(f"{label} {certified or 'none'}, {here or 'none'} here")
    if not _same_build(env.sageattention_source, device.sageattention_source):
        found.append(f"sageattention build {env.sageattention_source}, {device.sageattention_source} here "
                     "(another source under one version: a fork or an older build)")
    return found


def is_near_match(gpu: ProfileGpu, device: Machine) -> bool:
    """The same GPU model, sageattention and CUDA, with torch another patch release of the same build
    (2.11.1+cu130 for 2.11.0+cu130): the kernels are the same binaries and torch's SDPA backends do
    not change within a minor release, so the entry applies (docs/certify.md, "Which entry applies")."""
    env = gpu.environment
    return (len(differences(gpu, device)) == 1 and env.torch != device.torch
            and _torch_release(env.torch) == _torch_release(device.torch))


def nearest(profile: Profile, device: Machine) -> ProfileGpu:
    """The entry closest to this device: one that matches in everything that binds it (GPU model,
    memory, SM count, sageattention and its build, CUDA, torch) first, then a near match
    (`is_near_match`), then the same GPU model, memory, SM count, sageattention, its build, CUDA,
    torch's release and torch itself; the first in the file among equals."""
    def closeness(gpu: ProfileGpu):
        env = gpu.environment
        return (not differences(gpu, device), is_near_match(gpu, device),
                same_gpu_name(gpu.name, device.name) and tuple(gpu.capability) == device.capability,
                tuple(gpu.capability) == device.capability,
                gpu.memory_gib is None or abs(gpu.memory_gib - device.memory_gib) <= MEMORY_TOLERANCE_GIB,
                _same_sm_count(gpu.sm_count, device.sm_count),
                env.sageattention == device.sageattention,
                _same_build(env.sageattention_source, device.sageattention_source),
                env.torch_cuda == device.torch_cuda,
                _torch_release(env.torch) == _torch_release(device.torch), env.torch == device.torch)
    return max(profile.gpus, key=closeness)


def _same_sm_count(certified: int | None, here: int | None) -> bool:
    """Within SM_COUNT_TOLERANCE of each other, or one not recorded (not compared)."""
    return not certified or not here or abs(certified - here) <= SM_COUNT_TOLERANCE * max(certified, here)


def _same_build(certified: str, here: str) -> bool:
    """One sageattention build (`sage_package.source_digest`), or one not recorded (not compared)."""
    return not certified or not here or certified == here


def served_families(gpu: ProfileGpu) -> list[str]:
    return [name for name, chosen in gpu.families.items() if chosen.variant]


def verified_range(chosen: Entry) -> str:
    """The note's words for an entry's upper bounds, layouts, contexts and bounds ("" when it has none)."""
    words = ""
    if chosen.max_query_tokens is not None or chosen.max_key_tokens is not None:
        words += (f", up to {chosen.max_query_tokens or 'any'} query / {chosen.max_key_tokens or 'any'} "
                  "key tokens")
    if chosen.layouts is not None:
        words += f", layouts {', '.join(chosen.layouts)}"
    if chosen.contexts is not None:
        words += f", contexts {', '.join(chosen.contexts) or 'none (default stream only)'}"
    for bound in chosen.bounds or []:
        words += f", {bound.short()}"
    return words


@dataclass(frozen=True)
class DeviceConfig:
    config: WrapperConfig
    note: str  # which profile entry applies, or why none does: one line (limits.STATUS_LINE_LIMIT)
    reasons: tuple[str, ...] = ()  # every reason the applied entry gives for serving nothing, in full
    matched: bool = True  # False: no entry describes this device, or the defaults were another build's: warn


def _entry_note(gpu: ProfileGpu, chosen: Entry, family: str | None, near: str) -> str:
    scope = f", family {family}" if family else ""
    if chosen.variant:
        start = served_from(chosen.min_query_tokens, chosen.min_key_tokens, chosen.head_dims)
        return one_line(f"{near}profile entry {gpu.label}{scope}: {chosen.variant} from "
                        f"{start}{verified_range(chosen)}")
    count = len(chosen.reasons)
    first = chosen.reasons[0].detail if chosen.reasons else "no reason recorded"
    enabled = served_families(gpu) if family is None else []
    if enabled:  # the profile serves some families here: which, and how to pick one, before why not all
        listed = ", ".join(enabled[:4]) + (f" and {len(enabled) - 4} more" if len(enabled) > 4 else "")
        return one_line(f"{near}the profile enables only {listed} here, pick one: install(profile=..., "
                        f"family=\"{enabled[-1]}\"); why not all: {count} reasons in profile_reasons")
    why = f"{count} reasons in profile_reasons, first: {first}" if count > 1 else first
    return one_line(f"{near}the profile certifies no SageAttention variant on {gpu.label}{scope}: {why}")


def device_configs(profile, machines: list[Machine], family: str | None = None,
                   base: WrapperConfig | list[WrapperConfig] = DEFAULT_CONFIG) -> list[DeviceConfig]:
    """Each device's configuration: its matching entry applied to `base` (one config, or one per
    device), else `base` with a note naming the nearest entry and what differs; a family that the
    nearest entry keeps off stays off. ProfileError when the profile cannot be read or a matching
    entry lacks the family."""
    profile = load(profile)
    bases = base if isinstance(base, list) else [base] * len(machines)
    return [_device_config(profile, device, family, own)
            for device, own in zip(machines, bases, strict=True)]


def _device_config(profile: Profile, device: Machine, family: str | None,
                   base: WrapperConfig) -> DeviceConfig:
    gpu = nearest(profile, device)
    differ = differences(gpu, device)
    if not differ or is_near_match(gpu, device):
        chosen = entry(gpu, family)
        near = f"near match ({differ[0]}): " if differ else ""
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


def this_machine() -> list[Machine]:
    """Every visible device as a profile entry must match it. Raises SageUnavailable without a
    usable sageattention (its version is part of the match)."""
    package = sage_package.load()
    return machines(platform.current(), package.version, package.source)


def machines(cuda: platform.CudaPlatform, sageattention: str, source: str = "") -> list[Machine]:
    """Every device of `cuda` as a profile entry must match it, with this sageattention version and
    build (`source`)."""
    cuda_version = cuda.torch_cuda()
    torch_cuda = "%d.%d" % cuda_version if cuda_version else ""
    return [Machine(cuda.device_name(i), cuda.capability(i), round(cuda.total_memory(i) / 2**30, 1),
                    torch.__version__, torch_cuda, sageattention, source, cuda.sm_count(i))
            for i in range(cuda.device_count())]
