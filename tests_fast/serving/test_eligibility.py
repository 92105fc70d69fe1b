"""Inside a scope a call goes to SageAttention only if no rule refuses it; each refusal has its reason.

Every refused call must reach torch and give torch's result (or torch's exception) unchanged.
"""

import contextlib
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import sage_qual
from sage_qual.serving.eligibility import REASONS
from sage_qual.testing import on_device

from ..helpers import K_TOKENS, Q_TOKENS, SMALL, TORCH_SDPA, qkv, rand, wrapped


def outcome(function, args, kwargs, seed=0):
    """(result, None) or (None, (exception type, message)) of one call."""
    torch.manual_seed(seed)
    try:
        return function(*args, **kwargs), None
    except Exception as error:  # torch's own refusal must come through unchanged
        return None, (type(error), str(error))


def same_outcome(got, expected, shape_only=False):
    (result, error), (expected_result, expected_error) = got, expected
    assert error == expected_error
    if expected_result is not None:
        if expected_result.is_nested:
            assert result.is_nested
            pairs = zip(result.unbind(), expected_result.unbind(), strict=True)
            assert all(torch.equal(a, b) for a, b in pairs)
        elif expected_result.device.type == "meta" or shape_only:
            assert result.device == expected_result.device and result.shape == expected_result.shape
        else:
            assert result.dtype == expected_result.dtype
            assert torch.equal(result, expected_result)


def test_reasons_are_the_documented_ones():
    assert set(REASONS) >= {"arguments", "mask", "dropout", "causal", "shape", "dtype", "head_dim", "heads",
                            "short", "layout", "grad", "autocast", "device", "memory"}
    assert len(set(REASONS)) == len(REASONS)


# Served ---------------------------------------------------------------------------------------------

SERVED = [
    pytest.param(lambda: (qkv(), {}), id="fp16"),
    pytest.param(lambda: (qkv(dtype=torch.bfloat16), {}), id="bf16"),
    pytest.param(lambda: (qkv(head_dim=128), {}), id="head_dim=128"),
    pytest.param(lambda: (qkv(batch=2), {}), id="batch=2"),
    pytest.param(lambda: (qkv(heads=4, kv_heads=2), {"enable_gqa": True}), id="gqa_4/2"),
    pytest.param(lambda: (qkv(heads=4, kv_heads=1), {"enable_gqa": True}), id="gqa_4/1"),
    pytest.param(lambda: (qkv(), {"enable_gqa": True}), id="enable_gqa_equal_heads"),
    pytest.param(lambda: (qkv(), {"scale": 0.3}), id="scale=0.3"),
    pytest.param(lambda: (qkv(), {"attn_mask": None, "dropout_p": 0.0, "is_causal": False}),
                 id="defaults_spelled_out"),
    pytest.param(lambda: (qkv() + (None, 0.0, False), {}), id="defaults_positional"),
    pytest.param(lambda: ((), dict(zip(("query", "key", "value"), qkv(), strict=True))), id="all_keywords"),
    pytest.param(lambda: (tuple(t.transpose(1, 2).contiguous().transpose(1, 2) for t in qkv()), {}),
                 id="BNHD_storage_last_dim_contiguous"),
]


@pytest.mark.parametrize("make", SERVED)
def test_eligible_call_is_served(make):
    args, kwargs = make()
    with wrapped() as (_, fake), sage_qual.sage_attention_scope() as report:
        out = F.scaled_dot_product_attention(*args, **kwargs)
    assert (report.calls, report.served, dict(report.fallbacks)) == (1, 1, {})
    assert len(fake.calls) == 1
    expected = TORCH_SDPA(*args, **kwargs)
    assert out.dtype == expected.dtype and out.shape == expected.shape
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)


def test_grad_tensors_are_served_under_no_grad():
    q, k, v = qkv()
    q.requires_grad_()
    with wrapped() as (_, fake), sage_qual.sage_attention_scope() as report, torch.no_grad():
        F.scaled_dot_product_attention(q, k, v)
    assert report.served == 1 and len(fake.calls) == 1


# Refused, each with its reason ------------------------------------------------------------------------

