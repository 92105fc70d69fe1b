"""The suite catches kernel defects, and only where they reach: the fake kernel (sage_qual.testing),
returning what the numerics model says the H200's kernel returns, wrapped with each defect of
`sage_qual.qualification.detection`; the cells certify would write for every shipped fixture, read
by the gate's `verdict.decide()`, must keep off exactly the families the defect reaches (and those
the clean kernel keeps off already). docs/detection.md holds the matrix."""

import json
import math
from pathlib import Path

import pytest

from sage_qual.fixtures.fileformat import list_fixtures, load_fixture, shipped_dir
from sage_qual.limits import MEMORY_BOUND
from sage_qual.qualification import budgets, detection, judge, measure, report_model, verdict
from sage_qual.serving.variants import VARIANTS
from sage_qual.testing import FakeSageAttention

VARIANT = VARIANTS["sm90-fp8-cuda"]  # the kernel the field reports were tried with (H200)
# A complete two-H200 report (B's test data): its speed evidence, our fixtures and cells.
SAMPLE = Path(__file__).resolve().parent / "data" / "sample_h200_2gpu.json"
EXTRA_BYTES = 1.5  # per q/k/v element, within the memory bound: memory is not what is tested here


class _Package:
    def __init__(self, module):
        self.module = module


@pytest.fixture(scope="module")
def bench():
    """Every shipped fixture, the fake kernel's clean output on it (the model's), its reference."""
    fixtures = [load_fixture(p) for p in list_fixtures(shipped_dir())]
    fake = FakeSageAttention()

    def as_modelled(exact):
        call = fake.calls[-1]
        fixture = next(f for f in fixtures if f.q is call.q)
        assert call.keywords["sm_scale"] == fixture.q.shape[-1] ** -0.5
        return budgets.prediction(VARIANT, fixture)

    fake.return_value(as_modelled)
    package = _Package(fake.module())
    clean = {f.name: measure.call_kernel(package, VARIANT, f.q, f.k, f.v) for f in fixtures}
    assert [c.function for c in fake.calls] == [VARIANT.function] * len(fixtures)
    references = {f.name: measure.reference(f.q, f.k, f.v) for f in fixtures}
    return fixtures, clean, references


def test_every_fixture_is_read_by_some_family(bench):
    fixtures, _, _ = bench
    assert all(detection.owners(f) for f in fixtures)


def test_the_clean_kernel_fails_only_where_the_model_predicts_a_kernel_defect(failing, baseline):
    # FP8 V scale without epsilon: NaN on the IP-Adapter fixtures' all-zero V (numerics.py).
    assert failing == {"sdxl_ip_adapter_zero_uncond", "flux1_ip_adapter_zero_uncond"}
    assert baseline == {"SDXL", "FLUX.1"}


def test_at_least_eight_defects_including_the_three_of_the_field():
    names = {d.name for d in detection.DEFECTS}
    assert len(names) >= 8
    assert {"gqa_second_half_gets_first", "head_dim_64_scaled_1.10", "nan_last_row_partial_keys"} <= names


@pytest.fixture(scope="module")
def failing(bench):
    """The fixtures the clean kernel already fails."""
    return detection.failing(VARIANT, *bench)


@pytest.fixture(scope="module")
def baseline(bench, failing):
    """Families the clean kernel already keeps off."""
    fixtures, _, _ = bench
    return frozenset().union(*(detection.owners(f) for f in fixtures if f.name in failing))


def _cell(fixture, metrics: dict) -> dict:
    budget = budgets.budget(VARIANT, fixture)
    reasons = judge.cell_reasons(metrics, EXTRA_BYTES, budget, MEMORY_BOUND)
    numbers = {k: (None if isinstance(x, float) and not math.isfinite(x) else x) for k, x in metrics.items()}
    return {"variant": VARIANT.name, "fixture": fixture.name, "outcome": "fail" if reasons else "pass",
            "reasons": reasons, "accuracy_class": VARIANT.accuracy_class, "bounds": budget, **numbers,
            "extra_bytes_per_element": EXTRA_BYTES, "seconds": 0.1}


def kept_off_by_the_gate(fixtures, outputs, references) -> frozenset[str]:
    """The families `verdict.decide()` keeps off for a report holding these outputs' cells."""
    data = json.loads(SAMPLE.read_text())
    data["options"]["variants"] = [VARIANT.name]
    data["fixtures"] = [{"name": f.name, "family": f.family, "kind": f.kind,
                         "dtype": str(f.dtype).removeprefix("torch."), "q": list(f.q.shape),
                         "k": list(f.k.shape), "sha256": f.sha256, "bounds": f.bounds,
                         "provenance": f.provenance} for f in fixtures]
    cells = [_cell(f, measure.errors(outputs[f.name], references[f.name])) for f in fixtures]
    for device in data["devices"]:
        device["cells"] = cells
    gpu = verdict.decide(report_model.from_dict(data, "detection test"))[0]
    return frozenset(d.family for d in gpu.families if d.verdict == verdict.Verdict.KEEP_OFF)


@pytest.fixture(scope="module")
def gate_baseline(bench):
    return kept_off_by_the_gate(*bench)


@pytest.mark.parametrize("defect", detection.DEFECTS, ids=lambda d: d.name)
def test_defect_keeps_off_exactly_the_families_it_reaches(bench, gate_baseline, defect):
    fixtures, clean, references = bench
    defective = {f.name: defect.apply(detection.Call(f.q, f.k, f.v, clean[f.name], f.q.shape[-1] ** -0.5))
                 for f in fixtures}
    off = kept_off_by_the_gate(fixtures, defective, references)
    # Every family it reaches is kept off; any other family keeps the verdict it had without it.
    assert off == defect.reaches | gate_baseline, f"kept off {sorted(off)}, baseline {sorted(gate_baseline)}"


def test_the_gate_keeps_off_without_a_defect_only_what_the_model_predicts_and_the_uncertified(gate_baseline):
    # SDXL, FLUX.1: NaN on the IP-Adapter zero V; FLUX.2 and LTX-2 have no fixtures (not certified).
    assert gate_baseline == {"SDXL", "FLUX.1", "FLUX.2", "LTX-2"}


def test_a_defect_that_changes_nothing_keeps_nothing_off(bench, failing):
    harmless = detection.Defect("none", "returns the kernel's output", frozenset(), lambda call: call.out)
    assert detection.kept_off(VARIANT, *bench, harmless, failing)[0] == frozenset()

