"""Building the built-in defaults (sage_qual/serving/default_profile.json) from certify runs.

`python -m sage_qual.qualification.decide.defaults REPORT_OR_PROFILE...` decides each certify
report afresh with this code's rules (a profile.json is taken as it was written) and merges the
runs of each GPU model into its most conservative entry: every field a profile entry carries
(thresholds, verified range, layouts, contexts, bounds) and the GPU's span limit and SM count, the
software of its newest run. Models the inputs do not name are kept from the previous file.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from sage_qual import jsonfile, records
from sage_qual.qualification.decide import checked, verdict
from sage_qual.qualification.decide import profile as building
from sage_qual.qualification.evidence.report_model import ReportError
from sage_qual.serving.config import KERNEL_TABLE
from sage_qual.serving.defaults import DATA, KIND, DefaultProfile, Source, merged, most_conservative, read
from sage_qual.verdicts import machine, profile
from sage_qual.verdicts.env_record import Reason, ReasonKind


def load_run(path: Path) -> profile.Profile:
    """The profile a certify run gives with this code's rules: a report decided afresh, or a
    profile.json as written. ProfileError (one line) for anything else."""
    data = jsonfile.read(path, profile.ProfileError, unreadable="cannot read {path}: {reason}",
                         not_json="{path} is not JSON: {reason}")
    if isinstance(data, dict) and data.get("kind") == "sage-qual-report":
        try:
            report = checked.load(path)
        except ReportError as error:
            raise profile.ProfileError(str(error)) from None
        problem = checked.undecidable(report, str(path))
        if problem:
            raise profile.ProfileError(problem)
        return building.build(report, verdict.decide(report))
    return profile.load(path)


def _off(reasons: list[Reason]) -> profile.Entry:
    return profile.Entry(None, list(reasons))


def _default_entry(runs: list[tuple[str, profile.ProfileGpu]]) -> profile.Entry:
    """Where the capability's first-choice kernel (of the default table) was served in every run: the
    head sizes each run served it at, merged over the entries serving it there."""
    capability = tuple(runs[0][1].capability)
    for variant in KERNEL_TABLE.get(capability, ()):
        per_run = [[e for e in (gpu.default, *gpu.families.values()) if e.variant == variant]
                   for _, gpu in runs]
        per_run = [entries for entries in per_run if entries]
        if not per_run:
            continue
        head_dims = set.intersection(
            *({d for e in entries for d in e.served.head_dims} for entries in per_run)
        )
        served = [e for entries in per_run for e in entries if head_dims & set(e.served.head_dims)]
        if served:
            return merged(variant, served, sorted(head_dims))
    return _off(
        [Reason(ReasonKind.SPEED, "the default kernel was never measured faster than torch's SDPA here")]
    )


def _family_entry(name: str, runs: list[tuple[str, profile.ProfileGpu]]) -> profile.Entry:
    """Off where any run kept the family off; else that run's variant, merged over the runs
    (`most_conservative`)."""
    entries = [(file, profile.family_entry(gpu, name)) for file, gpu in runs]
    entries = [(file, e) for file, e in entries if e is not None]
    off = [(file, e) for file, e in entries if not e.variant]
    if off:
        file, e = off[0]
        return _off(e.reasons or [Reason(ReasonKind.SPEED, f"kept off in {file}")])
    variants = sorted({e.variant for _, e in entries})
    if len(variants) > 1:
        return _off([Reason(ReasonKind.SPEED, f"the runs chose different variants ({', '.join(variants)})")])
    return most_conservative([e for _, e in entries]) or _off([Reason(ReasonKind.SPEED,
                                                                      "the runs share no head size")])


def build(files: list[Path], previous: Path | None = DATA) -> DefaultProfile:
    """The data file from certify runs: one entry per GPU model, merged over its runs; models of
    `previous` that none of the files measured are kept with their sources."""
    runs: dict[tuple, list[tuple[str, profile.ProfileGpu, profile.Profile]]] = {}
    for file in files:
        loaded = load_run(Path(file))
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
                sources += [source for source in kept_sources if machine.same_gpu_name(source.gpu, gpu.name)]
    newest = max((loaded for group in runs.values() for _, _, loaded in group), key=lambda p: p.created)
    for group in runs.values():
        group.sort(key=lambda run: run[2].created)
        _, gpu, _ = group[-1]
        pairs = [(file, g) for file, g, _ in group]
        families = list(dict.fromkeys(name for _, g in pairs for name in g.families))
        spans = [g.max_span_elements for _, g in pairs]
        gpus.append(profile.ProfileGpu(gpu.name, list(gpu.capability), gpu.memory_gib, gpu.environment,
                                       _default_entry(pairs), {name: _family_entry(name, pairs)
                                                               for name in families},
                                       None if None in spans else min(spans), gpu.sm_count))
        sources += [Source(file, g.name, p.created, p.host) for file, g, p in group]
    return DefaultProfile(KIND, 1, sources, profile.Profile(
        profile.KIND, profile.SCHEMA_VERSION, newest.created, "sage-qual built-in defaults",
        dict(newest.fixtures), gpus))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sage_qual.qualification.decide.defaults",
        description="Build the built-in defaults from certify runs (report.json, decided with this code's "
                    "rules, or profile.json): every run of a GPU model merged to its most conservative "
                    "entry; models the files do not name are kept.")
    parser.add_argument(
        "runs", nargs="+", type=Path, help="report.json or profile.json files written by certify"
    )
    parser.add_argument(
        "--out", type=Path, default=DATA, help="the data file to write (default: %(default)s)"
    )
    args = parser.parse_args(argv)
    try:
        built = build(args.runs, args.out)
    except profile.ProfileError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    args.out.write_text(json.dumps(records.dump(built), indent=1) + "\n")
    print(f"wrote {args.out}: " + ", ".join(gpu.label for gpu in built.profile.gpus))
    return 0


if __name__ == "__main__":
    sys.exit(main())