@dataclass
class Case:
    make: Callable  # -> (args, kwargs), built inside the fake box
    reason: str
    detail: str  # the report's detail for the reason contains this
    gpus: tuple = ((9, 0),)
    context: Callable = contextlib.nullcontext
    prepare: Callable | None = None  # run with the fake before the scope under test
    shape_only: bool = False  # torch's own result is not deterministic (reads past the shorter value)


def strided_last_dim(which):
    def make():
        tensors = list(qkv())
        wide = rand(*tensors[which].shape[:-1], 128, seed=9)
        tensors[which] = wide[..., ::2]
        assert tensors[which].stride(-1) == 2
        return tuple(tensors), {}
    return make


def requiring_grad(which):
    def make():
        tensors = qkv()
        tensors[which].requires_grad_()
        return tensors, {}
    return make


def on_devices(*indices):
    def make():
        return tuple(on_device(t, i) for t, i in zip(qkv(), indices, strict=False)), {}
    return make


def nested_qkv():
    def nested(seed):
        return torch.nested.nested_tensor([rand(2, Q_TOKENS, 64, seed=seed),
                                           rand(2, Q_TOKENS - 8, 64, seed=seed)])
    return (nested(1), nested(2), nested(3)), {}


def mixed(dtypes):
    def make():
        q, k, v = qkv()
        return (q.to(dtypes[0]), k.to(dtypes[1]), v.to(dtypes[2])), {}
    return make


def retire_device_0(fake):
    fake.raise_error(ValueError("kernel is broken"))
    with sage_qual.sage_attention_scope():
        F.scaled_dot_product_attention(*qkv())
    fake.behave()


