"""The wrapper never hands the kernel a tensor past the span limit (issue 16), nor a call outside the
verified token range or layouts of a profile; each such call goes to torch with its reason.

The limit is a config value: on the CPU most tests use a small one; the real limit is exercised on
meta tensors (shape and strides without storage) and on a stride-0 view of a tiny storage.
"""

import dataclasses
import re

import pytest
import torch
import torch.nn.functional as F

import sage_qual
from sage_qual import limits
from sage_qual.kernels.variants import LAYOUTS
from sage_qual.serving import wrapper
from sage_qual.serving.config import DEFAULT_CONFIG, WrapperConfig
from sage_qual.serving.eligibility import REASONS, SdpaCall, extent, layout_of, padded_count, refusal

from ..helpers import SMALL, TORCH_SDPA, qkv, rand, wrapped


class NoAutocast:
    def autocast_enabled(self):
        return False


def fused(tokens, heads, head_dim=64, kv_heads=None, batch=1, device="cpu", seed=0):
    """q, k, v as a diffusers-style caller makes them from one fused projection: [B, N, (H+2Hkv)*D]
    split along the last dimension, each viewed as [B, N, H, D] and transposed to [B, H, N, D]."""
    kv_heads = kv_heads or heads
    widths = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    if device == "meta":
        buffer = torch.empty(batch, tokens, sum(widths), dtype=torch.bfloat16, device="meta")
    else:
        buffer = rand(batch, tokens, sum(widths), dtype=torch.bfloat16, seed=seed)
    return tuple(part.view(batch, tokens, h, head_dim).transpose(1, 2)
                 for part, h in zip(buffer.split(widths, dim=-1), (heads, kv_heads, kv_heads), strict=True))


def served(config, args, kwargs=None):
    """(report, fake kernel calls, output, torch's output) of one call in a scope."""
    kwargs = kwargs or {}
    with wrapped(config=config) as (_, fake), sage_qual.sage_attention_scope() as report:
        out = F.scaled_dot_product_attention(*args, **kwargs)
    return report, fake.calls, out, TORCH_SDPA(*args, **kwargs)


# The limit -----------------------------------------------------------------------------------------

def test_default_limit_is_the_largest_signed_32_bit_offset_and_copies_are_on():
    assert limits.MAX_SPAN_ELEMENTS == 2**31 - 1
    assert DEFAULT_CONFIG.max_span_elements == limits.MAX_SPAN_ELEMENTS
    assert DEFAULT_CONFIG.copy_past_span is True  # measured faster than torch (docs/benchmarks.md)
    assert (DEFAULT_CONFIG.max_query_tokens, DEFAULT_CONFIG.max_key_tokens, DEFAULT_CONFIG.layouts) == (
        None, None, None)
    assert {"span", "long"} <= set(REASONS)
    assert REASONS.index("long") == REASONS.index("short") + 1


def address_span(view: torch.Tensor) -> int:
    """Span measured from the values: the view's elements hold their own index in the buffer."""
    return int(view.max() - view.min()) + 1


@pytest.mark.parametrize("make", [
    pytest.param(lambda b: b.view(2, 3, 128, 8), id="contiguous"),
    pytest.param(lambda b: b.view(2, 128, 3, 8).transpose(1, 2), id="transposed"),
    pytest.param(lambda b: b.view(2, 128, 3, 8)[:, :, :2, :].transpose(1, 2), id="fused_like_row"),
    pytest.param(lambda b: b.view(2, 128, 3, 8)[1:, 1:, :, :4].permute(0, 2, 1, 3), id="offset_sliced"),
    pytest.param(lambda b: b.view(2, 3, 128, 8)[:, :, ::2], id="every_other_token"),
])
def test_extent_is_the_address_span_or_the_padded_count(make):
    view = make(torch.arange(2 * 3 * 128 * 8, dtype=torch.float64))
    assert extent(view.shape, view.stride()) == max(address_span(view), padded_count(view.shape))


def test_the_count_is_taken_at_the_sequence_padded_to_128_tokens():
    assert limits.SPAN_PAD_TOKENS == 128
    assert padded_count(torch.Size((2, 3, 129, 64))) == 2 * 3 * 256 * 64
    assert padded_count(torch.Size((2, 3, 128, 64))) == 2 * 3 * 128 * 64
    assert padded_count(torch.Size((2, 3, 1, 64))) == 2 * 3 * 128 * 64


def test_extent_counts_every_element_of_a_stride_0_view_and_nothing_of_an_empty_one():
    view = torch.zeros(1, 1, 1, 64).expand(2, 4, 128, 64)
    assert extent(view.shape, view.stride()) == 2 * 4 * 128 * 64
    assert extent(torch.Size((1, 4, 0, 64)), (0, 0, 64, 1)) == 0


