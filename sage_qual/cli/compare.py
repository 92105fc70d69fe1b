"""`sage-qual compare A B`: do two certify reports of one machine give the same thresholds?

Both reports are decided afresh (`verdict.decide`); per GPU model in both, and per family and the
default entry, the verdicts, variants and certified execution contexts must match and the query
and key thresholds lie within --tolerance of each other (relative to the larger). Exit 0 when they
do, 1 when not (each difference printed), 2 on unreadable input.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from sage_qual import records
from sage_qual.errors import Answer, ExitCode, UsageError
from sage_qual.qualification import report, verdict

DEFAULT_TOLERANCE = 0.10


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("compare", help="whether two certify reports give the same verdicts and "
                                                   "thresholds (within a tolerance)")
    parser.add_argument("first", type=Path, metavar="REPORT")
    parser.add_argument("second", type=Path, metavar="REPORT")
    parser.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE,
                        help=f"largest relative threshold difference (default {DEFAULT_TOLERANCE:g})")
    parser.add_argument("--json", action="store_true",
                        help="one JSON object on stdout: exit_code, problem, entries, differences")
    parser.set_defaults(func=_compare)


def _decide(path: Path) -> dict[str, verdict.GpuDecision]:
    try:
        data = report.load(path)
    except report.ReportError as error:
        raise UsageError(str(error)) from None
    if not data.complete:
        raise UsageError(f"{path}: complete: false: a partial report has no thresholds; run certify to "
                         "the end")
    return {gpu.model: gpu for gpu in verdict.decide(data)}


def _apart(a: int | None, b: int | None, tolerance: float) -> bool:
    if a is None or b is None:
        return a != b
    return abs(a - b) > tolerance * max(a, b)


def _entry(decision: verdict.FamilyDecision) -> str:
    """verdict, variant, thresholds and the contexts certified; '-' for what a verdict without a
    variant lacks."""
    thresholds = ("-" if decision.min_query_tokens is None else
                  f"{decision.min_query_tokens}/{decision.min_key_tokens}")
    contexts = "" if decision.contexts is None else f" contexts [{', '.join(decision.contexts)}]"
    return f"{decision.verdict.value} {decision.variant or '-'} {thresholds}{contexts}"


def differences(first: dict[str, verdict.GpuDecision], second: dict[str, verdict.GpuDecision],
                tolerance: float) -> tuple[list[str], list[str]]:
    """(one line per entry compared, the differences)."""
    lines, found = [], []
    for model in sorted(set(first) | set(second)):
        if model not in first or model not in second:
            found.append(f"{model}: in only one report")
            continue
        a_gpu, b_gpu = first[model], second[model]
        b_entries = {d.label: d for d in b_gpu.families + [b_gpu.default]}
        for a in a_gpu.families + [a_gpu.default]:
            b = b_entries.get(a.label)
            if b is None:
                found.append(f"{model} {a.label}: in only one report")
                continue
            line = f"{model} {a.label}: {_entry(a)} vs {_entry(b)}"
            lines.append(line)
            if (a.verdict, a.variant, a.contexts) != (b.verdict, b.variant, b.contexts) or \
                    _apart(a.min_query_tokens, b.min_query_tokens, tolerance) or \
                    _apart(a.min_key_tokens, b.min_key_tokens, tolerance):
                found.append(line)
    return lines, found


@dataclass(frozen=True)
class CompareAnswer(Answer):
    """`compare --json`: each entry's line, and those that differ beyond the tolerance."""
    tolerance: float
    entries: list[str]
    differences: list[str]


def _compare(args: argparse.Namespace) -> int:
    if not 0 <= args.tolerance < 1:
        raise UsageError(f"--tolerance is {args.tolerance:g}: give a fraction from 0 to below 1 (0.1 = 10 %)")
    lines, found = differences(_decide(args.first), _decide(args.second), args.tolerance)
    code = ExitCode.KEEP_OFF if found else ExitCode.OK
    if args.json:
        answer = CompareAnswer("compare", code, "", args.tolerance, lines, found)
        print(json.dumps(records.dump(answer), indent=1))
        return code
    print("\n".join(lines))
    if found:
        print(f"{len(found)} difference(s) beyond {args.tolerance:.0%}:")
        print("\n".join(f"  {line}" for line in found))
        return ExitCode.KEEP_OFF
    print(f"same verdicts, thresholds within {args.tolerance:.0%}")
    return ExitCode.OK
