"""`sage-qual gate` and `sage-qual merge`: the command line of `sage_qual.qualification.gate`."""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from sage_qual import limits
from sage_qual.errors import ExitCode, UsageError
from sage_qual.qualification import gate, junit, pool, report
from sage_qual.qualification.families import FAMILIES, Family, find


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


def _read(path: Path) -> report.Report:
    try:
        return report.load(path)
    except report.ReportError as error:
        raise UsageError(str(error)) from None


def _family(name: str) -> Family:
    try:
        return find(name)
    except KeyError as error:
        raise UsageError(error.args[0]) from None


def _gate(args: argparse.Namespace) -> int:
    family = _family(args.family)
    data = _read(args.report)
    if not data.complete:
        line = report.status_line(data.complete, data.started, data.finished, data.stopped)
        raise UsageError(f"{args.report} is a partial report ({line}): run certify to the end")
    if data.predicted:  # said before anything looks for a GPU: no GPU can make it measured
        raise UsageError(f"{args.report} is a predicted report (certify --emulate: the CPU numerics model, "
                         "no GPU ran), so it cannot enable a family: run `sage-qual certify` on the GPU")
    local = gate.local_fixtures(args.fixtures, family)
    with tempfile.TemporaryDirectory(prefix="sage-qual-gate-") as logs:
        try:
            here = pool.collect_environment(Path(logs) / "environment.log",
                                              limits.STARTUP_TIMEOUT)["environment"]
        except pool.WorkerError as error:
            raise UsageError(str(error)) from None
    if not here["gpus"]:
        raise UsageError("no CUDA GPU is visible here, so no report can be matched to this machine")
    if here["sageattention_problem"]:
        raise UsageError(f"sageattention cannot run here: {here['sageattention_problem']}")
    decision = gate.decide(data, family, here, local, args.require_speedup)
    if decision.code != ExitCode.USAGE:  # not stale: each stored budget against the one derived here
        problem = gate.budget_problem(str(args.report), data, family, here,
                                      gate.local_fixture_files(args.fixtures, family))
        if problem:
            decision = gate.GateDecision(family.name, ExitCode.USAGE, problem)
    if args.junit_xml:
        cases = ([junit.Case("gate", family.name, "error", decision.problem)] if decision.problem else
                 [junit.case(model, d, args.require_speedup) for model, d in decision.gpus])
        junit.write(args.junit_xml, f"sage-qual gate {family.name}", cases)
    if args.json:
        print(json.dumps(decision.as_json(), indent=1))
        return decision.code
    if decision.code == ExitCode.USAGE:
        raise UsageError(decision.problem)
    print("\n".join(decision.lines(args.require_speedup)))
    return decision.code


def _merge(args: argparse.Namespace) -> int:
    rows = gate.merge_rows([(path, _read(path)) for path in args.reports])
    if args.json:
        answer = {"command": "merge", "exit_code": ExitCode.OK, "problem": "", "rows": rows}
        print(json.dumps(answer, indent=1))
    else:
        print(gate.merge_markdown(rows))
    return ExitCode.OK