# Through the wrapper, with a small limit --------------------------------------------------------------

def limited(limit, **more):
    return dataclasses.replace(SMALL, max_span_elements=limit, **more)


def detail(span, name, copy, limit):
    return f"span={span} elements of {name}, {copy} in a contiguous copy padded to 128 tokens (limit {limit})"


def test_contiguous_tensors_past_the_limit_go_to_torch_with_the_span_and_limit():
    q, k, v = qkv(q_tokens=128, k_tokens=128)  # 2 x 128 x 64 = 16,384 elements each
    report, calls, out, expected = served(limited(16383), (q, k, v))
    assert dict(report.fallbacks) == {"span": 1} and report.served == 0 and calls == []
    assert report.details["span"] == detail(16384, "query", 16384, 16383)
    assert torch.equal(out, expected)


def test_contiguous_tensors_at_the_limit_are_served():
    report, calls, _, _ = served(limited(16384), qkv(q_tokens=128, k_tokens=128))
    assert (report.served, dict(report.fallbacks), len(calls)) == (1, {}, 1)


def test_a_tensor_whose_padded_copy_is_past_the_limit_goes_to_torch():
    """120 tokens span 15,360 elements; the kernel's copy padded to 128 tokens holds 16,384."""
    report, calls, _, _ = served(limited(15360), qkv(q_tokens=120, k_tokens=120))
    assert report.details["span"] == detail(15360, "query", 16384, 15360) and calls == []


def test_the_detail_names_the_first_tensor_past_the_limit():
    q, k, v = qkv(q_tokens=128, k_tokens=256)  # query 16,384 elements, key and value 32,768
    report, calls, _, _ = served(limited(32767), (q, k, v))
    assert report.details["span"] == detail(32768, "key", 32768, 32767)
    assert calls == []


# A fused [1, 128, 3*2*64] projection: each view spans 127*384 + 2*64 = 48,896 elements from its own
# pointer; its contiguous copy holds 16,384.
FUSED_SPAN = 127 * 3 * 2 * 64 + 2 * 64


def test_without_copies_a_strided_view_past_the_limit_goes_to_torch_though_its_copy_would_fit():
    q, k, v = fused(128, 2)
    assert extent(q.shape, q.stride()) == FUSED_SPAN
    report, calls, out, expected = served(limited(FUSED_SPAN - 1, copy_past_span=False), (q, k, v))
    assert dict(report.fallbacks) == {"span": 1} and calls == []
    assert report.details["span"] == detail(FUSED_SPAN, "query", 16384, FUSED_SPAN - 1)
    assert torch.equal(out, expected)


def test_the_same_view_within_the_limit_reaches_the_kernel_as_the_view():
    q, k, v = fused(128, 2)
    report, calls, _, _ = served(limited(FUSED_SPAN), (q, k, v))
    assert report.served == 1 and report.copied == 0
    assert calls[0].q.stride() == q.stride() and calls[0].q.data_ptr() == q.data_ptr()


def test_with_copy_past_span_the_strided_view_is_served_from_contiguous_copies():
    q, k, v = fused(128, 2)
    report, calls, out, expected = served(limited(FUSED_SPAN - 1, copy_past_span=True), (q, k, v))
    assert (report.served, report.copied, dict(report.fallbacks)) == (1, 1, {})
    [call] = calls
    assert all(t.is_contiguous() for t in (call.q, call.k, call.v))
    assert torch.equal(call.q, q) and torch.equal(call.v, v)
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)


def test_copy_past_span_copies_only_the_tensors_past_the_limit():
    q = rand(1, 128, 2, 64, dtype=torch.bfloat16).transpose(1, 2)  # a view spanning 16,384 elements
    _, k, v = fused(64, 2)  # views spanning 63*384 + 128 = 24,320 elements, 16,384 in a padded copy
    report, calls, _, _ = served(limited(24319, copy_past_span=True), (q, k, v))
    assert report.copied == 1
    [call] = calls
    assert call.q.data_ptr() == q.data_ptr()  # within the limit: handed over as it is
    assert call.k.is_contiguous() and call.k.data_ptr() != k.data_ptr()


def test_copy_past_span_leaves_a_call_whose_copy_is_past_the_limit_too_to_torch():
    q, k, v = qkv(q_tokens=256, k_tokens=128)  # query 32,768 elements, key and value 16,384
    report, calls, _, _ = served(limited(32767, copy_past_span=True), (q, k, v))
    assert dict(report.fallbacks) == {"span": 1} and report.copied == 0 and calls == []


