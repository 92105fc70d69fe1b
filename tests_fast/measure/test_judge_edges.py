"""The judgement at its edges: a metric exactly at its bound passes, each reason's exact words
(SDPA's error beside a relative L2 only), only the limits a budget holds are checked, a finite flag
that is not exactly true fails, and the long checks' layout reasons."""

import dataclasses

import pytest

from sage_qual.qualification.evidence.report_model import Budget, Metrics
from sage_qual.qualification.measure import judge
from tests_fast import builders

BUDGET = {
    "max_rel_l2": 0.05,
    "max_head_rel_l2": 0.06,
    "max_batch_rel_l2": 0.06,
    "max_block_rel_l2": 0.08,
    "min_norm_ratio": 0.99,
    "max_norm_ratio": 1.01,
    "min_cosine": 0.998,
    "max_abs": 0.5,
}
AT_BOUNDS = {
    "rel_l2": 0.05,
    "worst_head_rel_l2": 0.06,
    "worst_batch_rel_l2": 0.06,
    "worst_block_rel_l2": 0.08,
    "norm_ratio": 0.99,
    "worst_head_cosine": 0.998,
    "finite": True,
    "sdpa_rel_l2": 0.002,
    "max_abs_error": 0.5,
}


def pairs(reasons) -> list[tuple[str, str]]:
    """(kind, detail) of each reason, whether reasons come as dicts or as records."""
    found = []
    for reason in reasons:
        kind, detail = (
            (reason["kind"], reason["detail"]) if isinstance(reason, dict) else (reason.kind, reason.detail)
        )
        found.append((getattr(kind, "value", kind), detail))
    return found


def judged(values, per_element=2.5, budget=BUDGET, bound=2.5):
    """The reasons for a stored cell's numbers `values` (a missing one null, sdpa_rel_l2 beside the
    metrics) against the limits `budget` (a missing one null: not checked)."""
    if not isinstance(values, Metrics):
        values = dict(values)
        sdpa_rel_l2 = values.pop("sdpa_rel_l2", None)
        values = Metrics(**{f.name: values.get(f.name) for f in dataclasses.fields(Metrics)})
    else:
        sdpa_rel_l2 = getattr(values, "sdpa_rel_l2", None)
    limits = Budget(**{f.name: budget.get(f.name) for f in dataclasses.fields(Budget)})
    return pairs(
        judge.cell_reasons(values, per_element, limits, bound, sdpa_rel_l2, fitness=builders.CONFORMANCE_ONLY)
    )


def test_every_metric_exactly_at_its_bound_passes():
    assert judged(AT_BOUNDS) == []
    assert judged({**AT_BOUNDS, "norm_ratio": 1.01}) == []


@pytest.mark.parametrize(
    "metric, value, detail",
    [
        ("rel_l2", 0.0500001, "relative L2 0.05 > 0.05 (SDPA in the input precision: 0.002)"),
        ("worst_head_rel_l2", 0.061234, "worst query head's relative L2 0.06123 > 0.06"),
        ("worst_batch_rel_l2", 0.07, "worst batch item's relative L2 0.07 > 0.06"),
        ("worst_block_rel_l2", 0.1, "worst query-row block's relative L2 0.1 > 0.08"),
        ("norm_ratio", 0.98999, "output norm / reference norm 0.99 < 0.99"),
        ("norm_ratio", 1.0100001, "output norm / reference norm 1.01 > 1.01"),
        ("worst_head_cosine", 0.99799, "worst head cosine 0.998 < 0.998"),
        ("max_abs_error", 0.5000001, "largest element error |out - ref| 0.5 > 0.5"),
    ],
)
def test_a_metric_just_past_its_bound_fails_with_its_words(metric, value, detail):
    assert judged({**AT_BOUNDS, metric: value}) == [("accuracy", detail)]


def test_sdpas_error_is_named_only_when_it_was_measured():
    without = {k: v for k, v in AT_BOUNDS.items() if k != "sdpa_rel_l2"}
    assert judged({**without, "rel_l2": 0.06}) == [("accuracy", "relative L2 0.06 > 0.05")]
    assert judged({**AT_BOUNDS, "sdpa_rel_l2": None, "rel_l2": 0.06}) == [
        ("accuracy", "relative L2 0.06 > 0.05")
    ]
    assert judged({**AT_BOUNDS, "sdpa_rel_l2": 0.00123456, "rel_l2": 0.06}) == [
        ("accuracy", "relative L2 0.06 > 0.05 (SDPA in the input precision: 0.00123)")
    ]


