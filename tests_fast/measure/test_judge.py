"""The cell judgement: every limit of a budget against its metric, for a kernel's metrics
(accuracy.Accuracy), a stored cell's or a long check's; a missing number never passes; the slice
metrics see a defect confined to one head, one item or one block of rows, and the norm ratio sees a
scale."""

import dataclasses
import math

import pytest
import torch

from sage_qual.qualification.evidence.report_model import Budget, Metrics, Reason, ReasonKind
from sage_qual.qualification.measure import accuracy, judge
from tests_fast import builders

BUDGET = Budget(max_rel_l2=0.055, max_head_rel_l2=0.06, max_batch_rel_l2=0.06, max_block_rel_l2=0.08,
                min_norm_ratio=0.99, max_norm_ratio=1.01, min_cosine=0.998, max_abs=0.5)
GOOD = Metrics(rel_l2=0.05, worst_head_rel_l2=0.055, worst_batch_rel_l2=0.05, worst_block_rel_l2=0.07,
               norm_ratio=1.0, worst_head_cosine=0.999, finite=True, max_abs_error=0.3)


def with_(metrics=GOOD, **changed) -> Metrics:
    return dataclasses.replace(metrics, **changed)


def kinds(metrics, per_element=1.0, budget=BUDGET):
    return [
        r.kind.value
        for r in judge.cell_reasons(metrics, per_element, budget, 2.5, fitness=builders.CONFORMANCE_ONLY)
    ]


def test_a_cell_within_every_limit_passes():
    assert kinds(GOOD) == []


@pytest.mark.parametrize("metric, value, says", [
    ("rel_l2", 0.06, "relative L2 0.06 > 0.055"),
    ("worst_head_rel_l2", 0.2, "worst query head's relative L2"),
    ("worst_batch_rel_l2", 0.2, "worst batch item's relative L2"),
    ("worst_block_rel_l2", 0.2, "worst query-row block's relative L2"),
    ("norm_ratio", 1.1, "output norm / reference norm 1.1 > 1.01"),
    ("norm_ratio", 0.9, "output norm / reference norm 0.9 < 0.99"),
    ("worst_head_cosine", 0.99, "worst head cosine 0.99 < 0.998"),
    ("max_abs_error", 0.6, "largest element error |out - ref| 0.6 > 0.5"),
])
def test_each_limit_fails_alone(metric, value, says):
    reasons = judge.cell_reasons(
        with_(**{metric: value}), 1.0, BUDGET, 2.5, fitness=builders.CONFORMANCE_ONLY
    )
    assert len(reasons) == 1 and reasons[0].kind == ReasonKind.ACCURACY and says in reasons[0].detail


def test_reasons_are_records_with_the_texts_reports_hold():
    """The texts stored in reports and matched by gate, summaries and docs, word for word."""
    worst = with_(rel_l2=0.06, finite=False)
    assert judge.cell_reasons(
        worst, 3.0, BUDGET, 2.5, sdpa_rel_l2=0.002, fitness=builders.CONFORMANCE_ONLY
    ) == [
        Reason(ReasonKind.NON_FINITE, "output not finite where the reference is"),
        Reason(ReasonKind.ACCURACY, "relative L2 0.06 > 0.055 (SDPA in the input precision: 0.002)"),
        Reason(ReasonKind.MEMORY, "extra peak 3.00 bytes per q/k/v element > 2.5"),
    ]
    assert judge.cell_reasons(
        with_(norm_ratio=None), None, BUDGET, 2.5, fitness=builders.CONFORMANCE_ONLY
    ) == [
        Reason(ReasonKind.ACCURACY, "output norm / reference norm (norm_ratio) not measured"),
        Reason(ReasonKind.MEMORY, "extra peak memory not measured"),
    ]
    assert judge.cell_reasons(
        GOOD, 1.0, builders.budget(min_cosine="0.9"), 2.5, fitness=builders.CONFORMANCE_ONLY
    ) == [Reason(ReasonKind.ACCURACY, "budget min_cosine is not a number: '0.9'")]
    assert judge.layout_reasons({"transposed": False}, ["contiguous", "transposed", "fused_qkv"]) == [
        Reason(ReasonKind.LAYOUT, "layout transposed: output differs from the same kernel's on contiguous "
                                  "copies"),
        Reason(ReasonKind.LAYOUT, "layout fused_qkv: not compared with contiguous")]
    assert judge.layout_reasons({"transposed": True}, ["contiguous", "transposed"]) == []


