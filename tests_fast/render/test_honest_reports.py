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
from sage_qual.fixtures import known
from sage_qual.fixtures.fileformat import save_fixture
from sage_qual.qualification import selection
from sage_qual.qualification.decide import checked, verdict
from sage_qual.qualification.render import plots, summary
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
    said = "is a --quick report: it ran the smallest fixture of each family and those with a known failure"
    assert said in answer["problem"]
    assert "stale" not in answer["problem"]


def fixture(directory: Path, name: str, tokens: int, **extra) -> None:
    generator = torch.Generator().manual_seed(tokens)
    q, k, v = (torch.randn(1, 2, tokens, 64, generator=generator).to(torch.bfloat16) for _ in range(3))
    save_fixture(directory / f"{name}.safetensors", q, k, v, family="SDXL", kind="replica", source={"t": 1},
                 provenance="test", bounds=PUBLISHED, **extra)


@pytest.fixture(scope="module")
def predicted_quick(tmp_path_factory):
    """certify --emulate --quick on three SDXL fixtures: the smallest runs, and so does the one whose
    calibration records a kernel that returned inf; the other is left out."""
    root = tmp_path_factory.mktemp("honest")
    fixtures = root / "fixtures"
    fixtures.mkdir()
    fixture(fixtures, "small", 128)
    fixture(fixtures, "large", 192)
    fixture(fixtures, "stress", 256, calibration={"kernels": {
        "sm86-fp16-triton": {"finite": False, "rel_l2": float("inf")},
        "sm89-fp8-cuda": {"finite": True, "rel_l2": 0.25},
        "sm90-fp8-cuda": {"finite": True, "rel_l2": 0.02}}})
    data = records.dump(run.certify(builders.emulate_request(
        root / "out", variants=["sm90-fp8-cuda", "sm80-fp16-cuda"], families=["SDXL"],
        fixture_dirs=[str(fixtures)], quick=True)))
    return data, (root / "out" / "report.md").read_text()


def test_a_quick_report_runs_what_is_known_to_fail_and_names_what_it_left_out(predicted_quick):
    data, text = predicted_quick
    assert [f["name"] for f in data["fixtures"]] == ["small", "stress"]  # stress: a known failure
    left_out = text.split("## Left out by --quick", 1)[1].split("\n## ", 1)[0]
    assert f"| large | SDXL | {known.NOTHING_RAN} |" in left_out
    assert "| small |" not in left_out and "| stress |" not in left_out


def test_a_predicted_report_claims_no_timing_and_no_gpu(predicted_quick):
    _, text = predicted_quick
    assert "not timed" in text.lower() and "Not timed (a predicted report: no GPU ran)." in text
    for claim in ("runs here", "never measured faster", "cuda:0", "sm_00", "| shape | used by |",
                  "Break-even per variant"):
        assert claim not in text, claim
    assert "| SDXL | would pass | would pass | - |" in text


def test_a_predicted_report_says_per_variant_what_the_terminal_says(tmp_path, capsys):
    """Issue 54: the report said "would pass" for a family where any variant passed, and "-" under "why
    not", while the terminal printed FAIL for the kernel of every sm89/sm90/sm120 GPU."""
    fixture(tmp_path, "plain", 128)
    generator = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 128, 64, generator=generator).to(torch.bfloat16) for _ in range(3))
    v[..., 3] = 0  # a zero V channel: FP8 kernels scale V per channel by its maximum, 0/0 (their model)
    save_fixture(tmp_path / "zero_v.safetensors", q, k, v, family="SDXL", kind="replica", source={"t": 2},
                 provenance="test", bounds=PUBLISHED)
    run.certify(builders.emulate_request(tmp_path / "out", ["sm90-fp8-cuda", "sm80-fp16-cuda"], ["SDXL"],
                                         [str(tmp_path)]))
    terminal = capsys.readouterr().out.splitlines()
    said = {line.split()[0]: line.split()[-1] for line in terminal if line.startswith(("sm90-", "sm80-"))}
    assert said == {"sm90-fp8-cuda": "FAIL", "sm80-fp16-cuda": "pass"}
    text = (tmp_path / "out" / "report.md").read_text()
    row = next(line for line in text.splitlines() if line.startswith("| SDXL |"))
    assert row.startswith("| SDXL | would fail | would pass | sm90-fp8-cuda on zero_v: output not finite"), (
        row
    )
    header = text.splitlines()[text.splitlines().index(row) - 2]
    assert header == "| family | sm90-fp8-cuda (sm_90) | sm80-fp16-cuda (sm_80) | why not |"
    html = (tmp_path / "out" / "report.html").read_text()
    assert "would fail" in html and "sm90-fp8-cuda on zero_v: output not finite" in html


def test_a_predicted_plot_sets_the_prediction_against_the_published_bound(predicted_quick):
    data, _ = predicted_quick
    typed = checked.parse(data, "report.json")
    published = {f.name: f.bounds for f in typed.fixtures}
    for cell in typed.devices[0].cells:
        assert plots.heat_ratio(cell, published) == pytest.approx(
            cell.metrics.rel_l2 / PUBLISHED[cell.accuracy_class.value]["max_rel_l2"])


def test_quick_on_the_shipped_fixtures_keeps_every_file_the_h200_saw_fail():
    """Issue 40: --quick left out every fixture with a known failure and printed "pass" in all 64 cells."""
    chosen = selection.select(None, None, quick=True)
    ran = {f.name for f in chosen.fixtures}
    failed = {f.name for f in selection.read_fixtures(selection.fixture_dirs(None)) if known.failed(f)}
    assert {
        "flux1_ip_adapter_zero_uncond",
        "sdxl_ip_adapter_zero_uncond",
        "qwen_image_b52_value_offset",
    } <= failed
    assert failed <= ran and chosen.left_out
    assert not {f.fixture for f in chosen.left_out} & ran


def test_the_terminal_names_what_quick_left_out(predicted_quick):
    data, _ = predicted_quick
    written = checked.parse(data, "predicted")
    left = [selection.LeftOut("large", "SDXL", [known.NOTHING_RAN])]
    printed = summary.text(written, Path("out"), verdict.decide(written), left)
    assert printed.splitlines()[-1] == (
        "left out by --quick: 1 fixture(s), not run (report.md lists what the "
        "H200 measured on each): large (SDXL)"
    )
    assert "left out" not in summary.text(written, Path("out"), verdict.decide(written))


def test_the_terminal_folds_one_cause_of_several_variants_into_one_line(tmp_path, capsys):
    """Issue 54: the same 200-character sentence was printed once per variant (9 times)."""
    generator = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 128, 64, generator=generator).to(torch.bfloat16) for _ in range(3))
    v[..., 3] = 0  # every FP8 kernel's model divides by the zero channel's maximum
    save_fixture(tmp_path / "zero_v.safetensors", q, k, v, family="SDXL", kind="replica", source={"t": 2},
                 provenance="test", bounds=PUBLISHED)
    fp8 = ["sm89-fp8-cuda", "sm90-fp8-cuda", "sm120-fp8-perwarp"]
    variants = [*fp8, "sm80-fp16-cuda"]
    run.certify(builders.emulate_request(tmp_path / "out", variants, ["SDXL"], [str(tmp_path)]))
    failing = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  would fail ")]
    assert failing == [f"  would fail SDXL: {', '.join(fp8)} on zero_v: output not finite where the "
                       "reference is"]
