"""Which evidence a report holds once: every evidence record class declares its IDENTITY (the fields
that name one result: a cell's variant and fixture, a timing's kernel and shape, a context check's
variant), and a device holds one record of each identity. Read from the records' types, so a new
kind of evidence is covered without a list of kinds (issue 43: a second context check was read
last-wins, a passing copy after a failing one served the kernel under CUDA-graph capture)."""

from __future__ import annotations

import dataclasses


def evidence_lists(device) -> list[tuple[str, list]]:
    """(field name, records) for every list of evidence records the device (a dataclass) holds: its
    fields whose records declare an IDENTITY."""
    found = []
    for item in dataclasses.fields(device):
        value = getattr(device, item.name)
        if isinstance(value, list) and value and hasattr(value[0], "IDENTITY"):
            found.append((item.name, value))
    return found


def identity(record) -> str:
    """"sm90-fp8-cuda on flux1_outlier": the first field of its IDENTITY on the others (a shape key
    by key)."""
    def text(value) -> str:
        if dataclasses.is_dataclass(value):
            return " ".join(f"{k}={getattr(v, 'value', v)}" for k, v in sorted(vars(value).items()))
        return str(value)

    first, *rest = (text(getattr(record, name)) for name in record.IDENTITY)
    return " on ".join([first, " ".join(rest)]) if rest else first


def duplicate(device) -> tuple[str, str] | None:
    """(key, problem) for the second record of one identity; None when each is held once. With two,
    the verdict would depend on which one is read."""
    for what, records_ in evidence_lists(device):
        first: dict[str, int] = {}
        for m, record in enumerate(records_):
            key = identity(record)
            if key in first:
                names = ", ".join(type(record).IDENTITY)
                return (f"{what}[{m}]", f"a second result for {key} (the first is {what}[{first[key]}]): "
                                        f"one result per {names}")
            first[key] = m
    return None
