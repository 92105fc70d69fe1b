"""Which kernel serves which GPU, with which keywords, on which device; and the fakes themselves."""

import contextlib
import functools
import inspect
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F

import sage_qual
from sage_qual.kernels.variants import KERNEL_FUNCTIONS, VARIANTS
from sage_qual.testing import FakeCuda, FakeGpu, FakeSageAttention, exact_attention, on_device

from ..helpers import TORCH_SDPA, qkv, wrapped

KERNELS = tuple(KERNEL_FUNCTIONS)
# Names of upstream's kernel functions, as the expectations below use them.
FP16_CUDA = "sageattn_qk_int8_pv_fp16_cuda"
FP16_TRITON = "sageattn_qk_int8_pv_fp16_triton"
FP8_CUDA = "sageattn_qk_int8_pv_fp8_cuda"
FP8_SM90 = "sageattn_qk_int8_pv_fp8_cuda_sm90"


@dataclass
class RecordingSage(FakeSageAttention):
    """The fake, also recording the keywords each kernel was called with explicitly (not its defaults)
    and offering `sageattn`, which the wrapper must never call."""

    explicit: list = field(default_factory=list)
    sageattn_calls: list = field(default_factory=list)

    def module(self):
        module = super().module()
        for name in KERNELS:
            function = getattr(module, name, None)
            if function is not None:
                setattr(module, name, self._recording(function))

        def sageattn(q, k, v, tensor_layout="HND", is_causal=False, sm_scale=None, return_lse=False,
                     **kwargs):
            self.sageattn_calls.append(kwargs)
            return exact_attention(q, k, v, sm_scale or q.shape[-1] ** -0.5)

        module.sageattn = sageattn
        return module

    def _recording(self, function):
        @functools.wraps(function)
        def kernel(*args, **kwargs):
            self.explicit.append((function.__name__, len(args), dict(kwargs)))
            return function(*args, **kwargs)
        return kernel


# The kernel table ------------------------------------------------------------------------------------

COMMON = {"tensor_layout": "HND", "is_causal": False, "smooth_k": False}
# What upstream sageattn() calls per capability (sageattention/core.py), plus the fp32-accumulating
# variant where torch's CUDA is older than 12.8: the expectation, typed from upstream, not read from
# the registry under test.
TABLE = [
    pytest.param((8, 0), (13, 0), FP16_CUDA, {"pv_accum_dtype": "fp32"}, id="sm80"),
    pytest.param((8, 0), (12, 4), FP16_CUDA, {"pv_accum_dtype": "fp32"}, id="sm80_cuda12.4"),
    pytest.param((8, 6), (13, 0), FP16_TRITON, {}, id="sm86"),
    pytest.param((8, 9), (12, 8), FP8_CUDA, {"pv_accum_dtype": "fp32+fp16"}, id="sm89_cuda12.8"),
    pytest.param((8, 9), (13, 0), FP8_CUDA, {"pv_accum_dtype": "fp32+fp16"}, id="sm89_cuda13.0"),
    pytest.param((8, 9), (12, 6), FP8_CUDA, {"pv_accum_dtype": "fp32+fp32"}, id="sm89_cuda12.6"),
    pytest.param((8, 9), (11, 8), FP8_CUDA, {"pv_accum_dtype": "fp32+fp32"}, id="sm89_cuda11.8"),
    pytest.param((9, 0), (13, 0), FP8_SM90, {"pv_accum_dtype": "fp32+fp32"}, id="sm90"),
    pytest.param((9, 0), (12, 4), FP8_SM90, {"pv_accum_dtype": "fp32+fp32"}, id="sm90_cuda12.4"),
    pytest.param((12, 0), (13, 0), FP8_CUDA, {"qk_quant_gran": "per_warp", "pv_accum_dtype": "fp32+fp16"},
                 id="sm120_cuda13.0"),
    pytest.param((12, 1), (12, 9), FP8_CUDA, {"qk_quant_gran": "per_warp", "pv_accum_dtype": "fp32+fp16"},
                 id="sm121_cuda12.9"),
    pytest.param((12, 0), (12, 6), FP8_CUDA, {"qk_quant_gran": "per_warp", "pv_accum_dtype": "fp32"},
                 id="sm120_cuda12.6"),
]


