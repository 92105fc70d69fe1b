"""What serving a call from a side stream costs: the legacy-stream bridge (two event waits, the call
on the legacy stream, the output recorded on the caller's stream) against the same call on the
default stream and against torch's SDPA, at issue 24's [1, 24, 16384, 128] bf16, with the GPU's own
kernel. CUDA events, medians of interleaved repeats, ratios in the same run; a benchmark, so it
asserts no time, only that every timed call was served."""

import statistics

import pytest
import torch
import torch.nn.functional as F

import sage_qual
from sage_qual.qualification.measure import accuracy
from sage_qual.serving.torch_sdpa import TORCH_SDPA

from .shapes import make_qkv

pytestmark = [pytest.mark.slow, pytest.mark.gpu]


def test_side_stream_cost(benchmark, sage, box, record):
    sage_qual.uninstall()
    status = sage_qual.install(config=sage_qual.WrapperConfig(min_query_tokens=1, min_key_tokens=1))
    assert status.enabled, status.reason
    variant = status.devices[0].variant
    q, k, v = make_qkv((1, 24, 24, 16384, 16384, 128), torch.bfloat16)
    side = torch.cuda.Stream()

    def on_side():
        with torch.cuda.stream(side):
            return F.scaled_dot_product_attention(q, k, v)

    try:
        with sage_qual.sage_attention_scope() as report:
            F.scaled_dot_product_attention(q, k, v)  # the first-call checks stay out of the timing
            on_side()
            torch.cuda.synchronize()
            default_ms, side_ms, sdpa_ms = [], [], []
            for _ in range(5):
                default_ms.append(accuracy.median_ms(lambda: F.scaled_dot_product_attention(q, k, v), 3, 20))
                side_ms.append(accuracy.median_ms(on_side, 3, 20))
                sdpa_ms.append(accuracy.median_ms(lambda: TORCH_SDPA(q, k, v), 3, 20))
            benchmark(lambda: (on_side(), torch.cuda.synchronize()))
        assert report.fallbacks == {} and report.served == report.calls, report.summary()
    finally:
        sage_qual.uninstall()
    median = statistics.median
    numbers = dict(default_stream_ms=median(default_ms), side_stream_ms=median(side_ms),
                   sdpa_ms=median(sdpa_ms))
    bridge_ms = numbers["side_stream_ms"] - numbers["default_stream_ms"]
    numbers.update(bridge_cost_of_sdpa=bridge_ms / numbers["sdpa_ms"],
                   side_over_default=numbers["side_stream_ms"] / numbers["default_stream_ms"])
    benchmark.extra_info.update(variant=variant.name, **numbers)
    record(test="side-stream-cost", variant=variant.name, fixture="16384-tokens", kind="random", **numbers)
