"""certify --emulate end to end on two small fixture files: the report it writes (header, the one
pseudo-device, each predicted cell judged like a measured one, each predicted long check), the
terminal summary (the table, each predicted failure, families without fixtures), and its refusals."""

import contextlib
import dataclasses
import io
import itertools
import json
import math
import re
import socket
import types

import pytest
import torch

from sage_qual.errors import UsageError
from sage_qual.fixtures.fileformat import load_fixture
from sage_qual.kernels.variants import VARIANTS
from sage_qual.qualification.decide import checked
from sage_qual.qualification.evidence import report_model, tasks
from sage_qual.qualification.measure import accuracy, budgets, judge
from sage_qual.qualification.run import in_process, plan, run

from .. import builders
from ..fakes import random_fixture

VARIANT_NAMES = ["sm90-fp8-cuda", "sm80-fp16-cuda"]
BOUNDS = {"fp16": {"max_rel_l2": 0.1, "min_cosine": 0.99}, "fp8": {"max_rel_l2": 0.1, "min_cosine": 0.99}}


def write(directory, name, zero_v_channel=False, seed=0):
    # zero_v_channel: every FP8 kernel returns NaN there (README, Known limits).
    random_fixture(directory, name, "SDXL", BOUNDS, seed, tokens=96, dtype=torch.float16,
                   zero_v_channel=5 if zero_v_channel else None)


# One run shared by the module (about a second each; five runs were 6 s of the fast suite). mutmut
# attributes the run to the first test that uses it: the other files' emulate tests and this module's
# own runs (quick, progress) check the same functions (emulate counted in full: docs/mutation.md).
@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    root = tmp_path_factory.mktemp("emulate")
    fixtures = root / "fixtures"
    fixtures.mkdir()
    write(fixtures, "sdxl_plain", seed=1)
    write(fixtures, "sdxl_zero_v", zero_v_channel=True, seed=2)
    options = builders.emulate_request(
        root / "out", variants=VARIANT_NAMES, families=["SDXL", "FLUX.1"], fixture_dirs=[str(fixtures)]
    )
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        run.certify(options)
    # What the run wrote and printed (its return value is the same report, as a dict or a record).
    data = json.loads((root / "out" / "report.json").read_text())
    return data, root, fixtures, printed.getvalue()


def limits(budget) -> dict:
    """A budget's limits as report.json stores them."""
    return dataclasses.asdict(budget)


def cells_of(data):
    return {(c["variant"], c["fixture"]): c for c in data["devices"][0]["cells"]}


def test_the_report_header_says_predicted_and_complete(emulated):
    data, root, fixtures, _ = emulated
    assert data["kind"] == report_model.KIND and data["schema_version"] == report_model.SCHEMA_VERSION
    assert data["predicted"] is True and data["complete"] is True and data["stopped"] == ""
    assert data["finished"] is not None and data["started"] <= data["finished"]
    assert data["host"] == socket.gethostname()
    assert data["command"] == "sage_qual.qualification.run.run.certify()"
    plots = sorted(p.name for p in (root / "out").glob("*.png"))
    assert "accuracy-cpu.png" in plots and not [
        name for name in plots if "cuda" in name
    ]  # named where it ran
    assert "](accuracy-cpu.png)" in (root / "out" / "report.md").read_text()
    assert data["options"] == {
        "devices": [0],
        "variants": VARIANT_NAMES,
        "families": ["SDXL", "FLUX.1"],
        "fixture_dirs": [str(fixtures)],
        "quick": False,
        "timeout_s": 0.0,
    }
    assert [f["name"] for f in data["fixtures"]] == ["sdxl_plain", "sdxl_zero_v"]
    assert data["fixtures"][0]["dtype"] == "float16" and data["fixtures"][0]["q"] == [1, 2, 96, 64]
    assert data["shapes"] == {}
    device = data["devices"][0]
    assert (device["index"], device["name"], device["capability"], device["memory_gib"]) == (
        0,
        in_process.DEVICE_NAME,
        [0, 0],
        0.0,
    )
    assert device["not_supported"] == {} and device["speed"] == []
    # What it wrote reads back as a report, with its rendering next to it.
    loaded = checked.load(root / "out" / "report.json")
    assert loaded.predicted and loaded.complete
    assert (root / "out" / "report.md").is_file()


