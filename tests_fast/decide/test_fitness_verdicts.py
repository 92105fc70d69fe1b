"""Fitness in the verdicts: a variant whose numerics model predicts its own large error conforms to
that model and is still kept off the family, by the fitness judge, on the CPU prediction and on a
fake GPU through certify and gate; a report written before the fitness judge is judged by it when
read (run 40's comfy-kitchen cell on the Krea-2 outlier replica)."""

import json
import shutil
from pathlib import Path

import pytest

from sage_qual.cli import main
from sage_qual.fixtures.fileformat import shipped_dir
from sage_qual.qualification.decide import checked, verdict
from sage_qual.qualification.evidence import files
from sage_qual.qualification.evidence.report_model import Outcome, ReasonKind
from sage_qual.qualification.run import run
from sage_qual.qualification.selftest import faults as worker_faults
from sage_qual.verdicts import profile

from .. import builders

ROOT = Path(__file__).resolve().parents[2]
RUN40 = ROOT / "docs" / "results" / "run40-h200" / "certify" / "report.json.gz"
OUTLIER = "krea2_b0_outlier_gqa"


@pytest.fixture
def outlier_only(tmp_path) -> Path:
    """The Krea-2 outlier replica alone: comfy-kitchen's INT8 model predicts relative L2 ~0.53 there
    (the H200's kernel 0.508, run 40), within the budget that model derives, past the fixture's 0.3."""
    directory = tmp_path / "fixtures"
    directory.mkdir()
    shutil.copy(shipped_dir() / f"{OUTLIER}.safetensors", directory)
    return directory


def krea2(report) -> verdict.FamilyDecision:
    (gpu,) = verdict.decide(report)
    return next(f for f in gpu.families if f.family == "Krea-2")


def test_the_prediction_keeps_off_a_variant_whose_model_predicts_an_error_the_family_does_not_tolerate(
        tmp_path, outlier_only, capsys):
    run.certify(builders.emulate_request(tmp_path / "out", ["ck-int8-cuda", "sm90-fp8-cuda"], ["Krea-2"],
                                         [str(outlier_only)]))
    decision = krea2(checked.load(tmp_path / "out" / "report.json"))
    assert decision.results.certified == ["sm90-fp8-cuda"]
    (finding,) = decision.results.findings["ck-int8-cuda"]
    assert finding.reason.kind == ReasonKind.UNFIT  # conformance holds: the model is its own budget
    assert finding.reason.detail.startswith("unfit for the family: relative L2 0.5")
    assert "> 0.3" in finding.reason.detail and "InvokeAI PR #9662" in finding.reason.detail
    assert (
        "would fail Krea-2: ck-int8-cuda on krea2_b0_outlier_gqa: unfit for the family"
        in capsys.readouterr().out
    )


def test_gate_names_the_fitness_judge_that_keeps_the_family_off_on_a_fake_gpu(
    tmp_path, outlier_only, monkeypatch, capsys
):
    """comfy-kitchen's kernel computing as its numerics model (the test fault "model"): on its model,
    unfit for Krea-2; without the fault the fake kernel is exact, and Krea-2 is safe."""
    hook = {"gpus": [{"name": "Fake H200", "capability": [9, 0]}], "comfy_kitchen": "0.2.40",
            "faults": {f"ck-int8-cuda|{OUTLIER}": "model"}}
    monkeypatch.setenv(worker_faults.TEST_HOOK, json.dumps(hook))
    out = tmp_path / "out"
    assert (
        main(
            [
                "certify",
                "--variants",
                "ck-int8-cuda",
                "--fixtures",
                str(outlier_only),
                "--families",
                "Krea-2",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    capsys.readouterr()
    code = main(["gate", "--family", "Krea-2", "--report", str(out / "report.json"), "--fixtures",
                 str(outlier_only), "--json"])
    answer = json.loads(capsys.readouterr().out)
    assert code == 1, answer
    (gpu,) = answer["gpus"]
    assert gpu["verdict"] == "keep off"
    kinds = {reason["kind"] for reason in gpu["reasons"]}
    assert "unfit" in kinds and "accuracy" not in kinds, gpu["reasons"]
    assert "unfit for the family: relative L2" in json.dumps(gpu["reasons"])
    # The profile certify wrote carries the same reason for the wrapper to give.
    (certified,) = profile.load(out / "profile.json").gpus
    entry = certified.families["Krea-2"]
    assert entry.served is None and {r.kind for r in entry.reasons} == {ReasonKind.UNFIT}


def test_run_40_read_today_fails_comfy_kitchen_on_the_outlier_replicas_as_unfit_and_keeps_the_h200s_pick():
    report = checked.load(RUN40)
    assert not files.load(RUN40).fitness_judged and report.fitness_judged
    cells = {(c.variant, c.fixture): c for c in report.devices[0].cells}
    krea = cells[("ck-int8-cuda", OUTLIER)]
    assert krea.outcome == Outcome.FAIL and [r.kind for r in krea.reasons] == [ReasonKind.UNFIT]
    assert krea.reasons[0].detail.startswith("unfit for the family: relative L2 0.5084 > 0.3, worst head "
                                             "cosine 0.893 < 0.955")
    qwen = cells[("ck-int8-cuda", "qwen_image_b0_outlier_head")]
    assert ReasonKind.UNFIT in {r.kind for r in qwen.reasons}
    assert cells[("sm90-fp8-cuda", OUTLIER)].outcome == Outcome.PASS
    (gpu,) = verdict.decide(report)
    for family in gpu.families:
        if family.family in ("Krea-2", "Qwen-Image"):
            assert family.variant == "sm90-fp8-cuda"
            assert ReasonKind.UNFIT in {f.reason.kind for f in family.results.findings["ck-int8-cuda"]}
