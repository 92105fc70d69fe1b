"""Reading back the JSON files sage-qual writes (reports, profiles).

Each file names its "kind" and "schema_version". The callers keep their own exception and
messages, given here as format strings.
"""

from __future__ import annotations

import json
from pathlib import Path


def read(path, error: type[Exception], *, unreadable: str, not_json: str, missing: str | None = None):
    """The JSON value in the file at `path`. When the file cannot be read or is not JSON: `error`
    with `missing` (no such file, where given), `unreadable` or `not_json`, formatted with {path}
    and {reason}."""
    try:
        return json.loads(Path(path).read_text())
    except OSError as problem:
        message = missing if missing is not None and isinstance(problem, FileNotFoundError) else unreadable
        raise error(message.format(path=path, reason=problem.strerror or problem)) from None
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
