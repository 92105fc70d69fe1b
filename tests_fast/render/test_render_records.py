"""report.render reads the typed report (`checked.parse` or `checked.load`), never report.json's dict:
what renders is the record it is given, and the text is the same as the dict-reading renderer's.

run 13's committed report.md files (docs/results/run13-h200x2/certify-*/) were written by certify at
f51cd40+, and the dict-reading renderer of d7e9ec3 gave them again byte for byte; the record-reading
renderer must give the same bytes, once no call site names a fixture (bounds, issue 26, came later:
with them, only the verdict rows of the families they bound change).
"""

import dataclasses
import gzip
import json
from pathlib import Path

import pytest

from sage_qual import records
from sage_qual.qualification.decide import bounds, checked, verdict
from sage_qual.qualification.evidence import report_model
from sage_qual.qualification.evidence.report_model import PublishedBound
from sage_qual.qualification.measure import judge, speed
from sage_qual.qualification.render import plots, report
from tests_fast import builders

ROOT = Path(__file__).resolve().parents[2]
RUN13 = ROOT / "docs" / "results" / "run13-h200x2"
SAMPLE = ROOT / "tests_fast" / "data" / "sample_h200_2gpu.json"


def without_the_fitness_judge(monkeypatch):
    """As run 13's reports were rendered: the fitness judge (issue 52) and its table came later."""
    monkeypatch.setattr(judge, "fitness_reasons", lambda metrics, fitness: [])
    monkeypatch.setattr(report, "_fitness_blocks", lambda data: [])


