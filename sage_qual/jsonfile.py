"""Reading back the JSON files sage-qual writes (reports, profiles), plain or gzip-compressed (the
committed evidence under docs/results/ is kept as report.json.gz), and the one-line JSON answers of
every `--json` command.

Each file names its "kind" and "schema_version". The callers keep their own exception and
messages, given here as format strings.
"""

from __future__ import annotations

import gzip
import json
import zlib

from sage_qual.limits import MAX_JSON_BYTES

GZIP_MAGIC = b"\x1f\x8b"


def read(path, error: type[Exception], *, unreadable: str, not_json: str, missing: str | None = None):
    """The JSON value in the file at `path`, gzip-compressed or not (told by its first bytes, not its
    name). When the file cannot be read, holds more than MAX_JSON_BYTES (decompressed) or is not
    JSON: `error` with `missing` (no such file, where given), `unreadable` or `not_json`, formatted
    with {path} and {reason}."""
    try:
        with open(path, "rb") as file:
            compressed = file.read(2) == GZIP_MAGIC
            file.seek(0)
            with (gzip.GzipFile(fileobj=file) if compressed else file) as content:
                raw = content.read(MAX_JSON_BYTES + 1)  # no more than the limit, whatever the file says
    except (OSError, EOFError, zlib.error) as problem:
        message = missing if missing is not None and isinstance(problem, FileNotFoundError) else unreadable
        damaged = isinstance(problem, (EOFError, zlib.error, gzip.BadGzipFile))
        reason = f"a damaged gzip file ({problem})" if damaged else problem.strerror or problem
        raise error(message.format(path=path, reason=reason)) from None
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

