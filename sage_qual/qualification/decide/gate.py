"""`sage-qual gate` and `sage-qual merge`: decisions and a fleet table from certify reports.

Both take their verdicts from `verdict.decide()`, the function report.md and certify's summary
use, so the four always say the same word. gate exits 0 to enable a family on this machine
("enable"; also "safe, no speedup" unless --require-speedup: a profile then serves nothing, so
switching the family on changes nothing), 1 to keep it off (every reason printed), 2 when it
cannot decide: no report, a partial, damaged, edited or predicted one, no GPU or no usable
sageattention here, or a stale one: made on a machine that differs from this one in a way
`verdicts.machine.RULES` says binds (the rules the wrapper's profile matcher applies), or with other
fixtures than this machine has.

The whole decision is here, not in the command line: `gate()` reads the report, this machine and
its fixtures and calls `decide()`, which gives every refusal as a `GateDecision` with a `problem`
(never an exception), so every caller, `--json` and `--junit-xml` included, gets an answer.

A cell is judged against the budget stored with it, so `decide()` re-derives that budget from this
machine's fixture file (`budgets.budget`) for every cell it decides on and refuses a report whose
stored budget is looser (`budget_problem`): an edited budget cannot turn a failing cell into a pass.
merge has no fixture files and trusts the stored budgets, as `decide_stored()` does.

Importing this module imports no torch: the fixture loader and the numerics model are imported
where a fixture is read or a budget derived.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from sage_qual import records
from sage_qual.errors import ExitCode, UsageError
from sage_qual.kernels.variants import VARIANTS, gpu_label
from sage_qual.qualification.decide import budget_check, checked, verdict
from sage_qual.qualification.decide.verdict import FamilyDecision, Verdict
from sage_qual.qualification.evidence.report_model import Report, ReportError
from sage_qual.qualification.families import Family, counts_for, find
from sage_qual.verdicts import machine
from sage_qual.verdicts.env_record import EnvironmentRecord, Reason
from sage_qual.verdicts.served import Served

if TYPE_CHECKING:
    from sage_qual.fixtures.fileformat import Fixture


def models(here: EnvironmentRecord) -> set[str]:
    """The GPU models of a machine, as labels (`gpu_label`)."""
    return {gpu_label(gpu.name, gpu.capability) for gpu in here.gpus}


def stale(data: Report, family: Family, here: EnvironmentRecord, local: Mapping[str, str]) -> Staleness:
    """How the report's machine differs from this one for this family, by the rules the wrapper's
    profile matcher applies too (`verdicts.machine.RULES`): what keeps it from applying (`binding`, the
    fixtures included), and the differences it applies despite, said beside the verdict (`allowed`)."""
    binding_found, near_found = [], []
    for gpu in here.gpus:
        model = gpu_label(gpu.name, gpu.capability)
        measured = [d for d in data.devices if gpu_label(d.name, d.capability) == model]
        if not measured:
            binding_found.append(f"{model} here is not in the report")
            continue
        found = machine.differences(machine.from_record(data.environment, measured[0]),
                                    machine.from_record(here, gpu))
        binding_found += [d.text for d in machine.binding(found) if d.text not in binding_found]
        near_found += [d.text for d in machine.allowed(found) if d.text not in near_found]
    recorded = {f.name: f.sha256 for f in data.fixtures if counts_for(family, f.family)}
    misses, recordings = data.recorded_misses(), data.audit_recordings()
    for name in sorted(set(recorded) | set(local)):
        if name not in local and name in recordings:
            # What the audit recorded stands without its file: certifying without it would drop it.
            what = ("a miss the audit recorded" if name in misses
                    else "the worst call of a site the audit kept")
            near_found.append(f"fixture {name}, {what}, is in the report but not here (its cells are taken "
                              f"as stored; pass its folder with --fixtures to check them)")
        elif name not in local:
            binding_found.append(f"fixture {name} is in the report but not here")
        elif name not in recorded:
            binding_found.append(f"fixture {name} is here but not in the report")
        elif recorded[name] != local[name]:
            binding_found.append(f"fixture {name} changed (sha256 {local[name][:12]} here, "
                                 f"{recorded[name][:12]} in the report)")
    return Staleness(binding_found, near_found)


@dataclass(frozen=True)
class Staleness:
    binding: list[str]  # why the report does not apply here
    allowed: list[str]  # what differs that the rules allow (a near match, or only said): gate says them


@dataclass(frozen=True)
class GateDecision:
    """What gate says for one family on this machine: an exit code and, per GPU model here, the
    verdict of verdict.decide() (its lines: `render.gate`)."""
    family: str
    code: int
    problem: str = ""  # with code 2: why no decision is possible
    gpus: list[tuple[str, FamilyDecision]] = field(default_factory=list)
    differences: list[str] = field(default_factory=list)  # what differs that the rules allow (`stale`)

    def answer(self) -> GateAnswer:
        """The `gate --json` answer: each GPU's verdict with its `Served` unchanged."""
        return GateAnswer(self.family, self.code, self.problem, [
            GpuAnswer(model, d.verdict, d.served, d.results.certified, d.reasons,
                      VARIANTS[d.served.variant].provider if d.served else "") for model, d in self.gpus],
            differences=self.differences)


