"""The report loader refuses what would let a result hide or a verdict come from rules this
sage-qual lacks: a (variant, fixture) cell or (kernel, shape) timing held twice, an unknown
variant, fixture or family, and a file larger than any report certify writes. Each refusal is one
line naming the file and the entry."""

import copy
import gzip
import json
from dataclasses import replace
from pathlib import Path

import pytest

from sage_qual import cli, jsonfile, records
from sage_qual.qualification.decide import checked
from sage_qual.qualification.evidence import files, report_model
from sage_qual.qualification.evidence.report_model import Cell, Outcome

from ..builders import read, reason

SAMPLE = Path(__file__).parent.parent / "data" / "sample_h200_2gpu.json"


def refusal(tmp_path: Path, change) -> str:
    data = json.loads(SAMPLE.read_text())
    change(data)
    path = tmp_path / "report.json"
    path.write_text(json.dumps(data))
    with pytest.raises(report_model.ReportError) as error:
        checked.load(path)
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"{path}: ")
    return message.removeprefix(f"{path}: ")


def failing_copy_first(data: dict) -> None:
    """The same cell twice: a failing copy, then the passing one, so a reader keeping the last or
    a verdict taken per (variant, fixture) would see only the pass."""
    cells = data["devices"][0]["cells"]
    index = next(n for n, c in enumerate(cells) if c["outcome"] == "pass")
    passing = read(Cell, files.upgrade({"devices": [{"cells": [cells[index]]}]}, 1)["devices"][0]["cells"][0])
    failing = replace(passing, outcome=Outcome.FAIL,
                      metrics=replace(passing.metrics, rel_l2=passing.budget.max_rel_l2 * 3),
                      reasons=[reason("accuracy", "relative L2 over its bound")])
    cells.insert(index, records.dump(failing))


def test_a_cell_held_twice_is_refused(tmp_path):
    message = refusal(tmp_path, failing_copy_first)
    assert message.startswith("devices[0].cells[") and "a second result for sm90-fp8-cuda on " in message


def test_a_timing_held_twice_is_refused(tmp_path):
    timings = json.loads(SAMPLE.read_text())["devices"][1]["speed"]
    message = refusal(tmp_path, lambda d: d["devices"][1]["speed"].append(copy.deepcopy(timings[0])))
    assert message.startswith(f"devices[1].speed[{len(timings)}]")
    assert "(the first is speed[0])" in message


def test_merge_refuses_a_report_with_a_cell_held_twice(tmp_path, capsys):
    data = json.loads(SAMPLE.read_text())
    failing_copy_first(data)
    path = tmp_path / "twice.json"
    path.write_text(json.dumps(data))
    code = cli.main(["merge", str(path)])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.count("\n") == 1 and str(path) in err and "a second result" in err


@pytest.mark.parametrize("change, entry, name", [
    (lambda d: d["options"]["families"].append("Stable Cascade"), "options.families[8]", "'Stable Cascade'"),
    (lambda d: d["options"]["variants"].append("sm70-int4-cuda"), "options.variants[3]", "'sm70-int4-cuda'"),
    (lambda d: d["devices"][0]["cells"][0].update(fixture="not-shipped"), "devices[0].cells[0].fixture",
     "'not-shipped'"),
    (lambda d: d["devices"][0]["speed"][0].update(kernel="mystery-kernel"), "devices[0].speed[0].kernel",
     "'mystery-kernel'"),
])
def test_unknown_names_are_refused(tmp_path, change, entry, name):
    message = refusal(tmp_path, change)
    assert message.startswith(f"{entry}: {name} ")


def test_a_target_report_names_its_integration_not_registry_variants(tmp_path):
    data = json.loads(SAMPLE.read_text())
    data["target"] = "wrapper"
    data["options"]["variants"] = ["wrapper"]
    for device in data["devices"]:
        device["cells"] = [dict(c, variant="wrapper") for c in device["cells"]
                           if c["variant"] == "sm90-fp8-cuda"]
        device["speed"] = [dict(r, kernel="wrapper") if r["kernel"] == "sm90-fp8-cuda" else r
                           for r in device["speed"] if r["kernel"] in ("sm90-fp8-cuda", "sdpa")]
        device["not_supported"] = {}
    assert checked.parse(data, "target.json").target == "wrapper"


def test_a_file_larger_than_the_limit_is_refused_unread(tmp_path, monkeypatch):
    path = tmp_path / "report.json"
    path.write_text(SAMPLE.read_text())
    monkeypatch.setattr(jsonfile, "MAX_JSON_BYTES", path.stat().st_size - 1)
    with pytest.raises(report_model.ReportError,
                       match=r"cannot be read \(more than .* the most sage-qual reads"):
        checked.load(path)
    monkeypatch.setattr(jsonfile, "MAX_JSON_BYTES", path.stat().st_size)
    assert checked.load(path).host == "sample-h200-2gpu"


def test_a_gzip_compressed_report_reads_as_the_plain_one_whatever_its_name(tmp_path):
    """docs/results/ keeps its reports as report.json.gz: every reader takes them as they are."""
    plain = checked.load(SAMPLE)
    for name in ("report.json.gz", "report.json"):
        path = tmp_path / name
        path.write_bytes(gzip.compress(SAMPLE.read_bytes()))
        assert checked.load(path) == plain


def test_a_compressed_file_is_held_to_the_limit_by_what_it_decompresses_to(tmp_path, monkeypatch):
    path = tmp_path / "report.json.gz"
    path.write_bytes(gzip.compress(SAMPLE.read_bytes()))
    monkeypatch.setattr(jsonfile, "MAX_JSON_BYTES", len(SAMPLE.read_bytes()) - 1)
    assert path.stat().st_size < jsonfile.MAX_JSON_BYTES
    with pytest.raises(report_model.ReportError, match=r"cannot be read \(more than"):
        checked.load(path)


@pytest.mark.parametrize("damage", [lambda b: b[: len(b) // 2], lambda b: b[:10] + b"\0" * 64 + b[74:]],
                         ids=["torn", "corrupt"])
def test_a_damaged_compressed_report_says_so(tmp_path, damage):
    path = tmp_path / "report.json.gz"
    path.write_bytes(damage(gzip.compress(SAMPLE.read_bytes())))
    damaged = r"report.json.gz: cannot be read \(a damaged gzip file"
    with pytest.raises(report_model.ReportError, match=damaged):
        checked.load(path)
