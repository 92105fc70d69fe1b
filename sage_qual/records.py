"""Typed JSON records: dataclasses read strictly from parsed JSON, and the JSON Schema they imply.

One description serves both: `parse(cls, data, ...)` checks every key and type of `data` against the
dataclass `cls` (nested dataclasses, enums, lists, tuples `tuple[T, ...]` (a JSON list), string-keyed
dicts, Optional, Literal) and builds it; `dump(record)` is its inverse, the JSON object of a record,
checked by the same rules so a producer cannot write what a reader would refuse; `schema(cls)`
writes the rules as JSON Schema 2020-12. A field with a default may be absent; one without must be
present; unknown keys are refused. Numbers must be finite (Python's json module reads NaN and
Infinity, JSON itself has neither). Field metadata adds `description`, `minimum` and `pattern`; a
dataclass may define `check(self) -> list[tuple[str, str]]` for rules across fields, returning
(key, problem) pairs. A frozen record calls `tuples(self)` in `__post_init__` to hold tuples only.

A problem is a `RecordError` naming the key path, the problem and the fix, in one line.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import re
import types
import typing
from typing import Any, Literal, Union


class RecordError(ValueError):
    """One line: where (file), which key, what is wrong, and the fix."""

    def __init__(self, where: str, key: str, problem: str, fix: str):
        self.where, self.key, self.problem, self.fix = where, key, problem, fix
        super().__init__(f"{where}: {key or '(top level)'}: {problem}; {fix}")


def _json_type_name(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return f"the string {value!r}"[:80]
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _describe(tp) -> str:
    origin = typing.get_origin(tp)
    if tp is type(None):
        return "null"
    if tp is bool:
        return "true or false"
    if tp is int:
        return "an integer"
    if tp is float:
        return "a number"
    if tp is str:
        return "a string"
    if tp is Any:
        return "any JSON value"
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "one of " + ", ".join(repr(m.value) for m in tp)
    if dataclasses.is_dataclass(tp):
        return "an object"
    if origin in (list, tuple):
        return "a list"
    if origin is dict:
        return "an object"
    if origin is Literal:
        return " or ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    return str(tp)


def _is_tuple(tp) -> bool:
    """`tuple[T, ...]`, or it or null."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        return any(_is_tuple(option) for option in typing.get_args(tp))
    return typing.get_origin(tp) is tuple


def tuples(record) -> None:
    """For a frozen record's `__post_init__`: a list given for a `tuple[T, ...]` field is stored as a
    tuple, so a record built from lists equals the one read back, hashes, and cannot be changed."""
    for f, hint in _fields(type(record)):
        value = getattr(record, f.name)
        if isinstance(value, list) and _is_tuple(hint):
            object.__setattr__(record, f.name, tuple(value))


@functools.cache
def _fields(cls) -> tuple[tuple[dataclasses.Field, Any], ...]:
    """Each field of the dataclass with its resolved type (resolving is slow: done once per class)."""
    hints = typing.get_type_hints(cls)
    return tuple((f, hints[f.name]) for f in dataclasses.fields(cls))