@dataclass(frozen=True)
class GpuAnswer:
    """One GPU model here in `gate --json`: its verdict, what a profile serves (null: nothing) and
    why not more."""
    gpu: str
    verdict: Verdict
    served: Served | None
    certified: list[str]
    reasons: list[Reason]
    provider: str = ""  # whose kernel `served` names (`kernels.providers`); "" when nothing is served


# Version 2 (2026-12-03): what a GPU serves moved into its `served` object (the fields of
# `verdicts.served.Served`); version 1, which had no `version` key, held them flat on the GPU's entry.
ANSWER_VERSION = 2


@dataclass(frozen=True)
class GateAnswer:
    """`sage-qual gate --json`: the exit code, the problem (with code 2) or a verdict per GPU model."""
    family: str
    exit_code: int
    problem: str
    gpus: list[GpuAnswer]
    version: int = field(default=ANSWER_VERSION, metadata={
        "description": "2: each GPU's served range in `served`; absent (1): its fields flat"})
    differences: list[str] = field(default_factory=list, metadata={
        "description": "how this machine differs from the report's in ways the rules allow (a near match, or "
                       "only said: verdicts.machine.RULES); the report applies"})


def report_problem(source: str, data: Report, family: Family) -> str:
    """Why this report cannot decide for the family on any machine; empty when it can."""
    problem = checked.undecidable(data, source)
    if problem:
        return problem
    if family.name not in data.options.families:
        return f"the report did not certify {family.name} (it ran: {', '.join(data.options.families)})"
    return ""


def no_gpu_problem(why: str = "") -> str:
    """gate's refusal on a machine without a GPU (`why`: how that is known, when it is)."""
    known = f" ({why})" if why else ""
    return (f"no CUDA GPU is visible here{known}, so no report can be matched to this machine; "
            "`sage-qual merge REPORT` gives a report's verdicts on any machine")


def machine_problem(here: EnvironmentRecord) -> str:
    """Why no report can be matched to this machine; empty when one can."""
    if not here.gpus:
        return no_gpu_problem()
    if here.sageattention_problem:
        return f"sageattention cannot run here: {here.sageattention_problem}"
    return ""


def decide_stored(data: Report, family: Family, here: EnvironmentRecord, local: Mapping[str, str],
                  require_speedup: bool, source: str = "report.json") -> GateDecision:
    """The decision with the report's stored budgets taken as they stand (as merge takes them):
    every refusal of `decide()` but the budget re-derivation. `local`: this machine's fixtures that
    count for the family, name -> sha256."""
    problem = report_problem(source, data, family) or machine_problem(here)
    return _decided(problem, data, family, here, local, require_speedup)


def _decided(problem: str, data: Report, family: Family, here: EnvironmentRecord, local: Mapping[str, str],
             require_speedup: bool) -> GateDecision:
    """The decision once the report's and the machine's problem is known (`problem`)."""
    differences = Staleness([], []) if problem else stale(data, family, here, local)
    if differences.binding:
        problem = (f"stale report: {'; '.join(differences.binding)}. Run `sage-qual certify` on this machine "
                   "again")
    if problem:
        return GateDecision(family.name, ExitCode.USAGE, problem)
    models_here = models(here)
    gpus = [(gpu.model, gpu.family(family.name)) for gpu in verdict.decide(data) if gpu.model in models_here]
    kept_off = any(d.verdict == Verdict.KEEP_OFF or (d.verdict == Verdict.NO_SPEEDUP and require_speedup)
                   for _, d in gpus)
    return GateDecision(family.name, ExitCode.KEEP_OFF if kept_off else ExitCode.ENABLE, gpus=gpus,
                        differences=differences.allowed)


