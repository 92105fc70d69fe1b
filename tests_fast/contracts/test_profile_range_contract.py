"""The profile contract between certify (which writes the verified range) and the wrapper (which
serves only inside it): an entry's optional max_query_tokens, max_key_tokens (null: no upper bound)
and layouts (null: any), in the entry's `served` record (`verdicts.served.Served`). The builder's side is
also tests_fast/measure/test_long_checks.py."""

import json

import torch
import torch.nn.functional as F

import sage_qual
from sage_qual import records
from sage_qual.qualification.decide import checked, verdict
from sage_qual.qualification.decide import profile as building
from sage_qual.testing import FakeCuda, FakeGpu, FakeSageAttention
from sage_qual.verdicts import profile

from ..builders import SAMPLE, long_records

H200 = FakeGpu((9, 0), "Fake H200", 141.0)


def built_profile(fail_at=None) -> dict:
    data = json.loads(SAMPLE.read_text())
    for device in data["devices"]:
        device["long"] = long_records("sm90-fp8-cuda", fail_at) + long_records("sm89-fp8-cuda", fail_at)
    typed = checked.parse(data, "sample")
    built = records.dump(building.build(typed, verdict.decide(typed)))
    built["gpus"][0].update(name=H200.name, capability=list(H200.capability), memory_gib=H200.memory_gib)
    built["gpus"][0]["environment"].update(torch=torch.__version__, sageattention="2.2.0", torch_cuda="13.0")
    return built


def test_the_serving_side_reads_the_range_and_layouts():
    served = profile.load(built_profile(fail_at=16384)).gpus[0].families["FLUX.1"].served
    assert (served.max_query_tokens, served.max_key_tokens) == (8192, 8192)
    assert list(served.layouts) == ["contiguous", "transposed", "nhd", "fused_qkv"]


def test_the_wrapper_serves_inside_the_verified_range_only():
    built = built_profile()
    # The sample's FLUX.1 entry serves from 4608 query tokens; cap it just above to keep the calls small.
    built["gpus"][0]["families"]["FLUX.1"]["served"].update(max_query_tokens=4700, max_key_tokens=4700)
    fake = FakeSageAttention()
    with FakeCuda([H200]), fake.installed():
        status = sage_qual.install(profile=built, family="FLUX.1")
        assert status.enabled, status.reason
        try:
            inside, outside = (attention(tokens) for tokens in (4608, 4800))
        finally:
            sage_qual.uninstall()
    assert inside.served == 1 and not inside.fallbacks
    assert outside.served == 0 and sum(outside.fallbacks.values()) == 1


def attention(tokens: int):
    g = torch.Generator().manual_seed(tokens)
    q = torch.randn(1, 1, tokens, 128, generator=g, dtype=torch.bfloat16)
    kv = torch.randn(1, 1, tokens, 128, generator=g, dtype=torch.bfloat16)
    with sage_qual.sage_attention_scope() as scope:
        F.scaled_dot_product_attention(q, kv, kv)
    return scope


def test_the_builder_writes_what_the_contract_names():
    flux = built_profile(fail_at=32768)["gpus"][0]["families"]["FLUX.1"]
    assert {"max_query_tokens", "max_key_tokens", "layouts"} <= set(flux["served"])
    assert isinstance(flux["served"]["max_query_tokens"], int) and flux["served"]["max_query_tokens"] == 16896