def test_each_cell_is_judged_against_its_budget_like_a_measured_one(emulated):
    data, _, fixtures, _ = emulated
    cells = cells_of(data)
    assert list(cells) == [(v, f) for f in ("sdxl_plain", "sdxl_zero_v") for v in VARIANT_NAMES]
    fixture = load_fixture(fixtures / "sdxl_plain.safetensors")
    ref = accuracy.reference(fixture.q, fixture.k, fixture.v)
    for name in VARIANT_NAMES:
        cell, variant = cells[(name, "sdxl_plain")], VARIANTS[name]
        acc = accuracy.accuracy(budgets.prediction(variant, fixture), fixture.q, fixture.k, fixture.v, ref)
        assert cell["budget"] == limits(budgets.budget(variant, fixture))
        budget = budgets.budget(variant, fixture)
        assert (
            cell["reasons"]
            == judge.cell_reasons(acc, 0.0, budget, math.inf, fitness=builders.CONFORMANCE_ONLY)
            == []
        )
        assert cell["outcome"] == "pass" and cell["detail"] == in_process.PREDICTED
        assert cell["accuracy_class"] == variant.accuracy_class
        numbers = cell["metrics"]
        assert numbers["rel_l2"] == acc.rel_l2 and numbers["worst_head_cosine"] == acc.worst_head_cosine
        assert numbers["max_abs_error"] == acc.max_abs_error and numbers["finite"] is True
        assert cell["extra_bytes_per_element"] is None  # the model measures no memory
        assert cell["seconds"] >= 0 and round(cell["seconds"], 3) == cell["seconds"]


def test_a_non_finite_prediction_fails_and_stores_no_number(emulated):
    data, _, _, _ = emulated
    fp8, fp16 = (
        cells_of(data)[("sm90-fp8-cuda", "sdxl_zero_v")],
        cells_of(data)[("sm80-fp16-cuda", "sdxl_zero_v")],
    )
    assert fp8["outcome"] == "fail" and fp8["metrics"]["finite"] is False
    assert [r["kind"] for r in fp8["reasons"]][:1] == ["non_finite"]
    assert (
        fp8["metrics"]["rel_l2"] is None and fp8["metrics"]["max_abs_error"] is None
    )  # JSON: no NaN, no inf
    assert fp16["outcome"] == "pass"


def test_each_planned_long_check_is_predicted_on_one_group_of_heads(emulated):
    data, _, _, _ = emulated
    checks = data["devices"][0]["long"]
    assert {c["variant"] for c in checks} == set(VARIANT_NAMES)
    per_variant = [c for c in checks if c["variant"] == "sm90-fp8-cuda"]
    q_tokens = sorted(c["shape"]["q_tokens"] for c in per_variant)
    assert q_tokens == [1024, 2048, 4096, 8192, 16384, 16384, 16896, 32768]  # the sweep, SDXL's, FLUX.1's
    for check in checks:
        assert check["detail"] == in_process.PREDICTED and check["outcome"] == "pass"
        assert check["identical"] == {name: True for name in check["layouts"] if name != "contiguous"}
        shape = check["shape"]
        assert check["ran_heads"] == shape["heads"] // shape["kv_heads"]  # 1: every group is alike
        assert check["uses"] and check["layouts"][0] == "contiguous"
    flux = next(c for c in per_variant if c["shape"]["q_tokens"] == 16896)
    assert flux["uses"] == [{"family": "FLUX.1", "label": "longest call: 16896 query / 16896 key tokens"}]
    assert "fused_qkv" in flux["identical"]


