"""The per-GPU profile certify writes, as a file: its records, its schema, and reading it.

A profile holds one entry per certified GPU model, each with what defines the machine it was
measured on (GPU name, compute capability, memory, torch with its CUDA, sageattention) and, per
family and by default for all of them, the fastest variant that passed every fixture there (or
none), with the head sizes and the query and key lengths from which it measured faster than the
fastest SDPA backend. Which entry each visible device gets, and the `WrapperConfig` it gives, is
`profile_matching`'s job.

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
from sage_qual.kernels.variants import VARIANTS, capability_label, gpu_label
from sage_qual.verdicts import fitness
from sage_qual.verdicts.env_record import Reason
from sage_qual.verdicts.served import Served

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
    reasons: tuple[Reason, ...] = ()

    def __post_init__(self):
        records.tuples(self)

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
    capability: tuple[int, ...] = field(metadata={"length": 2, "minimum": 0})
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

    def __post_init__(self):
        records.tuples(self)

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
    gpus: tuple[ProfileGpu, ...]

    def __post_init__(self):
        records.tuples(self)

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
    key = fitness.family_key(family)
    return next((chosen for name, chosen in gpu.families.items() if fitness.family_key(name) == key),
                None)


def served_families(gpu: ProfileGpu) -> list[str]:
    return [name for name, chosen in gpu.families.items() if chosen.variant]
