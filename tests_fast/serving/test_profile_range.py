"""A profile's verified token range, layouts and span limit: read (optional: older profiles still
read), refused when malformed, and applied by the wrapper on the device they were certified on."""

import pytest
import torch
import torch.nn.functional as F

import sage_qual
from sage_qual import limits
from sage_qual.serving import profile_matching as matching
from sage_qual.testing import FakeCuda, FakeSageAttention
from sage_qual.verdicts import profile

from ..builders import H200, edited, machine, make_entry, make_gpu, make_profile, refusal


def ranged_entry(max_q=8192, max_k=4096, layouts=("contiguous", "transposed"), **more):
    return edited(make_entry(min_q=1024, min_k=256, **more), max_query_tokens=max_q, max_key_tokens=max_k,
                  layouts=None if layouts is None else list(layouts))


def test_the_range_layouts_and_span_reach_the_devices_config():
    gpu = {**make_gpu(entry=ranged_entry()), "max_span_elements": 3 * 2**29}
    [only] = matching.device_configs(make_profile(gpu), [machine(H200)])
    config = only.config
    assert (config.max_query_tokens, config.max_key_tokens) == (8192, 4096)
    assert config.layouts == ("contiguous", "transposed")
    assert config.max_span_elements == 3 * 2**29
    assert only.note.endswith("sm89-fp8-cuda 1,024 to 8,192 query / 256 to 4,096 key tokens, head_dim 128 "
                              "(contiguous, transposed)")


def test_a_profile_without_them_keeps_no_bound_any_layout_and_the_default_span():
    [only] = matching.device_configs(make_profile(), [machine(H200)])
    config = only.config
    assert (config.max_query_tokens, config.max_key_tokens, config.layouts) == (None, None, None)
    assert config.max_span_elements == limits.MAX_SPAN_ELEMENTS
    assert only.note.endswith("sm89-fp8-cuda >= 2048/512, head_dim 128")


def test_a_family_entry_brings_its_own_range():
    families = {"Wan 2.2": ranged_entry(max_q=75_600, max_k=75_600, layouts=None)}
    [only] = matching.device_configs(make_profile(families=families), [machine(H200)], family="wan 2.2")
    assert (only.config.max_query_tokens, only.config.layouts) == (75_600, None)


BAD = {
    "max below min": (
        ranged_entry(max_q=512),
        "default.served.max_query_tokens: is 512, below min_query_tokens 1024",
    ),
    "max key below min": (
        ranged_entry(max_k=100),
        "default.served.max_key_tokens: is 100, below min_key_tokens 256",
    ),
    "max a string": (ranged_entry(max_q="8192"), "default.served.max_query_tokens: is the string '8192'"),
    "unknown layout": (
        ranged_entry(layouts=("contiguous", "nchw")),
        "default.served.layouts: 'nchw' is not a layout",
    ),
    "no layouts": (ranged_entry(layouts=()), "default.served.layouts: empty"),
    "layouts a string": (
        edited(ranged_entry(), layouts="contiguous"),
        "default.served.layouts: is the string",
    ),
    "range beside no served record": (
        {**make_entry(variant=None), "max_query_tokens": 4096},
        "default.max_query_tokens: unknown key",
    ),
}


@pytest.mark.parametrize("name", BAD)
def test_a_malformed_entry_is_refused_in_one_line(name):
    entry, message = BAD[name]
    said = refusal(entry)
    assert message in said and "\n" not in said


@pytest.mark.parametrize("value, message", [
    (0, "gpus[0].max_span_elements: is 0, expected at least 1"),
    (2.5e9, "gpus[0].max_span_elements: is a number, expected an integer"),
    ("2147483647", "gpus[0].max_span_elements: is the string"),
    (2**40, "gpus[0].max_span_elements: is 1099511627776, expected at most 2147483647"),
    (2**31, "gpus[0].max_span_elements: is 2147483648, expected at most 2147483647"),
])
def test_a_malformed_span_limit_is_refused(value, message):
    with pytest.raises(profile.ProfileError) as refused:
        profile.load({**make_profile(), "gpus": [{**make_gpu(), "max_span_elements": value}]})
    assert message in str(refused.value)


def test_install_with_a_ranged_profile_leaves_long_calls_and_other_layouts_to_torch():
    gpu = {**make_gpu(entry=ranged_entry(max_q=2048, max_k=2048, layouts=("contiguous",))),
           "max_span_elements": 2 * 2048 * 128 - 1}
    fake = FakeSageAttention()
    with FakeCuda([H200]), fake.installed():
        status = sage_qual.install(profile=make_profile(gpu))
        assert status.enabled, status.reason

        def call(tokens, kv_tokens, heads=1, transposed=False):
            q, k, v = (torch.randn(1, n, heads, 128, dtype=torch.bfloat16).transpose(1, 2)
                       for n in (tokens, kv_tokens, kv_tokens))
            if not transposed:
                q, k, v = (t.contiguous() for t in (q, k, v))
            with sage_qual.sage_attention_scope() as report:
                F.scaled_dot_product_attention(q, k, v)
            return report

        try:
            assert call(2048, 2048).served == 1
            long = call(2049, 1024)
            assert dict(long.fallbacks) == {"long": 1}
            assert long.details["long"] == "tokens=2049/1024 (verified up to 2048/2048)"
            layout = call(1024, 1024, transposed=True, heads=2)
            assert layout.details == {"layout": "layout transposed (verified: contiguous)"}
            span = call(2048, 2048, heads=2)  # 2 x 2048 x 128 elements: one more than the profile's limit
            assert span.details == {"span": "span=524288 elements of query, 524288 in a contiguous copy "
                                             "padded to 128 tokens (limit 524287)"}
        finally:
            sage_qual.uninstall()
    assert len(fake.calls) == 1