@pytest.mark.parametrize("capability, torch_cuda, function, options", TABLE)
def test_kernel_and_exact_keywords_per_gpu(capability, torch_cuda, function, options):
    q, k, v = qkv()
    with wrapped(gpus=(capability,), torch_cuda=torch_cuda, fake=RecordingSage()) as (_, fake):
        with sage_qual.sage_attention_scope() as report:
            out = F.scaled_dot_product_attention(q, k, v)
    assert report.served == 1
    assert [c.function for c in fake.calls] == [function]
    name, positional, keywords = fake.explicit[0]
    assert name == function
    assert positional == 3
    assert keywords == {**COMMON, "sm_scale": 64 ** -0.5, **options}
    call = fake.calls[0]
    assert call.q is q and call.k is k and call.v is v
    assert out is not None and out.shape == q.shape
    assert fake.sageattn_calls == []


@pytest.mark.parametrize("capability", [
    pytest.param((8, 7), id="sm87"),
    pytest.param((10, 0), id="sm100_upstream_sageattn_raises"),
    pytest.param((13, 0), id="sm130_future"),
    pytest.param((7, 5), id="sm75_older"),
    pytest.param((8, 8), id="sm88_unknown"),
    pytest.param((10, 3), id="sm103_unknown"),
    pytest.param((11, 0), id="sm110_unknown"),
    pytest.param((9, 1), id="sm91_unknown"),
])
def test_gpu_without_kernel_is_not_served(capability):
    """A box whose other GPU has a kernel: install succeeds, this GPU's calls stay on torch."""
    q, k, v = qkv()
    with wrapped(gpus=(capability, (9, 0)), fake=RecordingSage()) as (_, fake):
        status = sage_qual.install_status()
        assert status.devices[0].variant is None
        assert "sm_%d%d" % capability in status.devices[0].no_kernel_reason
        with sage_qual.sage_attention_scope() as report:
            out = F.scaled_dot_product_attention(q, k, v)
            F.scaled_dot_product_attention(*(on_device(t, 1) for t in qkv()))
    assert dict(report.fallbacks) == {"device": 1}
    assert [c.device for c in fake.calls] == [1]
    assert torch.equal(out, TORCH_SDPA(q, k, v))


def test_sm89_without_cuda_12_8_falls_to_the_fp32_accumulator_variant():
    with wrapped(gpus=((8, 9),), torch_cuda=(12, 6), fake=RecordingSage()):
        assert sage_qual.install_status().devices[0].variant.name == "sm89-fp8-cuda-fp32acc"


