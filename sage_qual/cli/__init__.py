"""`sage-qual` command line: one subcommand per module of this package, on top of everything else.

Every command returns an `ExitCode`, and that code is what the process exits with, whatever
happens to stdout: a reader that stops early (`gate ... | head -1` under `set -o pipefail`)
never turns "keep off" into "enable". Bad input prints one line on stderr and exits 2; so does
an internal error (the traceback only with --debug). With --json, a refusal is one JSON object
with `exit_code` and `problem` on stdout too.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import textwrap
import traceback

from sage_qual import jsonfile, records
from sage_qual.errors import Answer, ExitCode, UsageError
from sage_qual.version import __version__

# Commands whose exit code is a decision (gate's enable/keep off, compare's same/different, a
# finished or interrupted certify, merge's table of readable reports): it stands when their
# output was cut. The others only print; cut short, they exit as any writer into a closed pipe
# does in a shell: 128 + SIGPIPE.
# What `sage-qual --help` opens with: what the tool is for, in a user's words.
DESCRIPTION = ("Qualify SageAttention on this GPU before an app switches it on: certify the kernels against "
               "real activations, then gate each model family on the report.")
DECIDING = ("gate", "compare", "merge", "certify", "audit")
BROKEN_PIPE = 141


class _Surviving(io.TextIOBase):
    """sys.stdout or sys.stderr that survives its reader going away: the first write or flush that
    finds the pipe closed points the file descriptor at /dev/null (also what the interpreter
    flushes at exit), and the command runs on to its decision."""

    def __init__(self, stream):
        self.stream, self.broken = stream, False
        if hasattr(stream, "reconfigure"):  # a lone surrogate (an undecodable host name) as its escape
            stream.reconfigure(errors="backslashreplace")

    def _guard(self, action) -> None:
        try:
            action()
        except BrokenPipeError:
            self._to_null()

    def _to_null(self) -> None:
        if not self.broken:
            self.broken = True
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, self.stream.fileno())
            os.close(null)

    def write(self, text: str) -> int:
        if not self.broken:
            self._guard(lambda: self.stream.write(text))
        return len(text)

    def flush(self) -> None:
        self._guard(self.stream.flush)

    def fileno(self) -> int:
        return self.stream.fileno()

    def isatty(self) -> bool:
        return self.stream.isatty()

    @property
    def encoding(self):
        return self.stream.encoding

    def writable(self) -> bool:
        return True


def build_parser() -> argparse.ArgumentParser:
    from sage_qual.cli import audit, certify, compare, env, fixtures, gate

    parser = argparse.ArgumentParser(prog="sage-qual", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"sage-qual {__version__}")
    parser.add_argument("--debug", action="store_true",
                        help="on an internal error, print the traceback (default: one line)")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for module in (env, fixtures, certify, gate, compare, audit):
        module.add_parser(subparsers)
    for command in {id(c): c for c in subparsers.choices.values()}.values():  # aliases: once each
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                             help="on an internal error, print the traceback")
        name = command.prog.split()[-1]  # its own name, not an alias
        command.description = textwrap.fill(command.description or _HELP[name], 100)
        codes = "\n".join(f"  {code:<4} {meaning}" for code, meaning in EXIT_CODES[name])
        command.epilog = f"exit codes:\n{codes}"
        command.formatter_class = argparse.RawDescriptionHelpFormatter
    return parser


# Each command's exit codes, as its --help states them (`errors.ExitCode`).
_USAGE = (2, "bad input: one line naming the problem and the fix (--debug: the traceback)")
EXIT_CODES = {
    "env": ((0, "the machine was described"), _USAGE),
    "fixtures": ((0, "listed or shown"), _USAGE),
    "certify": ((0, "a complete report (and, from a GPU run, its profile)"),
                (2, "nothing certified: bad input, no GPU or no usable sageattention, or an --out that\n"
                    "       holds a previous report (--force replaces it)"),
                (130, "stopped by SIGINT or SIGTERM: the report on disk is partial")),
    "gate": ((0, "enable the family here (also 'safe, no speedup' unless --require-speedup)"),
             (1, "keep it off: every reason printed"),
             (2, "cannot decide: no, partial, damaged, edited, predicted or stale report, or no GPU here")),
    "merge": ((0, "the fleet table"), _USAGE),
    "compare": ((0, "the reports serve the same calls, served speedups within --tolerance"),
                (1, "they differ: each difference printed"),
                (2, "unreadable, or reports that cannot be compared (partial, predicted, --quick)")),
    "audit": ((0, "no recorded misses in the folder"),
              (1, "recorded misses: each printed (certify --fixtures FOLDER keeps their variants off)"),
              (2, "bad input: no such folder, or a fixture in it that does not load (named)")),
}
# A command's description where it gives none: its one-line help.
_HELP = {"env": "torch, CUDA, each GPU and the kernel it gets, sageattention and its extensions.",
         "fixtures": "List and inspect activation fixtures.",
         "gate": "Whether to enable a model family on this machine, from a certify report.",
         "compare": "Whether two certify reports of one machine serve the same calls.",
         "audit": "The misses the wrapper's audit recorded in production, from the folder it saved them in."}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    streams = sys.stdout, sys.stderr
    guarded = [_Surviving(s) if _is_pipe_or_file(s) else s for s in streams]
    sys.stdout, sys.stderr = guarded
    try:
        code = _run(args)
        sys.stdout.flush()
    finally:
        sys.stdout, sys.stderr = streams
    cut = getattr(guarded[0], "broken", False)
    if cut and args.command not in DECIDING and code == ExitCode.OK:
        return BROKEN_PIPE
    return code


def _is_pipe_or_file(stream) -> bool:
    """A real stdout (the command line), not a test's capture or a caller's StringIO."""
    try:
        stream.fileno()
    except (AttributeError, OSError, ValueError):
        return False
    return True


def _run(args: argparse.Namespace) -> int:
    try:
        from sage_qual.qualification.run import options  # torch-free
        options.test_hook()  # a garbled hook is named here, not as a worker's JSONDecodeError
        return int(args.func(args))
    except UsageError as error:
        return _refuse(args, str(error))
    except KeyboardInterrupt:
        return _refuse(args, "interrupted", ExitCode.INTERRUPTED)
    except Exception as error:  # any other failure is a bug, and "cannot decide"
        missing = _missing_dependency(error)
        if missing:  # not our bug: the interpreter running us lacks what pyproject.toml requires
            return _refuse(args, missing)
        if getattr(args, "debug", False):
            traceback.print_exc()
        where = traceback.extract_tb(error.__traceback__)[-1]
        problem = (f"internal error: {type(error).__name__}: {_one_line(str(error))} (at "
                   f"{os.path.basename(where.filename)}:{where.lineno}); this is a bug in sage-qual"
                   + ("" if getattr(args, "debug", False) else ": --debug prints the traceback"))
        return _refuse(args, problem)


DEPENDENCIES = ("torch", "numpy", "safetensors", "packaging")  # pyproject.toml's


def _missing_dependency(error: Exception) -> str:
    """What to tell a user whose interpreter lacks one of our declared dependencies ("" for any
    other error): a job script that runs another Python than the venv's (the Slurm recipe's
    PYTHON, say) fails this way."""
    root = (getattr(error, "name", None) or "").split(".")[0]
    if not isinstance(error, ModuleNotFoundError) or root not in DEPENDENCIES:
        return ""
    return (f"{root} is not installed in the Python running sage-qual ({sys.executable}): run sage-qual "
            f"with the venv it was installed in, or install {root} there (README, Quick start)")


def _refuse(args: argparse.Namespace, problem: str, code: int = ExitCode.USAGE) -> int:
    """The one line on stderr, and the same answer in the machine outputs asked for: one JSON
    object on stdout (--json), an error test case (--junit-xml)."""
    problem = _one_line(problem).encode("utf-8", "backslashreplace").decode("utf-8")
    print(f"sage-qual {args.command}: {problem}", file=sys.stderr)
    if getattr(args, "json", False):
        print(jsonfile.line(records.dump(Answer(args.command, code, problem))))
    if getattr(args, "junit_xml", None):
        from sage_qual.qualification.render import junit

        try:
            junit.write(args.junit_xml, f"sage-qual {args.command}",
                        [junit.Case(f"sage-qual {args.command}", "cannot decide", junit.Outcome.ERROR,
                                    problem)])
        except UsageError as error:
            print(f"sage-qual {args.command}: {error}", file=sys.stderr)
    return code


def _one_line(text: str) -> str:
    return " ".join(text.split())


if __name__ == "__main__":
    sys.exit(main())
