"""The one certify run (`run.certify`) in its three modes: our variants in workers, a target in
workers, the numerics model in this process. The header, the end of a run (complete, interrupted,
failed) and the summary are the run's, whatever executor runs the tasks; no worker starts here (a
fake machine, and the executors' run_slots replaced where a test is about the run around them)."""

import dataclasses
import json
import re
import threading
import xml.etree.ElementTree as ET

import pytest
import torch

from sage_qual import cli, records
from sage_qual.errors import UsageError
from sage_qual.fixtures.fileformat import save_fixture
from sage_qual.qualification.decide import checked
from sage_qual.qualification.evidence.report_model import Cell, Device, Outcome, Reason, ReasonKind, Report
from sage_qual.qualification.measure import judge
from sage_qual.qualification.run import in_process, pool, run, worker_executor
from sage_qual.qualification.run import options as run_options
from sage_qual.verdicts.env_record import EnvironmentRecord, GpuInfo

from .. import builders
from ..fakes import env_result

BOUNDS = {"fp16": {"max_rel_l2": 0.05, "min_cosine": 0.99}, "fp8": {"max_rel_l2": 0.08, "min_cosine": 0.99}}
H200 = GpuInfo(index=0, name="Fake H200", capability=[9, 0], memory_gib=141.0, kernel="sm90-fp8-cuda")
ENVIRONMENT = EnvironmentRecord(sage_qual="0", python="3.11", os="Linux", torch="2.11", torch_cuda="13.0",
                                cudnn="9", driver="580", triton="3.6", sageattention="2.2.0",
                                sageattention_problem="", extensions={}, gpus=[H200])


class NoWorkers:
    """pool.Pool where no worker may start: the executors' tasks never run in these tests."""
    closed = 0

    def __init__(self, logs):
        pass

    def prefetch(self, count=1, imports=()):
        pass

    def close(self):
        NoWorkers.closed += 1


@pytest.fixture
def box(monkeypatch, tmp_path):
    """One fake H200 as the environment worker would report it, and one small FLUX.1 fixture."""
    monkeypatch.setattr(pool, "Pool", NoWorkers)
    monkeypatch.setattr(run_options, "gpu_absent", lambda: "")  # nor do its /dev nodes say otherwise
    monkeypatch.setattr(pool, "collect_environment", lambda *args, **kwargs: env_result(
        ENVIRONMENT, {"0": {}}))
    monkeypatch.setattr(worker_executor.WorkerExecutor, "_target_machine",
                        lambda self, target, indices: {index: {} for index in indices})
    NoWorkers.closed = 0
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 128, 64, generator=generator).to(torch.bfloat16) for _ in range(3))
    (tmp_path / "fixtures").mkdir()
    save_fixture(tmp_path / "fixtures" / "flux.safetensors", q, k, v, family="FLUX.1",
                 kind="replica", source={"test": 1}, provenance="random test data", bounds=BOUNDS)
    return tmp_path


def modes(root):
    """Each mode's request on the box's fixture: (name, the request, its executor class)."""
    chosen = {"families": ["FLUX.1"], "fixture_dirs": [str(root / "fixtures")]}
    variants = ["sm90-fp8-cuda"]
    return [
        (
            "certify",
            builders.gpu_request(root / "certify", variants=variants, **chosen),
            worker_executor.WorkerExecutor,
        ),
        (
            "target",
            builders.target_request(root / "target", "sageattn", **chosen),
            worker_executor.WorkerExecutor,
        ),
        (
            "emulate",
            builders.emulate_request(root / "emulate", variants=variants, **chosen),
            in_process.InProcessExecutor,
        ),
    ]


def run_without_tasks(monkeypatch, executor, run_slots, request):
    monkeypatch.setattr(executor, "run_slots", run_slots)
    monkeypatch.setattr(executor, "run_side_by_side", lambda *args, **kwargs: None)
    return run.certify(request)


def test_the_three_modes_start_the_same_report(box, monkeypatch):
    """One header builder: every mode's report.json has every key of a report, of its options and
    of each device entry, and differs from the others only where its mode says so."""
    headers = {}
    for name, options, executor in modes(box):
        written = run_without_tasks(monkeypatch, executor, lambda *args, **kwargs: None, options)
        on_disk = json.loads((options.out / "report.json").read_text())
        assert on_disk == records.dump(written)
        headers[name] = on_disk
    fields = {f.name for f in dataclasses.fields(Report)}
    devices = {f.name for f in dataclasses.fields(Device)}
    for name, header in headers.items():
        assert set(header) == fields, name
        assert all(set(device) == devices for device in header["devices"]), name
        assert header["complete"] and header["finished"] and not header["stopped"], name
    assert [h["predicted"] for h in headers.values()] == [False, False, True]
    assert [h["target"] for h in headers.values()] == ["", "sageattn", ""]
    assert [h["options"]["variants"] for h in headers.values()] == [["sm90-fp8-cuda"], ["sageattn"],
                                                                     ["sm90-fp8-cuda"]]
    assert [h["devices"][0]["name"] for h in headers.values()] == ["Fake H200", "Fake H200",
                                                                     in_process.DEVICE_NAME]
    assert headers["certify"]["fixtures"] == headers["target"]["fixtures"] == headers["emulate"]["fixtures"]
    assert (box / "certify" / "profile.json").exists()  # certify's only: the others time nothing
    assert not (box / "target" / "profile.json").exists() and not (box / "emulate" / "profile.json").exists()