def test_memory_at_its_bound_passes_and_past_it_fails_with_its_words():
    assert judged(AT_BOUNDS, per_element=2.5, bound=2.5) == []
    assert judged(AT_BOUNDS, per_element=2.504, bound=2.5) == [
        ("memory", "extra peak 2.50 bytes per q/k/v element > 2.5")
    ]
    assert judged(AT_BOUNDS, per_element=None) == [("memory", "extra peak memory not measured")]


def test_only_the_limits_a_budget_holds_are_checked():
    far = {
        **AT_BOUNDS,
        "worst_head_rel_l2": 9.0,
        "worst_block_rel_l2": 9.0,
        "max_abs_error": 9.0,
        "norm_ratio": 9.0,
    }
    assert judged(far, budget={"max_rel_l2": 0.05, "min_cosine": 0.998}) == []
    assert judged(far, budget={"max_abs": 0.5}) == [("accuracy", "largest element error |out - ref| 9 > 0.5")]
    assert judged(AT_BOUNDS, budget={}) == []


@pytest.mark.parametrize("finite", [1, "true", None, False])
def test_a_finite_flag_that_is_not_true_fails(finite):
    assert judged({**AT_BOUNDS, "finite": finite})[0] == (
        "non_finite",
        "output not finite where the reference is",
    )


def test_a_non_finite_output_is_not_also_unmeasured():
    broken = {**AT_BOUNDS, "finite": False, "rel_l2": None, "worst_head_cosine": float("nan")}
    assert judged(broken) == [("non_finite", "output not finite where the reference is")]


def test_an_unmeasured_metric_is_named_once_with_its_label():
    assert judged({**AT_BOUNDS, "norm_ratio": None}) == [
        ("accuracy", "output norm / reference norm (norm_ratio) not measured")
    ]
    assert judged({**AT_BOUNDS, "rel_l2": float("nan"), "worst_head_cosine": None}) == [
        ("accuracy", "relative L2 (rel_l2) not measured"),
        ("accuracy", "worst head cosine (worst_head_cosine) not measured"),
    ]


def test_a_budget_limit_that_is_not_a_number_says_which():
    assert judged(AT_BOUNDS, budget={"min_cosine": "0.9"}) == [
        ("accuracy", "budget min_cosine is not a number: '0.9'")
    ]
    assert judged(AT_BOUNDS, budget={"max_rel_l2": True}) == [
        ("accuracy", "budget max_rel_l2 is not a number: True")
    ]


def test_integers_are_numbers():
    assert judged({**AT_BOUNDS, "max_abs_error": 0}, budget={"max_abs": 1}) == []


def test_a_kernels_accuracy_is_judged_as_its_stored_numbers():
    from sage_qual.qualification.measure import accuracy

    unmeasured = {name: None for name in ("worst_head_rel_l2", "worst_batch_rel_l2", "worst_block_rel_l2",
                                          "norm_ratio", "max_abs_error")}
    record = accuracy.Accuracy(
        rel_l2=0.06, worst_head_cosine=0.999, finite=True, sdpa_rel_l2=0.002, error_vs_sdpa=30.0, **unmeasured
    )
    assert judged(record, budget={"max_rel_l2": 0.05, "min_cosine": 0.998}) == [
        ("accuracy", "relative L2 0.06 > 0.05 (SDPA in the input precision: 0.002)")
    ]


# Long checks: each declared layout against contiguous -------------------------------------------


def test_identical_layouts_pass_and_contiguous_needs_no_comparison():
    assert (
        pairs(judge.layout_reasons({"transposed": True, "nhd": True}, ["contiguous", "transposed", "nhd"]))
        == []
    )
    assert pairs(judge.layout_reasons({}, ["contiguous"])) == []


def test_a_layout_that_differs_or_was_not_compared_fails_each_with_its_words():
    reasons = pairs(
        judge.layout_reasons(
            {"transposed": False, "fused_qkv": 1}, ["contiguous", "transposed", "nhd", "fused_qkv"]
        )
    )
    assert reasons == [
        ("layout", "layout transposed: output differs from the same kernel's on contiguous copies"),
        ("layout", "layout nhd: not compared with contiguous"),
        ("layout", "layout fused_qkv: output differs from the same kernel's on contiguous copies"),
    ]
