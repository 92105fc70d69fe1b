"""The copy path serves only what the direct path would serve (issue 28): a call refused for `span`
alone passed every other rule, so serving it from contiguous copies skips none of them.

Before the fix a strided view past the span limit that required grad, or ran under autocast, was
served from copies: backward() raised where torch computes the gradient, and the output came back
in the input's dtype where autocast's torch returns its own.
"""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import sage_qual
from sage_qual import limits
from sage_qual.serving.config import WrapperConfig
from sage_qual.serving.eligibility import SdpaCall, refusal
from sage_qual.testing import FakeCuda, FakeGpu, FakeSageAttention
from sage_qual.verdicts.served import Bound

PROPERTY = settings(max_examples=300, deadline=None, derandomize=True, database=None)
SPAN = 20_000  # elements: a fused 64-token view of 2 x 3 heads spans more, its copies fewer
UNLIMITED = limits.MAX_SPAN_ELEMENTS  # far past any call drawn here (at most 64 tokens)


class Autocast:
    def __init__(self, on: bool):
        self.on = on

    def autocast_enabled(self):
        return self.on


@st.composite
def calls(draw):
    """A call as an app makes one: its layout, tokens, dtype, head size, flags and extras."""
    batch, heads = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2, 3]))
    tokens, kv_tokens = draw(st.sampled_from([8, 64, 80])), draw(st.sampled_from([4, 64, 80]))
    head_dim = draw(st.sampled_from([64, 128, 128, 96]))  # weighted to calls the other rules let through
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float16, torch.bfloat16, torch.float32]))
    layout = draw(st.sampled_from(["contiguous", "transposed", "fused"]))
    if layout == "fused":
        kv_tokens = tokens
        fused = torch.zeros(batch, tokens, 3 * heads * head_dim, dtype=dtype)
        q, k, v = (t.unflatten(-1, (heads, head_dim)).transpose(1, 2) for t in fused.chunk(3, dim=-1))
    else:
        def make(n):
            shape = (batch, n, heads, head_dim) if layout == "transposed" else (batch, heads, n, head_dim)
            t = torch.zeros(shape, dtype=dtype)
            return t.transpose(1, 2) if layout == "transposed" else t
        q, k, v = make(tokens), make(kv_tokens), make(kv_tokens)
    if draw(st.booleans()):
        q.requires_grad_(True)
    extras = draw(st.sampled_from([{}, {}, {}, {"attn_mask": torch.ones(tokens, kv_tokens, dtype=torch.bool)},
                                   {"is_causal": True}, {"dropout_p": 0.1}, {"scale": 0.5}]))
    return SdpaCall(q, k, v, **extras)


CONFIGS = st.builds(
    WrapperConfig, min_query_tokens=st.sampled_from([1, 64]), min_key_tokens=st.sampled_from([1, 64]),
    max_query_tokens=st.sampled_from([None, 64]), max_key_tokens=st.sampled_from([None, 64]),
    layouts=st.sampled_from([None, ("contiguous",), ("contiguous", "fused_qkv")]),
    bounds=st.sampled_from([(), (Bound("key", 5, "a failure at 4 keys"),)]),
    max_span_elements=st.sampled_from([SPAN, 2 * SPAN, UNLIMITED]))


@PROPERTY
@given(call=calls(), config=CONFIGS, autocast=st.booleans(), grad=st.booleans())
def test_a_span_refusal_means_every_other_rule_passed(call, config, autocast, grad):
    with torch.set_grad_enabled(grad):
        refused = refusal(call, config, Autocast(autocast))
        lifted = dataclasses.replace(config, max_span_elements=UNLIMITED)
        unlimited = refusal(call, lifted, Autocast(autocast))
    if refused is not None and refused[0] == "span":
        assert unlimited is None, f"served from copies, but the direct path says {unlimited[0]}"
    else:
        assert refused == unlimited  # the limit changes nothing else


def fused_view_past_the_span(dtype=torch.bfloat16, requires_grad=False):
    """q, k, v as views into one fused [1, 64, 3 * 3 * 128] projection: each view spans
    1 + 2 * 128 + 63 * 1152 + 127 = 72,960 elements, its contiguous copy padded to 128 tokens 49,152."""
    fused = torch.randn(1, 64, 3 * 3 * 128, dtype=dtype, requires_grad=requires_grad)
    return tuple(t.unflatten(-1, (3, 128)).transpose(1, 2) for t in fused.chunk(3, dim=-1))


@pytest.fixture
def copying():
    fake = FakeSageAttention()
    config = WrapperConfig(min_query_tokens=1, min_key_tokens=1, max_span_elements=60_000,
                           kernel_table={(9, 0): ("sm90-fp8-cuda",)})
    with FakeCuda([FakeGpu((9, 0), "Fake H200", 141.0)]), fake.installed():
        assert sage_qual.install(config=config).enabled
        yield fake
        sage_qual.uninstall()


def test_a_long_strided_view_is_served_from_copies(copying):
    with sage_qual.sage_attention_scope() as report:
        F.scaled_dot_product_attention(*fused_view_past_the_span())
    assert (report.served, report.copied) == (1, 1)


def test_a_long_strided_view_that_requires_grad_goes_to_torch_and_backward_works(copying):
    q, k, v = fused_view_past_the_span(requires_grad=True)
    with sage_qual.sage_attention_scope() as report:
        out = F.scaled_dot_product_attention(q, k, v)
    assert (report.served, dict(report.fallbacks)) == (0, {"grad": 1})
    out.float().sum().backward()  # raised on the copy path
    assert copying.calls == []
