"""`sage-qual` command line: one subcommand per job, each in its own module.

Every command returns an exit code; bad input prints one line on stderr and exits 2.
"""

from __future__ import annotations

import argparse
import sys

from . import __version__


class UsageError(Exception):
    """Bad input: printed as one line, exit code 2."""


def _env(args: argparse.Namespace) -> int:
    from . import environment

    env = environment.collect()
    print(environment.to_json(env) if args.json else environment.render_text(env))
    return 0


def _add_env(subparsers) -> None:
    parser = subparsers.add_parser(
        "env", aliases=["doctor"],
        help="torch, CUDA, each GPU and the kernel it gets, sageattention and its extensions")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(func=_env)


def build_parser() -> argparse.ArgumentParser:
    from . import certify, fixtures_cli, gate

    parser = argparse.ArgumentParser(prog="sage-qual", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"sage-qual {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for add in (_add_env, fixtures_cli.add_parser, certify.add_parser, gate.add_parser):
        add(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except UsageError as error:
        print(f"sage-qual {args.command}: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
