"""How a budget is derived from the numerics model's metrics, number by number against values
worked out by hand: every error grown by the margin, the norm ratio's window around 1, the cosine's
distance from 1 grown by the margin squared, the element-wise allowance, outward rounding to 6
decimals; the model's metrics on its finite elements; and the cached budget, expectation and
prediction of a (variant, fixture) pair on a small fixture file."""

import dataclasses
import math

import pytest
import torch

from sage_qual.fixtures.fileformat import load_fixture
from sage_qual.kernels import numerics
from sage_qual.kernels.variants import VARIANTS
from sage_qual.qualification.evidence.report_model import Metrics
from sage_qual.qualification.measure import accuracy, budgets

from ..fakes import random_fixture


@pytest.fixture(autouse=True)
def empty_caches(monkeypatch):
    """Each test starts with budgets' caches empty, as in a fresh process: a test that runs after
    others (or in a mutant forked from a process that ran them, as mutmut does) still reaches the
    model run and the cache logic it checks."""
    monkeypatch.setattr(budgets, "_CACHE", {})
    monkeypatch.setattr(budgets, "_REFERENCES", {})

METRICS = Metrics(rel_l2=0.05, worst_head_rel_l2=0.06, worst_batch_rel_l2=0.055, worst_block_rel_l2=0.08,
                  norm_ratio=0.98, worst_head_cosine=0.999, finite=True, max_abs_error=0.3)


def found(rounding=0.01, **metrics) -> budgets.Expected:
    """The model's numbers of the hand-worked example, with `metrics` changed."""
    return budgets.Expected(dataclasses.replace(METRICS, **metrics), model_finite=True, rounding=rounding)


def test_every_error_bound_is_the_models_error_grown_by_the_margin():
    budget = budgets.from_expected(found())
    assert budget.max_rel_l2 == 0.055
    assert budget.max_head_rel_l2 == 0.066
    assert budget.max_batch_rel_l2 == 0.0605
    assert budget.max_block_rel_l2 == 0.088
    assert budgets.MARGIN == 0.10


def test_the_norm_ratio_window_spans_the_model_and_one_widened_by_the_margin():
    budget = budgets.from_expected(found())  # tolerance 0.1 x 0.05 = 0.005
    assert budget.min_norm_ratio == 0.975
    assert budget.max_norm_ratio == 1.005
    above = budgets.from_expected(found(norm_ratio=1.02))
    assert above.min_norm_ratio == 0.995
    assert above.max_norm_ratio == 1.025


def test_the_norm_ratio_tolerance_never_drops_below_bf16_rounding():
    tiny = found(rel_l2=0.001, norm_ratio=1.0)  # 0.1 x 0.001 is below 2^-9
    budget = budgets.from_expected(tiny)
    assert budget.min_norm_ratio == math.floor((1 - 2**-9) * 1e6) / 1e6 == 0.998046
    assert budget.max_norm_ratio == math.ceil((1 + 2**-9) * 1e6) / 1e6 == 1.001954


def test_the_cosine_bound_grows_its_distance_from_one_by_the_margin_squared():
    assert budgets.from_expected(found()).min_cosine == 0.99879  # 1 - 0.001 x 1.21
    assert budgets.from_expected(found(worst_head_cosine=0.9)).min_cosine == 0.879


@pytest.mark.parametrize("cosine", [1.0, 1.0000405, 0.9999999])
def test_a_cosine_at_or_above_one_gives_a_bound_an_exact_output_meets(cosine):
    assert budgets.from_expected(found(worst_head_cosine=cosine)).min_cosine == 0.999999


def test_the_element_wise_bound_is_twice_the_models_plus_rounding():
    assert budgets.from_expected(found()).max_abs == 0.61
    assert budgets.from_expected(found(rounding=0.0)).max_abs == 0.6


def test_a_wider_margin_widens_every_bound():
    budget = budgets.from_expected(found(), margin=0.5)
    assert budget.max_rel_l2 == 0.075 and budget.max_block_rel_l2 == 0.12
    assert budget.min_norm_ratio == 0.955 and budget.max_norm_ratio == 1.025
    assert budget.min_cosine == 0.99775
    assert budget.max_abs == 0.61  # the element-wise bound has its own factor


def test_bounds_are_rounded_outwards_to_six_decimals():
    # 0.0500001 x 1.1 = 0.05500011: up to 0.055001; a product that lands a hair above 0.055 in
    # binary stays 0.055.
    assert budgets.from_expected(found(rel_l2=0.0500001)).max_rel_l2 == 0.055001
    assert budgets.from_expected(found(worst_head_rel_l2=0.05)).max_head_rel_l2 == 0.055
    assert budgets.from_expected(found(norm_ratio=0.9800004)).min_norm_ratio == 0.975
    assert budgets.from_expected(found(worst_head_cosine=0.99900001)).min_cosine == 0.99879
    assert budgets.from_expected(found(rel_l2=0.0)).max_rel_l2 == 0.0


# The model's metrics ---------------------------------------------------------------------------------