# Scale and GQA ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("head_dim, kwargs, sm_scale", [
    pytest.param(64, {}, 64 ** -0.5, id="head_dim=64_default_scale"),
    pytest.param(128, {}, 128 ** -0.5, id="head_dim=128_default_scale"),
    pytest.param(64, {"scale": 0.3}, 0.3, id="scale=0.3"),
    pytest.param(128, {"scale": 1.0}, 1.0, id="head_dim=128_scale=1.0"),
])
def test_sm_scale(head_dim, kwargs, sm_scale):
    q, k, v = qkv(head_dim=head_dim)
    with wrapped(fake=RecordingSage()) as (_, fake), sage_qual.sage_attention_scope() as report:
        out = F.scaled_dot_product_attention(q, k, v, **kwargs)
    assert report.served == 1
    assert fake.explicit[0][2]["sm_scale"] == pytest.approx(sm_scale, rel=1e-12)
    torch.testing.assert_close(out.float(), TORCH_SDPA(q, k, v, **kwargs).float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("heads, kv_heads", [
    pytest.param(4, 2, id="heads=4/2"),
    pytest.param(4, 1, id="heads=4/1"),
    pytest.param(6, 3, id="heads=6/3"),
])
def test_gqa_key_value_passed_unexpanded(heads, kv_heads):
    q, k, v = qkv(heads=heads, kv_heads=kv_heads)
    with wrapped(fake=RecordingSage()) as (_, fake), sage_qual.sage_attention_scope() as report:
        out = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert report.served == 1
    call = fake.calls[0]
    assert call.k is k and call.v is v
    assert call.k.shape[1] == kv_heads and call.v.shape[1] == kv_heads
    assert "enable_gqa" not in fake.explicit[0][2]
    torch.testing.assert_close(out.float(), TORCH_SDPA(q, k, v, enable_gqa=True).float(),
                               atol=2e-2, rtol=2e-2)


# Device context -------------------------------------------------------------------------------------

def test_kernel_and_check_run_with_the_tensors_device_current(torch_spy):
    with wrapped(gpus=((9, 0), (9, 0)), fake=RecordingSage()) as (cuda, fake):
        assert cuda.current_device == 0
        tensors = tuple(on_device(t, 1) for t in qkv())
        with sage_qual.sage_attention_scope() as report:
            F.scaled_dot_product_attention(*tensors)
        assert report.served == 1
        assert cuda.events == ["enter 1", f"kernel {FP8_SM90} on 1", "exit 1"]
        assert fake.calls[0].device == 1
        # The first-call check recomputed its slice with torch, with device 1 current too.
        assert [device for _, _, device in torch_spy] == [1]
        assert cuda.current_device == 0


def test_each_device_runs_with_itself_current():
    with wrapped(gpus=((9, 0), (8, 9)), fake=RecordingSage()) as (cuda, fake):
        with sage_qual.sage_attention_scope() as report:
            F.scaled_dot_product_attention(*(on_device(t, 1) for t in qkv()))
            F.scaled_dot_product_attention(*qkv())
    assert report.served == 2
    assert [(c.function, c.device) for c in fake.calls] == [(FP8_CUDA, 1), (FP8_SM90, 0)]
    assert cuda.events == ["enter 1", f"kernel {FP8_CUDA} on 1", "exit 1",
                           "enter 0", f"kernel {FP8_SM90} on 0", "exit 0"]


def test_device_is_restored_when_the_kernel_raises():
    fake = RecordingSage()
    fake.raise_error(ValueError("broken"))
    with wrapped(gpus=((9, 0), (9, 0)), fake=fake) as (cuda, _):
        with sage_qual.sage_attention_scope():
            F.scaled_dot_product_attention(*(on_device(t, 1) for t in qkv()))
        assert cuda.events[0] == "enter 1" and cuda.events[-1] == "exit 1"
        assert cuda.current_device == 0


# The fakes themselves -------------------------------------------------------------------------------

@pytest.mark.parametrize("function", KERNELS)
def test_fake_kernels_are_signed_as_the_registry_declares(function):
    parameters = list(inspect.signature(FakeSageAttention().function(function)).parameters.values())
    assert [p.name for p in parameters[:3]] == ["q", "k", "v"]
    keywords = [(p.name, p.default) for p in parameters[3:-1]]
    assert keywords == list(KERNEL_FUNCTIONS[function].keywords)
    assert parameters[-1].kind is inspect.Parameter.VAR_KEYWORD
    if KERNEL_FUNCTIONS[function].takes_layout:
        assert dict(keywords)["smooth_k"] is True  # upstream's default, which the wrapper must override


@pytest.mark.parametrize("variant", VARIANTS.values(), ids=VARIANTS)
def test_every_keyword_a_variant_passes_is_in_its_kernels_contract(variant):
    contract = variant.kernel_function
    passed = variant.call_keywords(0.125)
    assert set(passed) <= set(contract.defaults), set(passed) - set(contract.defaults)
    for name, value in passed.items():
        assert value in contract.choices.get(name, (value,)), (name, value)
    if contract.takes_layout:
        assert passed["smooth_k"] is False and passed["is_causal"] is False
        assert passed["tensor_layout"] == "HND"
    else:  # comfy-kitchen's: no smoothing, no causal mask to turn off; only the scale
        assert passed == {contract.scale_keyword: 0.125}


def test_fake_signature_drops_and_missing():
    module = FakeSageAttention(signature_drops=("smooth_k",), missing=(FP16_TRITON,)).module()
    assert not hasattr(module, FP16_TRITON)
    for function in (FP16_CUDA, FP8_CUDA, FP8_SM90):
        parameters = inspect.signature(getattr(module, function)).parameters
        assert "smooth_k" not in parameters and "sm_scale" in parameters


@pytest.mark.parametrize("function", KERNELS)
@pytest.mark.parametrize("heads, kv_heads, sm_scale", [
    pytest.param(2, 2, None, id="mha_default_scale"),
    pytest.param(4, 2, 0.2, id="gqa_scale=0.2"),
])
def test_fake_kernels_record_and_return_exact_attention(function, heads, kv_heads, sm_scale):
    fake, contract = FakeSageAttention(), KERNEL_FUNCTIONS[function]
    kernel = fake.function(function)
    q, k, v = qkv(heads=heads, kv_heads=kv_heads, dtype=torch.bfloat16)
    out = kernel(q, k, v, **dict(contract.fixed), **{contract.scale_keyword: sm_scale})
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    expected = TORCH_SDPA(q.float(), k.float(), v.float(), scale=sm_scale, enable_gqa=heads != kv_heads)
    torch.testing.assert_close(out.float(), expected, atol=1e-2, rtol=1e-2)
    [call] = fake.calls
    assert call.function == function and call.q is q and call.k is k and call.v is v
    assert call.keywords[contract.scale_keyword] == sm_scale
    assert {name: call.keywords[name] for name, _ in contract.fixed} == dict(contract.fixed)


def test_fake_behaviours():
    fake = FakeSageAttention()
    kernel = getattr(fake.module(), FP8_SM90)
    q, k, v = qkv()
    fake.raise_error(OSError("cache"), times=2)
    for _ in range(2):
        with pytest.raises(OSError):
            kernel(q, k, v)
    exact = kernel(q, k, v)
    fake.return_value(lambda out: out * 0)
    assert torch.count_nonzero(kernel(q, k, v)) == 0
    fake.behave()
    assert torch.equal(kernel(q, k, v), exact)
    assert len(fake.calls) == 5


def test_fake_cuda_devices_and_events():
    cuda = FakeCuda([FakeGpu((8, 9), "RTX 4090"), FakeGpu((9, 0), "H200")], torch_cuda=(12, 8))
    t = torch.zeros(2)
    assert cuda.tensor_device(t) == 0
    assert cuda.tensor_device(on_device(torch.zeros(2), 1)) == 1
    assert cuda.tensor_device(torch.zeros(2, device="meta")) is None
    assert (cuda.device_count(), cuda.capability(1), cuda.device_name(0)) == (2, (9, 0), "RTX 4090")
    assert cuda.torch_cuda() == (12, 8) and not cuda.is_rocm()
    with cuda.device_guard(1):
        assert cuda.current_device == 1
    assert cuda.current_device == 0 and cuda.events == ["enter 1", "exit 1"]
    assert not cuda.autocast_enabled()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert cuda.autocast_enabled()
    with cuda:
        assert sage_qual.serving.platform.current() is cuda
    assert sage_qual.serving.platform.current() is not cuda


# The fakes refuse what the real kernels refuse ------------------------------------------------------
# Each case is a call upstream's kernels reject (core.py asserts and ValueErrors, csrc/qattn's
# CHECK_SHAPE) or would read out of bounds; a wrapper rule that let such a call through must fail.

def _bad(**changes):
    """q, k, v (fp16, [1, 4, 48, 64] / [1, 2, 24, 64]) with one of them replaced."""
    q, k, v = qkv(heads=4, kv_heads=2)
    tensors = {"q": q, "k": k, "v": v, **changes}
    return tensors["q"], tensors["k"], tensors["v"]


MALFORMED = [
    pytest.param(lambda: _bad(k=qkv(batch=2, heads=4, kv_heads=2)[1]), RuntimeError, id="batch_mismatch"),
    pytest.param(lambda: _bad(v=qkv(heads=4, kv_heads=2, k_tokens=12)[2]), RuntimeError,
                 id="kv_len_mismatch"),
    pytest.param(lambda: _bad(k=qkv(heads=4, kv_heads=2, head_dim=128)[1]), RuntimeError,
                 id="head_dim_mismatch"),
    pytest.param(lambda: _bad(k=qkv(heads=3)[1], v=qkv(heads=3)[2]), ValueError, id="heads_not_a_multiple"),
    pytest.param(lambda: _bad(v=qkv(heads=4, kv_heads=4)[2]), RuntimeError, id="value_heads_differ"),
    pytest.param(lambda: _bad(q=qkv(heads=4, head_dim=256)[0], k=qkv(kv_heads=2, heads=4, head_dim=256)[1],
                              v=qkv(kv_heads=2, heads=4, head_dim=256)[2]), ValueError, id="head_dim=256"),
    pytest.param(lambda: _bad(q=qkv(heads=4)[0][0]), RuntimeError, id="3-D_query"),
    pytest.param(lambda: _bad(q=qkv(heads=4, dtype=torch.float32)[0]), AssertionError, id="float32"),
    pytest.param(lambda: _bad(k=qkv(heads=4, kv_heads=2, dtype=torch.bfloat16)[1]), AssertionError,
                 id="mixed_dtypes"),
    pytest.param(lambda: _bad(q=qkv(heads=4)[0].transpose(2, 3).contiguous().transpose(2, 3)), AssertionError,
                 id="last_dim_not_contiguous"),
    pytest.param(lambda: _bad(q=qkv(heads=4)[0].to("meta")), AssertionError, id="not_on_a_gpu"),
    pytest.param(lambda: _bad(k=on_device(qkv(heads=4, kv_heads=2)[1], 1)), AssertionError,
                 id="two_devices"),
]


@pytest.mark.parametrize("function", KERNELS)
@pytest.mark.parametrize("make, error", MALFORMED)
def test_fake_kernels_refuse_malformed_calls(function, make, error):
    kernel = FakeSageAttention().function(function)
    head_dim = make()[0].shape[-1]
    if 128 < head_dim <= KERNEL_FUNCTIONS[function].max_head_dim:
        pytest.skip(f"{function} takes head_dim {head_dim}")
    with pytest.raises(error):
        kernel(*make())


@pytest.mark.parametrize("function, keyword, value", [
    pytest.param(function, name, "no-such-value", id=f"{function}-{name}")
    for function, contract in KERNEL_FUNCTIONS.items() for name in contract.choices
])
def test_fake_kernels_refuse_option_values_upstream_does_not_take(function, keyword, value):
    kernel = getattr(FakeSageAttention().module(), function)
    with pytest.raises(ValueError, match=keyword):
        kernel(*qkv(), **{keyword: value})


def test_fake_kernels_take_nhd_layout_causal_and_lse():
    q, k, v = qkv(heads=4, kv_heads=2, dtype=torch.bfloat16)
    kernel = getattr(FakeSageAttention().module(), FP8_CUDA)
    nhd = kernel(*(t.transpose(1, 2).contiguous() for t in (q, k[:, :, :24], v)), tensor_layout="NHD")
    torch.testing.assert_close(nhd.transpose(1, 2).float(), kernel(q, k, v).float())
    square = qkv(q_tokens=24, k_tokens=24)
    out, lse = kernel(*square, is_causal=True, return_lse=True)
    expected = TORCH_SDPA(*(t.float() for t in square), is_causal=True)
    torch.testing.assert_close(out.float(), expected, atol=2e-3, rtol=2e-3)
    assert lse.shape == (1, 2, 24) and lse.dtype == torch.float32


@pytest.mark.parametrize("make, error", MALFORMED)
def test_malformed_calls_never_reach_the_kernel_through_the_wrapper(make, error):
    """What the kernels refuse, the rules refuse first: torch gets the call, the GPU stays in service."""
    q, k, v = make()
    with wrapped(gpus=((9, 0), (9, 0))) as (_, fake):
        with sage_qual.sage_attention_scope() as report:
            with contextlib.suppress(Exception):  # torch may refuse the call too: its own error
                F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        status = sage_qual.install_status()
    assert fake.calls == [] and report.served == 0 and report.calls == 1
    assert not any(d.retired for d in status.devices)


# Upstream's sageattn() as the fake gives it --------------------------------------------------------

@pytest.mark.parametrize("capability, function, options", [
    pytest.param(cap, function, options, id="sm%d%d" % cap) for cap, function, options in [
        ((8, 0), FP16_CUDA, {"pv_accum_dtype": "fp32"}),
        ((8, 6), FP16_TRITON, {}),
        ((8, 9), FP8_CUDA, {"pv_accum_dtype": "fp32+fp16"}),
        ((9, 0), FP8_SM90, {"pv_accum_dtype": "fp32+fp32"}),
        ((12, 0), FP8_CUDA, {"qk_quant_gran": "per_warp", "pv_accum_dtype": "fp32+fp16"}),
        ((12, 1), FP8_CUDA, {"qk_quant_gran": "per_warp", "pv_accum_dtype": "fp32+fp16"}),
    ]])
def test_fake_sageattn_dispatches_as_upstream_and_swallows_smooth_k(capability, function, options):
    fake = FakeSageAttention()
    with FakeCuda([FakeGpu(capability)]), fake.installed():
        import sageattention

        sageattention.sageattn(*qkv(), smooth_k=False)
    [call] = fake.calls
    assert call.function == function
    assert call.keywords["smooth_k"] is True  # swallowed by sageattn's **kwargs, as upstream does
    assert {name: call.keywords[name] for name in options} == options


@pytest.mark.parametrize("capability", [(8, 7), (10, 0), (13, 0)], ids=["sm87", "sm100", "sm130"])
def test_fake_sageattn_refuses_architectures_upstream_does_not_know(capability):
    with FakeCuda([FakeGpu(capability)]), FakeSageAttention().installed():
        import sageattention

        with pytest.raises(ValueError, match="Unsupported CUDA architecture: sm%d%d" % capability):
            sageattention.sageattn(*qkv())


def test_a_kernel_without_a_layout_keyword_gets_hnd_views_and_gives_the_callers_layout():
    """comfy-kitchen's kernel takes [B, H, N, D] only: an NHD call reaches it transposed, with no
    tensor_layout keyword, and its output goes back to the caller's layout (Variant.invoke)."""
    ck = VARIANTS["ck-int8-cuda"]
    seen = []

    def kernel(q, k, v, **keywords):
        seen.append((tuple(q.shape), tuple(k.shape), keywords))
        return TORCH_SDPA(q, k, v, scale=keywords["scale"])

    q, k, v = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 7, 8), torch.randn(2, 3, 7, 8)  # HND
    hnd = ck.invoke(kernel, q, k, v, sm_scale=0.3)
    nhd = ck.invoke(kernel, *(t.transpose(1, 2) for t in (q, k, v)), sm_scale=0.3, layout="NHD")
    assert [shapes for *shapes, _ in seen] == [[(2, 3, 5, 8), (2, 3, 7, 8)]] * 2
    assert all("tensor_layout" not in keywords and keywords["scale"] == 0.3 for *_, keywords in seen)
    assert nhd.shape == (2, 5, 3, 8) and torch.equal(nhd, hnd.transpose(1, 2))


def test_invoke_refuses_what_a_kernel_does_not_have_by_name():
    ck, sm90 = VARIANTS["ck-int8-cuda"], VARIANTS["sm90-fp8-cuda"]
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(ValueError, match="^ck-int8-cuda has no K smoothing to turn on$"):
        ck.invoke(lambda *a, **k: a[0], q, q, q, sm_scale=1.0, smooth_k=True)
    with pytest.raises(ValueError, match="^sm90-fp8-cuda takes no attn_mask$"):
        sm90.invoke(lambda *a, **k: a[0], q, q, q, sm_scale=1.0, attn_mask=torch.ones(4, 4, dtype=torch.bool))
    passed = []
    sm90.invoke(lambda *a, **k: passed.append(k) or a[0], q, q, q, sm_scale=1.0, smooth_k=True)
    assert passed[0]["smooth_k"] is True and passed[0]["tensor_layout"] == "HND"
