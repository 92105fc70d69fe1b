"""The served path's cost over calling the same kernel directly (FLUX.1 1024^2 shape), timed with
CUDA events in the same run: per call with a synchronization after each (the latency of one call,
host time included in full) and back to back (as a pipeline issues calls, where GPU time hides host
time), plus the host time per call. Medians of interleaved repeats, reported in the benchmark's
extra_info and the results table; a benchmark, so it asserts no time."""

import statistics
import timeit

import pytest
import torch
import torch.nn.functional as F

import sage_qual
from sage_qual.qualification.measure import accuracy
from sage_qual.serving import eligibility, platform, wrapper

from .shapes import SHAPES, make_qkv

pytestmark = [pytest.mark.slow, pytest.mark.gpu]


def test_served_call_against_direct_kernel(benchmark, sage, box, record):
    sage_qual.uninstall()
    status = sage_qual.install(config=sage_qual.WrapperConfig())  # 1536/512: served (the H200's own
    # built-in thresholds, 16,384 tokens, would leave this 4,608-token shape to torch)
    assert status.enabled, status.reason
    variant = status.devices[0].variant
    q, k, v = make_qkv(*SHAPES["flux1-1024"])
    try:
        with sage_qual.sage_attention_scope() as report:
            F.scaled_dot_product_attention(q, k, v)  # the checked first call stays out of the timing
            direct, routed, direct_piped, routed_piped = [], [], [], []
            for _ in range(5):  # interleaved, so clock drift hits both alike
                direct.append(accuracy.median_ms(lambda: accuracy.call_kernel(sage, variant, q, k, v), 3, 20))
                routed.append(accuracy.median_ms(lambda: F.scaled_dot_product_attention(q, k, v), 3, 20))
                direct_piped.append(
                    accuracy.pipelined_ms(lambda: accuracy.call_kernel(sage, variant, q, k, v)))
                routed_piped.append(accuracy.pipelined_ms(lambda: F.scaled_dot_product_attention(q, k, v)))

            def served():
                F.scaled_dot_product_attention(q, k, v)
                torch.cuda.synchronize()

            benchmark(served)
        assert report.fallbacks == {}, dict(report.fallbacks)
    finally:
        sage_qual.uninstall()
    median = statistics.median
    numbers = dict(
        direct_ms=median(direct), served_ms=median(routed),
        direct_pipelined_ms=median(ms for ms, _ in direct_piped),
        served_pipelined_ms=median(ms for ms, _ in routed_piped),
        direct_host_us=median(us for _, us in direct_piped),
        served_host_us=median(us for _, us in routed_piped),
    )
    numbers.update(
        served_over_direct=numbers["served_ms"] / numbers["direct_ms"],
        pipelined_served_over_direct=numbers["served_pipelined_ms"] / numbers["direct_pipelined_ms"])
    benchmark.extra_info.update(variant=variant.name, **numbers)
    record(test="served-overhead", variant=variant.name, fixture="flux1-1024", kind="random", **numbers)


def test_host_time_of_the_served_path_without_the_kernel(benchmark, sage, box, record):
    """What the wrapper itself costs the host per served call on this machine, the kernel replaced
    by a no-op after the first (checked) call; its parts timed alone with timeit."""
    sage_qual.uninstall()
    status = sage_qual.install(config=sage_qual.WrapperConfig())  # 1536/512, as above
    assert status.enabled, status.reason
    q, k, v = make_qkv(*SHAPES["flux1-1024"])
    state = wrapper._installed
    cuda = platform.current()
    call, _ = eligibility.bind((q, k, v), {})
    try:
        with sage_qual.sage_attention_scope() as report:
            F.scaled_dot_product_attention(q, k, v)
            state.kernels[0] = lambda q, k, v, sm_scale, attn_mask: q  # as the wrapper calls it
            benchmark(F.scaled_dot_product_attention, q, k, v)
        assert report.fallbacks == {} and report.served > 1, report.summary()
    finally:
        sage_qual.uninstall()

    def per_call_us(fn, number=20000):
        return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6

    def device_guard():
        with cuda.device_guard(0):
            pass

    parts = dict(
        wrapper_us=benchmark.stats.stats.median * 1e6,
        rules_us=per_call_us(lambda: eligibility.refusal(call, state.config, cuda)),
        device_check_us=per_call_us(lambda: wrapper._device_refusal(state, call, cuda, None, None)),
        device_guard_us=per_call_us(device_guard),
    )
    benchmark.extra_info.update(parts)
    record(test="served-host-time", variant=status.devices[0].variant.name, fixture="flux1-1024",
           kind="random", **parts)
