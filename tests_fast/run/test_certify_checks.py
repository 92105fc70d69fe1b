"""certify refuses what it cannot trust before it measures: numbers out of range (before any worker
starts), fixtures with non-finite values, GPU indices this machine lacks; and it leaves no output
directory behind. With --junit-xml it writes one test case per GPU model and family."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from sage_qual import cli
from sage_qual.errors import UsageError
from sage_qual.fixtures.fileformat import save_fixture
from sage_qual.qualification import families
from sage_qual.qualification.evidence import tasks
from sage_qual.qualification.run import plan, run
from sage_qual.qualification.run import pool as workers
from sage_qual.qualification.selftest import faults as worker_faults

from .. import builders

BOUNDS = {"fp16": {"max_rel_l2": 0.05, "min_cosine": 0.99}, "fp8": {"max_rel_l2": 0.08, "min_cosine": 0.99}}


@pytest.fixture
def no_workers(monkeypatch):
    """Any worker start fails the test: the checks must come first."""

    def refuse(*args, **kwargs):
        raise AssertionError("a worker started before the input was checked")

    monkeypatch.setattr(workers, "Pool", refuse)
    monkeypatch.setattr(workers, "collect_environment", refuse)


@pytest.mark.parametrize("timeout", [0.0, -5.0, float("nan"), float("inf"), 1e9])
def test_a_timeout_out_of_range_is_refused_before_any_worker(tmp_path, no_workers, timeout):
    out = tmp_path / "a" / "out"
    with pytest.raises(UsageError, match=r"--timeout is .*: give seconds above 0 and at most 3600"):
        run.certify(builders.gpu_request(out, timeout=timeout))
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize(
    "devices, message", [("-1", "-1 is not a GPU index"), ("0,x", "takes GPU indices"), (",", "names no GPU")]
)
def test_bad_device_indices_are_refused_before_any_worker(tmp_path, no_workers, devices, message):
    with pytest.raises(UsageError, match=message):
        run.certify(builders.gpu_request(tmp_path / "out", devices=devices))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--timeout", "0"], "--timeout is 0.0"),
        (["--timeout", "nan"], "--timeout is nan"),
        (["--devices", "-2"], "-2 is not a GPU index"),
    ],
)
def test_cli_refusals_are_one_line_exit_2(tmp_path, capsys, no_workers, argv, message):
    code = cli.main(["certify", "--out", str(tmp_path / "out"), *argv])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.count("\n") == 1 and message in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("mode", [[], ["--emulate"]], ids=["gpu", "emulate"])
def test_an_out_holding_a_previous_report_is_refused_unless_forced(tmp_path, capsys, no_workers, mode):
    """Issue 28: a second run into the same --out mixed its plots, logs and profile with the first's."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "report.json").write_text("{}")
    assert cli.main(["certify", "--out", str(out), *mode]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "report.json is a previous run's report: give another --out, or " \
        "--force" in err
    assert (out / "report.json").read_text() == "{}" and [p.name for p in out.iterdir()] == ["report.json"]
    request = builders.emulate_request(out)
    with pytest.raises(UsageError, match="previous run's report"):
        request.check()
    dataclasses.replace(request, force=True).check()  # --force takes it


@pytest.mark.parametrize("options, message", [
    ({"timeout": -5.0}, "--timeout is -5.0"),
    ({"devices": "-1"}, "-1 is not a GPU index"),
])
def test_certify_target_checks_its_numbers_before_any_worker(tmp_path, no_workers, options, message):
    with pytest.raises(UsageError, match=message):
        run.certify(builders.target_request(tmp_path / "a" / "out", "wrapper", **options))
    assert not (tmp_path / "a").exists()


def test_certify_target_refused_on_a_machine_without_a_gpu_before_a_worker_starts(tmp_path, monkeypatch):
    """Once the target is resolved, a machine that surely has no GPU is refused without a worker
    (it took one worker's torch import to learn, 2.7 s here)."""
    def no_worker(*args, **kwargs):
        raise AssertionError("a worker was started on a machine without a GPU")

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(workers.Process, "__init__", no_worker)
    out = tmp_path / "new" / "out"
    with pytest.raises(UsageError, match=r"\(CUDA_VISIBLE_DEVICES is ''\): certify --target needs the GPU"):
        run.certify(builders.target_request(out, "wrapper", families=["FLUX.1"]))
    assert not (tmp_path / "new").exists()
    with pytest.raises(UsageError, match="unknown target|no target|not a target"):
        run.certify(builders.target_request(out, "no-such-target", families=["FLUX.1"]))


def fixture_dir(tmp_path: Path, poison=None) -> Path:
    directory = tmp_path / "fixtures"
    directory.mkdir()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 64, 64, generator=g).to(torch.bfloat16) for _ in range(3))
    if poison:
        poison(q)
    save_fixture(
        directory / "f.safetensors",
        q,
        k,
        v,
        family="flux.1",
        kind="replica",
        source={"test": 1},
        provenance="random test data",
        bounds=BOUNDS,
    )
    return directory


