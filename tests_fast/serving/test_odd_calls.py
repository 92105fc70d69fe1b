"""Odd calls inside a scope: a scale of a number type torch refuses (Fraction, Decimal) and empty
calls (batch 0, no heads, no query or key rows under zero thresholds) go to torch, which answers
them as it would outside a scope, and never reach the kernel nor retire the GPU."""

import decimal
import fractions

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import sage_qual

from ..helpers import TORCH_SDPA, qkv, wrapped

NO_THRESHOLDS = sage_qual.WrapperConfig(min_query_tokens=0, min_key_tokens=0, check_rows=16)


def outcome(function, *args, **kwargs):
    try:
        return function(*args, **kwargs), None
    except Exception as error:  # torch's own refusal must come through unchanged
        return None, (type(error), str(error))


@pytest.mark.parametrize("scale", [
    pytest.param(fractions.Fraction(1, 8), id="Fraction"),
    pytest.param(decimal.Decimal("0.125"), id="Decimal"),
])
def test_a_scale_torch_refuses_goes_to_torch_and_retires_nothing(scale):
    args = qkv()
    with wrapped() as (_, fake):
        with sage_qual.sage_attention_scope() as report:
            got = outcome(F.scaled_dot_product_attention, *args, scale=scale)
            later = F.scaled_dot_product_attention(*args)
        status = sage_qual.install_status()
    assert got == outcome(TORCH_SDPA, *args, scale=scale)  # torch's own error, word for word
    assert got[1] is not None and "must be float" in got[1][1]
    assert not status.devices[0].retired and [c.q.shape for c in fake.calls] == [later.shape]
    assert dict(report.fallbacks) == {"arguments": 1} and report.served == 1


@pytest.mark.parametrize("scale", [pytest.param(np.int64(1), id="numpy_int64"),
                                   pytest.param(np.float16(0.125), id="numpy_float16"),
                                   pytest.param(True, id="bool")])
def test_a_scale_torch_takes_is_served(scale):
    with wrapped() as (_, fake):
        with sage_qual.sage_attention_scope() as report:
            F.scaled_dot_product_attention(*qkv(), scale=scale)
        assert not sage_qual.install_status().devices[0].retired
    assert report.served == 1 and fake.calls[0].keywords["sm_scale"] == float(scale)


@pytest.mark.parametrize("shape", [
    pytest.param(dict(batch=0), id="batch_0"),
    pytest.param(dict(q_tokens=0), id="0_query_rows"),
    pytest.param(dict(k_tokens=0), id="0_key_rows"),
    pytest.param(dict(heads=0), id="0_heads"),
])
def test_an_empty_call_goes_to_torch(shape):
    args = qkv(**shape)
    with wrapped(config=NO_THRESHOLDS) as (_, fake):
        with sage_qual.sage_attention_scope() as report:
            got = outcome(F.scaled_dot_product_attention, *args)
        status = sage_qual.install_status()
    expected = outcome(TORCH_SDPA, *args)
    assert (got[1], expected[1]) == (None, None)
    assert got[0].shape == expected[0].shape and torch.equal(got[0].nan_to_num(), expected[0].nan_to_num())
    assert fake.calls == [] and not status.devices[0].retired
    assert dict(report.fallbacks) == {"shape": 1} and "empty call" in report.details["shape"]
