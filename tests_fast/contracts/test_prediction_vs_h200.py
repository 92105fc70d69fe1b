"""certify --emulate cannot contradict the GPU evidence: every (variant, fixture) cell the committed
H200 reports measured non-finite (sage_qual/fixtures/known_failures.json, which
tests_fast/fixtures/test_known_failures.py regenerates from them) is predicted to fail, by the model's
own non-finite output or by a hazard it names; the test lists every disagreement."""

from sage_qual import limits
from sage_qual.fixtures import known
from sage_qual.fixtures.fileformat import shipped_dir
from sage_qual.qualification.evidence import tasks
from sage_qual.qualification.evidence.report_model import Outcome, ReasonKind
from sage_qual.qualification.run import in_process


def measured_non_finite() -> list[tuple[str, str]]:
    return [(variant, name) for name, entry in known.table().items()
            for variant, seen in entry["failures"].items() if "not finite" in seen["how"]]


def predicted(variant: str, fixture: str):
    path = shipped_dir() / f"{fixture}.safetensors"
    task = tasks.CellTask(f"{variant} {fixture}", variant, fixture, str(path), limits.MEMORY_BOUND)
    return in_process.InProcessExecutor().predict(task)


def test_every_cell_the_h200_measured_non_finite_is_predicted_to_fail():
    cells = measured_non_finite()
    assert len(cells) >= 16, cells  # runs 8-22: both IP-Adapter fixtures, qwen_image_b52_value_offset
    outcomes = {(variant, fixture): predicted(variant, fixture).outcome for variant, fixture in cells}
    disagree = [f"{variant} on {fixture}: predicted {outcome.value}"
                for (variant, fixture), outcome in outcomes.items() if outcome != Outcome.FAIL]
    assert not disagree, "certify --emulate contradicts the committed H200 reports: " + "; ".join(disagree)


def test_a_hazard_fails_the_prediction_and_is_named():
    """sm80-fp16-cuda on 4 keys: the model's own output is finite, its stale V tail is a hazard; the
    H200 returned NaN there (docs/results/run18-h200/certify-a/report.md.gz)."""
    cell = predicted("sm80-fp16-cuda", "flux1_ip_adapter_zero_uncond")
    assert cell.metrics.finite is True and cell.outcome == Outcome.FAIL
    assert cell.hazards and cell.hazards[0].startswith("4 keys, fewer than one key block")
    assert [r.kind for r in cell.reasons] == [ReasonKind.NON_FINITE]
    assert cell.reasons[0].detail.startswith("predicted to fail: the numerics model names a hazard: 4 keys")
