"""The wrapper on a real GPU: what it serves, what it leaves to torch, and what it costs in memory.

Each test runs with every runnable variant forced into the kernel table (the GPU's own kernel
among them), at real model shapes.
"""

import functools

import pytest
import torch
import torch.nn.functional as F

import sage_qual
from sage_qual import records
from sage_qual.limits import MEMORY_BOUND
from sage_qual.qualification.measure import accuracy
from sage_qual.serving.config import WrapperConfig

from .conftest import VARIANT_NAMES
from .shapes import SHAPES, make_qkv

pytestmark = [pytest.mark.slow, pytest.mark.gpu]

MiB = 2**20
variants = pytest.mark.parametrize("variant_name", VARIANT_NAMES)
shapes = pytest.mark.parametrize("shape_name", list(SHAPES))


@variants
@shapes
def test_scope_output_is_the_kernels(variant_name, shape_name, kernels, runnable, wrapper_serving, record):
    variant = runnable(variant_name)
    q, k, v = make_qkv(*SHAPES[shape_name])
    gqa = q.shape[1] != k.shape[1]
    direct = accuracy.call_kernel(kernels(variant), variant, q, k, v)
    with wrapper_serving(variant), sage_qual.sage_attention_scope() as report:
        routed = F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
    assert report.served == 1, dict(report.fallbacks)
    assert torch.equal(routed, direct)
    found = accuracy.accuracy(direct, q, k, v)
    record(test="random-shape", variant=variant.name, fixture=shape_name, kind="random",
           **records.finite_or_none(vars(found)))


@variants
def test_outside_scope_masked_and_autocast_calls_are_torchs(variant_name, runnable, wrapper_serving):
    variant = runnable(variant_name)
    q, k, v = make_qkv(*SHAPES["flux1-1024"])
    expected = accuracy.TORCH_SDPA(q, k, v)
    mask = torch.ones(q.shape[2], k.shape[2], device="cuda", dtype=torch.bool).tril()
    with wrapper_serving(variant):
        outside = F.scaled_dot_product_attention(q, k, v)
        with sage_qual.sage_attention_scope() as report:
            masked = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                autocast = F.scaled_dot_product_attention(q, k, v)
    assert torch.equal(outside, expected)
    assert torch.equal(masked, accuracy.TORCH_SDPA(q, k, v, attn_mask=mask))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert torch.equal(autocast, accuracy.TORCH_SDPA(q, k, v))
    assert report.served == 0 and report.fallbacks == {"mask": 1, "autocast": 1}


@variants
def test_gqa_reaches_the_kernel_unexpanded(variant_name, kernels, runnable, wrapper_serving, monkeypatch):
    """Each provider's kernel (thu-ml's and comfy-kitchen's: device run 42 found this test reading
    comfy-kitchen's function from thu-ml's module) gets the 12 key heads, not 48 copies."""
    variant = runnable(variant_name)
    package = kernels(variant)
    seen = []
    kernel = getattr(package.module, variant.function)

    @functools.wraps(kernel)  # keep the real signature: install() checks its keywords
    def spy(q, k, v, **keywords):
        seen.append((q.shape[1], k.shape[1], v.shape[1]))
        return kernel(q, k, v, **keywords)

    monkeypatch.setattr(package.module, variant.function, spy)  # install() picks the spy up
    q, k, v = make_qkv(*SHAPES["krea2-gqa-48q-12kv"])
    with wrapper_serving(variant), sage_qual.sage_attention_scope() as report:
        F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert report.served == 1, dict(report.fallbacks)
    assert seen == [(48, 12, 12)]


@variants
@pytest.mark.parametrize("shape_name", ["flux1-1024", "krea2-gqa-48q-12kv"])
def test_memory_of_first_and_later_calls(variant_name, shape_name, runnable, wrapper_serving, record):
    """Extra peak allocation per call <= MEMORY_BOUND bytes per element of q+k+v, the checked first
    call no more than a later call + 1 MiB, and nothing left allocated after the scope."""
    variant = runnable(variant_name)
    q, k, v = make_qkv(*SHAPES[shape_name])
    gqa = q.shape[1] != k.shape[1]
    elements = accuracy.elements(q, k, v)
    with wrapper_serving(variant):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        with sage_qual.sage_attention_scope() as report:
            first, first_extra = accuracy.extra_peak_bytes(
                lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa), 0)
            del first
            later, later_extra = accuracy.extra_peak_bytes(
                lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa), 0)
            del later
        torch.cuda.synchronize()
        left = torch.cuda.memory_allocated() - before
    record(test="memory", variant=variant.name, fixture=shape_name, kind="random",
           first_call_bytes_per_element=first_extra / elements,
           later_bytes_per_element=later_extra / elements)
    assert report.served == 2, dict(report.fallbacks)
    assert first_extra / elements <= MEMORY_BOUND
    assert later_extra / elements <= MEMORY_BOUND
    assert first_extra <= later_extra + MiB
    assert left == 0


def test_native_kernel_passes_first_call_check_on_flux(box, caplog):
    """The fixed kernel table serves a FLUX.1 call on this GPU and logs the kernel (`WrapperConfig()`:
    the built-in H200 defaults serve from 16,384 tokens and would leave this 4,608-token call to torch)."""
    sage_qual.uninstall()
    caplog.set_level("INFO", logger="sage_qual")
    status = sage_qual.install(WrapperConfig())
    try:
        assert status.enabled, status.reason
        q, k, v = make_qkv(*SHAPES["flux1-1024"])
        with sage_qual.sage_attention_scope() as report:
            F.scaled_dot_product_attention(q, k, v)
        assert report.served == 1, dict(report.fallbacks)
        device = status.devices[0]
        assert not device.retired
        assert any(device.variant.function in r.getMessage() and "serves attention" in r.getMessage()
                   for r in caplog.records)
    finally:
        sage_qual.uninstall()