def one_cell_then(error):
    """A run_slots that records one skipped cell, then meets `error` (an interrupt or a bug)."""

    def run_slots(self, jobs, writer, progress, stop, refine=None, ahead=()):
        writer.append(0, "cells", Cell(variant=writer.report.options.variants[0], fixture="flux",
                                       outcome=Outcome.SKIP, detail="recorded before the end"))
        raise error

    return run_slots


@pytest.mark.parametrize("mode", ["certify", "target", "emulate"])
def test_an_interrupt_leaves_a_partial_report_in_every_mode(box, monkeypatch, capsys, mode):
    name, options, executor = next(m for m in modes(box) if m[0] == mode)
    written = run_without_tasks(monkeypatch, executor, one_cell_then(KeyboardInterrupt()), options)
    assert not written.complete and written.stopped == run.INTERRUPTED
    assert checked.load(options.out / "report.json") == written
    assert [c.detail for c in written.devices[0].cells] == ["recorded before the end"]
    assert "PARTIAL REPORT (interrupted" in (options.out / "report.md").read_text()
    said = capsys.readouterr()
    assert said.out.startswith("sage-qual certify")
    assert re.search(
        r"^sage-qual certify: [\d.]+ s \(discovery [\d.]+ s, conclusion [\d.]+ s\)$", said.err, re.M
    )
    assert NoWorkers.closed == (mode != "emulate")
    assert not (options.out / "profile.json").exists()


@pytest.mark.parametrize("mode", ["certify", "target", "emulate"])
def test_an_internal_error_is_said_in_the_report_then_raised_in_every_mode(box, monkeypatch, capsys, mode):
    name, options, executor = next(m for m in modes(box) if m[0] == mode)
    failing = one_cell_then(RuntimeError("a bug in a backend"))
    with pytest.raises(RuntimeError, match="a bug in a backend"):
        run_without_tasks(monkeypatch, executor, failing, options)
    written = checked.load(options.out / "report.json")
    assert not written.complete and written.stopped == "internal error: RuntimeError('a bug in a backend')"
    assert "PARTIAL: internal error: RuntimeError('a bug in a backend')" in capsys.readouterr().out
    assert "PARTIAL REPORT" in (options.out / "report.md").read_text()


@pytest.mark.parametrize("mode", ["certify", "target", "emulate"])
def test_a_result_recorded_twice_stops_the_conclusion_in_every_mode(box, monkeypatch, mode):
    """Appends check what they add, not the rules across results: the conclusion reads the whole
    report back, so a backend that appends a duplicate is one line, not a verdict on it."""
    name, options, executor = next(m for m in modes(box) if m[0] == mode)

    def twice(self, jobs, writer, progress, stop, refine=None, ahead=()):
        cell = Cell(variant=writer.report.options.variants[0], fixture="flux", outcome=Outcome.SKIP,
                    detail="recorded")
        writer.append(0, "cells", cell, cell)

    with pytest.raises(UsageError, match="does not read back.*devices\\[0\\]"):
        run_without_tasks(monkeypatch, executor, twice, options)
    assert len(json.loads((options.out / "report.json").read_text())["devices"][0]["cells"]) == 2  # kept


def test_parallel_jobs_finish_before_the_first_error_is_raised():
    finished = []

    def fails():
        raise ValueError("first")

    def works():
        finished.append(True)

    with pytest.raises(ValueError, match="first"):
        worker_executor.parallel([fails, works, works], threading.Event())
    assert finished == [True, True]


# The summary, from verdict.decide() only -----------------------------------------------------------
def one_gpu_report(sdxl="pass", **fields) -> Report:
    """sm90-fp8-cuda on two FLUX.1 fixtures (one with "): " in its name), passing, and on an SDXL
    one (`sdxl`: its outcome), on one H200; FLUX.1, FLUX.2 (no fixtures) and SDXL chosen."""
    flux = [builders.fixture("flux (block 5): an odd name", "flux.1"), builders.fixture("flux", "flux.1")]
    cells = [builders.cell("sm90-fp8-cuda", f) for f in flux]
    fixtures = flux + [builders.fixture("sdxl", "sdxl")]
    device = builders.device(cells + [builders.cell("sm90-fp8-cuda", fixtures[2], sdxl)])
    return builders.report([device], fixtures, families_=("FLUX.1", "FLUX.2", "SDXL"), **fields)


