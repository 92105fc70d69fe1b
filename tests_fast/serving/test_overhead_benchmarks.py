"""What the wrapper adds to every SDPA call, on the CPU (pytest-benchmark; nothing here asserts a
time). torch's function is replaced by a no-op before install(), so each benchmark times the
wrapper alone; `bare-call` times a Python call of the same arguments in the same run, the
baseline the others are divided by (docs/benchmarks.md)."""

import pytest
import torch
import torch.nn.functional as F

import sage_qual
from sage_qual.testing import FakeCuda, FakeGpu, FakeSageAttention

# A quarter second per benchmark after its 2000 rounds: each is a sub-microsecond call, so that is
# still 13,000-49,000 rounds here (pytest-benchmark's default second cost the fast suite 3.5 s).
pytestmark = pytest.mark.benchmark(group="wrapper-overhead", min_rounds=2000, max_time=0.25, warmup=True)


def noop(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return query


@pytest.fixture
def tensors():
    return tuple(torch.empty(1, 2, 64, 64, dtype=torch.bfloat16) for _ in range(3))  # "short": falls back


@pytest.fixture
def wrapped_noop(monkeypatch):
    monkeypatch.setattr(F, "scaled_dot_product_attention", noop)
    with FakeCuda([FakeGpu((9, 0))]), FakeSageAttention().installed():
        assert sage_qual.install().enabled
        yield
        sage_qual.uninstall()


def test_bare_call(benchmark, tensors):
    assert benchmark(noop, *tensors) is tensors[0]


def test_installed_outside_scope(benchmark, tensors, wrapped_noop):
    assert F.scaled_dot_product_attention is not noop
    assert benchmark(F.scaled_dot_product_attention, *tensors) is tensors[0]


def test_fallback_inside_scope(benchmark, tensors, wrapped_noop):
    with sage_qual.sage_attention_scope() as report:
        assert benchmark(F.scaled_dot_product_attention, *tensors) is tensors[0]
    assert report.served == 0 and set(report.fallbacks) == {"short"}
