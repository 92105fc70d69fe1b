"""`sage-qual audit FOLDER`: the misses the wrapper's audit recorded in a folder, for a person or a CI job."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from sage_qual import jsonfile, records
from sage_qual.errors import Answer, ExitCode, UsageError
from sage_qual.fixtures.audit_misses import AUDIT_PROVENANCE, RecordedMiss, recorded_miss


@dataclass(frozen=True)
class FolderMiss:
    """One recorded miss: its fixture (certify --fixtures FOLDER runs it), family and the miss."""
    fixture: str
    path: str
    family: str
    miss: RecordedMiss


@dataclass(frozen=True)
class AuditAnswer(Answer):
    """`sage-qual audit --json`: the folder's recorded misses, oldest first, and the names of its other
    fixtures (not recorded by the audit: listed, never judged)."""
    folder: str = ""
    misses: list[FolderMiss] = field(default_factory=list)
    others: list[str] = field(default_factory=list)


SCHEMA_FILE = "docs/audit_schema.json"  # `schema()` as committed; a fast test checks they agree


def schema() -> dict:
    """The JSON Schema of `sage-qual audit --json`."""
    return records.schema(AuditAnswer, "sage-qual audit --json",
                          "The misses the wrapper's audit recorded in a folder: exit_code 0 none, 1 some, "
                          "2 bad input (problem says why).", "https://sage-qual.invalid/audit/1")


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("audit", help="list the misses the wrapper's audit recorded in a folder")
    parser.add_argument("folder", help="the folder given to fixtures.recorder.AuditFolder")
    parser.add_argument("--json", action="store_true", help="one JSON object (docs/audit.md has its schema)")
    parser.set_defaults(func=_audit)


def read(folder: str) -> AuditAnswer:
    """The folder's recorded misses; a UsageError naming the file for one that does not load."""
    from sage_qual.qualification import selection  # torch: only when the command runs

    misses, others = [], []
    for fixture in selection.read_fixtures([folder]):  # a file that does not load is a UsageError
        miss = recorded_miss(fixture.source, str(fixture.path))
        if miss is None and fixture.provenance.startswith(AUDIT_PROVENANCE):
            raise UsageError(f"{fixture.path}: source.audit: missing, where its provenance says the "
                             "audit recorded it: the file was edited; re-record it with the wrapper's audit, "
                             "or take it out of the folder")
        if miss is None:
            others.append(fixture.name)
        else:
            misses.append(FolderMiss(fixture.name, str(fixture.path), fixture.family, miss))
    misses.sort(key=lambda found: (found.miss.recorded, found.fixture))
    code = ExitCode.KEEP_OFF if misses else ExitCode.OK
    return AuditAnswer("audit", code, "", folder, misses, sorted(others))


def _audit(args: argparse.Namespace) -> int:
    answer = read(args.folder)
    if args.json:
        print(jsonfile.line(records.dump(answer)))
        return answer.exit_code
    if not answer.misses:
        print(f"no recorded misses in {answer.folder}")
    else:
        print(f"{len(answer.misses)} recorded misses in {answer.folder} (certify --fixtures {answer.folder} "
              "runs them beside the shipped fixtures):")
    for found in answer.misses:
        print(f"  {found.fixture} [{found.family}, recorded]: {found.miss.variant}: {found.miss.reason()}"
              + (f"; {found.miss.call}, slice {found.miss.slice}" if found.miss.call else ""))
    if answer.others:
        print(f"  no miss recorded (the worst calls the audit kept, or fixtures of others), not judged: "
              f"{', '.join(answer.others)}")
    return answer.exit_code

