"""`certify --target` end to end in real worker processes on the fake CUDA and fake kernel, and
`certify --emulate` on the CPU: the same report, loaded strictly, with the target or the
prediction named, and `gate` refusing a predicted report."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from sage_qual.cli import main
from sage_qual.fixtures.fileformat import load_fixture, save_fixture, shipped_dir
from sage_qual.qualification.decide import checked
from sage_qual.qualification.evidence import tasks
from sage_qual.qualification.run import in_process, run
from sage_qual.qualification.selftest import faults as worker_faults

from .. import builders

H200 = {"name": "Fake H200", "capability": [9, 0]}
A100 = {"name": "Fake A100", "capability": [8, 0]}
BOUNDS = {"fp16": {"max_rel_l2": 0.05, "min_cosine": 0.99}, "fp8": {"max_rel_l2": 0.08, "min_cosine": 0.99}}


def fixtures_dir(directory, zero_v_channel: str | None = None):
    """Two small fixtures (FLUX.1 and Qwen-Image). `zero_v_channel` names the family whose fixture
    has one V channel all zero: FP8 kernels scale V per channel by its maximum, so the numerics
    model predicts 0/0 there (a non-finite output), FP16 kernels do not."""
    directory.mkdir()
    g = torch.Generator().manual_seed(0)
    for name, family in (("flux", "flux.1"), ("qwen", "qwen-image")):
        q, k, v = (torch.randn(1, 2, 64, 64, generator=g).to(torch.bfloat16) for _ in range(3))
        if family == zero_v_channel:
            v[..., 3] = 0
        save_fixture(directory / f"{name}.safetensors", q, k, v, family=family, kind="replica",
                     source={"test": name}, provenance="random test data", bounds=BOUNDS)
    return directory


@pytest.fixture
def fake_gpus(monkeypatch):
    def use(*gpus, faults=None):
        monkeypatch.setenv(worker_faults.TEST_HOOK, json.dumps({"gpus": list(gpus), "faults": faults or {}}))

    return use


def test_a_target_is_certified_per_family_in_workers(tmp_path, fake_gpus, capsys):
    fake_gpus(H200)
    out = tmp_path / "out"
    directory = fixtures_dir(tmp_path / "f")
    code = main(["certify", "--target", "wrapper:sm90-fp8-cuda", "--fixtures", str(directory),
                 "--families", "FLUX.1", "Qwen-Image", "--out", str(out)])
    assert code == 0
    data = checked.load(out / "report.json")  # strict: every key, type and cell's outcome checked
    assert data.target == "wrapper:sm90-fp8-cuda" and data.options.variants == ["wrapper:sm90-fp8-cuda"]
    cells = {c.fixture: c for c in data.devices[0].cells}
    assert {c.outcome.value for c in cells.values()} == {"pass"}
    assert cells["flux"].accuracy_class.value == "fp8"
    printed = capsys.readouterr().out
    assert "Fake H200 (sm_90)  FLUX.1       safe: every fixture of the family passed" in printed
    assert "Target: `wrapper:sm90-fp8-cuda`" in (out / "report.md").read_text()
    assert main(["merge", str(out / "report.json")]) == 0
    table = capsys.readouterr().out.splitlines()
    assert "| target |" in table[0] and "| wrapper:sm90-fp8-cuda |" in table[2]


def test_a_target_that_cannot_run_on_the_gpu_gets_skips_with_the_reason(tmp_path, fake_gpus, capsys):
    fake_gpus(A100)
    out = tmp_path / "out"
    directory = fixtures_dir(tmp_path / "f")
    assert main(["certify", "--target", "wrapper:sm90-fp8-cuda", "--fixtures", str(directory),
                 "--out", str(out)]) == 0
    device = json.loads((out / "report.json").read_text())["devices"][0]
    reasons = device["not_supported"]["wrapper:sm90-fp8-cuda"]
    assert any("(needs >= (9, 0))" in r for r in reasons), reasons
    assert {c["outcome"] for c in device["cells"]} == {"skip"}
    printed = capsys.readouterr().out
    assert "Fake A100 (sm_80)  FLUX.1       not qualified: " in printed and "NOT SAFE" not in printed


def test_a_failing_fixture_keeps_its_family_unsafe_and_no_other(tmp_path, fake_gpus):
    # sageattn() returns noise on the Qwen-Image fixture: nothing between it and the app checks it.
    fake_gpus(H200, faults={"qwen": "noise"})
    directory = fixtures_dir(tmp_path / "f")
    data = run.certify(builders.target_request(tmp_path / "out", "sageattn",
                                                     fixture_dirs=[str(directory)],
                                                     families=["FLUX.1", "Qwen-Image"]))
    lines = builders.summarized(data, tmp_path / "out").splitlines()
    assert any("FLUX.1" in line and line.endswith("safe: every fixture of the family passed")
               for line in lines), lines
    qwen = next(line for line in lines if "Qwen-Image" in line)
    assert "NOT SAFE: sageattn on qwen (cuda:0): relative L2" in qwen


def test_the_wrappers_first_call_check_keeps_a_noisy_kernel_away_from_the_app(tmp_path, fake_gpus):
    # The same noise behind our wrapper: its first-call check retires the GPU and PyTorch serves the
    # call, so the cell is no evidence for SageAttention either way.
    fake_gpus(H200, faults={"qwen": "noise"})
    data = run.certify(builders.target_request(
        tmp_path / "out", "wrapper:sm90-fp8-cuda", fixture_dirs=[str(fixtures_dir(tmp_path / "f"))],
        families=["Qwen-Image"]))
    qwen = builders.summarized(data, tmp_path / "out").splitlines()[1]
    assert "not qualified: " in qwen
    assert "did not run SageAttention on this call: kernel_error: first-call" in qwen


def test_sigterm_leaves_a_partial_report_and_exit_130(tmp_path):
    """SIGTERM while the integration hangs on the second fixture: the first cell is kept, the report
    says it was interrupted, no verdict is drawn, and the exit code says so."""
    out = tmp_path / "out"
    # PYTHONFAULTHANDLER: should the parent ever abort again (it once did under load, rc -6, before the
    # pool joined its pipe readers), its stderr shows every thread's stack.
    env = {**os.environ, "PYTHONFAULTHANDLER": "1",
           worker_faults.TEST_HOOK: json.dumps({"gpus": [H200], "faults": {"qwen": "hang"}})}
    parent = subprocess.Popen([sys.executable, "-m", "sage_qual", "certify", "--target", "sageattn",
                               "--fixtures", str(fixtures_dir(tmp_path / "f")), "--out", str(out)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # until the first cell is on disk
        try:
            if json.loads((out / "report.json").read_text())["devices"][0]["cells"]:
                break
        except (OSError, ValueError, IndexError):
            pass
        time.sleep(0.05)
    parent.send_signal(signal.SIGTERM)
    stdout, stderr = parent.communicate(timeout=60)
    assert parent.returncode == 130, stderr
    data = checked.load(out / "report.json")
    assert not data.complete and data.stopped == "interrupted (SIGINT or SIGTERM)"
    assert [c.fixture for c in data.devices[0].cells] == ["flux"]
    assert "Traceback" not in stderr and "PARTIAL REPORT" in (out / "report.md").read_text()


@pytest.mark.parametrize("args, message", [
    (["--target", "nonsense"], "unknown target 'nonsense'"),
    (["--target", "wrapper", "--variants", "sm90-fp8-cuda"], "leave out --emulate and --variants"),
    (["--target", "wrapper", "--emulate"], "leave out --emulate and --variants"),
])
def test_bad_target_arguments_are_one_line_and_exit_2(tmp_path, args, message, capsys):
    assert main(["certify", *args, "--out", str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err.strip()
    assert message in error and "\n" not in error


def test_emulate_predicts_each_variant_and_gate_refuses_the_report(tmp_path, capsys):
    out = tmp_path / "out"
    directory = fixtures_dir(tmp_path / "f", zero_v_channel="qwen-image")
    assert main(["certify", "--emulate", "--fixtures", str(directory), "--variants", "sm90-fp8-cuda",
                 "sm80-fp16-cuda", "--families", "FLUX.1", "Qwen-Image", "--out", str(out)]) == 0
    data = checked.load(out / "report.json")
    assert data.predicted and data.complete and data.devices[0].speed == []
    cells = data.devices[0].cells
    assert len(cells) == 4 and all(c.extra_bytes_per_element is None for c in cells)
    printed = capsys.readouterr().out
    assert "would fail Qwen-Image: sm90-fp8-cuda on qwen: output not finite where the reference is" in printed
    assert "sm80-fp16-cuda on qwen" not in printed and "would fail FLUX.1" not in printed
    assert (out / "report.md").read_text().startswith("# PREDICTED SageAttention certification")
    assert main(["gate", "--family", "FLUX.1", "--report", str(out / "report.json")]) == 2
    assert "is a predicted report" in capsys.readouterr().err


def test_the_prediction_is_the_numerics_models_output_judged_against_its_budget():
    import math

    from sage_qual.kernels import numerics
    from sage_qual.kernels.variants import VARIANTS
    from sage_qual.qualification.measure import accuracy, budgets, judge

    fixture = load_fixture(sorted(shipped_dir().glob("*.safetensors"))[0])
    variant = VARIANTS["sm90-fp8-cuda"]
    task = tasks.CellTask(f"{variant.name}|{fixture.name}", variant.name, fixture.name, str(fixture.path),
                          2.5)
    cell = in_process.InProcessExecutor().worker.run(task)
    expected = accuracy.accuracy(numerics.predict(variant, fixture.q, fixture.k, fixture.v),
                                fixture.q, fixture.k, fixture.v)
    assert cell.metrics.rel_l2 == pytest.approx(expected.rel_l2) and cell.accuracy_class == "fp8"
    assert cell.budget == budgets.budget(variant, fixture)
    reasons = judge.cell_reasons(expected, 0.0, cell.budget, math.inf, fitness=builders.CONFORMANCE_ONLY)
    assert cell.outcome == ("fail" if reasons else "pass")


def test_comfy_kitchens_variant_is_certified_beside_thu_mls_on_fake_gpus(tmp_path, monkeypatch, capsys):
    """Both providers installed (the test hook's fake comfy-kitchen beside the fake sageattention):
    certify measures each provider's variant on every fixture, and the report names comfy-kitchen."""
    monkeypatch.setenv(worker_faults.TEST_HOOK, json.dumps({"gpus": [H200], "comfy_kitchen": "0.2.40"}))
    out = tmp_path / "out"
    assert main(["certify", "--variants", "ck-int8-cuda", "sm90-fp8-cuda", "--fixtures",
                 str(fixtures_dir(tmp_path / "f")), "--families", "FLUX.1", "--out", str(out)]) == 0
    data = checked.load(out / "report.json")
    measured = {(c.variant, c.fixture) for c in data.devices[0].cells if c.measured}
    assert {("ck-int8-cuda", "flux"), ("sm90-fp8-cuda", "flux")} <= measured
    assert [(o.provider, o.version) for o in data.environment.other_providers] == [
        ("comfy-kitchen", "0.2.40")
    ]
