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
