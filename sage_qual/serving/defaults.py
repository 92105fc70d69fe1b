"""The built-in defaults: thresholds measured on the GPU models this repository certified.

`default_profile.json` (next to this module) is a sage-qual profile, read by `profile.load` like a
user's, built by `python -m sage_qual.serving.defaults` from `sage-qual certify` profiles, with the
runs it came from. When install() is given neither a config nor a profile (docs/certify.md,
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

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from sage_qual import jsonfile, records
from sage_qual.limits import one_line
from sage_qual.serving import profile
from sage_qual.serving.config import DEFAULT_CONFIG, KERNEL_TABLE, Bound, WrapperConfig, served_from
from sage_qual.serving.env_record import Reason, ReasonKind
from sage_qual.serving.variants import capability_label

DATA = Path(__file__).with_name("default_profile.json")
KIND = "sage-qual-default-profile"
FIX = "rebuild it with `python -m sage_qual.serving.defaults` (docs/certify.md, Built-in defaults)"


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
        wrapper = records.parse(DefaultProfile, data, str(path), FIX)
    except records.RecordError as error:
        raise profile.ProfileError(str(error)) from None
    return profile.load(wrapper.profile, f"built-in defaults {path}: profile", FIX), wrapper.sources


def _same_model(gpu: profile.ProfileGpu, device: profile.Machine) -> bool:
    memory = gpu.memory_gib is None or abs(gpu.memory_gib - device.memory_gib) <= profile.MEMORY_TOLERANCE_GIB
    return (profile.same_gpu_name(gpu.name, device.name) and tuple(gpu.capability) == device.capability
            and memory)


def device_configs(machines: list[profile.Machine], family: str | None = None,
                   base: WrapperConfig = DEFAULT_CONFIG, path: Path = DATA) -> list[profile.DeviceConfig]:
    """Each device's defaults under the rules of the module docstring."""
    measured, _ = read(path)
    return [_device_config(measured, device, family, base) for device in machines]


def _device_config(measured: profile.Profile, device: profile.Machine, family: str | None,
                   base: WrapperConfig) -> profile.DeviceConfig:
    what = f"family {family}" if family else "all families"
    same = next((gpu for gpu in measured.gpus if _same_model(gpu, device)), None)
    if same is not None:
        chosen = profile.family_entry(same, family) or same.default
        where = f"built-in defaults, measured on {same.label} with torch {same.environment.torch}"
        return _applied(base, device, chosen, where, what)
    kin = [gpu for gpu in measured.gpus if tuple(gpu.capability) == device.capability]
    capability = capability_label(device.capability)
    models = ", ".join(gpu.name for gpu in kin)
    kept_off = [e for gpu in kin if family and (e := profile.family_entry(gpu, family)) and not e.variant]
    if kept_off:  # the kernels of one capability are the same code: a family failed there stays off
        where = f"built-in defaults: {device.name} was never measured, kept as on {models}"
        return _applied(base, device, kept_off[0], where, what)
    strictest = most_conservative([gpu.default for gpu in kin])
    if strictest is None:
        return profile.DeviceConfig(base, "")
    config = dataclasses.replace(base, min_query_tokens=strictest.min_query_tokens,
                                 min_key_tokens=strictest.min_key_tokens,
                                 head_dims=tuple(strictest.head_dims), bounds=tuple(strictest.bounds or ()))
    return profile.DeviceConfig(config, one_line(
        f"built-in defaults: {device.name} was never measured; the most conservative thresholds measured "
        f"on {capability} ({models}): {_served(strictest)}"))


def _applied(base: WrapperConfig, device: profile.Machine, chosen: profile.Entry, where: str,
             what: str) -> profile.DeviceConfig:
    config = profile.apply(base, device.capability, chosen)
    if chosen.variant:
        return profile.DeviceConfig(config, one_line(f"{where}: {chosen.variant} {_served(chosen)}"))
    first = chosen.reasons[0].detail if chosen.reasons else "no reason recorded"
    return profile.DeviceConfig(config, one_line(f"{where}: {what} kept off: {first}"),
                                tuple(r.detail for r in chosen.reasons))


def _served(chosen: profile.Entry) -> str:
    return "from " + served_from(chosen.min_query_tokens, chosen.min_key_tokens, chosen.head_dims)


def most_conservative(entries: list[profile.Entry]) -> profile.Entry | None:
    """The highest thresholds of the entries that serve a variant, at the head sizes every one of
    them serves; None when none serves or they share no head size."""
    serving = [e for e in entries if e.variant]
    if not serving:
        return None
    head_dims = sorted(set.intersection(*(set(e.head_dims) for e in serving)))
    if not head_dims:
        return None
    return profile.Entry(serving[0].variant, max(e.min_query_tokens for e in serving),
                         max(e.min_key_tokens for e in serving), head_dims, bounds=merged_bounds(serving))


def merged_bounds(entries: list[profile.Entry]) -> list[Bound] | None:
    """Every entry's bounds at once: per side the highest (a bound is safety, not speed: the runs'
    most conservative entry keeps it); None when none has a bound."""
    highest: dict[str, Bound] = {}
    for bound in (b for e in entries for b in e.bounds or []):
        if bound.side not in highest or bound.below > highest[bound.side].below:
            highest[bound.side] = bound
    return [highest[side] for side in sorted(highest)] or None


