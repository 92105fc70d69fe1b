"""Which fixtures, families and variants a run or a gate takes: named, read and checked once, and what
a --quick run leaves out (with the known failures of what it left out), before anything runs.

certify, `gate` and the pytest plugin select here, so the three never disagree on what a directory
holds: a fixture that does not load, two of one name or one with a non-finite input is refused with
the file named, whoever asked.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sage_qual import records
from sage_qual.errors import UsageError
from sage_qual.fixtures import fileformat, known
from sage_qual.fixtures.audit_misses import recorded_miss
from sage_qual.qualification import families as families_mod
from sage_qual.qualification.evidence import report_model
from sage_qual.qualification.names import select_families


def fixture_dirs(directories: list[str] | None) -> list[str]:
    """The directories given, or the repository's fixtures/ when none were. Folders of the wrapper's
    audit alone (every fixture in them recorded by it: a miss, a drift or a site's worst call) run
    beside the shipped fixtures: what production saw is evidence about the family, not a replacement
    for its fixtures."""
    shipped = fileformat.shipped_dir()
    shipped = [str(shipped)] if shipped else []
    if directories is None:
        return shipped
    if directories and all(_holds_audit_misses(d) for d in directories):
        return shipped + [d for d in directories if d not in shipped]
    return directories


def _holds_audit_misses(directory: str) -> bool:
    """Whether every fixture of the folder was recorded by the wrapper's audit (False for a folder
    that does not load: `read_fixtures` names its problem)."""
    try:
        paths = fileformat.list_fixtures(directory)
        return bool(paths) and all({"audit", "worst"} & set(fileformat.load_fixture(p).source) for p in paths)
    except fileformat.FixtureError:
        return False


@dataclass(frozen=True)
class LeftOut:
    """A fixture a --quick run left out, and its known failures: what the committed H200 reports
    measured on that very file (`sage_qual.fixtures.known`)."""
    fixture: str
    family: str
    failures: list[str]


@dataclass(frozen=True)
class Selection:
    """What a run takes, read and checked: the families, the fixture directories, the fixtures of
    those families (with --quick, the smallest per family and those with a known failure) and what
    --quick left out."""
    families: list[families_mod.Family]
    fixture_dirs: list[str]
    fixtures: list[fileformat.Fixture]
    left_out: list[LeftOut]


def select(families: list[str] | None, directories: list[str] | None, quick: bool) -> Selection:
    """The families named (all when none), and the fixtures of the directories (the shipped ones when
    none) that count for them; family-less fixtures too when no family was named. --quick keeps the
    smallest per family and every fixture with a known failure (`known.failed`)."""
    chosen = select_families(families)
    directories = fixture_dirs(directories)
    taken = [f for f in read_fixtures(directories)
             if families is None or any(families_mod.counts_for(family, f.family) for family in chosen)]
    if not quick:
        return Selection(chosen, directories, taken, [])
    smallest: dict[str, fileformat.Fixture] = {}
    for fixture in sorted(taken, key=lambda f: (f.q.numel() + 2 * f.k.numel(), f.name)):
        if fixture.mask is None:  # one every variant runs (a masked call runs on masked kernels only)
            smallest.setdefault(families_mod.normalize(fixture.family), fixture)
    # Every file a committed H200 report saw a variant fail stays in: a quick run that left them out
    # printed "pass" in all 64 cells of its table (issue 40).
    names = {f.name for f in smallest.values()} | {f.name for f in taken if known.failed(f)}
    ran = sorted((f for f in taken if f.name in names), key=lambda f: f.name)
    return Selection(chosen, directories, ran, [_left_out(f) for f in taken if f.name not in names])


def read_fixtures(directories: list[str]) -> list[fileformat.Fixture]:
    """Every fixture of the directories, loaded and checked (`load_checked`)."""
    paths = []
    for directory in directories:
        try:
            paths += fileformat.list_fixtures(directory)
        except fileformat.FixtureError as error:
            raise UsageError(str(error)) from None
    return load_checked(paths)


def load_checked(paths) -> list[fileformat.Fixture]:
    """The fixture files, loaded; UsageError naming the file for one that does not load, is not
    finite, or shares its name with another (certify, gate and the pytest plugin read through here)."""
    fixtures, seen = [], {}
    for path in paths:
        try:
            fixture = fileformat.load_fixture(path)
        except fileformat.FixtureError as error:
            raise UsageError(str(error)) from None
        check_finite(fixture, path)
        try:
            recorded_miss(fixture.source, str(path))  # an audit's record is read whole, or refused here
        except records.RecordError as error:
            raise UsageError(str(error)) from None
        if fixture.name in seen:
            raise UsageError(f"two fixtures named {fixture.name}: {seen[fixture.name]} and {path}")
        seen[fixture.name] = path
        fixtures.append(fixture)
    return fixtures


def family_fixtures(directories: list[str] | None,
                    family: families_mod.Family) -> dict[str, fileformat.Fixture]:
    """The fixtures that count for one family, by name (what `gate` re-derives budgets on)."""
    return {f.name: f for f in read_fixtures(fixture_dirs(directories))
            if families_mod.counts_for(family, f.family)}


def check_finite(fixture: fileformat.Fixture, path) -> None:
    """The float32 reference needs finite q, k and v: with NaN or infinity in them, accuracy is
    measured on the finite rows only and a broken kernel can pass on what is left."""
    for name in ("q", "k", "v"):
        tensor = getattr(fixture, name)
        bad = int((~torch.isfinite(tensor)).sum())
        if bad:
            raise UsageError(f"{path}: tensor {name}: {bad} of {tensor.numel()} values are not finite; the "
                             "reference needs finite inputs: re-create the fixture from finite activations")


def _left_out(fixture: fileformat.Fixture) -> LeftOut:
    """A fixture --quick left out, with what the committed H200 reports measured on it."""
    failures = known.failures(fixture)
    owner = families_mod.family_of(fixture.family)
    return LeftOut(fixture.name, owner.name if owner else families_mod.normalize(fixture.family), failures)


def fixture_record(fixture: fileformat.Fixture) -> report_model.FixtureRecord:
    """What a report stores of a fixture file: certify writes it, gate compares a report's copy with it."""
    return report_model.FixtureRecord(
        name=fixture.name, family=fixture.family, kind=report_model.FixtureKind(fixture.kind),
        dtype=report_model.DType(str(fixture.dtype).replace("torch.", "")), q=list(fixture.q.shape),
        k=list(fixture.k.shape), sha256=fixture.sha256, provenance=fixture.provenance,
        bounds={report_model.AccuracyClass(name): report_model.PublishedBound(**bound)
                for name, bound in fixture.bounds.items()}, masked=fixture.mask is not None,
        audit=recorded_miss(fixture.source, str(fixture.path)))