def test_the_summary_tables_each_variant_and_lists_each_predicted_failure(emulated):
    _, root, _, printed = emulated
    lines = printed.splitlines()
    start = lines.index(next(line for line in lines if line.startswith("PREDICTED (CPU numerics model")))
    assert lines[start] == (
        "PREDICTED (CPU numerics model, no GPU ran): 2 fixture(s), 2 variant(s); FAIL = "
        "would fail at least one fixture of the family"
    )
    assert lines[start + 1] == (
        "  it finds non-finite model outputs, named hazards and outputs unfit for the "
        "family: a finite prediction conforms to its own model (report.md says more)"
    )
    width = len("sm80-fp16-cuda") + 2
    assert lines[start + 2] == "variant".ljust(width) + "default on".ljust(16) + "SDXL".ljust(10)
    assert lines[start + 3] == "sm90-fp8-cuda".ljust(width) + "sm_90".ljust(16) + "FAIL".ljust(10)
    assert lines[start + 4] == "sm80-fp16-cuda".ljust(width) + "sm_80".ljust(16) + "pass".ljust(10)
    failures = [line for line in lines if line.startswith("  would fail ")]
    assert len(failures) == 1
    assert failures[0].startswith("  would fail SDXL: sm90-fp8-cuda on sdxl_zero_v: ")
    assert "not finite" in failures[0] and "not measured" not in failures[0] and "cuda:0" not in failures[0]
    assert "  no fixtures, not predicted: FLUX.1" in lines
    said = [line for line in lines if line.startswith("sage-qual certify --emulate: ")]
    assert len(said) == 1 and str(root / "out" / "report.md") in said[0]
    assert (
        "PREDICTED" in said[0]
        and "`sage-qual gate` refuses it: certify on the GPU to enable a family" in said[0]
    )


def test_a_quick_run_predicts_the_smallest_fixture_and_the_longest_family_call(tmp_path):
    fixtures = tmp_path / "fixtures"
    fixtures.mkdir()
    write(fixtures, "one", seed=3)
    run.certify(builders.emulate_request(
            tmp_path / "out",
            variants=["sm80-fp16-cuda"],
            families=["SDXL"],
            fixture_dirs=[str(fixtures)],
            quick=True,
        )
    )
    data = json.loads((tmp_path / "out" / "report.json").read_text())
    assert data["options"]["quick"] is True
    cells = data["devices"][0]["cells"]
    assert [(c["fixture"], c["detail"]) for c in cells] == [("one", in_process.PREDICTED)]
    assert [c["shape"]["q_tokens"] for c in data["devices"][0]["long"]] == [1024, 4096, 16384, 16384]


def test_no_fixture_is_a_usage_error_that_says_what_to_give(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError) as error:
        run.certify(builders.emulate_request(tmp_path / "out", families=["SDXL"],
                                             fixture_dirs=[str(tmp_path / "empty")]))
    assert str(error.value) == (
        "no fixtures selected: give --fixtures DIR with *.safetensors fixtures, or other --families"
    )
    assert not (tmp_path / "out").exists()


def test_an_output_that_cannot_be_made_is_a_usage_error(tmp_path):
    fixtures = tmp_path / "fixtures"
    fixtures.mkdir()
    write(fixtures, "one")
    (tmp_path / "file").write_text("x")
    with pytest.raises(UsageError, match=r"^--out .*file.out is under .*file, a file: give a folder"):
        run.certify(builders.emulate_request(
                tmp_path / "file" / "out",
                variants=["sm80-fp16-cuda"],
                families=["SDXL"],
                fixture_dirs=[str(fixtures)],
            )
        )


