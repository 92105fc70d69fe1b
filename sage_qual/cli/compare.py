"""`sage-qual compare A B`: do two certify reports of one machine serve the same calls?

Both reports are decided afresh (`verdict.decide`). Per GPU model and per family (and the default
entry), everything a verdict serves is compared: the verdict, the variant, the head sizes, the
verified upper bounds, layouts, execution contexts and bounds (the calls kept on torch) must be
equal. Speed is judged as it is measured: over the shapes either report serves, the geometric mean
of the second report's median speedup over the first's must lie within --tolerance of 1 (default:
the run-to-run spread, `speed.RUN_TO_RUN_SPREAD`). The length a family is served from is not
compared on its own: it sits where the speedup is flat near the bar and moved one refinement step
(11,648 against 12,672 tokens) between identical runs (docs/runs/run29_speed_spread.txt), while the
speedups it serves agreed. A GPU model, a family or a variant that ran in one report only is a
difference too. The software each ran on (sageattention, its build, torch, CUDA, Triton, the driver)
is said where it differs, not counted. Exit 0 when nothing differs, 1 when something does (each
difference printed), 2 on unreadable input and on reports that cannot be compared: partial,
predicted (certify --emulate) or --quick runs (their thresholds are no profile's).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

from sage_qual import jsonfile, records
from sage_qual.errors import Answer, ExitCode, UsageError
from sage_qual.qualification.decide import checked, verdict
from sage_qual.qualification.evidence.report_model import ReportError, ShapeSpec
from sage_qual.qualification.measure.speed import RUN_TO_RUN_SPREAD
from sage_qual.verdicts import machine
from sage_qual.verdicts.env_record import EnvironmentRecord
from sage_qual.verdicts.served import Served

DEFAULT_TOLERANCE = RUN_TO_RUN_SPREAD


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("compare", help="whether two certify reports serve the same calls: "
                                                   "verdicts, variants, ranges, head sizes, layouts and "
                                                   "contexts, served speed within a tolerance")
    parser.add_argument("first", type=Path, metavar="REPORT")
    parser.add_argument("second", type=Path, metavar="REPORT")
    parser.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE,
                        help="largest relative change of the served speedup (geometric mean over the "
                             f"shapes either report serves; default {DEFAULT_TOLERANCE:g}, the run-to-run "
                             "spread measured on the H200)")
    parser.add_argument("--json", action="store_true",
                        help="one JSON object on stdout: exit_code, problem, entries, differences, software")
    parser.set_defaults(func=_compare)


@dataclass(frozen=True)
class Decided:
    """One report's decisions per GPU model, the shapes its speedups are keyed by, and the software
    it ran on."""
    gpus: dict[str, verdict.GpuDecision]
    shapes: dict[str, ShapeSpec]
    environment: EnvironmentRecord


def software_changes(first: Decided, second: Decided) -> list[str]:
    """One line per difference of the machines the two reports ran on (`verdicts.machine`), of a GPU
    model both ran on. A rebuild of one source gives another build fingerprint (runs 31 and 33,
    docs/results/), so every difference is said, none counted: the verdicts decide whether the two
    serve the same calls."""
    common = [model for model in first.gpus if model in second.gpus] or [None]
    gpus = [d.gpus[common[0]] if common[0] else next(iter(d.gpus.values()), None) for d in (first, second)]
    if None in gpus:
        return []
    machines = [machine.from_record(d.environment, gpu) for d, gpu in zip((first, second), gpus, strict=True)]
    return [d.between() for d in machine.differences(*machines)]


def _decide(path: Path) -> Decided:
    try:
        data = checked.load(path)
    except ReportError as error:
        raise UsageError(str(error)) from None
    problem = checked.undecidable(data, str(path))
    if problem:
        raise UsageError(problem)
    return decided(data)


def decided(data) -> Decided:
    """A report read back (`checked.load`) as compare sees it."""
    return Decided({gpu.model: gpu for gpu in verdict.decide(data)},
                   {key: entry.shape for key, entry in data.shapes.items()}, data.environment)


def _entry(decision: verdict.FamilyDecision) -> str:
    """The verdict, the variant and what it serves (`Served.text`); '-' for what a verdict without a
    variant lacks."""
    served = decision.served
    return f"{decision.verdict.value} {served.variant} {served.text()}" if served else \
        f"{decision.verdict.value} - -"


def _bound_limits(decision: verdict.FamilyDecision) -> list[tuple[str, int]]:
    """What a decision's bounds keep on torch; their reasons' words are not compared."""
    return [(bound.side, bound.below) for bound in decision.served.bounds] if decision.served else []


def _serves(decision: verdict.FamilyDecision, shape: ShapeSpec) -> bool:
    served = decision.served
    if served is None or shape.head_dim not in served.head_dims:
        return False
    return (served.min_query_tokens <= shape.q_tokens <= (served.max_query_tokens or math.inf)
            and served.min_key_tokens <= shape.kv_tokens <= (served.max_key_tokens or math.inf))


def served_speed_change(a: verdict.FamilyDecision, b: verdict.FamilyDecision, first: Decided, second: Decided,
                        model: str) -> float | None:
    """The geometric mean, over the shapes both reports timed that either decision serves, of the
    second report's median speedup of the served variant over the first's; None when none."""
    ratios = []
    for key, shape in first.shapes.items():
        if second.shapes.get(key) != shape or not (_serves(a, shape) or _serves(b, shape)):
            continue
        old = first.gpus[model].speedups.get((a.variant, key))
        new = second.gpus[model].speedups.get((b.variant, key))
        if old and new and old[1] > 0 and new[1] > 0:
            ratios.append(new[1] / old[1])
    return math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else None


# How each field of `Served` is compared: the thresholds by the served speedups, the bounds by what they
# keep on torch (not their reasons' words), every other field exactly, named in these words (a field
# added to Served is compared exactly under its own name: none can be forgotten).
BY_SPEED = ("min_query_tokens", "min_key_tokens")
WORDS = {"head_dims": "head dims", "max_query_tokens": "upper bound", "max_key_tokens": "upper bound",
         "masks": "masked calls"}
EXACT = {f.name: WORDS.get(f.name, f.name) for f in dataclasses.fields(Served)
         if f.name not in BY_SPEED and f.name != "bounds"}


def changed(a: verdict.FamilyDecision, b: verdict.FamilyDecision, change: float | None,
            tolerance: float) -> list[str]:
    """What differs between two decisions of one entry, in words ([]: nothing beyond `tolerance`)."""
    if a.verdict != b.verdict:
        return [f"verdict {a.verdict.value} vs {b.verdict.value}"]
    found = [] if (a.served is None) == (b.served is None) else ["what is served"]
    if a.served and b.served:
        found = list(dict.fromkeys(said for name, said in EXACT.items()
                                   if str(getattr(a.served, name)) != str(getattr(b.served, name))))
    if _bound_limits(a) != _bound_limits(b):
        found.append("calls kept on torch")
    if change is not None and abs(math.log(change)) > math.log1p(tolerance):
        found.append(f"served speedup x{change:.3f}")
    return found


@dataclass(frozen=True)
class Comparison:
    """One entry (a GPU model's family, or its default) in both reports."""
    where: str  # "NVIDIA H200 (sm_90) FLUX.1"
    first: str  # `_entry` of each
    second: str
    change: float | None  # the served speedup's ratio, second over first (None: not comparable)
    changed: list[str]  # what differs beyond the tolerance, in words ([]: nothing)

    @property
    def line(self) -> str:
        """The whole entry on one line (compare --json's `entries` and `differences`)."""
        speed = "" if self.change is None else f" (served speedup x{self.change:.3f})"
        return f"{self.where}: {self.first} vs {self.second}{speed}"

    def short(self) -> list[str]:
        """One short line, and under a difference its two sides in full."""
        speed = "" if self.change is None else f", served speedup x{self.change:.3f}"
        if not self.changed:
            return [f"{self.where}: no difference{speed}"]
        return [f"{self.where}: DIFFERS: {', '.join(self.changed)}", f"    first:  {self.first}",
                f"    second: {self.second}"]


def verdict_differences(first: Decided, second: Decided,
                        tolerance: float) -> tuple[list[Comparison], list[str]]:
    """(every entry compared, every difference as one line: a GPU model or a variant in one report
    only, then each entry that differs, whole)."""
    compared, found = [], []
    for model in sorted(set(first.gpus) | set(second.gpus)):
        if model not in first.gpus or model not in second.gpus:
            found.append(f"{model}: in only one report")
            continue
        a_gpu, b_gpu = first.gpus[model], second.gpus[model]
        ran = [{name for name, status in gpu.variants.items() if status.ran} for gpu in (a_gpu, b_gpu)]
        found += [f"{model}: variant {name} ran in only one report" for name in sorted(ran[0] ^ ran[1])]
        a_entries = {d.label: d for d in a_gpu.families + [a_gpu.default]}
        b_entries = {d.label: d for d in b_gpu.families + [b_gpu.default]}
        for label in [*a_entries, *(name for name in b_entries if name not in a_entries)]:
            a, b = a_entries.get(label), b_entries.get(label)
            if a is None or b is None:
                found.append(f"{model} {label}: in only one report")
                continue
            change = served_speed_change(a, b, first, second, model) if a.variant == b.variant else None
            compared.append(Comparison(f"{model} {label}", _entry(a), _entry(b), change,
                                       changed(a, b, change, tolerance)))
    return compared, found + [c.line for c in compared if c.changed]


@dataclass(frozen=True)
class CompareAnswer(Answer):
    """`compare --json`: each entry's line, and those that differ beyond the tolerance."""
    tolerance: float
    entries: list[str]
    differences: list[str]
    software: list[str]  # what the two ran on that differs (said, not a difference)


def _compare(args: argparse.Namespace) -> int:
    if not 0 <= args.tolerance < 1:
        raise UsageError(f"--tolerance is {args.tolerance:g}: give a fraction from 0 to below 1 (0.1 = 10 %)")
    first, second = _decide(args.first), _decide(args.second)
    compared, found = verdict_differences(first, second, args.tolerance)
    software = software_changes(first, second)
    code = ExitCode.KEEP_OFF if found else ExitCode.OK
    if args.json:
        entries = [c.line for c in compared]
        answer = CompareAnswer("compare", code, "", args.tolerance, entries, found, software)
        print(jsonfile.line(records.dump(answer)))
        return code
    if software:
        print(f"ran on other software: {'; '.join(software)}")
    print("\n".join(line for c in compared for line in c.short()))
    if found:
        short = [line for line in found if line not in {c.line for c in compared}]
        short += [f"{c.where}: {', '.join(c.changed)}" for c in compared if c.changed]
        print(f"{len(found)} difference(s) beyond {args.tolerance:.0%}:")
        print("\n".join(f"  {line}" for line in short))
        return ExitCode.KEEP_OFF
    print("same verdicts, variants, ranges, layouts and contexts; served speedups within "
          f"{args.tolerance:.0%}")
    return ExitCode.OK
