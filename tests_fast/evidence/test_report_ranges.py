"""Numbers a report cannot hold: an error, norm ratio or byte count below zero, or a cosine outside
[-1, 1] (with float32's rounding room), would pass every limit on its side, so reading refuses them;
a real report's numbers, a cosine of 1.0000001 among them, still read."""

import copy
import dataclasses
import gzip
import json
from pathlib import Path

import pytest

from sage_qual.qualification.decide import checked
from sage_qual.qualification.evidence import report_model

METRICS = {f.name for f in dataclasses.fields(report_model.Metrics)}
REAL = Path(__file__).resolve().parents[2] / "docs/results/run8-h200x2-final/certify/certify-b/report.json.gz"


@pytest.fixture(scope="module")
def real():
    return json.loads(gzip.decompress(REAL.read_bytes()))


def measured_cell(data):
    return next(c for c in data["devices"][0]["cells"] if c["outcome"] in ("pass", "fail"))


@pytest.mark.parametrize("field, value", [
    ("rel_l2", -0.5), ("worst_head_rel_l2", -1e-6), ("worst_block_rel_l2", -0.01), ("norm_ratio", -1.0),
    ("extra_bytes_per_element", -2.0), ("sdpa_rel_l2", -0.1), ("worst_head_cosine", 5.0),
    ("worst_head_cosine", -1.5),
])
def test_an_impossible_number_is_refused(real, field, value):
    data = copy.deepcopy(real)
    measured_cell(data)[field] = value  # run 8 wrote version 2: the reader moves an error number into metrics
    path = f"metrics\\.{field}" if field in METRICS else field
    with pytest.raises(report_model.ReportError, match=f"cells\\[\\d+\\]\\.{path}: is {value}"):
        checked.parse(data, "r.json")


def test_a_real_report_with_float32_rounding_reads(real):
    data = copy.deepcopy(real)
    measured_cell(data)["worst_head_cosine"] = 1.0000001192092896  # seen in run 8's cells
    checked.parse(data, "r.json")
