"""The built-in defaults: thresholds measured on the GPU models this repository certified.

`default_profile.json` (next to this module) is a sage-qual profile, read by `profile.load` like a
user's, built by `python -m sage_qual.qualification.decide.defaults` from `sage-qual certify` runs,
with the runs it came from. When install() is given neither a config nor a profile (docs/certify.md,
"Built-in defaults"):

- a GPU model measured here (name without case or surrounding space, compute capability, memory)
  gets its measured entry: its kernel from the measured thresholds and head sizes, or, for a family
  its runs kept off, no kernel;
- a GPU model never measured keeps the default kernel table, with the most conservative thresholds
  measured for its compute capability (the highest token counts, the head sizes all of them served),
  and no kernel for a family one of them keeps off;
- a compute capability never measured keeps the default table and thresholds.

The entry that serves "all families" is a speed rule only: where the default kernel was measured
faster than torch's SDPA. Whether a family's numbers hold is what `sage-qual certify` and the gate
decide, as without built-in defaults.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from sage_qual import jsonfile, records
from sage_qual.kernels.variants import capability_label
from sage_qual.limits import one_line
from sage_qual.serving import profile_matching as matching
from sage_qual.serving.config import DEFAULT_CONFIG, WrapperConfig
from sage_qual.verdicts import machine, profile
from sage_qual.verdicts.served import Bound, Served

DATA = Path(__file__).with_name("default_profile.json")
KIND = "sage-qual-default-profile"
FIX = (
    "rebuild it with `python -m sage_qual.qualification.decide.defaults` (docs/certify.md, Built-in defaults)"
)


@dataclass(frozen=True)
class Source:
    """One certify profile the defaults were built from."""
    file: str
    gpu: str
    created: str
    host: str


@dataclass(frozen=True)
class DefaultProfile:
    kind: Literal["sage-qual-default-profile"]
    schema_version: Literal[1]
    sources: list[Source]
    # A profile.Profile when built; read back as parsed JSON, for profile.load (which upgrades and
    # names what is wrong in a profile's words).
    profile: Any


def read(path: Path = DATA) -> tuple[profile.Profile, list[Source]]:
    """The packaged profile and its sources; ProfileError (one line) when the file is broken."""
    data = jsonfile.read(path, profile.ProfileError,
                         unreadable="cannot read built-in defaults {path}: {reason}",
                         not_json="built-in defaults {path} are not JSON: {reason}; " + FIX)
    try:
        wrapper = records.parse(DefaultProfile, data, f"built-in defaults {path}", FIX)
    except records.RecordError as error:
        raise profile.ProfileError(str(error)) from None
    return profile.load(wrapper.profile, f"built-in defaults {path}: profile", FIX), wrapper.sources


def _same_model(gpu: profile.ProfileGpu, device: matching.LocalDevice) -> bool:
    """The defaults bind the hardware only (`machine.HARDWARE`): software differences are said."""
    return not any(d.kind in machine.HARDWARE for d in matching.entry_differences(gpu, device))


def device_configs(machines: list[matching.LocalDevice], family: str | None = None,
                   base: WrapperConfig = DEFAULT_CONFIG, path: Path = DATA) -> list[matching.DeviceConfig]:
    """Each device's defaults under the rules of the module docstring."""
    measured, _ = read(path)
    return [_device_config(measured, device, family, base) for device in machines]


