"""The compiled operator's contract, by torch.library.opcheck (issue 43): its schema, autograd
registration, fake implementation and AOT dispatch agree with what its body returns, for transposed
views, grouped-query heads, odd lengths and a value head size of its own, served by the fake kernel
inside a scope and left to torch outside one."""

import pytest
import torch

import sage_qual
from sage_qual.serving import compiled
from sage_qual.testing import FakeCuda, FakeGpu, FakeSageAttention


def _bf16(*shape):
    return torch.randn(*shape, dtype=torch.bfloat16)


CASES = {
    "gqa_odd_lengths": lambda: (_bf16(1, 4, 37, 64), _bf16(1, 2, 41, 64), _bf16(1, 2, 41, 64), None, True),
    "transposed_views": lambda: (*(_bf16(1, 37, 4, 64).transpose(1, 2) for _ in range(3)), 0.2, False),
    "value_head_size_32": lambda: (_bf16(2, 3, 33, 64), _bf16(2, 3, 17, 64), _bf16(2, 3, 17, 32), None,
                                   False),
}


@pytest.fixture
def installed():
    with FakeCuda([FakeGpu((9, 0), "NVIDIA H200")]), FakeSageAttention().installed() as fake:
        config = sage_qual.WrapperConfig(min_query_tokens=16, min_key_tokens=16)
        assert sage_qual.install(config).enabled
        yield fake
        sage_qual.uninstall()


@pytest.mark.parametrize("op", [compiled.sdpa, compiled.sdpa_outside_cuda_graphs], ids=lambda op: op._name)
@pytest.mark.parametrize("case", list(CASES))
def test_the_operator_passes_opcheck(installed, op, case):
    query, key, value, scale, gqa = CASES[case]()
    results = torch.library.opcheck(op, (query, key, value, None, 0.0, False, scale, gqa))
    assert set(results.values()) == {"SUCCESS"}, results


@pytest.mark.parametrize("case", list(CASES))
def test_a_served_call_returns_what_the_fake_implementation_promises(installed, case):
    """opcheck's own runs do not see the thread's scope, so the served path is checked here: the
    kernel's output (or torch's, for the other value head size) has the fake's shape, dtype and strides."""
    query, key, value, scale, gqa = CASES[case]()
    arguments = (query, key, value, None, 0.0, False, scale, gqa)
    with sage_qual.sage_attention_scope() as report:
        out = compiled.sdpa(*arguments)
    promised = compiled._fake(*arguments)
    assert (out.shape, out.dtype, out.stride()) == (promised.shape, promised.dtype, promised.stride())
    assert report.served == (case != "value_head_size_32"), report.summary()
