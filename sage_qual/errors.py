"""The errors a user sees and the exit codes of every `sage-qual` command, in one place.

Every command exits with an `ExitCode`. Bad input (a missing or malformed file, an unknown name,
an out-of-range number) is a `UsageError`: one line on stderr naming the problem and the fix,
exit 2, never a traceback and never the code that means "keep off". With --json a command prints
one `Answer` (or a record extending it) on stdout, written by `records.dump`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class ExitCode(enum.IntEnum):
    OK = 0
    ENABLE = 0  # gate: the family may be switched on here
    KEEP_OFF = 1  # gate: the evidence says no; every reason is printed
    USAGE = 2  # bad input, or the gate cannot decide from what it was given
    INTERRUPTED = 130  # certify stopped by SIGINT/SIGTERM: the report on disk is partial


class UsageError(Exception):
    """Bad input: printed as one line, exit code 2."""


@dataclass(frozen=True)
class Answer:
    """What every `--json` answer starts with: the command, its exit code and, with code 2, the problem."""
    command: str
    exit_code: int
    problem: str
