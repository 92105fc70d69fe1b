"""The suite catches kernel defects, and only where they reach: the fake kernel (sage_qual.testing),
returning what the numerics model says the H200's kernel returns, wrapped with each defect of
`sage_qual.qualification.detection`; certify's judgement on every shipped fixture must keep off
exactly the families the defect reaches. docs/detection.md holds the matrix."""

import pytest

from sage_qual.fixtures.fileformat import list_fixtures, load_fixture, shipped_dir
from sage_qual.qualification import budgets, detection, measure
from sage_qual.serving.variants import VARIANTS
from sage_qual.testing import FakeSageAttention

VARIANT = VARIANTS["sm90-fp8-cuda"]  # the kernel the field reports were tried with (H200)


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


@pytest.mark.parametrize("defect", detection.DEFECTS, ids=lambda d: d.name)
def test_defect_keeps_off_exactly_the_families_it_reaches(bench, failing, baseline, defect):
    newly, caught = detection.kept_off(VARIANT, *bench, defect, failing)
    # Caught by a fixture that passed before wherever the family was not off already, and never
    # on a family the defect cannot reach; with the defect the gate keeps off exactly these.
    assert defect.reaches - baseline <= newly <= defect.reaches, f"caught on {sorted(caught)}"
    assert newly | baseline == defect.reaches | baseline


def test_a_defect_that_changes_nothing_keeps_nothing_off(bench, failing):
    harmless = detection.Defect("none", "returns the kernel's output", frozenset(), lambda call: call.out)
    assert detection.kept_off(VARIANT, *bench, harmless, failing)[0] == frozenset()

