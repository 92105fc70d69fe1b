"""The per-GPU profile: break-even thresholds, conversion to a WrapperConfig, and install(profile=...)
changing which calls the wrapper serves (fake CUDA and fake sageattention on CPU tensors)."""

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import sage_qual
from sage_qual.qualification import profile as building
from sage_qual.qualification.speed import break_even
from sage_qual.serving import profile
from sage_qual.serving.config import DEFAULT_CONFIG, KERNEL_TABLE
from sage_qual.testing import FakeCuda, FakeGpu, FakeSageAttention

H200 = FakeGpu((9, 0), "Fake H200")
TORCH_SDPA = F.scaled_dot_product_attention  # torch's own, read before any install


# break_even ------------------------------------------------------------------------------------
def self_points(speedups: dict[int, float], head_dim: int = 128):
    return [(n, n, head_dim, x) for n, x in speedups.items()]


def test_break_even_is_the_first_length_from_which_every_shape_was_faster():
    result = break_even(self_points({1024: 0.8, 2048: 1.1, 4096: 1.3, 8192: 1.5}))
    assert result == {"min_query_tokens": 2048, "min_key_tokens": 2048, "head_dims": [128],
                      "served_shapes": 3, "measured_shapes": 4}


def test_break_even_keeps_short_keys_out_when_they_were_slower():
    points = self_points({1024: 0.8, 2048: 1.1, 4096: 1.3}) + [(4096, 77, 128, 0.7), (4096, 512, 128, 1.05)]
    result = break_even(points)
    assert (result["min_query_tokens"], result["min_key_tokens"], result["served_shapes"]) == (2048, 512, 3)


def test_break_even_none_when_never_faster_and_equal_is_not_faster():
    assert break_even(self_points({1024: 0.5, 4096: 0.9, 16384: 1.0})) is None


def test_a_failure_at_the_largest_shape_serves_nothing():
    # The failed shape (speedup 0) is the largest: every threshold pair would serve it.
    assert break_even(self_points({2048: 1.2, 4096: 1.4, 8192: 0.0})) is None


def test_a_head_size_that_is_slower_everywhere_is_left_out():
    points = (self_points({1024: 0.9, 4096: 1.3, 16384: 1.6})
              + self_points({1024: 0.5, 4096: 0.8, 16384: 0.9}, head_dim=64))
    result = break_even(points)
    assert (result["head_dims"], result["min_query_tokens"], result["served_shapes"]) == ([128], 4096, 2)


# config_from_profile ---------------------------------------------------------------------------
def make_profile(variant="sm89-fp8-cuda", min_q=2048, min_k=512, head_dims=(128,), gpu=H200, families=None,
                 torch_version=None, sageattention="2.2.0", reasons=()):
    entry = {"variant": variant, "min_query_tokens": min_q if variant else None,
             "min_key_tokens": min_k if variant else None, "head_dims": list(head_dims) if variant else None,
             "reasons": list(reasons)}
    return {"kind": "sage-qual-profile", "schema_version": 1, "created": "2026-11-29T20:00:00+00:00",
            "host": "test", "gpu": {"name": gpu.name, "capability": list(gpu.capability)},
            "environment": {"torch": torch_version or torch.__version__, "torch_cuda": "13.0",
                            "driver": "580.159.04", "sageattention": sageattention, "triton": "3.6.0"},
            "fixtures": {}, "default": entry, "families": families or {}}


def test_config_from_profile_replaces_this_gpus_entry_and_thresholds():
    config = profile.config_from_profile(make_profile(min_q=4096, min_k=1024))
    assert config.kernel_table[(9, 0)] == ("sm89-fp8-cuda",)
    assert (config.min_query_tokens, config.min_key_tokens, config.head_dims) == (4096, 1024, (128,))
    assert {c: v for c, v in config.kernel_table.items() if c != (9, 0)} == \
        {c: v for c, v in KERNEL_TABLE.items() if c != (9, 0)}


def test_config_from_profile_without_a_variant_leaves_the_gpu_without_kernel():
    config = profile.config_from_profile(make_profile(variant=None))
    assert config.kernel_table[(9, 0)] == ()
    assert config.min_query_tokens == DEFAULT_CONFIG.min_query_tokens


def test_config_from_profile_takes_the_family_entry():
    families = {"FLUX.1": {"variant": "sm90-fp8-cuda", "min_query_tokens": 4608, "min_key_tokens": 512,
                           "head_dims": [128], "reasons": []}}
    config = profile.config_from_profile(make_profile(families=families), family="flux.1")
    assert config.kernel_table[(9, 0)] == ("sm90-fp8-cuda",) and config.min_query_tokens == 4608
    with pytest.raises(profile.ProfileError, match="no entry for family SDXL"):
        profile.config_from_profile(make_profile(families=families), family="SDXL")
    with pytest.raises(profile.ProfileError, match="no entry for family nope"):
        profile.config_from_profile(make_profile(), family="nope")