# Building the data file from certify profiles ---------------------------------------------------
def _off(reasons: list[Reason]) -> profile.Entry:
    return profile.Entry(None, None, None, None, list(reasons))


def _served_or_off(chosen: profile.Entry | None, why_not: str) -> profile.Entry:
    """`chosen` when it serves a variant, else an entry that serves nothing for the speed reason `why_not`."""
    return chosen if chosen is not None and chosen.variant else _off([Reason(ReasonKind.SPEED, why_not)])


def _default_entry(runs: list[tuple[str, profile.ProfileGpu]]) -> profile.Entry:
    """Where the capability's first-choice kernel (of the default table) was measured faster in
    every run: the head sizes each run served it at, from the highest thresholds any run needed."""
    capability = tuple(runs[0][1].capability)
    for variant in KERNEL_TABLE.get(capability, ()):
        per_run = [[e for e in (gpu.default, *gpu.families.values()) if e.variant == variant]
                   for _, gpu in runs]
        per_run = [entries for entries in per_run if entries]
        if not per_run:
            continue
        head_dims = set.intersection(*({d for e in entries for d in e.head_dims} for entries in per_run))
        served = [e for entries in per_run for e in entries if head_dims & set(e.head_dims)]
        if served:
            return profile.Entry(variant, max(e.min_query_tokens for e in served),
                                 max(e.min_key_tokens for e in served), sorted(head_dims),
                                 bounds=merged_bounds(served))
    return _served_or_off(None, "the default kernel was never measured faster than torch's SDPA here")


def _family_entry(name: str, runs: list[tuple[str, profile.ProfileGpu]]) -> profile.Entry:
    """Off where any run kept the family off; else that run's variant from the highest thresholds."""
    entries = [(file, profile.family_entry(gpu, name)) for file, gpu in runs]
    entries = [(file, e) for file, e in entries if e is not None]
    off = [(file, e) for file, e in entries if not e.variant]
    if off:
        file, e = off[0]
        return _off(e.reasons or [Reason(ReasonKind.SPEED, f"kept off in {file}")])
    variants = sorted({e.variant for _, e in entries})
    if len(variants) > 1:
        return _served_or_off(None, f"the runs chose different variants ({', '.join(variants)})")
    return _served_or_off(most_conservative([e for _, e in entries]), "the runs share no head size")


def build(files: list[Path], previous: Path | None = DATA) -> DefaultProfile:
    """The data file from certify profiles: one entry per GPU model, merged over its runs (without
    the runs' verified ranges, layouts and span limits: the entries are speed rules); models of
    `previous` that none of the files measured are kept with their sources."""
    runs: dict[tuple, list[tuple[str, profile.ProfileGpu, profile.Profile]]] = {}
    for file in files:
        loaded = profile.load(file)
        for gpu in loaded.gpus:
            key = (gpu.name.strip().casefold(), tuple(gpu.capability))
            runs.setdefault(key, []).append((str(file), gpu, loaded))
    gpus: list[profile.ProfileGpu] = []
    sources: list[Source] = []
    if previous is not None and Path(previous).exists():
        kept, kept_sources = read(previous)
        for gpu in kept.gpus:
            if (gpu.name.strip().casefold(), tuple(gpu.capability)) not in runs:
                gpus.append(gpu)
                sources += [source for source in kept_sources if profile.same_gpu_name(source.gpu, gpu.name)]
    newest = max((loaded for group in runs.values() for _, _, loaded in group), key=lambda p: p.created)
    for group in runs.values():
        group.sort(key=lambda run: run[2].created)
        _, gpu, _ = group[-1]
        pairs = [(file, g) for file, g, _ in group]
        families = list(dict.fromkeys(name for _, g in pairs for name in g.families))
        gpus.append(profile.ProfileGpu(gpu.name, list(gpu.capability), gpu.memory_gib, gpu.environment,
                                       _default_entry(pairs), {name: _family_entry(name, pairs)
                                                               for name in families}))
        sources += [Source(file, g.name, p.created, p.host) for file, g, p in group]
    return DefaultProfile(KIND, 1, sources, profile.Profile(
        profile.KIND, profile.SCHEMA_VERSION, newest.created, "sage-qual built-in defaults",
        dict(newest.fixtures), gpus))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sage_qual.serving.defaults",
        description="Build the built-in defaults from `sage-qual certify` profile.json files: every run of a "
                    "GPU model merged to its most conservative entry; models the files do not name are kept.")
    parser.add_argument("profiles", nargs="+", type=Path, help="profile.json files written by certify")
    parser.add_argument("--out", type=Path, default=DATA,
                        help="the data file to write (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        built = build(args.profiles, args.out)
    except profile.ProfileError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    args.out.write_text(json.dumps(records.dump(built), indent=1) + "\n")
    print(f"wrote {args.out}: " + ", ".join(gpu.label for gpu in built.profile.gpus))
    return 0


if __name__ == "__main__":
    sys.exit(main())