def test_a_kernels_accuracy_and_a_stored_cells_metrics_judge_alike():
    """certify's worker judges an Accuracy; the verdict judges the Cell stored from it."""
    from sage_qual.qualification.evidence import tasks

    for metric, value in (("rel_l2", 0.06), ("worst_head_cosine", 0.99), ("max_abs_error", 0.6),
                          (None, None)):
        found = accuracy.Accuracy(**vars(with_(**({metric: value} if metric else {}))), sdpa_rel_l2=0.002,
                                  error_vs_sdpa=30.0)
        live = judge.cell_reasons(
            found, 1.0, BUDGET, 2.5, found.sdpa_rel_l2, fitness=builders.CONFORMANCE_ONLY
        )
        cell = tasks.judged_cell("sm90-fp8-cuda", "fx", found, BUDGET, live, "fp8", 1.0)
        assert (
            judge.cell_reasons(
                cell.metrics, 1.0, cell.budget, 2.5, cell.sdpa_rel_l2, fitness=builders.CONFORMANCE_ONLY
            )
            == live
        )
        assert bool(live) == (metric is not None)


@pytest.mark.parametrize("value", [None, math.nan, "0.01", True])
def test_a_missing_or_non_numeric_metric_fails(value):
    assert kinds(with_(worst_block_rel_l2=value)) == ["accuracy"]


def test_non_finite_output_and_memory_are_reasons_of_their_own():
    assert kinds(with_(finite=False)) == ["non_finite"]
    assert kinds(with_(finite=None)) == ["non_finite"]
    assert kinds(GOOD, per_element=2.6) == ["memory"]
    assert kinds(GOOD, per_element=None) == ["memory"]


def test_a_non_finite_output_is_one_reason_not_one_per_unmeasured_metric():
    assert kinds(builders.metrics(finite=False)) == ["non_finite"]
    # A finite cell stripped of its norm ratio says so once, though two limits read it.
    assert kinds(with_(norm_ratio=None)) == ["accuracy"]


def test_a_limit_that_is_not_a_number_fails_the_cell():
    assert kinds(GOOD, budget=dataclasses.replace(BUDGET, max_rel_l2="0.1")) == ["accuracy"]
    assert kinds(GOOD, budget=dataclasses.replace(BUDGET, max_abs=math.nan)) == ["accuracy"]


def test_old_class_bounds_judge_as_before():
    """A schema 1 report's budget holds max_rel_l2 and min_cosine only: the limits it lacks are null."""
    assert kinds(GOOD, budget=builders.budget(0.08, 0.99)) == []
    assert kinds(with_(rel_l2=0.09), budget=builders.budget(0.08, 0.99)) == ["accuracy"]


def _pair(seed=0):
    g = torch.Generator().manual_seed(seed)
    ref = torch.randn(2, 4, 256, 64, generator=g)
    return ref, ref + 0.05 * torch.randn(ref.shape, generator=g)


@pytest.mark.parametrize("defect, metric", [
    (lambda out: out.index_fill(1, torch.tensor([2]), 0.0), "worst_head_rel_l2"),
    (lambda out: torch.cat([out[:1], out[1:] * 1.5]), "worst_batch_rel_l2"),
    (lambda out: torch.cat([out[..., :64, :].flip(2), out[..., 64:, :]], 2), "worst_block_rel_l2"),
])
def test_a_defect_confined_to_one_slice_shows_in_that_slice(defect, metric):
    ref, out = _pair()
    clean, broken = accuracy.errors(out, ref), accuracy.errors(defect(out), ref)
    assert getattr(broken, metric) > 10 * getattr(clean, metric)
    assert getattr(broken, metric) > 1.3 * broken.rel_l2  # more than the whole tensor's error shows


def test_a_few_wrong_elements_show_in_the_largest_element_error_not_in_the_aggregates():
    ref, out = _pair(3)
    clean = accuracy.errors(out, ref)
    broken = out.clone()
    broken[1, 2, 100, 7] += 3 * ref.square().mean().sqrt()  # one element off by 3x the output's RMS
    found = accuracy.errors(broken, ref)
    assert found.max_abs_error > 5 * clean.max_abs_error  # clean: about 0.25, now about 3
    assert found.worst_block_rel_l2 - clean.worst_block_rel_l2 < 0.03  # inside an FP8 budget
    assert found.rel_l2 < 1.02 * clean.rel_l2


def test_the_largest_element_error_is_infinite_where_the_output_is_not_finite():
    ref, out = _pair(4)
    out[0, 0, 0, 0] = float("nan")
    assert accuracy.errors(out, ref).max_abs_error == math.inf


def test_a_scale_error_shows_in_the_norm_ratio_not_in_the_cosine():
    ref, out = _pair(1)
    clean, scaled = accuracy.errors(out, ref), accuracy.errors(out * 1.10, ref)
    assert scaled.norm_ratio == pytest.approx(clean.norm_ratio * 1.10, rel=1e-5)
    assert scaled.worst_head_cosine == pytest.approx(clean.worst_head_cosine, abs=1e-6)


def test_a_slice_whose_reference_is_zero_is_measured_against_the_mean_energy():
    ref, out = _pair(2)
    ref[1], out[1] = 0.0, 1e-3  # a batch item attending over zero values
    found = accuracy.errors(out, ref)
    assert math.isfinite(found.worst_batch_rel_l2) and found.worst_batch_rel_l2 < 0.1
