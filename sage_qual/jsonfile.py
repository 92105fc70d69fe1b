"""Reading back the JSON files sage-qual writes (reports, profiles), and the one-line JSON answers
of every `--json` command.

Each file names its "kind" and "schema_version". The callers keep their own exception and
messages, given here as format strings.
"""

from __future__ import annotations

import json

from sage_qual.limits import MAX_JSON_BYTES


def read(path, error: type[Exception], *, unreadable: str, not_json: str, missing: str | None = None):
    """The JSON value in the file at `path`. When the file cannot be read, is larger than
    MAX_JSON_BYTES or is not JSON: `error` with `missing` (no such file, where given), `unreadable`
    or `not_json`, formatted with {path} and {reason}."""
    try:
        with open(path, "rb") as file:
            raw = file.read(MAX_JSON_BYTES + 1)  # no more than the limit, whatever the file says its size is
    except OSError as problem:
        message = missing if missing is not None and isinstance(problem, FileNotFoundError) else unreadable
        raise error(message.format(path=path, reason=problem.strerror or problem)) from None
    if len(raw) > MAX_JSON_BYTES:
        raise error(unreadable.format(path=path, reason=(
            f"more than {MAX_JSON_BYTES // 2**20} MiB, the most sage-qual reads from a file it wrote "
            "(a full report is under 1 MiB)")))
    try:
        return json.loads(raw)
    except ValueError as problem:
        raise error(not_json.format(path=path, reason=problem)) from None


def check(data, where, kind: str, schema_version: int, error: type[Exception], *,
          wrong_kind: str, wrong_version: str) -> dict:
    """`data` when it is a dict of this kind and schema version. Otherwise `error` with `wrong_kind`
    or `wrong_version`, formatted with {where}, {kind}, {found} (the version in `data`) and
    {expected}."""
    if not isinstance(data, dict) or data.get("kind") != kind:
        raise error(wrong_kind.format(where=where, kind=kind))
    found = data.get("schema_version")
    if found != schema_version:
        raise error(wrong_version.format(where=where, found=found, expected=schema_version))
    return data


def line(data) -> str:
    """`data` as one line of JSON: what every `--json` answer prints, so that answers appended to one
    file read back one object per line (examples/fleet/certify-one.sh collects the gate's so)."""
    return json.dumps(data)

