"""Every runnable variant against every activation fixture: accuracy, finiteness, and proof that
the variant served the call when routed through the wrapper."""

import pytest
import torch
import torch.nn.functional as F

import sage_qual
from sage_qual.fixtures.fileformat import load_fixture
from sage_qual.qualification import measure

from .conftest import FIXTURE_PATHS, VARIANT_NAMES
from .known_defects import marks

pytestmark = [pytest.mark.slow, pytest.mark.gpu]

CASES = [
    pytest.param(variant, path, id=f"{variant}-{path.stem}", marks=marks(variant, path.stem))
    for path in FIXTURE_PATHS
    for variant in VARIANT_NAMES
]


@pytest.mark.parametrize("variant_name, fixture_path", CASES)
def test_variant_on_fixture(variant_name, fixture_path, sage, runnable, wrapper_serving, record):
    variant = runnable(variant_name)
    fixture = load_fixture(fixture_path, device="cuda")
    q, k, v = fixture.q, fixture.k, fixture.v
    direct = measure.call_kernel(sage, variant, q, k, v)
    accuracy = measure.accuracy(direct, q, k, v)
    bounds = fixture.bounds[variant.accuracy_class]
    record(test="accuracy", variant=variant.name, fixture=fixture.name, kind=fixture.kind,
           **accuracy.as_dict(), max_rel_l2=bounds["max_rel_l2"], min_cosine=bounds["min_cosine"])
    label = f"{variant.name} on {fixture.kind} fixture {fixture.name}"
    assert accuracy.finite, f"{label}: non-finite output where the float32 reference is finite"
    assert accuracy.rel_l2 <= bounds["max_rel_l2"], f"{label}: {accuracy}"
    assert accuracy.worst_head_cosine >= bounds["min_cosine"], f"{label}: {accuracy}"

    # Through the wrapper, forced to this variant: served, and bit-identical to the direct call.
    with wrapper_serving(variant), sage_qual.sage_attention_scope() as report:
        routed = F.scaled_dot_product_attention(q, k, v, enable_gqa=q.shape[1] != k.shape[1])
    assert report.served == 1, f"{label}: wrapper fell back ({dict(report.fallbacks)})"
    assert torch.equal(routed, direct), f"{label}: wrapper output differs from the direct kernel call"
