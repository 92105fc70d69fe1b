"""What serving a call past the span limit from contiguous copies costs, against leaving it to
torch's SDPA (the default), on q, k, v views into one fused [1, N, 3*56*128] bf16 projection:

- N = 100,000 (span 2.15e9, past the limit): torch's SDPA on the views against the wrapper with
  `copy_past_span` (three 1.4 GB copies, then the kernel);
- N = 80,000 (span 1.72e9, within it): the same two, and the kernel called directly on the views
  (what the wrapper serves there by default, less its few microseconds of host time), the wrapper
  made to copy by a limit under the views' span.

CUDA events, one warm-up call per path, then five interleaved rounds; medians and each path's ratio
to torch's SDPA in the same run go to the results table (`record`). A benchmark: it asserts only
which path served the wrapper's calls, never a time. About 20 s on an H200 (estimated: 30 calls of
about half a second).
"""

import statistics

import pytest
import torch
import torch.nn.functional as F

import sage_qual
from sage_qual.qualification.measure import accuracy
from sage_qual.serving.config import WrapperConfig

pytestmark = [pytest.mark.slow, pytest.mark.gpu]

HEADS, HEAD_DIM, ROUNDS = 56, 128, 5


def fused_views(tokens: int):
    gen = torch.Generator("cuda").manual_seed(0)
    fused = torch.randn(1, tokens, 3 * HEADS * HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
    return tuple(t.view(1, tokens, HEADS, HEAD_DIM).transpose(1, 2) for t in fused.chunk(3, dim=-1))


def interleaved_medians(paths: dict) -> dict[str, float]:
    """Median ms per path: one warm-up call each, then ROUNDS rounds calling each path once."""
    times = {name: [] for name in paths}
    for call in paths.values():
        call()
    torch.cuda.synchronize()
    for _ in range(ROUNDS):
        for name, call in paths.items():
            times[name] += accuracy.timings_ms(call, warmup=0, repeats=1)
    return {name: statistics.median(ms) for name, ms in times.items()}


@pytest.mark.parametrize("tokens", [100_000, 80_000])
def test_copy_and_kernel_against_torch_sdpa_on_a_fused_view(tokens, sage, record):
    q, k, v = fused_views(tokens)
    # 100,000 tokens: past the default limit. 80,000: within it, so the wrapper is given a limit
    # between the padded copies (5.7e8 elements) and the views' span (1.7e9) to make it copy.
    limit = WrapperConfig().max_span_elements if tokens == 100_000 else 10**9
    sage_qual.uninstall()
    status = sage_qual.install(WrapperConfig(copy_past_span=True, max_span_elements=limit))
    assert status.enabled, status.reason
    variant = status.devices[0].variant
    paths = {"torch_sdpa": lambda: accuracy.TORCH_SDPA(q, k, v),
             "copy_and_kernel": lambda: F.scaled_dot_product_attention(q, k, v)}
    if tokens == 80_000:  # the kernel on the views themselves (the wrapper's default there)
        paths["kernel_on_view"] = lambda: accuracy.call_kernel(sage, variant, q, k, v)
    try:
        with sage_qual.sage_attention_scope() as report:  # counts the wrapper's calls only
            medians = interleaved_medians(paths)
    finally:
        sage_qual.uninstall()
    calls = ROUNDS + 1
    assert (report.served, report.copied, dict(report.fallbacks)) == (calls, calls, {}), report.summary()
    ratios = {f"{name}_over_torch": ms / medians["torch_sdpa"] for name, ms in medians.items()
              if name != "torch_sdpa"}
    record(test="span-copy-benchmark", variant=variant.name, kind=f"fused {tokens}x{HEADS}x{HEAD_DIM} bf16",
           **{f"{name}_ms": ms for name, ms in medians.items()}, **ratios)