def test_metrics_of_a_finite_prediction_are_measures_errors_plus_the_rounding_allowance():
    ref = torch.randn(1, 2, 64, 16, generator=torch.Generator().manual_seed(0))
    predicted = (ref * 1.01).to(torch.bfloat16)
    expected = budgets.metrics_of(predicted, ref)
    assert expected.model_finite is True
    assert expected.metrics == accuracy.errors(predicted, ref)
    eps = torch.finfo(torch.bfloat16).eps
    assert expected.rounding == pytest.approx(2.0 * eps * ref.abs().max().item(), rel=1e-9)


def test_metrics_of_a_non_finite_prediction_are_those_of_its_finite_elements():
    ref = torch.randn(1, 2, 64, 16, generator=torch.Generator().manual_seed(0))
    predicted = ref * 1.01
    broken = predicted.clone()
    broken[0, 1, 5] = math.nan
    broken[0, 0, 9, 3] = math.inf
    expected = budgets.metrics_of(broken.half(), ref)
    assert expected.model_finite is False
    repaired = torch.where(torch.isfinite(broken), broken.half().float(), ref)  # the reference's own values
    assert expected.metrics == accuracy.errors(repaired, ref)
    assert math.isfinite(expected.metrics.max_abs_error) and expected.metrics.finite is True
    # The rounding allowance is the output dtype's: fp16 here, over the finite reference.
    ref_with_hole = ref.clone()
    ref_with_hole[0, 0, 0, 0] = math.inf
    assert budgets.metrics_of(predicted.half(), ref_with_hole).rounding == pytest.approx(
        2.0 * torch.finfo(torch.float16).eps * ref.abs().max().item(), rel=1e-9
    )


def test_expected_is_the_models_output_measured_against_the_reference():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 64, 64, generator=g).to(torch.bfloat16) for _ in range(3))
    variant = VARIANTS["sm90-fp8-cuda"]
    ref = accuracy.reference(q, k, v)
    want = budgets.metrics_of(numerics.predict(variant, q, k, v), ref)
    assert budgets.expected(variant, q, k, v) == want
    assert budgets.expected(variant, q, k, v, ref=ref * 2) == budgets.metrics_of(
        numerics.predict(variant, q, k, v), ref * 2
    )


# One (variant, fixture) pair, cached -------------------------------------------------------------------


def small_fixture(tmp_path, name, seed, zero_v_channel=False):
    bounds = {"fp16": {"max_rel_l2": 0.1, "min_cosine": 0.99}, "fp8": {"max_rel_l2": 0.1, "min_cosine": 0.99}}
    return load_fixture(random_fixture(tmp_path, name, "generic", bounds, seed, tokens=96,
                                       zero_v_channel=3 if zero_v_channel else None))


def test_a_pairs_budget_expectation_and_prediction_come_from_one_model_run(tmp_path):
    fixture = small_fixture(tmp_path, "one", 1)
    variant = VARIANTS["sm89-fp8-cuda"]
    ref = accuracy.reference(fixture.q, fixture.k, fixture.v)
    predicted = numerics.predict(variant, fixture.q, fixture.k, fixture.v)
    assert torch.equal(budgets.prediction(variant, fixture), predicted)
    assert budgets.prediction(variant, fixture).dtype == torch.bfloat16
    expectation = budgets.expectation(variant, fixture)
    assert dataclasses.replace(expectation, hazards=()) == budgets.metrics_of(predicted, ref)
    assert expectation.hazards == tuple(numerics.hazards(variant, fixture.q, fixture.k, fixture.v))
    assert budgets.budget(variant, fixture) == budgets.from_expected(expectation)


def test_each_variant_and_fixture_has_its_own_budget(tmp_path):
    first, second = small_fixture(tmp_path, "first", 1), small_fixture(tmp_path, "second", 2)
    fp8, fp16 = VARIANTS["sm89-fp8-cuda"], VARIANTS["sm80-fp16-cuda"]
    for fixture in (first, second, first):  # back to a fixture whose reference was dropped
        for variant in (fp8, fp16):
            ref = accuracy.reference(fixture.q, fixture.k, fixture.v)
            predicted = numerics.predict(variant, fixture.q, fixture.k, fixture.v)
            want = budgets.from_expected(budgets.metrics_of(predicted, ref))
            assert budgets.budget(variant, fixture) == want, (variant.name, fixture.name)
    assert budgets.budget(fp8, first) != budgets.budget(fp16, first)


def test_a_zero_v_channel_under_fp8_is_a_non_finite_expectation(tmp_path):
    fixture = small_fixture(tmp_path, "zero", 1, zero_v_channel=True)
    assert budgets.expectation(VARIANTS["sm90-fp8-cuda"], fixture).model_finite is False
    assert budgets.expectation(VARIANTS["sm80-fp16-cuda"], fixture).model_finite is True


def test_callers_cannot_change_the_cache(tmp_path):
    fixture = small_fixture(tmp_path, "copy", 4)
    variant = VARIANTS["sm90-fp8-cuda"]
    budget, expectation = budgets.budget(variant, fixture), budgets.expectation(variant, fixture)
    for record, name in ((budget, "max_rel_l2"), (expectation, "rounding"), (expectation.metrics, "rel_l2")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(record, name, 99.0)