def test_a_value_view_alone_past_the_limit_is_refused():
    q, k, _ = qkv(q_tokens=128, k_tokens=128, dtype=torch.bfloat16)
    _, _, v = fused(128, 2)
    report, calls, _, _ = served(limited(FUSED_SPAN - 1, copy_past_span=False), (q, k, v))
    assert report.details["span"] == detail(FUSED_SPAN, "value", 16384, FUSED_SPAN - 1) and calls == []


def test_out_of_memory_while_copying_falls_back_like_the_kernels_own(monkeypatch):
    def no_memory(call, limit):
        raise torch.OutOfMemoryError("CUDA out of memory (copy)")

    monkeypatch.setattr(wrapper, "within_span", no_memory)
    q, k, v = fused(128, 2)
    report, calls, out, expected = served(limited(FUSED_SPAN - 1, copy_past_span=True), (q, k, v))
    assert dict(report.fallbacks) == {"memory": 1} and report.out_of_memory
    assert "(copy)" in report.details["memory"]
    assert calls == [] and torch.equal(out, expected)


# The real limit, on tensors without storage ---------------------------------------------------------

def test_a_fused_100k_by_56_view_is_refused_at_the_default_limit():
    """issue 16's faulting call: span 2,150,385,664 > 2^31 - 1; each contiguous copy 716,800,000
    elements, 717,488,128 padded to 100,096 tokens."""
    q, k, v = fused(100_000, 56, head_dim=128, device="meta")
    reason, template, values = refusal(SdpaCall(q, k, v), DEFAULT_CONFIG, NoAutocast())
    assert reason == "span"
    assert template % values == detail(2150385664, "query", 717488128, 2147483647)


def test_a_fused_90k_by_56_view_passes_the_span_rule():
    """issue 16: bit-identical to contiguous copies on the H200 at this size (span 1.94e9)."""
    q, k, v = fused(90_000, 56, head_dim=128, device="meta")
    assert refusal(SdpaCall(q, k, v), DEFAULT_CONFIG, NoAutocast()) is None


@pytest.mark.parametrize("tokens, refused", [(299_520, False), (299_521, True)])
def test_contiguous_tensors_at_the_real_boundary(tokens, refused):
    """56 heads x 128: 299,520 tokens (a multiple of 128) hold 2,146,959,360 elements; one token more
    spans 2,146,966,528, under 2^31 - 1, but its copy padded to 299,648 tokens holds 2,147,876,864."""
    q = torch.empty(1, 56, tokens, 128, dtype=torch.bfloat16, device="meta")
    got = refusal(SdpaCall(q, q, q), DEFAULT_CONFIG, NoAutocast())
    assert (got is not None and got[0] == "span") == refused


def test_a_stride_0_view_of_a_tiny_storage_is_refused_by_its_element_count():
    """The kernel's output and quantized copies hold every element of an expanded view."""
    q = torch.zeros(1, 1, 1, 128, dtype=torch.bfloat16).expand(1, 56, 300_000, 128)
    got = refusal(SdpaCall(q, q, q), DEFAULT_CONFIG, NoAutocast())
    assert got[0] == "span"
    assert got[1] % got[2] == detail(128, "query", 56 * 300_032 * 128, 2147483647)


# The verified token range ---------------------------------------------------------------------------

@pytest.mark.parametrize("max_q, max_k, reason, detail", [
    (48, 24, None, None),
    (47, None, "long", "tokens=48/24 (verified up to 47/any)"),
    (None, 23, "long", "tokens=48/24 (verified up to any/23)"),
    (100, 23, "long", "tokens=48/24 (verified up to 100/23)"),
])
def test_calls_above_the_verified_range_go_to_torch(max_q, max_k, reason, detail):
    config = dataclasses.replace(SMALL, max_query_tokens=max_q, max_key_tokens=max_k)
    report, calls, out, expected = served(config, qkv())
    if reason is None:
        assert report.served == 1 and dict(report.fallbacks) == {}
    else:
        assert dict(report.fallbacks) == {reason: 1} and calls == []
        assert report.details[reason] == detail
        assert torch.equal(out, expected)


# Layouts --------------------------------------------------------------------------------------------

def test_layout_of_names_each_layout():
    q, k, v = qkv()
    assert layout_of(q, k, v) == "contiguous"
    assert layout_of(*(t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))) == "transposed"
    assert layout_of(*fused(48, 2)) == "fused_qkv"
    assert layout_of(*fused(48, 4, kv_heads=2, batch=2)) == "fused_qkv"  # GQA: a row of (4 + 2 + 2) heads