class _Reader:
    def __init__(self, where: str, fix: str):
        self.where, self.fix = where, fix

    def fail(self, key: str, problem: str):
        raise RecordError(self.where, key, problem, self.fix)

    def value(self, tp, data, key: str):
        origin = typing.get_origin(tp)
        if origin in (Union, types.UnionType):
            options = typing.get_args(tp)
            if data is None and type(None) in options:
                return None
            concrete = [o for o in options if o is not type(None)]
            if len(concrete) == 1:
                return self.value(concrete[0], data, key)
            for option in concrete:
                try:
                    return self.value(option, data, key)
                except RecordError:
                    continue
            self.fail(key, f"is {_json_type_name(data)}, expected {_describe(tp)}")
        if tp is Any:
            return data
        if origin is Literal:
            if data not in typing.get_args(tp) or isinstance(data, bool):
                self.fail(key, f"is {_json_type_name(data)}, expected {_describe(tp)}")
            return data
        if tp is bool:
            if not isinstance(data, bool):
                self.fail(key, f"is {_json_type_name(data)}, expected true or false")
            return data
        if tp is int:
            if isinstance(data, bool) or not isinstance(data, int):
                self.fail(key, f"is {_json_type_name(data)}, expected an integer")
            return data
        if tp is float:
            if isinstance(data, bool) or not isinstance(data, (int, float)):
                self.fail(key, f"is {_json_type_name(data)}, expected a number")
            if not math.isfinite(data):
                self.fail(key, f"is {data}, expected a finite number")
            return float(data)
        if tp is str:
            if not isinstance(data, str):
                self.fail(key, f"is {_json_type_name(data)}, expected a string")
            return data
        if isinstance(tp, type) and issubclass(tp, enum.Enum):
            try:
                return tp(data)
            except ValueError:
                self.fail(key, f"is {_json_type_name(data)}, expected {_describe(tp)}")
        if origin in (list, tuple):
            if not isinstance(data, list):
                self.fail(key, f"is {_json_type_name(data)}, expected a list")
            item, *rest = typing.get_args(tp)
            if origin is tuple and rest != [Ellipsis]:
                raise TypeError(f"records reads tuple[T, ...] only, not {tp!r}: a length is metadata")
            return origin(self.value(item, x, f"{key}[{i}]") for i, x in enumerate(data))
        if origin is dict:
            if not isinstance(data, dict):
                self.fail(key, f"is {_json_type_name(data)}, expected an object")
            keys, item = typing.get_args(tp)
            paths = {k: f"{key}.{k}" if key else k for k in data}
            return {self.value(keys, k, paths[k]): self.value(item, x, paths[k]) for k, x in data.items()}
        if dataclasses.is_dataclass(tp):
            return self.record(tp, data, key)
        raise TypeError(f"records cannot read {tp!r}")

    def record(self, cls, data, key: str):
        if not isinstance(data, dict):
            self.fail(key, f"is {_json_type_name(data)}, expected an object")
        fields = _fields(cls)
        unknown = sorted(set(data) - {f.name for f, _ in fields})
        if unknown:
            self.fail(f"{key}.{unknown[0]}" if key else unknown[0], "unknown key")
        values = {}
        for f, hint in fields:
            name = f.name
            path = f"{key}.{name}" if key else name
            if name not in data:
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    self.fail(path, "missing")
                continue
            values[name] = self.value(hint, data[name], path)
            self._constraints(f, values[name], path)
        built = cls(**values)
        for sub, problem in getattr(built, "check", lambda: [])():
            self.fail(f"{key}.{sub}" if key and sub else (sub or key), problem)
        return built

    def _constraints(self, f: dataclasses.Field, value, path: str) -> None:
        minimum, maximum = f.metadata.get("minimum"), f.metadata.get("maximum")
        items = value if isinstance(value, (list, tuple)) else [value]
        for x in items:
            if not isinstance(x, (int, float)) or isinstance(x, bool):
                continue
            if minimum is not None and x < minimum:
                self.fail(path, f"is {x}, expected at least {minimum}")
            if maximum is not None and x > maximum:
                self.fail(path, f"is {x}, expected at most {maximum}")
        pattern = f.metadata.get("pattern")
        if pattern is not None and isinstance(value, str) and not re.fullmatch(pattern, value):
            self.fail(path, f"{value!r} does not match {pattern}")
        length = f.metadata.get("length")
        if length is not None and isinstance(value, (list, tuple)) and len(value) != length:
            self.fail(path, f"has {len(value)} items, expected {length}")


def parse(cls, data, where: str, fix: str):
    """`data` (parsed JSON) as an instance of the dataclass `cls`; RecordError on the first problem."""
    return _Reader(where, fix).record(cls, data, "")


