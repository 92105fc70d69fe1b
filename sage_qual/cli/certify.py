"""`sage-qual certify`: the command line of `sage_qual.qualification.run.run.certify`."""

from __future__ import annotations

import argparse
import contextlib
import shlex
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

from sage_qual import jsonfile, limits, records
from sage_qual.errors import Answer, ExitCode, UsageError
from sage_qual.qualification.run import options


def _split(values: list[str] | None) -> list[str] | None:
    """`--variants a b` and `--variants a,b` both work."""
    if not values:
        return None
    return [item for value in values for item in value.split(",") if item]


def folder(text: str) -> Path:
    """--out's folder; an empty name would write into the current folder."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty: name the folder certify writes into (default: "
                                         "sage-qual-report)")
    return Path(text)


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "certify", help="run every variant on every fixture and a speed sweep; write report and profile",
        description="Run every runnable variant on every fixture, and a speed sweep, on each GPU.")
    parser.add_argument("--out", type=folder, default=Path("sage-qual-report"),
                        help="output directory (default: %(default)s); one that holds a report.json is "
                             "refused unless --force")
    parser.add_argument("--force", action="store_true",
                        help="write into an --out that holds a previous run's report, replacing it")
    parser.add_argument("--devices", default="all", help="GPU indices, e.g. 0,1, or all (default: all)")
    parser.add_argument("--variants", nargs="+", help="variant names (default: all)")
    parser.add_argument("--families", nargs="+", help="families to certify (default: all)")
    parser.add_argument("--fixtures", nargs="+", metavar="DIR", help="fixture directories (default: shipped)")
    parser.add_argument("--quick", action="store_true",
                        help="smallest fixture per family and each fixture with a known failure, short sweep")
    parser.add_argument("--timeout", type=float, default=limits.TASK_TIMEOUT,
                        help="seconds a task may run before its worker is killed "
                             f"(default {limits.TASK_TIMEOUT:g})")
    parser.add_argument("--junit-xml", type=Path, metavar="FILE",
                        help="also write JUnit XML: one test case per GPU model and family")
    parser.add_argument("--json", action="store_true",
                        help="one JSON object on stdout (exit_code, problem, report, complete); the "
                             "summary goes to stderr")
    parser.add_argument("--emulate", action="store_true",
                        help="no GPU: predict every variant on the fixtures with the CPU numerics model "
                             "(report marked predicted, no speed; gate refuses it)")
    parser.add_argument("--target", metavar="NAME",
                        help="qualify an integration instead of the variants: wrapper, wrapper:VARIANT, "
                             "sageattn, diffusers:BACKEND or module:function (docs/targets.md)")
    parser.set_defaults(func=_command)


@dataclass(frozen=True)
class CertifyAnswer(Answer):
    """`certify --json`: where the report is and whether the run completed."""
    report: str
    complete: bool


def _command(args: argparse.Namespace) -> int:
    if not args.json:
        return _certify(args)
    with contextlib.redirect_stdout(sys.stderr):  # stdout holds the one JSON object
        code = _certify(args)
    answer = CertifyAnswer("certify", code, "", str(args.out / "report.json"), code == ExitCode.OK)
    print(jsonfile.line(records.dump(answer)))
    return code


def _certify(args: argparse.Namespace) -> int:
    if args.target is not None and (args.emulate or args.variants):
        raise UsageError("--target qualifies one integration: leave out --emulate and --variants")
    subject = (options.Integration(args.target) if args.target is not None
               else options.Variants(_split(args.variants)))
    if args.emulate and args.timeout != limits.TASK_TIMEOUT:  # a number nothing reads would be a silent no
        raise UsageError(f"--timeout {args.timeout:g} with --emulate: it starts no worker to time out; leave "
                         "out --timeout")
    executor = options.InProcess() if args.emulate else options.Workers(args.devices, args.timeout)
    request = options.RunRequest(out=args.out, subject=subject, executor=executor,
                                 families=_split(args.families), fixture_dirs=args.fixtures, quick=args.quick,
                                 junit_xml=args.junit_xml, command="sage-qual " + shlex.join(sys.argv[1:]),
                                 force=args.force)
    request.check()  # a bad name or number is refused before torch is imported (1.6 s here)
    request.check_gpu_visible()  # and a machine without a GPU: 0.2 s instead of 7.5 s here
    if isinstance(executor, options.Workers):
        from sage_qual.qualification.run import pool

        pool.start_zygote()  # its imports beside this process's
    from sage_qual.qualification.run import run  # torch: only when a command runs

    return _until_stopped(run.certify, request)


def _until_stopped(run_certify, options) -> int:
    """Run with SIGTERM turned into KeyboardInterrupt, which the run answers with a partial report."""

    def terminate(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        written = run_certify(options)
    finally:
        signal.signal(signal.SIGTERM, previous)
    return ExitCode.OK if written.complete else ExitCode.INTERRUPTED
