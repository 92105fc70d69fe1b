"""The records a verdict travels in hold tuples, not lists (issue 53): one read back from a file or
built in code cannot be changed in place, and `Served` hashes."""

import dataclasses
import typing

import pytest

from sage_qual.qualification.decide.fleet import FleetRow, FleetVerdict
from sage_qual.serving import defaults
from sage_qual.verdicts.profile import Entry, Profile, ProfileGpu
from sage_qual.verdicts.served import Served

RECORDS = [Served, Entry, ProfileGpu, Profile, FleetRow, FleetVerdict]


def _lists(tp) -> bool:
    return typing.get_origin(tp) is list or any(_lists(arg) for arg in typing.get_args(tp))


@pytest.mark.parametrize("record", RECORDS, ids=lambda cls: cls.__name__)
def test_no_field_is_a_list(record):
    hints = typing.get_type_hints(record)
    assert record.__dataclass_params__.frozen
    assert [f.name for f in dataclasses.fields(record) if _lists(hints[f.name])] == []


def test_a_record_built_from_lists_holds_tuples():
    served = Served("sm90-fp8-cuda", 4608, 512, head_dims=[128], layouts=["contiguous"], contexts=[])
    assert (served.head_dims, served.layouts, served.contexts, served.bounds) == \
        ((128,), ("contiguous",), (), ())
    same = Served("sm90-fp8-cuda", 4608, 512, (128,), layouts=("contiguous",), contexts=())
    assert hash(served) == hash(same)


def test_the_built_in_defaults_read_back_as_tuples():
    measured, _ = defaults.read()
    assert type(measured.gpus) is tuple
    served = [e.served for gpu in measured.gpus for e in [gpu.default, *gpu.families.values()] if e.served]
    assert served and all(type(s.head_dims) is tuple and type(s.bounds) is tuple for s in served)
    assert all(isinstance(hash(s), int) for s in served)  # a list inside would raise TypeError