def test_layout_of_calls_anything_else_strided():
    q, k, v = qkv()
    transposed = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)]
    assert layout_of(q, transposed[1], transposed[2]) == "strided"  # mixed
    assert layout_of(*(t[:, :, ::2] for t in (q, k, v))) == "strided"  # every other token
    # Fused strides, but three separate buffers: not one projection.
    apart = [fused(48, 2, seed=s)[i] for i, s in enumerate((1, 2, 3))]
    assert layout_of(*apart) == "strided"
    # One buffer, but each token's row longer than q, k and v together.
    buffer = rand(1, 48, 4 * 2 * 64, dtype=torch.bfloat16)
    assert layout_of(*(buffer[..., i * 128:(i + 1) * 128].view(1, 48, 2, 64).transpose(1, 2)
                       for i in range(3))) == "strided"


def test_a_layout_the_profile_did_not_verify_goes_to_torch_naming_it():
    config = dataclasses.replace(SMALL, layouts=("contiguous", "transposed"))
    args = fused(48, 2)
    report, calls, out, expected = served(config, args)
    assert dict(report.fallbacks) == {"layout": 1} and calls == []
    assert report.details["layout"] == "layout fused_qkv (verified: contiguous, transposed)"
    assert torch.equal(out, expected)
    report, calls, _, _ = served(config, qkv())
    assert report.served == 1


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("max_query_tokens", 0, "max_query_tokens=0: give a token count of at least 1"),
        ("max_key_tokens", 1.5, "max_key_tokens=1.5"),
        ("max_span_elements", 0, "max_span_elements=0: give an element count from 1 to 2147483647"),
        ("max_span_elements", None, "max_span_elements=None"),
        # Issue 43: once accepted, so a view spanning 2,147,549,696 elements reached the kernel as it was.
        (
            "max_span_elements",
            2**40,
            "max_span_elements=1099511627776: give an element count from 1 to 2147483647",
        ),
        (
            "max_span_elements",
            2**31,
            "max_span_elements=2147483648: give an element count from 1 to 2147483647",
        ),
        ("layouts", ("contiguous", "nchw"), "layouts=('contiguous', 'nchw'): give a tuple of layout names"),
        ("layouts", "contiguous", "layouts='contiguous'"),
        # Issue 54: each silently accepted before.
        ("check_rows", 0, "check_rows=0: give a whole number of at least 1"),
        ("cache_error_limit", -1, "cache_error_limit=-1: give a whole number of at least 1"),
        ("min_query_tokens", -5, "min_query_tokens=-5"),
        ("min_key_tokens", 512.0, "min_key_tokens=512.0"),
        ("head_dims", (96,), "head_dims=(96,): give a tuple of head sizes the kernels take (64, 128)"),
        ("head_dims", (), "head_dims=()"),
        ("head_dims", 128, "head_dims=128"),
        ("masks", "yes", "masks='yes': give True or False"),
        ("copy_past_span", 1, "copy_past_span=1"),
    ],
)
def test_config_refuses_bad_values_naming_the_field(field, value, message):
    with pytest.raises(ValueError, match=re.escape("WrapperConfig." + message)):
        WrapperConfig(**{field: value})


def test_the_config_takes_the_profiles_span_limit_and_no_more():
    """One limit where the value enters, by a profile or by a caller's config."""
    from sage_qual.verdicts.profile import ProfileGpu

    [maximum] = [
        f.metadata["maximum"] for f in dataclasses.fields(ProfileGpu) if f.name == "max_span_elements"
    ]
    assert maximum == limits.MAX_SPAN_ELEMENTS == WrapperConfig(max_span_elements=maximum).max_span_elements


def test_layout_names_are_the_documented_ones():
    assert LAYOUTS == ("contiguous", "transposed", "fused_qkv", "nhd")


@pytest.mark.parametrize("batch", [2, 3])
def test_layout_of_a_batch_of_more_than_one_reads_its_batch_stride_too(batch):
    """Issue 54: every layout test used batch 1, where the batch stride is never read; a batch taken
    every other item of a larger one is neither transposed nor one fused projection."""
    made = [rand(2 * batch, 48, 2, 64, dtype=torch.bfloat16).transpose(1, 2) for _ in range(3)]
    assert layout_of(*(t[:batch] for t in made)) == "transposed"
    assert layout_of(*(t[::2] for t in made)) == "strided"
    q, k, v = fused(48, 2, batch=2 * batch)
    assert layout_of(q[:batch], k[:batch], v[:batch]) == "fused_qkv"
    assert layout_of(q[::2], k[::2], v[::2]) == "strided"
    contiguous = [rand(2 * batch, 2, 48, 64, dtype=torch.bfloat16) for _ in range(3)]
    assert layout_of(*(t[::2] for t in contiguous)) == "strided"
