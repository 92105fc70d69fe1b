"""`sage-qual` command line: one subcommand per module of this package, on top of everything else.

Every command returns an `ExitCode`; bad input prints one line on stderr and exits 2.
"""

from __future__ import annotations

import argparse
import os
import sys

from sage_qual.errors import ExitCode, UsageError
from sage_qual.version import __version__


def build_parser() -> argparse.ArgumentParser:
    from sage_qual.cli import certify, compare, env, fixtures, gate

    parser = argparse.ArgumentParser(prog="sage-qual", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"sage-qual {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for module in (env, fixtures, certify, gate, compare):
        module.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except UsageError as error:
        print(f"sage-qual {args.command}: {error}", file=sys.stderr)
        return ExitCode.USAGE
    except BrokenPipeError:
        # The reader stopped early (`merge --json | head`): not an error, and no traceback at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return ExitCode.OK


if __name__ == "__main__":
    sys.exit(main())