@pytest.mark.parametrize("content, message", [
    ('{"kind": "sage-qual-report"}', "is not a sage-qual profile"),
    ('{"kind": "sage-qual-profile", "schema_version": 7}', "schema version 7"),
    ("nope", "is not JSON"),
])
def test_load_refuses_what_is_not_a_profile(tmp_path, content, message):
    path = tmp_path / "profile.json"
    path.write_text(content)
    with pytest.raises(profile.ProfileError, match=message):
        profile.load(path)


# install(profile=...) --------------------------------------------------------------------------
@pytest.fixture
def fake():
    fake = FakeSageAttention()
    with FakeCuda([H200]), fake.installed():
        yield fake


def attention(tokens: int, head_dim: int = 128, kv_tokens: int | None = None):
    g = torch.Generator().manual_seed(tokens)
    q = torch.randn(1, 1, tokens, head_dim, generator=g, dtype=torch.bfloat16)
    kv = torch.randn(1, 1, kv_tokens or tokens, head_dim, generator=g, dtype=torch.bfloat16)
    with sage_qual.sage_attention_scope() as report:
        F.scaled_dot_product_attention(q, kv, kv)
    return report


def test_without_profile_the_default_thresholds_serve_1536_tokens(fake):
    assert sage_qual.install().enabled
    assert attention(1536).served == 1


def test_profile_thresholds_decide_which_calls_are_served(fake):
    status = sage_qual.install(profile=make_profile(variant="sm89-fp8-cuda", min_q=2048, min_k=512))
    assert status.enabled, status.reason
    assert status.devices[0].variant.name == "sm89-fp8-cuda"
    assert dict(attention(1536).fallbacks) == {"short": 1}  # served without the profile
    assert dict(attention(2048, kv_tokens=256).fallbacks) == {"short": 1}
    assert attention(2048).served == 1
    assert dict(attention(2048, head_dim=64).fallbacks) == {"head_dim": 1}  # it measured slower at 64
    assert [c.function for c in fake.calls] == ["sageattn_qk_int8_pv_fp8_cuda"]


def test_profile_from_a_file(fake, tmp_path):
    path = tmp_path / "profile.json"
    building.save(make_profile(variant="sm90-fp8-cuda", min_q=1024, min_k=64), path)
    status = sage_qual.install(profile=path)
    assert status.enabled and status.devices[0].variant.name == "sm90-fp8-cuda"
    assert attention(1024, kv_tokens=64).served == 1


@pytest.mark.parametrize("bad, message", [
    (make_profile(variant=None, reasons=[{"kind": "accuracy", "detail": "sm90-fp8-cuda on qwen: L2 0.3"}]),
     "the profile certifies no SageAttention variant on Fake H200 (sm_90): sm90-fp8-cuda on qwen: L2 0.3"),
    (make_profile(gpu=FakeGpu((8, 9), "Fake RTX 4090")),
     "the profile was certified on Fake RTX 4090 (sm_89); this machine has Fake H200 (sm_90): run `sage-qual "
     "certify` here"),
    (make_profile(gpu=FakeGpu((9, 0), "Fake H100")), "certified on Fake H100 (sm_90)"),
    (make_profile(torch_version="1.0.0"),
     f"certified with torch 1.0.0; this process runs torch {torch.__version__}"),
    (make_profile(sageattention="2.2.1"), "certified with sageattention 2.2.1; this process has 2.2.0"),
    ({"kind": "something"}, "is not a sage-qual profile"),
])
def test_install_refuses_a_profile_that_does_not_apply(fake, caplog, bad, message):
    status = sage_qual.install(profile=copy.deepcopy(bad))
    assert not status.enabled
    assert message in status.reason
    assert F.scaled_dot_product_attention is TORCH_SDPA
    assert attention(2048).served == 0


def test_install_refuses_an_unreadable_profile_file(fake, tmp_path):
    status = sage_qual.install(profile=tmp_path / "missing.json")
    assert not status.enabled and "cannot read profile" in status.reason


def test_profile_built_by_certify_installs(fake, tmp_path):
    """A profile from a (sample) report, made to match this fake machine, selects its entry."""
    data = json.loads((Path(__file__).parent / "data" / "sample_rtx4090.json").read_text())
    built = building.build(data, data["gpus"][0])
    built["gpu"] = {"name": H200.name, "capability": list(H200.capability)}
    built["environment"].update(torch=torch.__version__, sageattention="2.2.0")
    status = sage_qual.install(profile=built, family="FLUX.1")
    assert status.enabled and status.devices[0].variant.name == "sm89-fp8-cuda"
    assert dict(attention(2048).fallbacks) == {"short": 1}  # sample break-even: 4608 query tokens
