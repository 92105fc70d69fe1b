"""--quick and predicted reports say what they are: a --quick report names the fixtures it left out
and the known failures they carry, and the gate refuses it as such (not as "stale"); a predicted
report says "not timed" and shows no GPU, break-even or speed table it does not have, and its plot
sets the prediction against the fixture's published bound (its budget is the prediction plus a
margin, so against the budget every cell shows about 0.91)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sage_qual import records
from sage_qual.fixtures.fileformat import save_fixture
from sage_qual.qualification.decide import checked
from sage_qual.qualification.render import plots
from sage_qual.qualification.run import run

from .. import builders

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "tests_fast" / "data" / "sample_h200_2gpu.json"
PUBLISHED = {"fp16": {"max_rel_l2": 0.05, "min_cosine": 0.99}, "fp8": {"max_rel_l2": 0.1, "min_cosine": 0.99}}


def test_the_gate_refuses_a_quick_report_as_such(tmp_path):
    """On the sample's machine (tests_fast/cli_child.py), where the full report enables FLUX.1."""
    data = json.loads(SAMPLE.read_text())
    data["options"]["quick"] = True
    path = tmp_path / "quick.json"
    path.write_text(json.dumps(data))
    done = subprocess.run([sys.executable, "-m", "tests_fast.cli_child", "gate", "--family", "FLUX.1",
                           "--report", str(path), "--json"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    answer = json.loads(done.stdout)
    assert done.returncode == 2 == answer["exit_code"], done.stderr
    assert "a --quick report cannot enable a family: " in answer["problem"]
    assert "stale" not in answer["problem"]


def fixture(directory: Path, name: str, tokens: int, **extra) -> None:
    generator = torch.Generator().manual_seed(tokens)
    q, k, v = (torch.randn(1, 2, tokens, 64, generator=generator).to(torch.bfloat16) for _ in range(3))
    save_fixture(directory / f"{name}.safetensors", q, k, v, family="SDXL", kind="replica", source={"t": 1},
                 provenance="test", bounds=PUBLISHED, **extra)


@pytest.fixture(scope="module")
def predicted_quick(tmp_path_factory):
    """certify --emulate --quick on two SDXL fixtures: the larger is left out, and its calibration
    records a kernel that returned inf."""
    root = tmp_path_factory.mktemp("honest")
    fixtures = root / "fixtures"
    fixtures.mkdir()
    fixture(fixtures, "small", 128)
    fixture(fixtures, "stress", 256, calibration={"kernels": {
        "sm86-fp16-triton": {"finite": False, "rel_l2": float("inf")},
        "sm89-fp8-cuda": {"finite": True, "rel_l2": 0.25},
        "sm90-fp8-cuda": {"finite": True, "rel_l2": 0.02}}})
    data = records.dump(run.certify(builders.emulate_request(
        root / "out", variants=["sm90-fp8-cuda", "sm80-fp16-cuda"], families=["SDXL"],
        fixture_dirs=[str(fixtures)], quick=True)))
    return data, (root / "out" / "report.md").read_text()


def test_a_quick_report_names_what_it_left_out_and_the_known_failures(predicted_quick):
    _, text = predicted_quick
    left_out = text.split("## Left out by --quick", 1)[1].split("\n## ", 1)[0]
    assert ("| stress | SDXL | sm86-fp16-triton not finite (its calibration); sm89-fp8-cuda relative L2 "
            "0.25 over the published bound 0.1 (its calibration) |") in left_out
    assert "| small |" not in left_out


def test_a_predicted_report_claims_no_timing_and_no_gpu(predicted_quick):
    _, text = predicted_quick
    assert "not timed" in text.lower() and "Not timed (a predicted report: no GPU ran)." in text
    for claim in ("runs here", "never measured faster", "cuda:0", "sm_00", "| shape | used by |",
                  "Break-even per variant"):
        assert claim not in text, claim
    assert "| SDXL | would pass | sm90-fp8-cuda, sm80-fp16-cuda | - |" in text


def test_a_predicted_plot_sets_the_prediction_against_the_published_bound(predicted_quick):
    data, _ = predicted_quick
    typed = checked.parse(data, "report.json")
    published = {f.name: f.bounds for f in typed.fixtures}
    for cell in typed.devices[0].cells:
        assert plots.heat_ratio(cell, published) == pytest.approx(
            cell.rel_l2 / PUBLISHED[cell.accuracy_class.value]["max_rel_l2"])