def test_a_cells_seconds_are_the_time_its_prediction_took(tmp_path, monkeypatch):
    fixtures = tmp_path / "fixtures"
    fixtures.mkdir()
    write(fixtures, "timed", seed=4)
    clock = itertools.cycle([100.0, 100.12345])  # each task's start and end
    monkeypatch.setattr(in_process, "time", types.SimpleNamespace(monotonic=lambda: next(clock)))
    with contextlib.redirect_stdout(io.StringIO()):
        written = run.certify(builders.emulate_request(tmp_path / "out", variants=["sm80-fp16-cuda"],
                                                       families=["SDXL"], fixture_dirs=[str(fixtures)],
                                                       quick=True))
    (cell,) = written.devices[0].cells
    assert cell.seconds == 0.123 and {check.seconds for check in written.devices[0].long} == {0.123}


def test_calls_alike_after_the_head_reduction_share_one_prediction_but_keep_their_own_record(monkeypatch):
    from sage_qual.qualification import families

    # FLUX.1 (24 heads) and FLUX.2 (32 heads) at 16,896 tokens: one group of heads each, one computation.
    planned = plan.long_checks([families.find("FLUX.1"), families.find("FLUX.2")], 10**6, quick=False,
                               sweep_tokens=())
    flux1, flux2 = sorted(planned.values(), key=lambda p: p.shape.heads)
    executor = in_process.InProcessExecutor()
    computed = []
    real_run = executor.worker.run
    monkeypatch.setattr(executor.worker, "run", lambda task: computed.append(task) or real_run(task))
    first, second = (executor._long(tasks.LongTask(f"sm80-fp16-cuda~{n}", "sm80-fp16-cuda", p.shape, p.uses,
                                                   p.layouts)) for n, p in enumerate((flux1, flux2)))
    assert len(computed) == 1
    assert (first.shape.heads, second.shape.heads) == (24, 32) and first.ran_heads == second.ran_heads == 1
    assert [u.family for u in first.uses] == ["FLUX.1"] and [u.family for u in second.uses] == ["FLUX.2"]
    assert first.identical == {"transposed": True, "fused_qkv": True, "nhd": True}
    assert second.identical == {"transposed": True, "nhd": True}


def test_progress_counts_every_prediction_on_the_cpu_without_a_line_each(tmp_path, monkeypatch):
    """One tick per predicted cell and long check, all on the pseudo-device "cpu", and no line per
    result (the summary follows; a line at each tenth instead): the bar's total is what the run then
    records."""
    bars = []

    class Bar:
        def __init__(self, total, lines=True):
            self.total, self.lines, self.ticks = total, lines, []
            bars.append(self)

        def tick(self, device, record):
            self.ticks.append(device)

        def grow(self, tasks):
            self.total += tasks

        def close(self):
            pass

    monkeypatch.setattr(run, "Progress", Bar)
    fixtures = tmp_path / "fixtures"
    fixtures.mkdir()
    write(fixtures, "one", seed=4)
    options = builders.emulate_request(tmp_path / "out", variants=VARIANT_NAMES, families=["SDXL"],
                              fixture_dirs=[str(fixtures)], quick=True)
    with contextlib.redirect_stdout(io.StringIO()):
        run.certify(options)
    data = json.loads((tmp_path / "out" / "report.json").read_text())
    recorded = len(data["devices"][0]["cells"]) + len(data["devices"][0]["long"])
    (bar,) = bars
    assert bar.lines is False
    assert bar.total == len(bar.ticks) == recorded == len(VARIANT_NAMES) * (1 + 4)
    assert set(bar.ticks) == {"cpu"}


def test_a_prediction_in_a_log_prints_a_line_at_each_tenth(capsys):
    """Not a terminal (pytest's capture): 25 results give a line at 3, 5, 8, ..., 25, none per result."""
    progress = run.Progress(25, lines=False)
    record = builders.cell(VARIANT_NAMES[0], builders.fixture(), "pass")
    for _ in range(25):
        progress.tick("cpu", record)
    progress.close()
    lines = capsys.readouterr().out.splitlines()
    tenths = (3, 5, 8, 10, 13, 15, 18, 20, 23, 25)
    assert [line.split(",")[0] for line in lines] == [f"[{n}/25" for n in tenths]
    assert re.match(r"\[25/25, \d+\.\d s\] 100 % done, last: cpu ", lines[-1])