@pytest.mark.parametrize(
    "poison, count",
    [
        (lambda q: q[:, :, :16].fill_(float("nan")), 2 * 16 * 64),  # a quarter of the query rows
        (lambda q: q[0, 0, 0, 0].fill_(float("inf")), 1),
    ],
)
def test_a_fixture_with_non_finite_values_is_refused(tmp_path, no_workers, poison, count):
    directory = fixture_dir(tmp_path, poison)
    with pytest.raises(UsageError) as refused:
        run.certify(builders.gpu_request(tmp_path / "out", fixture_dirs=[str(directory)]))
    assert str(refused.value).startswith(f"{directory / 'f.safetensors'}: tensor q: {count} of 8192 values")
    assert "reference needs finite inputs" in str(refused.value)
    assert not (tmp_path / "out").exists()


def test_a_missing_gpu_index_is_refused_and_leaves_no_output(tmp_path, monkeypatch):
    monkeypatch.setenv(
        worker_faults.TEST_HOOK, json.dumps({"gpus": [{"name": "Fake H200", "capability": [9, 0]}]})
    )
    out = tmp_path / "new" / "out"
    with pytest.raises(UsageError, match=r"there is no cuda:3: this machine shows 1 GPU\(s\)"):
        run.certify(builders.gpu_request(out, devices="3", fixture_dirs=[str(fixture_dir(tmp_path))]))
    assert not (tmp_path / "new").exists()


def test_refined_lengths_fall_between_the_crossing_sweep_points():
    # (tokens, lower bound, median): no median within 10 % of 1x, so only the crossing is refined
    points = [(1024, 0.4, 0.5), (2048, 0.7, 0.8), (4096, 0.8, 0.85), (8192, 1.3, 1.4), (16384, 1.6, 1.7)]
    # 4096 * 2^(i/8), to 128 tokens: neighbours within 10 % of each other
    assert plan.refined_lengths(points) == [4480, 4864, 5248, 5760, 6272, 6912, 7552]
    assert plan.refined_lengths([(1024, 1.2, 1.3), (4096, 1.5, 1.6)]) == []  # pays everywhere
    assert plan.refined_lengths([(1024, 0.2, 0.3), (4096, 0.5, 0.6)]) == []  # pays nowhere
    # a dip back below 1 gives a second crossing
    assert len(plan.refined_lengths([(1024, 1.1, 1.2), (2048, 0.8, 0.85), (4096, 1.12, 1.2)])) == 7