def test_the_predicted_summary_groups_by_fixture_whatever_a_reason_says(tmp_path, monkeypatch):
    """Each would-fail line names the variant and fixture from the decision's fields: a fixture name
    and a reason wording holding "): " (what the old summary split the composed sentence at) change
    nothing."""
    monkeypatch.setattr(judge, "cell_reasons", lambda *args, **kwargs: [
        Reason(ReasonKind.ACCURACY, "relative L2 (budget 0.1): 0.5"),
        Reason(ReasonKind.NON_FINITE, "odd): wording")])
    lines = builders.summarized(one_gpu_report(predicted=True), tmp_path).splitlines()
    failures = [line for line in lines if line.startswith("  would fail ")]
    assert failures == [
        f"  would fail {family}: sm90-fp8-cuda on {fixture}: relative L2 (budget 0.1): 0.5; odd): wording"
        for family, fixture in [("FLUX.1", "flux (block 5): an odd name"), ("FLUX.1", "flux"),
                                ("SDXL", "sdxl")]]
    row = next(line for line in lines if line.startswith("sm90-fp8-cuda "))
    assert row.split()[2:] == ["FAIL", "FAIL"]  # FLUX.1 and SDXL, the families with fixtures
    assert lines[-1] == "  no fixtures, not predicted: FLUX.2"


def test_the_target_summary_words_are_the_verdicts_evidence(tmp_path):
    """certify --target: safe, NOT SAFE or not qualified, as `FamilyDecision.evidence` says."""
    lines = builders.summarized(one_gpu_report("crash", target="sm90-fp8-cuda"), tmp_path).splitlines()
    assert lines == [
        f"sage-qual certify --target sm90-fp8-cuda: complete; report in {tmp_path / 'report.md'}",
        "  NVIDIA H200 (sm_90)  FLUX.1       safe: every fixture of the family passed",
        "  NVIDIA H200 (sm_90)  FLUX.2       not qualified: no fixtures of FLUX.2 in this run: not certified",
        "  NVIDIA H200 (sm_90)  SDXL         NOT SAFE: sm90-fp8-cuda on sdxl (cuda:0): test crash"]
    skipped = builders.summarized(one_gpu_report("skip", target="sm90-fp8-cuda"), tmp_path).splitlines()
    assert skipped[-1] == ("  NVIDIA H200 (sm_90)  SDXL         not qualified: "
                           "sm90-fp8-cuda on sdxl (cuda:0): test skip")


def test_a_prediction_writes_no_junit_and_says_so(tmp_path, capsys):
    assert cli.main(["certify", "--emulate", "--junit-xml", str(tmp_path / "x.xml"), "--out",
                     str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err.strip()
    assert "leave out --junit-xml" in error and "\n" not in error
    assert not (tmp_path / "out").exists()
    assert "leave out --junit-xml" in (tmp_path / "x.xml").read_text()  # CI sees the refusal as an error


def test_a_target_run_writes_junit_as_certify_does(box, monkeypatch):
    options = builders.target_request(box / "out", "sageattn", families=["FLUX.1"],
                                      fixture_dirs=[str(box / "fixtures")], junit_xml=box / "target.xml")
    run_without_tasks(monkeypatch, worker_executor.WorkerExecutor, lambda *args, **kwargs: None, options)
    cases = ET.parse(box / "target.xml").getroot().findall("testsuite/testcase")
    assert [(c.get("classname"), c.get("name")) for c in cases] == [("Fake H200 (sm_90)", "FLUX.1")]
    assert cases[0].find("failure").get("message") == "keep off"  # no cell ran: no evidence


def test_certify_json_answers_where_the_report_is_and_whether_the_run_completed(box, capsys):
    """`certify --json`: one CertifyAnswer on stdout (the run's own lines go to stderr)."""
    out = box / "emulated"
    code = cli.main(["certify", "--emulate", "--json", "--out", str(out), "--families", "FLUX.1",
                     "--variants", "sm90-fp8-cuda", "--fixtures", str(box / "fixtures")])
    answer = json.loads(capsys.readouterr().out)
    assert answer == {"command": "certify", "exit_code": code, "problem": "",
                      "report": str(out / "report.json"), "complete": code == 0}
    assert json.loads((out / "report.json").read_text())["complete"] is answer["complete"]