def dump(record) -> dict:
    """The JSON object of the dataclass instance `record` (enums as their values, every field written),
    such that `parse(type(record), dump(record), ...) == record`. A record that would not read back
    (a NaN, a wrong type, a failed `check()`) is a RecordError naming the key: a producer's bug."""
    if not dataclasses.is_dataclass(record) or isinstance(record, type):
        raise TypeError(f"records.dump takes a dataclass instance, not {type(record).__name__}")
    data = _plain(record)
    parse(type(record), data, f"a {type(record).__name__} being written",
          "the producer built it from a wrong value (a sage-qual bug)")
    return data


def finite_or_none(values: dict) -> dict:
    """Numbers as a record stores them: JSON has no NaN or infinity, so such a number is null (the
    record's `finite` says what happened)."""
    return {k: (None if isinstance(x, float) and not math.isfinite(x) else x) for k, x in values.items()}


def _plain(value):
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [_plain(x) for x in value]
    if isinstance(value, dict):
        return {_plain(k): _plain(x) for k, x in value.items()}
    return value


# JSON Schema ------------------------------------------------------------------------------------
def schema(cls, title: str, description: str, schema_id: str) -> dict:
    """JSON Schema 2020-12 of the dataclass `cls`, each nested dataclass once under $defs."""
    defs: dict[str, dict] = {}
    root = _schema_of(cls, defs)
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": schema_id, "title": title,
            **defs.pop(root["$ref"].rsplit("/", 1)[1]), "description": description,
            "$defs": dict(sorted(defs.items()))}


def _schema_of(tp, defs: dict) -> dict:
    origin = typing.get_origin(tp)
    if tp is type(None):
        return {"type": "null"}
    if tp is Any:
        return {}
    if tp is bool:
        return {"type": "boolean"}
    if tp is int:
        return {"type": "integer"}
    if tp is float:
        return {"type": "number"}
    if tp is str:
        return {"type": "string"}
    if origin is Literal:
        values = list(typing.get_args(tp))
        return {"const": values[0]} if len(values) == 1 else {"enum": values}
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return {"enum": [m.value for m in tp]}
    if origin in (Union, types.UnionType):
        return {"anyOf": [_schema_of(a, defs) for a in typing.get_args(tp)]}
    if origin in (list, tuple):
        return {"type": "array", "items": _schema_of(typing.get_args(tp)[0], defs)}
    if origin is dict:
        keys, item = typing.get_args(tp)
        named = {} if keys is str else {"propertyNames": _schema_of(keys, defs)}
        return {"type": "object", **named, "additionalProperties": _schema_of(item, defs)}
    if dataclasses.is_dataclass(tp):
        name = tp.__name__
        if name not in defs:
            defs[name] = {}  # placeholder: recursive references stop here
            hints = typing.get_type_hints(tp)
            properties, required = {}, []
            for f in dataclasses.fields(tp):
                prop = _schema_of(hints[f.name], defs)
                target = prop["items"] if prop.get("type") == "array" else prop
                for bound in ("minimum", "maximum"):
                    if bound in f.metadata:
                        target[bound] = f.metadata[bound]
                if "pattern" in f.metadata:
                    prop["pattern"] = f.metadata["pattern"]
                if "length" in f.metadata:
                    prop.update(minItems=f.metadata["length"], maxItems=f.metadata["length"])
                if "description" in f.metadata:
                    prop["description"] = f.metadata["description"]
                properties[f.name] = prop
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    required.append(f.name)
            definition = {"type": "object"}
            if tp.__doc__ and not tp.__doc__.startswith(name + "("):
                definition["description"] = " ".join(tp.__doc__.split())
            definition.update(required=required, additionalProperties=False, properties=properties)
            definition.update(getattr(tp, "SCHEMA_EXTRA", {}))
            defs[name] = definition
        return {"$ref": f"#/$defs/{name}"}
    raise TypeError(f"no schema for {tp!r}")
