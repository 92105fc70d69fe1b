"""The served path's cost over calling the same kernel directly (FLUX.1 1024^2 shape), timed with
CUDA events (medians of interleaved repeats, same run). Reported in the benchmark's extra_info and
the results table; a benchmark, so it asserts no time."""

import pytest
import torch
import torch.nn.functional as F

import sage_qual
from sage_qual import measure

from .test_wrapper_gpu import SHAPES, make_qkv

pytestmark = [pytest.mark.slow, pytest.mark.gpu]


def test_served_call_against_direct_kernel(benchmark, sage, box, record):
    sage_qual.uninstall()
    status = sage_qual.install()
    assert status.enabled, status.reason
    variant = status.devices[0].variant
    q, k, v = make_qkv(*SHAPES["flux1-1024"])
    try:
        with sage_qual.sage_attention_scope() as report:
            F.scaled_dot_product_attention(q, k, v)  # the checked first call stays out of the timing
            direct, routed = [], []
            for _ in range(5):  # interleaved, so clock drift hits both alike
                direct.append(measure.median_ms(lambda: measure.call_kernel(sage, variant, q, k, v), 3, 20))
                routed.append(measure.median_ms(lambda: F.scaled_dot_product_attention(q, k, v), 3, 20))

            def served():
                F.scaled_dot_product_attention(q, k, v)
                torch.cuda.synchronize()

            benchmark(served)
        assert report.fallbacks == {}, dict(report.fallbacks)
    finally:
        sage_qual.uninstall()
    direct_ms, routed_ms = sorted(direct)[2], sorted(routed)[2]
    benchmark.extra_info.update(variant=variant.name, direct_ms=direct_ms, served_ms=routed_ms,
                                ratio=routed_ms / direct_ms)
    record(test="served-overhead", variant=variant.name, fixture="flux1-1024", kind="random",
           direct_ms=direct_ms, served_ms=routed_ms, served_over_direct=routed_ms / direct_ms)