REFUSED = [
    pytest.param(Case(lambda: (qkv(), {"attn_mask": torch.rand(Q_TOKENS, K_TOKENS) > 0.3}),
                      "mask", "attn_mask given (no masked call was certified here)"), id="mask_bool"),
    pytest.param(Case(lambda: (qkv(), {"attn_mask": rand(1, 1, Q_TOKENS, K_TOKENS, seed=5)}),
                      "mask", "attn_mask given (no masked call was certified here)"), id="mask_additive"),
    pytest.param(Case(lambda: (qkv() + (rand(1, 1, Q_TOKENS, K_TOKENS, seed=5),), {}),
                      "mask", "attn_mask given (no masked call was certified here)"), id="mask_positional"),
    pytest.param(Case(lambda: (qkv(), {"dropout_p": 0.1}), "dropout", "dropout_p=0.1"), id="dropout=0.1"),
    pytest.param(Case(lambda: (qkv() + (None, 0.5), {}),
                      "dropout", "dropout_p=0.5"), id="dropout_positional"),
    pytest.param(Case(lambda: (qkv(), {"is_causal": True}), "causal", "is_causal=True"), id="causal"),
    pytest.param(Case(lambda: (qkv() + (None, 0.0, True), {}),
                      "causal", "is_causal=True"), id="causal_positional"),
    pytest.param(Case(lambda: (tuple(t[0] for t in qkv()), {}),
                      "shape", "dims=(3, 3, 3) (supported: 4)"), id="3-D"),
    pytest.param(Case(lambda: (tuple(t[None] for t in qkv()), {}),
                      "shape", "dims=(5, 5, 5) (supported: 4)"), id="5-D"),
    pytest.param(Case(lambda: (qkv(batch=2)[:1] + tuple(t[:, 0] for t in qkv(batch=2)[1:]), {}),
                      "shape", "dims=(4, 3, 3) (supported: 4)"), id="query_4-D_key_value_3-D"),
    pytest.param(Case(nested_qkv, "shape", "nested tensor"),
                 id="nested", marks=pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")),
    pytest.param(Case(lambda: ((qkv(batch=2)[0],) + qkv(batch=1)[1:], {}),
                      "shape", "batch=(2, 1, 1) (must match)"), id="batch_2_vs_1"),
    pytest.param(Case(lambda: (qkv()[:2] + (qkv(k_tokens=K_TOKENS + 8)[2],), {}),
                      "shape", "differ in heads or length", shape_only=True), id="key_value_lengths_differ"),
    pytest.param(Case(lambda: (qkv(dtype=torch.float32), {}),
                      "dtype", "dtype=(torch.float32, torch.float32, torch.float32)"), id="float32"),
    pytest.param(Case(lambda: (qkv(dtype=torch.float64), {}), "dtype", "torch.float64"), id="float64"),
    pytest.param(Case(mixed((torch.float16, torch.bfloat16, torch.float16)),
                      "dtype", "dtype=(torch.float16, torch.bfloat16, torch.float16)"), id="mixed_fp16_bf16"),
    pytest.param(Case(mixed((torch.float16, torch.float16, torch.float32)),
                      "dtype", "torch.float32)"), id="value_float32"),
    pytest.param(Case(lambda: (qkv(head_dim=96), {}),
                      "head_dim", "head_dim=96 (supported: 64, 128)"), id="head_dim=96"),
    pytest.param(Case(lambda: (qkv(head_dim=32), {}),
                      "head_dim", "head_dim=32 (supported: 64, 128)"), id="head_dim=32"),
    pytest.param(Case(lambda: (qkv(head_dim=256), {}),
                      "head_dim", "head_dim=256 (supported"), id="head_dim=256"),
    pytest.param(Case(lambda: (qkv()[:2] + (qkv(head_dim=128)[2],), {}),
                      "head_dim", "head_dim=(64, 64, 128) (must match)"), id="value_head_dim_differs"),
    pytest.param(Case(lambda: ((qkv()[0],) + qkv(head_dim=128)[1:], {}),
                      "head_dim", "head_dim=(64, 128, 128) (must match)"), id="key_head_dim_differs"),
    pytest.param(Case(lambda: (qkv(heads=4, kv_heads=2), {}),
                      "heads", "heads=4/2 without enable_gqa"), id="heads_4/2_without_enable_gqa"),
    pytest.param(Case(lambda: (qkv(heads=3, kv_heads=2), {"enable_gqa": True}),
                      "heads", "heads=3/2 (query heads must be a multiple)"), id="heads_3/2_not_divisible"),
    pytest.param(Case(strided_last_dim(0), "layout", "last-dim stride != 1"), id="query_last_dim_stride_2"),
    pytest.param(Case(strided_last_dim(1), "layout", "last-dim stride != 1"), id="key_last_dim_stride_2"),
    pytest.param(Case(strided_last_dim(2), "layout", "last-dim stride != 1"), id="value_last_dim_stride_2"),
    pytest.param(Case(requiring_grad(0), "grad", "requires grad"), id="query_requires_grad"),
    pytest.param(Case(requiring_grad(2), "grad", "requires grad"), id="value_requires_grad"),
    pytest.param(Case(lambda: (qkv(), {}), "autocast", "autocast is on",
                      context=lambda: torch.autocast("cpu", dtype=torch.bfloat16)), id="autocast"),
    pytest.param(Case(lambda: (tuple(t.to("meta") for t in qkv()), {}),
                      "device", "not all on one CUDA device"), id="meta_tensors"),
    pytest.param(Case(on_devices(0, 1, 1),
                      "device", "not all on one CUDA device", gpus=((9, 0), (9, 0))),
                 id="query_on_other_gpu"),
    pytest.param(Case(on_devices(0, 0, 1),
                      "device", "not all on one CUDA device", gpus=((9, 0), (9, 0))),
                 id="value_on_other_gpu"),
    pytest.param(Case(on_devices(0, 0, 0),
                      "device", "no SageAttention kernel for this GPU", gpus=((8, 7), (9, 0))),
                 id="gpu_without_kernel"),
    pytest.param(Case(lambda: (qkv(), {}), "device", "retired: ", prepare=retire_device_0), id="retired_gpu"),
]


@pytest.mark.parametrize("case", REFUSED)
def test_refused_call_gives_torch_outcome_with_its_reason(case):
    with wrapped(gpus=case.gpus) as (_, fake):
        if case.prepare:
            case.prepare(fake)
        calls_before = len(fake.calls)
        args, kwargs = case.make()
        with case.context():
            expected = outcome(TORCH_SDPA, args, kwargs)
            with sage_qual.sage_attention_scope() as report:
                got = outcome(F.scaled_dot_product_attention, args, kwargs)
    assert dict(report.fallbacks) == {case.reason: 1}
    assert case.detail in report.details[case.reason], report.details
    assert (report.calls, report.served) == (1, 0)
    assert len(fake.calls) == calls_before, "the kernel ran for a refused call"
    same_outcome(got, expected, case.shape_only)


def test_refused_for_memory_after_out_of_memory_in_the_scope():
    with wrapped() as (_, fake):
        fake.raise_error(torch.OutOfMemoryError("CUDA out of memory"), times=1)
        args = qkv()
        with sage_qual.sage_attention_scope() as report:
            F.scaled_dot_product_attention(*args)
            got = outcome(F.scaled_dot_product_attention, args, {})
    assert dict(report.fallbacks) == {"memory": 2}
    assert "OutOfMemoryError: CUDA out of memory" in report.details["memory"]  # the first call's detail
    assert report.served == 0
    assert len(fake.calls) == 1
    same_outcome(got, outcome(TORCH_SDPA, args, {}))


# Arguments torch does not take: torch's TypeError, counted as "arguments" ---------------------------

ARGUMENTS = [
    pytest.param(lambda: (qkv(), {"window": 128}), id="unknown_keyword"),
    pytest.param(lambda: (qkv() + (None, 0.0, False, 0.3), {}), id="scale_positional"),
    pytest.param(lambda: (qkv() + (None, 0.0, False, None, True), {}), id="enable_gqa_positional"),
    pytest.param(lambda: (qkv()[:2], {}), id="value_missing"),
    pytest.param(lambda: (qkv(), {"query": qkv()[0]}), id="query_twice"),
]


@pytest.mark.parametrize("make", ARGUMENTS)
def test_arguments_torch_rejects_raise_torchs_type_error(make):
    args, kwargs = make()
    expected = outcome(TORCH_SDPA, args, kwargs)
    assert expected[1] is not None and expected[1][0] is TypeError
    with wrapped() as (_, fake):
        with sage_qual.sage_attention_scope() as report:
            got = outcome(F.scaled_dot_product_attention, args, kwargs)
        outside = outcome(F.scaled_dot_product_attention, args, kwargs)
    assert got[1] == expected[1]
    assert outside[1] == expected[1]
    assert dict(report.fallbacks) == {"arguments": 1}
    assert report.details["arguments"].startswith(("scaled_dot_product_attention() ", "unknown keywords"))
    assert fake.calls == []


# Values torch's parser refuses or the kernel cannot take: never the kernel, never a retired GPU ---------

BAD_VALUES = [
    pytest.param({"dropout_p": None}, id="dropout_p=None"),
    pytest.param({"dropout_p": "0"}, id="dropout_p=str"),
    pytest.param({"is_causal": 0}, id="is_causal=0"),
    pytest.param({"is_causal": None}, id="is_causal=None"),
    pytest.param({"is_causal": 1}, id="is_causal=1"),
    pytest.param({"enable_gqa": None}, id="enable_gqa=None"),
    pytest.param({"enable_gqa": 0}, id="enable_gqa=0"),
    pytest.param({"scale": "0.125"}, id="scale=str"),
    pytest.param({"scale": 1j}, id="scale=complex"),
    pytest.param({"attn_mask": 0}, id="attn_mask=int"),
    pytest.param({"attn_mask": False}, id="attn_mask=False"),
]


@pytest.mark.parametrize("kwargs", BAD_VALUES)
def test_values_torch_refuses_get_torchs_error_and_never_reach_the_kernel(kwargs):
    args = qkv()
    expected = outcome(TORCH_SDPA, args, kwargs)
    assert expected[1] is not None  # torch refuses each of these
    with wrapped() as (_, fake):
        with sage_qual.sage_attention_scope() as report:
            got = outcome(F.scaled_dot_product_attention, args, kwargs)
            served = F.scaled_dot_product_attention(*qkv())
        status = sage_qual.install_status()
    assert got[1] == expected[1]
    assert [c.q.shape for c in fake.calls] == [served.shape]  # only the good call reached the kernel
    assert not status.devices[0].retired
    assert report.served == 1 and sum(report.fallbacks.values()) == 1


@pytest.mark.parametrize("scale", [
    pytest.param(float("nan"), id="nan"),
    pytest.param(float("inf"), id="inf"),
    pytest.param(0.0, id="zero"),
    pytest.param(-0.125, id="negative"),
    pytest.param(torch.tensor(0.125), id="tensor"),
])
def test_scales_torch_takes_but_the_kernel_cannot_go_to_torch(scale):
    args = qkv()
    with wrapped() as (_, fake):
        with sage_qual.sage_attention_scope() as report:
            got = outcome(F.scaled_dot_product_attention, args, {"scale": scale})
        status = sage_qual.install_status()
    (result, error), (expected, _) = got, outcome(TORCH_SDPA, args, {"scale": scale})
    assert error is None and torch.equal(result.nan_to_num(), expected.nan_to_num())
    assert fake.calls == [] and not status.devices[0].retired
    assert dict(report.fallbacks) == {"arguments": 1}


@pytest.mark.parametrize("scale", [
    pytest.param(0.125, id="float"),
    pytest.param(1, id="int"),
    pytest.param(np.float32(0.125), id="numpy_float32"),
])
def test_real_scales_are_served_as_python_floats(scale):
    with wrapped() as (_, fake):
        with sage_qual.sage_attention_scope() as report:
            F.scaled_dot_product_attention(*qkv(), scale=scale)
    assert report.served == 1
    [call] = fake.calls
    assert type(call.keywords["sm_scale"]) is float and call.keywords["sm_scale"] == float(scale)


# The break-even thresholds, at their exact boundary --------------------------------------------------

@pytest.mark.parametrize("q_tokens, k_tokens, served", [
    pytest.param(1535, 512, False, id="query=1535_key=512"),
    pytest.param(1536, 511, False, id="query=1536_key=511"),
    pytest.param(1536, 512, True, id="query=1536_key=512"),
    pytest.param(1535, 4096, False, id="query=1535_key=4096"),
])
def test_default_thresholds(q_tokens, k_tokens, served):
    args = qkv(heads=1, q_tokens=q_tokens, k_tokens=k_tokens)
    with wrapped(config=sage_qual.WrapperConfig()) as (_, fake), sage_qual.sage_attention_scope() as report:
        got = outcome(F.scaled_dot_product_attention, args, {})
    assert report.calls == 1
    if served:
        assert (report.served, dict(report.fallbacks), len(fake.calls)) == (1, {}, 1)
    else:
        assert (report.served, dict(report.fallbacks), len(fake.calls)) == (0, {"short": 1}, 0)
        same_outcome(got, outcome(TORCH_SDPA, args, {}))


@pytest.mark.parametrize("q_tokens, k_tokens, served", [
    pytest.param(31, 16, False, id="query=31"),
    pytest.param(32, 15, False, id="key=15"),
    pytest.param(32, 16, True, id="query=32_key=16"),
])
def test_configured_thresholds(q_tokens, k_tokens, served):
    with wrapped(config=SMALL) as (_, fake), sage_qual.sage_attention_scope() as report:
        F.scaled_dot_product_attention(*qkv(q_tokens=q_tokens, k_tokens=k_tokens))
    assert report.served == int(served)
    assert dict(report.fallbacks) == ({} if served else {"short": 1})


def test_configured_head_dims():
    config = sage_qual.WrapperConfig(min_query_tokens=32, min_key_tokens=16, check_rows=16, head_dims=(128,))
    with wrapped(config=config) as (_, fake), sage_qual.sage_attention_scope() as report:
        F.scaled_dot_product_attention(*qkv(head_dim=64))
        F.scaled_dot_product_attention(*qkv(head_dim=128))
    assert report.served == 1
    assert dict(report.fallbacks) == {"head_dim": 1}
    assert fake.calls[0].q.shape[-1] == 128
