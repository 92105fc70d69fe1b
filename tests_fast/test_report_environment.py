"""The report's environment records (qualification/report_model.py) hold what `sage-qual env`
collects (serving/environment.py) field for field: the report keeps its own frozen, schema-bearing
copy, and this test keeps the two from drifting apart."""

import dataclasses

import pytest

from sage_qual.qualification import report_model
from sage_qual.serving import environment


@pytest.mark.parametrize("collected, recorded", [
    (environment.Environment, report_model.EnvironmentRecord),
    (environment.Gpu, report_model.GpuInfo),
], ids=["environment", "gpu"])
def test_the_report_records_every_collected_field(collected, recorded):
    assert [f.name for f in dataclasses.fields(recorded)] == [f.name for f in dataclasses.fields(collected)]
