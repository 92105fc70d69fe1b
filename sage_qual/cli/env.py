"""`sage-qual env`: what this machine can run, and why not."""

from __future__ import annotations

import argparse

from sage_qual.errors import ExitCode


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "env", aliases=["doctor"],
        help="torch, CUDA, each GPU and the kernel it gets, sageattention and its extensions")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(func=_env)


def _env(args: argparse.Namespace) -> int:
    from sage_qual.serving import environment  # torch: only when the command runs

    env = environment.collect()
    print(environment.to_json(env) if args.json else environment.render_text(env, contexts=True))
    return ExitCode.OK
