"""The app's tests: its own CPU behaviour, and its SageAttention integration qualified on the GPU by
sage-qual's plugin (one test per activation fixture; skipped with the reason without a GPU)."""

import pytest
import torch
import torch.nn.functional as F
from downstream_app.attention import attention


def test_cpu_calls_are_plain_sdpa():
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 32, 64, generator=generator) for _ in range(3))
    assert torch.equal(attention(q, k, v), F.scaled_dot_product_attention(q, k, v))


def test_the_configured_target_is_this_apps_function(pytestconfig):
    from sage_qual.qualification.integrations import targets

    target = targets.resolve(pytestconfig.getini("sage_qual_target"))  # a typo there fails here
    assert target.attention is attention


@pytest.mark.sage_qual(families=["FLUX.1", "Qwen-Image", "Wan 2.2"])
def test_sage_attention_is_safe_on_this_gpu(sage_qual_fixture, sage_qual_budget, sage_qual_check):
    cell = sage_qual_check(sage_qual_fixture)  # fails with the reasons unless served within budget
    assert cell.metrics.rel_l2 <= sage_qual_budget.max_rel_l2