def _device_config(measured: profile.Profile, device: matching.LocalDevice, family: str | None,
                   base: WrapperConfig) -> matching.DeviceConfig:
    what = f"family {family}" if family else "all families"
    same = next((gpu for gpu in measured.gpus if _same_model(gpu, device)), None)
    if same is not None:
        chosen = profile.family_entry(same, family) or same.default
        where = f"built-in defaults, measured on {same.label} with torch {same.environment.torch}"
        other = _other_build(same, device)
        if other:
            # The entry still applies, and it serves only what was verified: its range, layouts,
            # contexts and bounds. A build that differs is said once (install's WARNING), the advice
            # first: the 200-character line (limits.one_line) cut it after the GPU's name and both
            # build digests on the H100 of device run 42.
            where = ("built-in defaults: another build's (verified range only; certify this build for its "
                     f"own profile), measured on {same.label} with {other}")
        applied = _applied(base, device, chosen, where, what, same.max_span_elements)
        return dataclasses.replace(applied, matched=not other)
    kin = [gpu for gpu in measured.gpus if tuple(gpu.capability) == device.capability]
    capability = capability_label(device.capability)
    models = ", ".join(gpu.name for gpu in kin)
    kept_off = [e for gpu in kin if family and (e := profile.family_entry(gpu, family)) and not e.variant]
    if kept_off:  # the kernels of one capability are the same code: a family failed there stays off
        where = f"built-in defaults: {device.name} never measured, off as on {models}"
        return _applied(base, device, kept_off[0], where, what)
    # A GPU model no run measured that gets a kernel is warned about (matched=False): it serves by a
    # rule, not a verdict certified on it.
    strictest = most_conservative([gpu.default for gpu in kin])
    if strictest is None:
        if not base.kernel_table.get(device.capability):
            return matching.DeviceConfig(base, "")
        return matching.DeviceConfig(base, one_line(
            f"built-in defaults: no {capability} GPU was measured, so not certified (run sage-qual certify "
            f"here): {what} by the default rule, from {base.min_query_tokens:,} query tokens (InvokeAI's "
            f"RTX 4090 break-even, limits.MIN_QUERY_TOKENS)"), matched=False)
    # Today's table stays (the model was never measured); what it serves is what its kin verified.
    verified = matching.apply(base, device.capability, strictest)
    config = dataclasses.replace(verified, kernel_table=base.kernel_table)
    return matching.DeviceConfig(config, one_line(
        f"built-in defaults: {device.name} never measured, not certified (run sage-qual certify): "
        f"{what} as the strictest {capability} measured ({models}): {strictest.served.short()}"),
        matched=False)


def _applied(base: WrapperConfig, device: matching.LocalDevice, chosen: profile.Entry, where: str,
             what: str, max_span_elements: int | None = None) -> matching.DeviceConfig:
    config = matching.apply(base, device.capability, chosen, max_span_elements)
    if chosen.served:
        return matching.DeviceConfig(config, one_line(f"{where}: {chosen.served.short()}"))
    first = chosen.reasons[0].detail if chosen.reasons else "no reason recorded"
    return matching.DeviceConfig(config, one_line(f"{where}: {what} kept off: {first}"),
                                tuple(r.detail for r in chosen.reasons))


def _other_build(measured: profile.ProfileGpu, device: matching.LocalDevice) -> str:
    """How the defaults' sageattention version or build differs from this device's ("" when neither
    does, or a build is not recorded), in `machine`'s phrasing."""
    found = [d.text for d in matching.entry_differences(measured, device) if d.kind in machine.KERNELS]
    return "; ".join(found)


def most_conservative(entries: list[profile.Entry]) -> profile.Entry | None:
    """The entries that serve a variant, merged (`merged`) at the head sizes every one of them serves;
    None when none serves or they share no head size."""
    serving = [e for e in entries if e.served]
    if not serving:
        return None
    head_dims = sorted(set.intersection(*(set(e.served.head_dims) for e in serving)))
    if not head_dims:
        return None
    return merged(serving[0].variant, serving, head_dims)


def merged(variant: str, entries: list[profile.Entry], head_dims: list[int]) -> profile.Entry:
    """Entries serving `variant` as one, each of `Served`'s fields by keyword: the highest thresholds,
    the lowest verified upper bounds, the layouts and contexts every entry verified, every entry's
    bounds, masked calls only where every entry serves them, the last entry's reasons."""
    served = [e.served for e in entries]
    return profile.Entry(Served(
        variant=variant, min_query_tokens=max(s.min_query_tokens for s in served),
        min_key_tokens=max(s.min_key_tokens for s in served), head_dims=head_dims,
        max_query_tokens=_lowest([s.max_query_tokens for s in served]),
        max_key_tokens=_lowest([s.max_key_tokens for s in served]),
        layouts=_shared([s.layouts for s in served]), contexts=_shared([s.contexts for s in served]),
        bounds=merged_bounds(served), masks=all(s.masks for s in served)),
        list(entries[-1].reasons))


def _shared(values: list[list[str] | None]) -> list[str] | None:
    """What every entry names (in the first's order); None when none names any (null: any)."""
    named = [v for v in values if v is not None]
    return [x for x in named[0] if all(x in v for v in named)] if named else None


def _lowest(values: list[int | None]) -> int | None:
    """The lowest verified upper bound; None when no entry verified one."""
    named = [v for v in values if v is not None]
    return min(named) if named else None


def merged_bounds(served: list[Served]) -> list[Bound]:
    """Every entry's bounds at once: per side the highest (a bound is safety, not speed: the runs'
    most conservative entry keeps it)."""
    highest: dict[str, Bound] = {}
    for bound in (b for s in served for b in s.bounds):
        if bound.side not in highest or bound.below > highest[bound.side].below:
            highest[bound.side] = bound
    return [highest[side] for side in sorted(highest)]
