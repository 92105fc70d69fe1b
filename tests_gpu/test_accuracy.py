"""Every runnable variant against every activation fixture, judged as certify judges it (the budget
the numerics model derives for the cell, `judge.cell_reasons`), and proof that the variant served
the call when routed through the wrapper.

Where the numerics model predicts a non-finite output (an fp16 accumulator overflowing, a zero V
channel under FP8), the kernel must be non-finite too: then the cell is an expected failure, a
kernel defect the model foresaw (a finite kernel there fails the test: the model is wrong). A
defect measured on a GPU is also listed with its numbers in known_defects.py.
"""

import math

import pytest
import torch
import torch.nn.functional as F

import sage_qual
from sage_qual import records
from sage_qual.fixtures.fileformat import load_fixture
from sage_qual.qualification.measure import accuracy, budgets, judge

from .conftest import FIXTURE_PATHS, MASK_CASES, VARIANT_NAMES
from .known_defects import marks

pytestmark = [pytest.mark.slow, pytest.mark.gpu]

CASES = [
    pytest.param(variant, path, id=f"{variant}-{path.stem}", marks=marks(variant, path.stem))
    for variant, path in [(v, p) for p in FIXTURE_PATHS for v in VARIANT_NAMES] + MASK_CASES
]


@pytest.mark.parametrize("variant_name, fixture_path", CASES)
def test_variant_on_fixture(variant_name, fixture_path, kernels, runnable, wrapper_serving, record):
    variant = runnable(variant_name)
    fixture = load_fixture(fixture_path, device="cuda")
    q, k, v, mask = fixture.q, fixture.k, fixture.v, fixture.mask
    direct = accuracy.call_kernel(kernels(variant), variant, q, k, v, attn_mask=mask)
    found = accuracy.accuracy(direct, q, k, v, attn_mask=mask)
    budget = budgets.budget(variant, fixture)
    expected = budgets.expectation(variant, fixture)
    reasons = judge.cell_reasons(found, 0.0, budget, math.inf, found.sdpa_rel_l2,
                                 fitness=fixture.fitness(variant))
    record(test="accuracy", variant=variant.name, fixture=fixture.name, kind=fixture.kind,
           family=fixture.family, **records.finite_or_none(vars(found)), model_rel_l2=expected.metrics.rel_l2,
           model_finite=expected.model_finite, model_hazards="; ".join(expected.hazards),
           **{f"budget_{key}": x for key, x in vars(budget).items()},
           reasons="; ".join(r.detail for r in reasons))
    label = f"{variant.name} on {fixture.kind} fixture {fixture.name}"
    if expected.hazards and not found.finite:
        pytest.xfail(f"{label}: non-finite output where the numerics model names a hazard: "
                     + "; ".join(expected.hazards))
    if not expected.model_finite:
        assert not found.finite, (f"{label}: the numerics model predicts a non-finite output, the "
                                  f"kernel's is finite ({found.rel_l2:.4g}): the model is wrong here")
        pytest.xfail(f"{label}: non-finite output, as the numerics model predicts (a kernel defect)")
    assert not reasons, f"{label}: " + "; ".join(r.detail for r in reasons)

    # Through the wrapper, forced to this variant (masked calls allowed for a masked fixture): served,
    # and bit-identical to the direct call.
    with wrapper_serving(variant, masks=mask is not None), sage_qual.sage_attention_scope() as report:
        routed = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
    assert report.served == 1, f"{label}: wrapper fell back ({dict(report.fallbacks)})"
    assert torch.equal(routed, direct), f"{label}: wrapper output differs from the direct kernel call"