def decide(data: Report, family: Family, here: EnvironmentRecord, fixtures: Mapping[str, Fixture],
           require_speedup: bool, source: str = "report.json", problem: str | None = None) -> GateDecision:
    """gate's answer for one family on this machine (`here`: its environment;
    `fixtures`: this machine's fixtures that count for the family, loaded): every refusal, the
    verdicts, and each stored budget against the one derived here. `problem`: the report's, when the
    caller asked `report_problem` already (gate() does, before it looks for a GPU)."""
    local = {name: fixture.sha256 for name, fixture in fixtures.items()}
    if problem is None:
        problem = report_problem(source, data, family) or copies_problem(source, data, fixtures)
    decision = _decided(problem or machine_problem(here), data, family, here, local, require_speedup)
    if decision.code != ExitCode.USAGE:
        problem = (budget_check.budget_problem(source, data, family, models(here), fixtures)
                   or budget_check.long_budget_problem(source, data, family, models(here)))
        if problem:
            return GateDecision(family.name, ExitCode.USAGE, problem)
    return decision


# What a report copies from a fixture file, besides its bytes' sha256: the evidence is the file at hand.
COPIED_FIELDS = ("family", "kind", "dtype", "q", "k", "bounds", "provenance", "masked", "audit")


def copies_problem(source: str, data: Report, fixtures: Mapping[str, Fixture]) -> str:
    """Why the report's copy of a fixture file at hand is not what that file says ('' when every copy
    is): with the same sha256 the file's fields cannot differ, so a difference is an edit of the
    report (a recorded miss removed or moved, a bound raised). A changed file is `stale`'s to say."""
    from sage_qual.qualification import selection

    for stored in data.fixtures:
        fixture = fixtures.get(stored.name)
        if fixture is None or fixture.sha256 != stored.sha256:
            continue
        copy, here = records.dump(stored), records.dump(selection.fixture_record(fixture))
        for name in COPIED_FIELDS:
            copied, found = copy.get(name), here.get(name)
            while isinstance(copied, dict) and isinstance(found, dict) and copied != found:  # the first key
                key = next(k for k in sorted(set(copied) | set(found)) if copied.get(k) != found.get(k))
                name, copied, found = f"{name}.{key}", copied.get(key), found.get(key)
            if copied != found:
                return (f"{source}: fixtures: {stored.name!r}.{name} is {_shown(copied)} in the report but "
                        f"{_shown(found)} in {fixture.path} (the same file, sha256 {fixture.sha256[:12]}): "
                        "the report's copy was edited; certify again")
    return ""


def _shown(value) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 120 else text[:117] + "..."


def family_fixtures(fixture_dirs: list[str] | None, family: Family) -> Mapping[str, Fixture]:
    """This machine's fixtures that count for the family, loaded (`selection` imports torch: only once
    a report that can decide was read)."""
    from sage_qual.qualification import selection

    return selection.family_fixtures(fixture_dirs, family)


def gate(report_path: Path, family_name: str, machine: Callable[[], EnvironmentRecord],
         fixture_dirs: list[str] | None = None, require_speedup: bool = False) -> GateDecision:
    """`sage-qual gate`: read the report, this machine (`machine()`: `run.worker_executor.this_machine`
    collects it in a worker; UsageError when it cannot) and its fixtures, and decide. Bad input and every
    refusal come back as a decision with a problem."""
    try:
        family = find(family_name)
    except KeyError as error:
        return GateDecision(family_name, ExitCode.USAGE, error.args[0])
    try:
        data = checked.load(report_path)
    except ReportError as error:
        return GateDecision(family.name, ExitCode.USAGE, str(error))
    problem = report_problem(str(report_path), data, family)  # before a worker looks for a GPU
    if problem:
        return GateDecision(family.name, ExitCode.USAGE, problem)
    try:
        here = machine()  # first: a machine without a GPU is refused before the fixtures import torch
        fixtures = family_fixtures(fixture_dirs, family)
    except UsageError as error:
        return GateDecision(family.name, ExitCode.USAGE, str(error))
    return decide(data, family, here, fixtures, require_speedup, str(report_path), problem="")