def test_an_interval_with_an_end_near_the_bar_is_refined_too():
    """Run 11's cuda:1 (docs/results/README.md): the 8,192-token point's lower bound cleared 1x, so
    the crossing lay between 4,096 and 8,192 and nothing between 8,192 and 16,384 was timed, where
    the other GPU put the threshold. An end within 10 % of the bar refines its intervals as well."""
    points = [(4096, 0.7, 0.75), (8192, 1.04, 1.07), (16384, 1.12, 1.18)]
    lengths = plan.refined_lengths(points)
    assert [n for n in lengths if n < 8192] == [4480, 4864, 5248, 5760, 6272, 6912, 7552]
    assert [n for n in lengths if n > 8192] == [8960, 9728, 10624, 11648, 12672, 13824, 14976]
    # a family's own bar: 1.31x lies within 10 % of 1.3, so 16,384-32,768 is refined for it
    assert plan.refined_lengths([(16384, 1.12, 1.2), (32768, 1.25, 1.31)], min_speedups=(1.3,)) == \
        [17920, 19456, 21248, 23168, 25216, 27520, 30080]
    assert plan.refined_lengths([(16384, 1.12, 1.2), (32768, 1.25, 1.31)]) == []


def test_after_a_sweep_the_lengths_around_its_crossover_are_queued(tmp_path):
    """A variant whose lower bound crosses SDPA between 4096 and 8192 tokens at head_dim 128 gets
    seven refined lengths, each with SDPA (not yet timed there) and the variant."""
    shapes = plan.speed_shapes([], quick=False)
    speed = []
    for key, entry in shapes.items():
        ms = 0.5 if entry.shape.q_tokens >= 8192 and entry.shape.head_dim == 128 else 2.0
        speed += [builders.timing("sdpa", key, 1.0, samples_ms=[1.0] * 5),
                  builders.timing("sm90-fp8-cuda", key, ms, samples_ms=[ms] * 5)]
    begun = builders.report([builders.device(speed=speed)], [], shapes, ["sm90-fp8-cuda"], complete=False,
                            finished=None)
    shape = tasks.shape_spec(families.self_attention(24, 4096).as_dict())

    def swept(variant):
        return [tasks.SpeedTask(f"{variant}@k", variant, "k", shape, 1, 5)]

    new_shapes, refined = plan.refinement(begun, 0, swept("sm90-fp8-cuda"))
    keys = [f"b1 h24 q{n} k{n} d128 bfloat16" for n in (4480, 4864, 5248, 5760, 6272, 6912, 7552)]
    # SDPA was not timed there: the variant and SDPA are timed in turn in one worker
    paired = tasks.TaskKind.PAIRED
    assert [(t.id, t.KIND) for t in refined] == [(f"sm90-fp8-cuda+sdpa@{k}", paired) for k in keys]
    assert [(t.variant, t.key, t.shape.q_tokens) for t in refined] == [
        ("sm90-fp8-cuda", k, int(k.split()[2][1:])) for k in keys]
    labels = [f"refined self {n}, head_dim 128" for n in (4480, 4864, 5248, 5760, 6272, 6912, 7552)]
    assert [[(u.family, u.label) for u in new_shapes[k].uses] for k in keys] == [[(None, label)]
                                                                               for label in labels]
    cell = tasks.CellTask("sm90-fp8-cuda|f", "sm90-fp8-cuda", "f", "f.safetensors", 2.5)
    assert plan.refinement(begun, 0, [cell]) == ({}, [])


def test_only_a_full_run_refines_and_follows_up(tmp_path):
    """A pre-flight (--quick) plans its sweep and nothing after it: its thresholds are not the ones a
    profile keeps."""
    from sage_qual.qualification.selection import Selection
    from sage_qual.verdicts.env_record import GpuInfo

    gpu = GpuInfo(index=0, name="Fake H200", capability=[9, 0], memory_gib=141.0, kernel="sm90-fp8-cuda")
    machine = plan.Machine(builders.environment([builders.device()]), [plan.DeviceFacts(gpu, {})])
    chosen = Selection([families.find("FLUX.1")], [], [], [])
    for quick in (False, True):
        planned = plan.build(builders.gpu_request(tmp_path, quick=quick), chosen, machine, ["sm90-fp8-cuda"],
                             in_process=False)
        assert planned.follows_up is not quick
        swept = [t.variant for t in planned.jobs[0][1] if isinstance(t, tasks.SpeedTask)]
        assert swept[:1] == ["sm90-fp8-cuda"]
