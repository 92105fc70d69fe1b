"""Paired timing near the crossover (issue 17 item 2): certify's refinement times the variant and
the fastest SDPA backend call by call in turn in one worker (fake GPU and fake kernel on CPU), and
records both timings, each as the report's speed records hold them."""

import json

import pytest

from sage_qual import records
from sage_qual.qualification import families
from sage_qual.qualification.evidence import files, tasks
from sage_qual.qualification.evidence.report_model import Outcome, ShapeEntry, ShapeSpec, ShapeUse, Speed
from sage_qual.qualification.measure import accuracy
from sage_qual.qualification.run import run, worker, worker_executor
from sage_qual.qualification.selftest import faults as worker_faults

from .. import builders

SHAPE = tasks.shape_spec(families.self_attention(24, 8192, 128).as_dict())


@pytest.fixture
def bench():
    fake = worker_faults.FakeBench([{"name": "Fake H200", "capability": [9, 0]}])
    try:
        yield fake
    finally:
        fake._stack.close()  # the fake CUDA and sageattention it entered


def test_the_variant_and_sdpa_are_timed_in_turn_after_their_warm_ups(bench, monkeypatch):
    order = []
    call_kernel, torch_sdpa = accuracy.call_kernel, accuracy.TORCH_SDPA

    def logged(name, function):
        def call(*args, **kwargs):
            order.append(name)
            return function(*args, **kwargs)
        return call

    monkeypatch.setattr(accuracy, "call_kernel", logged("ours", call_kernel))
    monkeypatch.setattr(accuracy, "TORCH_SDPA", logged("sdpa", torch_sdpa))
    shape = tasks.shape_spec(families.self_attention(24, 8192, 128).as_dict())
    task = tasks.PairedTask("t", "sm90-fp8-cuda", "k", shape, warmup=2, repeats=5)
    asked = []  # (warm-up, repeats) of each timing the worker asks for
    timings_ms = bench.timings_ms

    def timed(fn, warmup, repeats):
        asked.append((warmup, repeats))
        return timings_ms(fn, warmup, repeats)

    monkeypatch.setattr(bench, "timings_ms", timed)
    result = worker.Worker(bench).run(task)
    assert result.outcome == Outcome.PASS, result
    # after the backends' screen: both warmed up, then one timed call of each in turn
    assert asked[-12:] == [(2, 0), (2, 0)] + [(0, 1), (0, 1)] * 5
    assert order[-10:] == ["ours", "sdpa"] * 5
    ours, sdpa = result.ours, result.sdpa
    assert (ours.kernel, ours.shape, sdpa.kernel, sdpa.shape) == ("sm90-fp8-cuda", "k", "sdpa", "k")
    assert len(ours.samples_ms) == len(sdpa.samples_ms) == 5
    assert sdpa.best_backend == min(sdpa.backends, key=sdpa.backends.get)
    # each half reads back as a speed record of the report (types and the median checked)
    for speed in (ours, sdpa):
        assert records.parse(Speed, records.dump(speed), "paired", "") == speed


def started(tmp_path):
    """A writer on a run's report with one timed shape, "k", and no timing yet."""
    entry = ShapeEntry(builders.read(ShapeSpec, families.self_attention(24, 8192, 128).as_dict()),
                       [ShapeUse(None, "k")])
    begun = builders.report([builders.device()], [], {"k": entry}, ["sm90-fp8-cuda"], complete=False,
                            finished=None)
    writer = files.Writer(tmp_path / "report.json", begun)
    return writer


def test_a_paired_result_becomes_two_speed_records(tmp_path):
    writer = started(tmp_path)
    task = tasks.PairedTask("sm90-fp8-cuda+sdpa@k", "sm90-fp8-cuda", "k", SHAPE, 1, 3)
    sdpa = task.sdpa_record(Outcome.PASS, 2.0, samples_ms=[2.0, 2.0, 2.0], best_backend="cudnn",
                            backends={"cudnn": 2.0})
    paired = task.record(Outcome.PASS, 1.5, samples_ms=[1.4, 1.5, 1.6], sdpa=sdpa)
    worker_executor.record(writer, 0, "cuda:0", run.Progress(1), task, paired)
    on_disk = json.loads((tmp_path / "report.json").read_text())["devices"][0]["speed"]
    assert [(r["kernel"], r["shape"], r["ms"], r["samples_ms"]) for r in on_disk] == [
        ("sdpa", "k", 2.0, [2.0, 2.0, 2.0]), ("sm90-fp8-cuda", "k", 1.5, [1.4, 1.5, 1.6])]
    assert on_disk[0]["best_backend"] == "cudnn" and on_disk[1]["best_backend"] == ""
    assert writer.report.devices[0].speed == [sdpa, paired.ours]


def test_a_paired_task_that_crashed_records_the_variant_only(tmp_path):
    writer = started(tmp_path)
    task = tasks.PairedTask("v+sdpa@k", "sm90-fp8-cuda", "k", SHAPE, 1, 3)
    worker_executor.record(
        writer, 0, "cuda:0", run.Progress(1), task, task.record(Outcome.CRASH, detail="boom")
    )
    assert writer.report.devices[0].speed == [
        Speed(kernel="sm90-fp8-cuda", shape="k", ms=None, outcome=Outcome.CRASH, detail="boom")]
