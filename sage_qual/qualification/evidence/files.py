"""report.json on disk: its schema file, generated from `report_model`; reading it strictly (`load`,
`from_dict`: every key and type, an older schema version upgraded); and the Writer that keeps the
file current while a run appends results.

report.json is rewritten after every result with "complete": false, and once more at the end with
"complete": true; a run killed halfway leaves a valid, partial report. It holds evidence only: the
verdicts are `decide`'s, drawn when a report is read back.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
from importlib import resources
from pathlib import Path
from typing import Any

from sage_qual import jsonfile, records
from sage_qual.qualification.evidence.report_model import (
    FIX,
    KIND,
    METRIC_NAMES,
    SCHEMA_VERSION,
    Budget,
    Metrics,
    Report,
    ReportError,
)

SCHEMA_FILE = "report_schema.json"


READABLE_VERSIONS = (1, 2, 3, 4, 5)


def schema() -> dict:
    """The committed report_schema.json (a test checks it equals the generated one)."""
    return json.loads(resources.files("sage_qual.qualification.evidence").joinpath(SCHEMA_FILE).read_text())


def write_schema() -> Path:
    """Regenerate report_schema.json from report_model."""
    path = Path(__file__).with_name(SCHEMA_FILE)
    path.write_text(json.dumps(json_schema(), indent=1) + "\n")
    return path


class Writer:
    """Holds the report being built, a `Report` record; every change is written to disk at once,
    atomically, as `records.dump` writes it. What a change adds is checked by the reader's rules
    first (a NaN, a wrong type, a missing detail) and a change that would not read back is refused
    (RecordError), leaving the report as it was. A whole-report dump per appended result would cost
    the parent 52 ms per write at run 13's 655 results (this 2-core CPU, 2026-12-01), so appends
    check only what they add; the rules across results (duplicates) are checked when the run
    concludes, which reads the whole report back."""

    def __init__(self, path: Path, built: Report):
        self.path = Path(path)
        self.lock = threading.Lock()
        with self.lock:
            self._commit(built, records.dump(built))

    def replace(self, **fields) -> None:
        """Top-level flags changed (complete, finished, stopped: strings and booleans, written as
        they are): the end of a run is written even when a result appended before it breaks a rule
        across results, which the conclusion then names."""
        with self.lock:
            self._commit(dataclasses.replace(self.report, **fields), {**self._data, **fields})

    def append(self, position: int, field: str, *items) -> None:
        """Records added to the list `field` (cells, speed, long, span) of the device at `position`
        in `devices`; with no items, an empty list where the field was null (its check began)."""
        with self.lock:
            written = [records.dump(item) for item in items]
            device = self.report.devices[position]
            data = {**self._data, "devices": list(self._data["devices"])}
            data["devices"][position] = {**data["devices"][position],
                                         field: [*(data["devices"][position][field] or []), *written]}
            self._commit(self._with_device(position, **{field: [*(getattr(device, field) or []), *items]}),
                         data)

    def add_shapes(self, entries: dict) -> None:
        """Timed shapes (key -> ShapeEntry) added where the report has none of that key yet."""
        with self.lock:
            new = {key: entry for key, entry in entries.items() if key not in self.report.shapes}
            changed = dataclasses.replace(self.report, shapes={**self.report.shapes, **new})
            self._commit(changed, records.dump(changed))

    def _with_device(self, position: int, **fields) -> Report:
        devices = list(self.report.devices)
        devices[position] = dataclasses.replace(devices[position], **fields)
        return dataclasses.replace(self.report, devices=devices)

    def _commit(self, changed: Report, data: dict) -> None:
        temporary = self.path.with_name(self.path.name + ".tmp")
        temporary.write_text(json.dumps(data, indent=1) + "\n")
        os.replace(temporary, self.path)
        self.report, self._data = changed, data


def json_schema() -> dict:
    """report_schema.json, generated from the classes above."""
    return records.schema(
        Report, f"sage-qual certify report, schema version {SCHEMA_VERSION}",
        "Written by `sage-qual certify` as report.json (generated from "
        "sage_qual/qualification/evidence/report_model.py; do not edit by hand). Evidence only: verdicts are "
        "computed from the cells and timings when the report is read. Non-finite numbers are stored "
        "as null.",
        f"https://sage-qual.invalid/report/{SCHEMA_VERSION}")


def upgrade(data: dict, version: int) -> dict:
    """A report of an older schema `version` as the current one, the same evidence:
    1 -> 2 drops the stored analysis (`gpus`); 2 -> 3 gives every budget each limit, null where the
    older writer had none (judge checks no null limit), and moves a long check's `finite` into its
    metrics, which get each number the same way (no metrics: null); 3 -> 4 names a cell's and a long
    check's `bounds` `budget` and moves a cell's error numbers into its `metrics` (none where it has
    no number and no `finite`: it did not run to the end); 4 -> 5 changes no key: an older report's
    outcomes were judged by conformance alone (`fitness_judged` false), and the reader judges them
    for fitness too (`decide.checked`)."""
    if version == 1:
        data = {k: v for k, v in data.items() if k != "gpus"}
    devices = data.get("devices")
    if isinstance(devices, list):
        data = {**data, "devices": [_upgrade_device(d) if isinstance(d, dict) else d for d in devices]}
    return {**data, "schema_version": SCHEMA_VERSION}


def _upgrade_device(device: dict) -> dict:
    device = dict(device)
    for key, upgraded in (("cells", _upgrade_cell), ("long", _upgrade_long)):
        if isinstance(device.get(key), list):
            device[key] = [upgraded(item) if isinstance(item, dict) else item for item in device[key]]
    return device


def _upgrade_cell(cell: dict) -> dict:
    cell = dict(_upgrade_budget(cell))  # a copy: the caller's report stays as it was read
    if (
        "metrics" in cell
    ):  # already schema 4's shape; a flat number beside it is left for the reader to refuse
        return cell
    numbers = {name: cell.pop(name) for name in METRIC_NAMES if name in cell}  # schema 3 kept them flat
    # A number beside a null `finite` is kept, for the reader to refuse by its path, never dropped.
    measured = any(value is not None for value in numbers.values())
    return {**cell, "metrics": _filled(Metrics, numbers) if measured else None}


def _upgrade_long(check: dict) -> dict:
    check = dict(_upgrade_budget(check))
    moved = {"finite": check.pop("finite")} if "finite" in check else {}
    metrics = check.get("metrics")
    if isinstance(metrics, dict):
        check["metrics"] = {**moved, **_filled(Metrics, metrics)} if metrics else None
    return check


def _upgrade_budget(record: dict) -> dict:
    """`bounds` (schema 1 to 3) as `budget`, with every limit (null where the writer had none); a
    record that has both keeps both, for the reader to refuse."""
    if "bounds" not in record or "budget" in record:
        return record
    rest = {k: v for k, v in record.items() if k != "bounds"}
    return {**rest, "budget": _filled(Budget, record["bounds"])}


def _filled(cls, mapping) -> Any:
    """`mapping` with a null for each of `cls`'s fields it lacks (not a mapping: as it is, for the
    reader to refuse)."""
    if not isinstance(mapping, dict):
        return mapping
    return {**{f.name: None for f in dataclasses.fields(cls) if f.name != "finite"}, **mapping}


def from_dict(data: Any, where: str) -> Report:
    if not isinstance(data, dict) or data.get("kind") != KIND:
        raise ReportError(f'{where}: kind: not a sage-qual report (no "kind": "{KIND}"); give the '
                          "report.json that `sage-qual certify` wrote")
    version = data.get("schema_version")
    if isinstance(version, int) and not isinstance(version, bool) and version > SCHEMA_VERSION:
        raise ReportError(f"{where}: schema_version: {version} is newer than this sage-qual reads "
                          f"({', '.join(map(str, READABLE_VERSIONS))}); upgrade sage-qual")
    if version not in READABLE_VERSIONS or isinstance(version, bool):
        raise ReportError(f"{where}: schema_version: {version!r} is not a report schema version "
                          f"({', '.join(map(str, READABLE_VERSIONS))}); {FIX}")
    if version < SCHEMA_VERSION:
        data = upgrade(data, version)
    try:
        return records.parse(Report, data, where, FIX)
    except records.RecordError as error:
        raise ReportError(str(error)) from None


def load(path) -> Report:
    data = jsonfile.read(path, ReportError, missing="{path}: no report there: run `sage-qual certify` first",
                         unreadable="{path}: cannot be read ({reason}); give a readable report.json",
                         not_json="{path}: not JSON, or cut short ({reason}); " + FIX)
    return from_dict(data, str(path))