@pytest.mark.parametrize("run", ["certify-b", "certify-e"])
def test_run_13s_reports_render_as_committed(run, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")  # the committed report.md shows the plots
    monkeypatch.setattr(speed, "RUN_TO_RUN_SPREAD", 0.0)  # the bar those reports were decided with
    monkeypatch.setattr(bounds, "sites_of", lambda fixture, family=None: [])
    without_the_fitness_judge(monkeypatch)
    builders.rendered(checked.load(RUN13 / run / "report.json.gz"), tmp_path)
    committed = gzip.decompress((RUN13 / run / "report.md.gz").read_bytes())
    assert (tmp_path / "report.md").read_bytes() == committed


@pytest.mark.parametrize("run", ["certify-b", "certify-e"])
def test_bounds_change_only_the_rows_of_the_families_they_bound(run, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    monkeypatch.setattr(speed, "RUN_TO_RUN_SPREAD", 0.0)  # the bar those reports were decided with
    without_the_fitness_judge(monkeypatch)
    data = checked.load(RUN13 / run / "report.json.gz")
    builders.rendered(data, tmp_path)
    now = (tmp_path / "report.md").read_text().splitlines()
    then = gzip.decompress((RUN13 / run / "report.md.gz").read_bytes()).decode().splitlines()
    assert len(now) == len(then)
    changed = {line.split(" | ")[0] for line, old in zip(now, then, strict=True) if line != old}
    [gpu] = verdict.decide(data)
    entries = gpu.families + [gpu.default]
    bounded = {f"| {d.family or '(default: all fixtures)'}" for d in entries if d.results.bounded}
    assert changed == bounded and "| SDXL" in changed


@pytest.fixture
def no_plots(monkeypatch):
    monkeypatch.setattr(plots, "plots", lambda *args: {})  # the text is what these tests read


def test_what_renders_is_the_record_given(tmp_path, no_plots):
    typed = dataclasses.replace(checked.load(SAMPLE), host="edited-in-the-record", command="sage-qual x")
    builders.rendered(typed, tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert md.startswith("# SageAttention certification, edited-in-the-record\n")
    assert "Command: `sage-qual x`" in md
    assert "<title>sage-qual report edited-in-the-record</title>" in (tmp_path / "report.html").read_text()


def _with_stderr(record, text):
    return dataclasses.replace(record, stderr_tail=text)


def test_each_kind_of_record_heads_its_crash_output(tmp_path, no_plots):
    """A timing, a long check and a span probe that left a stderr tail each say what ran on what."""
    data = json.loads(SAMPLE.read_text())
    data["devices"][0]["long"] = builders.long_records("sm90-fp8-cuda", fail_at=75600, how="crash")
    typed = checked.parse(data, "sample")
    device = typed.devices[0]
    timing = ("sm89-fp8-cuda", "b1 h24 q1024 k1024 d64 bfloat16")
    speed = [_with_stderr(r, "timing stderr") if (r.kernel, r.shape) == timing else r for r in device.speed]
    long = [_with_stderr(c, "long stderr") if c.shape.q_tokens == 75600 else c for c in device.long]
    probe = records.parse(report_model.SpanProbe, {
        "variant": "sm90-fp8-cuda", "layout": "fused_qkv", "side": "above", "tokens": 100000, "heads": 56,
        "head_dim": 128, "kv_tokens": 1024, "span": 2150385664, "limit": 2147483647, "outcome": "crash",
        "detail": "killed by SIGABRT", "stderr_tail": "probe stderr"}, "probe", "")
    device = dataclasses.replace(device, speed=speed, long=long, span=[probe])
    builders.rendered(dataclasses.replace(typed, devices=[device, *typed.devices[1:]]), tmp_path)
    md = (tmp_path / "report.md").read_text()
    crashes = md.split("### Crashes, hangs and errors\n", 1)[1].split("\n## ", 1)[0]
    assert "sm89-fp8-cuda on b1 h24 q1024 k1024 d64 bfloat16: pass: \n" in crashes
    assert "sm90-fp8-cuda on 75600 tokens, 40 heads (long check): crash: the worker ran this task when it " \
           "died (killed by SIGSEGV)\n" in crashes
    assert "sm90-fp8-cuda on a span of 2,150,385,664 elements (fused_qkv, span probe): crash: killed by " \
           "SIGABRT\n" in crashes
    for tail in ("timing stderr", "long stderr", "probe stderr"):
        assert f"```text\n{tail}\n```" in crashes
    assert ("| sm90-fp8-cuda | 75,600 / 75,600 tokens, 40 heads x 128 bfloat16 | Wan 2.2 test | crash | - | "
            "- | the worker ran this task when it died (killed by SIGSEGV) |") in md


def test_a_predicted_heatmap_cell_is_measured_against_its_class_published_bound():
    cell = checked.load(SAMPLE).devices[0].cells[0]
    bound = PublishedBound(max_rel_l2=cell.metrics.rel_l2 * 4, min_cosine=0.9)
    published = {cell.fixture: {cell.accuracy_class: bound}}
    assert plots.heat_ratio(cell, published) == pytest.approx(0.25)
    assert plots.heat_ratio(cell) == pytest.approx(cell.metrics.rel_l2 / cell.budget.max_rel_l2)
    assert plots.heat_ratio(cell, {}) is None  # a fixture with no published bound: no number


def test_no_number_has_a_colour_of_its_own_on_the_heatmap():
    """The heatmap's colour for a cell without a number was a light grey, and cividis's middle (0.35-0.52
    of the budget) reads as grey too (issue 43): a neutral colour must lie outside the lightness the
    scale spans."""
    matplotlib = pytest.importorskip("matplotlib")
    import numpy as np

    def lightness(rgb):
        return np.asarray(rgb) @ np.array([0.2126, 0.7152, 0.0722])  # Rec. 709 luminance

    scale = matplotlib.colormaps["cividis"](np.linspace(0, 1, 256))[:, :3]
    missing = np.array(matplotlib.colors.to_rgb(plots.NO_NUMBER))
    neutral = missing.max() - missing.min() < 0.1
    assert not (neutral and lightness(scale).min() <= lightness(missing) <= lightness(scale).max())


def test_a_non_finite_cell_takes_the_top_colour_and_a_skipped_one_the_white():
    """Issue 54: a non-finite failure was white "fail", the colour of a cell that did not run."""
    fixture = builders.fixture()
    nan = builders.cell("sm90-fp8-cuda", fixture, "fail", finite=False,
                        reasons=[builders.reason("non_finite", "output not finite where the reference is")])
    value, text = plots.heat_cell(nan)
    assert value == 1.0 and text == "fail\nnot finite"
    skipped = report_model.Cell("sm90-fp8-cuda", fixture.name, report_model.Outcome.SKIP, "not supported")
    value, text = plots.heat_cell(skipped)
    assert value != value and text == "skip"  # NaN: drawn in NO_NUMBER's white
    value, _ = plots.heat_cell(builders.cell("sm90-fp8-cuda", fixture, rel_l2=0.01))
    assert -2 <= value < 0
