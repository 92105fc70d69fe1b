"""`sage-qual gate` and `sage-qual merge`: the command line of `sage_qual.qualification.decide.gate`.

gate's decision, refusals included, is `gate.gate()`'s: this module parses arguments and prints.
`--json` and `--junit-xml` answer on every path, an internal error included: exit 2 (cannot
decide) with one line, its traceback only under `--debug`.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

from sage_qual import jsonfile, records
from sage_qual.errors import Answer, ExitCode, UsageError
from sage_qual.qualification.decide import checked, fleet, gate
from sage_qual.qualification.evidence.report_model import Report, ReportError
from sage_qual.qualification.families import FAMILIES
from sage_qual.qualification.render import junit
from sage_qual.qualification.render.fleet import merge_markdown
from sage_qual.qualification.render.gate import lines as gate_lines


def add_parser(subparsers) -> None:
    command = subparsers.add_parser(
        "gate", help="exit 0 to enable a family on this machine, 1 to keep it off, 2 when the report "
                     "cannot decide")
    command.add_argument("--family", required=True, help=f"one of: {', '.join(f.name for f in FAMILIES)}")
    command.add_argument("--report", type=Path, default=Path("sage-qual-report/report.json"),
                         help="the report.json certify wrote (default: %(default)s)")
    command.add_argument("--require-speedup", action="store_true",
                         help="keep off a family that passes accuracy but whose measured speed serves none "
                              "of its shapes ('safe, no speedup')")
    command.add_argument("--fixtures", nargs="+", metavar="DIR",
                         help="fixture directories (default: shipped)")
    command.add_argument("--json", action="store_true", help="the decision as one JSON object on stdout")
    command.add_argument("--junit-xml", type=Path, metavar="FILE",
                         help="also write JUnit XML: one test case per GPU model here")
    command.set_defaults(func=_gate)
    merge = subparsers.add_parser(
        "merge", help="one table of verdicts across GPUs and hosts from reports",
        description="One table of verdicts across GPUs and hosts. merge has no fixture files, so it "
                    "trusts each report's stored budgets; `sage-qual gate` re-derives them.")
    merge.add_argument("reports", nargs="+", type=Path, metavar="REPORT")
    merge.add_argument("--json", action="store_true",
                       help="one JSON object (exit_code, problem, rows) instead of a Markdown table")
    merge.set_defaults(func=_merge)


def _read(path: Path) -> Report:
    try:
        return checked.load(path)
    except ReportError as error:
        raise UsageError(str(error)) from None


def _gate(args: argparse.Namespace) -> int:
    def this_machine():
        from sage_qual.qualification.run import options

        absent = options.gpu_absent()  # known without torch or a worker: 0.3 s instead of 2.9 s here
        if absent:
            raise UsageError(gate.no_gpu_problem(absent))
        # A worker: torch, only once a report was read.
        from sage_qual.qualification.run import worker_executor

        return worker_executor.this_machine()

    try:
        decision = gate.gate(args.report, args.family, this_machine, args.fixtures, args.require_speedup)
    except Exception as error:  # a bug, or a machine no one foresaw: still an answer, exit 2
        if getattr(args, "debug", False):  # the command line's --debug (sage_qual/cli/__init__.py)
            traceback.print_exc()
        message = f"internal error: {type(error).__name__}: {error}".splitlines()[0]
        decision = gate.GateDecision(args.family, ExitCode.USAGE, message + " (--debug shows where)")
    if args.junit_xml:
        if decision.problem:
            cases = [junit.Case("gate", decision.family, junit.Outcome.ERROR, decision.problem)]
        else:
            cases = [junit.case(model, d, args.require_speedup) for model, d in decision.gpus]
        junit.write(args.junit_xml, f"sage-qual gate {decision.family}", cases)
    if args.json:
        print(jsonfile.line(records.dump(decision.answer())))
        return decision.code
    if decision.problem:
        print(f"sage-qual gate: {decision.problem}", file=sys.stderr)
        return decision.code
    print("\n".join(gate_lines(decision, args.require_speedup)))
    return decision.code


@dataclass(frozen=True)
class MergeAnswer(Answer):
    """`merge --json`: one row per GPU model of the reports."""
    rows: list[fleet.FleetRow]


def _merge(args: argparse.Namespace) -> int:
    rows = fleet.merge_rows([(path, _read(path)) for path in args.reports])
    if args.json:
        print(jsonfile.line(records.dump(MergeAnswer("merge", ExitCode.OK, "", rows))))
    else:
        print(merge_markdown(rows))
    return ExitCode.OK
