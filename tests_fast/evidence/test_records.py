"""records.dump is records.parse's inverse, and refuses what a reader would refuse."""

import dataclasses
import enum
import json
import math
from pathlib import Path

import pytest

from sage_qual import records
from sage_qual.qualification.evidence import files

RUN13 = Path(__file__).parent.parent.parent / "docs" / "results" / "run13-h200x2"


class Colour(str, enum.Enum):
    RED = "red"


@dataclasses.dataclass
class Inner:
    size: int = dataclasses.field(metadata={"minimum": 1})

    def check(self):
        return [("size", "must be odd")] if self.size % 2 == 0 else []


@dataclasses.dataclass
class Outer:
    name: str
    colour: Colour
    share: float
    inner: list[Inner]
    by_name: dict[str, Inner]
    note: str | None = None


def _outer(**change) -> Outer:
    values = dict(name="a", colour=Colour.RED, share=0.5, inner=[Inner(3)], by_name={"x": Inner(5)})
    return Outer(**{**values, **change})


def test_dump_writes_json_that_parses_back_equal():
    record = _outer(note="kept")
    data = records.dump(record)
    assert data == {"name": "a", "colour": "red", "share": 0.5, "inner": [{"size": 3}],
                    "by_name": {"x": {"size": 5}}, "note": "kept"}
    assert records.parse(Outer, json.loads(json.dumps(data)), "t", "f") == record


@pytest.mark.parametrize("change, key", [
    ({"share": math.nan}, "share"),
    ({"share": "half"}, "share"),
    ({"colour": "blue"}, "colour"),  # not a member of the enum
    ({"inner": [Inner(3), Inner(4)]}, "inner[1]"),  # fails Inner.check
    ({"by_name": {"x": Inner(0)}}, "by_name.x.size"),  # below the minimum
])
def test_dump_refuses_a_record_that_would_not_read_back(change, key):
    with pytest.raises(records.RecordError) as caught:
        records.dump(_outer(**change))
    assert caught.value.key.startswith(key)


def test_dump_takes_instances_only():
    with pytest.raises(TypeError, match="dataclass instance"):
        records.dump(Outer)
    with pytest.raises(TypeError, match="dataclass instance"):
        records.dump({"name": "a"})


@pytest.mark.parametrize("run", ["certify-b", "certify-e"])
def test_a_real_report_round_trips(run):
    path = RUN13 / run / "report.json.gz"
    report = files.load(path)
    assert files.from_dict(json.loads(json.dumps(records.dump(report))), str(path)) == report


@dataclasses.dataclass(frozen=True)
class Frozen:
    sizes: tuple[int, ...] = dataclasses.field(metadata={"minimum": 1, "length": 2})
    inner: tuple[Inner, ...] | None = None

    def __post_init__(self):
        records.tuples(self)


def test_a_frozen_record_holds_tuples_read_or_built():
    built = Frozen([3, 5], [Inner(7)])
    assert built.sizes == (3, 5) and built.inner == (Inner(7),)
    assert records.dump(built) == {"sizes": [3, 5], "inner": [{"size": 7}]}
    read = records.parse(Frozen, {"sizes": [3, 5], "inner": [{"size": 7}]}, "f.json", "fix")
    assert read == built and type(read.sizes) is tuple
    for data, key in (({"sizes": [0, 5]}, "sizes"), ({"sizes": [3]}, "sizes"), ({"sizes": "35"}, "sizes"),
                      ({"sizes": [3, 5], "inner": [{"size": 2}]}, "inner[0].size")):
        with pytest.raises(records.RecordError) as refused:
            records.parse(Frozen, data, "f.json", "fix")
        assert refused.value.key == key
    schema = records.schema(Frozen, "t", "d", "id")["properties"]["sizes"]
    assert schema == {"type": "array", "items": {"type": "integer", "minimum": 1},
                      "minItems": 2, "maxItems": 2}


def test_a_tuple_of_fixed_length_is_not_a_record_type():
    @dataclasses.dataclass(frozen=True)
    class Pair:
        pair: tuple[int, int]

    with pytest.raises(TypeError, match=r"tuple\[T, \.\.\.\] only"):
        records.parse(Pair, {"pair": [1, 2]}, "p.json", "fix")
