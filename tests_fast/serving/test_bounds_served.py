"""The wrapper enforces a profile's bounds (issue 26) with the reason `bound`, whatever the thresholds:
a call with fewer tokens than a bound goes to torch even where a config or a hand-edited profile would
serve it (fake CUDA and fake sageattention on CPU tensors)."""

import pytest
import torch
import torch.nn.functional as F

import sage_qual
from sage_qual.serving.config import WrapperConfig
from sage_qual.testing import FakeCuda, FakeSageAttention
from sage_qual.verdicts import profile
from sage_qual.verdicts.served import Bound

from ..builders import H200, make_entry, make_gpu, make_profile

IP_ADAPTER = Bound("key", 17, "flux1_ip_adapter_zero_uncond: sm90-fp8-cuda output not finite")


@pytest.fixture
def fake():
    fake = FakeSageAttention()
    with FakeCuda([H200]), fake.installed():
        yield fake


def attention(q_tokens: int, kv_tokens: int):
    g = torch.Generator().manual_seed(q_tokens + kv_tokens)
    q = torch.randn(1, 1, q_tokens, 128, generator=g, dtype=torch.bfloat16)
    kv = torch.randn(1, 1, kv_tokens, 128, generator=g, dtype=torch.bfloat16)
    with sage_qual.sage_attention_scope() as report:
        out = F.scaled_dot_product_attention(q, kv, kv)
    return report, out, F.scaled_dot_product_attention(q, kv, kv)


def bounded_profile(min_k: int, bounds=(IP_ADAPTER,)) -> dict:
    entry = make_entry("sm90-fp8-cuda", 64, min_k)
    entry["served"]["bounds"] = [{"side": b.side, "below": b.below, "reason": b.reason} for b in bounds]
    return make_profile(make_gpu(H200, entry, families={"FLUX.1": entry}))


@pytest.mark.parametrize(("kv_tokens", "served"), [(4, False), (16, False), (17, True), (64, True)])
def test_a_config_bound_keeps_fewer_keys_on_torch_below_thresholds_that_would_serve_them(
        fake, kv_tokens, served):
    config = WrapperConfig(min_query_tokens=16, min_key_tokens=1, bounds=(IP_ADAPTER,),
                           kernel_table={(9, 0): ("sm90-fp8-cuda",)})
    assert sage_qual.install(config=config).enabled
    report, out, reference = attention(256, kv_tokens)
    assert report.served == int(served)
    if not served:
        assert dict(report.fallbacks) == {"bound": 1}
        assert report.details["bound"] == f"tokens=256/{kv_tokens}: " + IP_ADAPTER.text()
        assert torch.equal(out, reference)  # torch's own result
    assert len(fake.calls) == int(served)


def test_a_query_bound_counts_query_tokens():
    fake = FakeSageAttention()
    bound = Bound("query", 300, "a query-side failure")
    with FakeCuda([H200]), fake.installed():
        assert sage_qual.install(config=WrapperConfig(min_query_tokens=16, min_key_tokens=1, bounds=(bound,),
                                                      kernel_table={(9, 0): ("sm90-fp8-cuda",)})).enabled
        refused = attention(299, 4096)[0]
        assert dict(refused.fallbacks) == {"bound": 1}
        assert refused.details["bound"].endswith("calls with fewer than 300 query tokens stay on torch "
                                                 "(a query-side failure)")
        assert attention(300, 4)[0].served == 1
    assert bound.short() == "query tokens >= 300"


@pytest.mark.parametrize("family", [None, "FLUX.1"])
def test_a_profile_carries_its_bounds_to_the_wrapper_even_with_its_thresholds_lowered_by_hand(fake, family):
    """The profile's entry was edited to serve from 1 key: the bound still keeps 4 to 16 keys off."""
    status = sage_qual.install(profile=bounded_profile(min_k=1), family=family)
    assert status.enabled, status.reason
    assert status.devices[0].config.bounds == (IP_ADAPTER,)
    assert "keys >= 17" in status.devices[0].profile_note
    assert dict(attention(256, 4)[0].fallbacks) == {"bound": 1}
    assert attention(256, 17)[0].served == 1


def test_with_the_certified_thresholds_a_short_call_says_short_first(fake):
    assert sage_qual.install(profile=bounded_profile(min_k=9728)).enabled
    assert dict(attention(256, 4)[0].fallbacks) == {"short": 1}


def test_an_older_profile_without_bounds_serves_as_before(fake):
    data = bounded_profile(min_k=1)
    for entry in [data["gpus"][0]["default"], *data["gpus"][0]["families"].values()]:
        del entry["served"]["bounds"]
    assert sage_qual.install(profile=data).enabled
    assert attention(256, 4)[0].served == 1


@pytest.mark.parametrize(("bound", "says"), [
    ({"side": "batch", "below": 17, "reason": "x"}, "bounds[0].side: is the string 'batch', expected"),
    ({"side": "key", "below": 1, "reason": "x"}, "bounds[0].below: is 1, expected at least 2"),
    ({"side": "key", "below": 17, "reason": " "}, "bounds[0].reason: is empty: say which fixture"),
    ({"side": "key", "below": 17.5, "reason": "x"}, "bounds[0].below: "),
    ({"side": "key", "below": 17}, "bounds[0].reason: missing"),
], ids=["side", "below-1", "no-reason", "float", "missing-reason"])
def test_a_broken_bound_in_a_profile_is_refused_naming_it(bound, says):
    data = bounded_profile(min_k=9728)
    data["gpus"][0]["families"]["FLUX.1"]["served"]["bounds"] = [bound]
    with pytest.raises(profile.ProfileError) as refused:
        profile.load(data)
    assert says in str(refused.value) and "families.FLUX.1" in str(refused.value)


def test_a_profile_entry_that_serves_nothing_has_no_bounds():
    data = bounded_profile(min_k=9728)
    data["gpus"][0]["families"]["FLUX.1"] = {**make_entry(None, reasons=()), "bounds": [
        {"side": "key", "below": 17, "reason": "x"}]}
    with pytest.raises(profile.ProfileError, match="families.FLUX.1.bounds: unknown key"):
        profile.load(data)


@pytest.mark.parametrize("bounds", [IP_ADAPTER, ("key", 17, "x"), (IP_ADAPTER, "x")],
                         ids=["bare", "tuple", "mixed"])
def test_a_config_takes_a_tuple_of_bounds_only(bounds):
    with pytest.raises(ValueError, match="give a tuple of config.Bound"):
        WrapperConfig(bounds=bounds)
    assert WrapperConfig(bounds=(IP_ADAPTER,)).bounds == (IP_ADAPTER,)
