"""report.json schema, loading, atomic writing, and the Markdown/HTML rendering with plots.

The JSON files in tests_fast/data are hand-made samples with synthetic numbers (see the README
there), shaped exactly like certify's output.
"""

import copy
import json
from pathlib import Path

import pytest

from sage_qual.qualification import profile, report

jsonschema = pytest.importorskip("jsonschema")  # a test dependency; the GPU box lacks it

DATA = Path(__file__).parent / "data"
SAMPLES = sorted(DATA.glob("sample_*.json"))


@pytest.fixture(scope="module")
def validator():
    schema = report.schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def sample(name: str) -> dict:
    return json.loads((DATA / name).read_text())


def errors(validator, data) -> list[str]:
    return [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(data)]


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.stem)
def test_samples_validate_and_load(path, validator):
    data = json.loads(path.read_text())
    assert errors(validator, data) == []
    assert report.load(path) == data


def broken_cell(data):
    cell = next(c for c in data["devices"][0]["cells"] if c["outcome"] == "fail")
    cell["reasons"] = []


def unknown_field(data):
    data["devices"][0]["cells"][0]["speedy"] = True


def unknown_outcome(data):
    data["devices"][0]["speed"][0]["outcome"] = "slow"


def missing_complete(data):
    del data["complete"]


def crash_without_detail(data):
    cell = next(c for c in data["devices"][0]["cells"] if c["outcome"] == "crash")
    del cell["detail"]


@pytest.mark.parametrize("damage", [broken_cell, unknown_field, unknown_outcome, missing_complete,
                                    crash_without_detail])
def test_schema_rejects_damaged_reports(damage, validator):
    data = sample("sample_h200_2gpu.json")
    if damage is broken_cell:  # the fail cell of the sample sits on cuda:1
        data["devices"][0], data["devices"][1] = data["devices"][1], data["devices"][0]
    damage(data)
    assert errors(validator, data)


def test_profile_built_from_a_report_validates(validator):
    data = sample("sample_h200_2gpu.json")
    built = profile.build(data, data["gpus"][0])
    profile_schema = {"$defs": report.schema()["$defs"], "$ref": "#/$defs/profile"}
    assert list(jsonschema.Draft202012Validator(profile_schema).iter_errors(built)) == []
    assert built["families"]["FLUX.1"]["variant"] == "sm90-fp8-cuda"
    assert built["default"]["variant"] is None


@pytest.mark.parametrize("content, message", [
    ("[1, 2]", "is not a sage-qual report"),
    ('{"kind": "something-else"}', "is not a sage-qual report"),
    ('{"kind": "sage-qual-report", "schema_version": 99}', "schema version 99"),
    ("{not json", "is not JSON"),
])
def test_load_refuses_foreign_files(tmp_path, content, message):
    path = tmp_path / "report.json"
    path.write_text(content)
    with pytest.raises(report.ReportError, match=message):
        report.load(path)


def test_load_missing_report_says_to_certify(tmp_path):
    with pytest.raises(report.ReportError, match="run `sage-qual certify` first"):
        report.load(tmp_path / "absent.json")


def test_writer_rewrites_the_file_after_each_change(tmp_path, validator):
    data = sample("sample_partial.json")
    writer = report.Writer(tmp_path / "report.json", data)
    cell = copy.deepcopy(data["devices"][0]["cells"][0])
    writer.update(lambda d: d["devices"][1]["cells"].append(cell))
    on_disk = json.loads((tmp_path / "report.json").read_text())
    assert on_disk["devices"][1]["cells"] == [cell]
    assert on_disk["complete"] is False
    assert errors(validator, on_disk) == []
    assert not list(tmp_path.glob("*.tmp"))


def test_writer_refuses_non_finite_numbers(tmp_path):
    writer = report.Writer(tmp_path / "report.json", {"kind": report.KIND})
    with pytest.raises(ValueError):
        writer.update(lambda d: d.update(x=float("inf")))


def test_render_complete_report(tmp_path):
    data = sample("sample_h200_2gpu.json")
    files = report.render(data, tmp_path)
    names = {f.name for f in files}
    assert {"report.md", "report.html", "accuracy-cuda0.png", "accuracy-cuda1.png", "speedup-0.png"} <= names
    md = (tmp_path / "report.md").read_text()
    assert md.startswith("# SageAttention certification, sample-h200-2gpu")
    assert "| FLUX.1 | enable | sm90-fp8-cuda | 4608 / 512, head_dim 128 |" in md
    assert "no fixtures of FLUX.2 in this run: not certified" in md
    assert "sm90-fp8-cuda on wan22-video-self (cuda:0): the worker ran this task when it died" in md
    assert "CUDA error: an illegal memory access was encountered" in md  # the crash's stderr tail
    assert "NVIDIA driver  580.159.04" in md  # the environment block
    assert data["fixtures"][0]["sha256"] in md
    page = (tmp_path / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 3
    assert "PARTIAL" not in page


def test_render_partial_report_says_so(tmp_path):
    data = sample("sample_partial.json")
    report.render(data, tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "PARTIAL REPORT" in md and "No verdicts are drawn" in md
    assert "### Verdicts" not in md
    assert 'class="partial"' in (tmp_path / "report.html").read_text()
