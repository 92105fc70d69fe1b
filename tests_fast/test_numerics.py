"""The CPU emulation (not the kernel) against known numbers, and K smoothing on the outlier replicas."""

import pytest
import torch

from sage_qual.fixtures import emulation
from sage_qual.fixtures.fileformat import load_fixture, shipped_dir
from sage_qual.serving.variants import VARIANTS


def test_declared_numerics_follow_upstream_block_sizes():
    # (Q tile, Q groups, K tile, K groups, P.V type, V scale max) at head_dim 128, from upstream quant.py
    expected = {
        "sm86-fp16-triton": (128, 1, 64, 1, "fp16", 448.0),
        "sm80-fp16-cuda": (32, 8, 64, 4, "fp16", 448.0),
        "sm80-fp16-cuda-fp16acc": (16, 8, 64, 4, "fp16", 448.0),
        "sm89-fp8-cuda": (32, 8, 64, 4, "fp8", 2.25),
        "sm89-fp8-cuda-fp32acc": (32, 8, 64, 4, "fp8", 448.0),
        "sm90-fp8-cuda": (16, 8, 128, 4, "fp8", 448.0),
        "sm120-fp8-perwarp": (32, 1, 64, 1, "fp8", 2.25),
        "sm120-fp8-perwarp-fp32acc": (32, 1, 64, 1, "fp8", 448.0),
    }
    assert set(expected) == set(VARIANTS)
    for name, values in expected.items():
        n = VARIANTS[name].numerics.at_head_dim(128)
        assert (n.q_tile, n.q_groups, n.k_tile, n.k_groups, n.pv, n.v_scale_max) == values, name
    assert VARIANTS["sm80-fp16-cuda-fp16acc"].numerics.at_head_dim(64).q_tile == 32


def test_int8_groups_share_one_scale():
    x = torch.ones(1, 1, 64, 4)
    x[0, 0, 8, 0] = 254.0  # scale 2 for row 8's group: an element of 1 rounds (half away) to 2
    per_thread = emulation.quantize_int8(x, 64, 4)  # K groups: rows {2t, 2t+1} + 8j
    assert per_thread[0, 0, [0, 1, 9, 16], 1].tolist() == [2.0] * 4  # row 8's group
    assert per_thread[0, 0, [2, 3, 10], 1].tolist() == [1.0] * 3  # another group: exact
    per_block = emulation.quantize_int8(x, 64, 1)
    assert per_block[0, 0, [2, 3, 10], 1].tolist() == [2.0] * 3


def test_random_data_matches_the_h200_measurement():
    # Measured on the H200 (shared notes): fp16 kernels 0.011-0.013, fp8 kernels 0.038 relative L2.
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 2048, 128, generator=g).bfloat16() for _ in range(3))
    ref = emulation.reference(q, k, v)
    fp16 = emulation.errors(emulation.emulate(q, k, v, VARIANTS["sm80-fp16-cuda"].numerics.at_head_dim(128),
                                              smooth_k=False), ref)
    fp8 = emulation.errors(emulation.emulate(q, k, v, VARIANTS["sm90-fp8-cuda"].numerics.at_head_dim(128),
                                             smooth_k=False), ref)
    assert 0.008 < fp16["rel_l2"] < 0.016
    assert 0.03 < fp8["rel_l2"] < 0.046


@pytest.mark.parametrize("name", ["qwen_image_b0_outlier_head", "krea2_b0_outlier_gqa"])
def test_smoothing_breaks_the_outlier_replicas(name):
    fixture = load_fixture(shipped_dir() / f"{name}.safetensors")
    # the RTX 4090 kernel of the published numbers
    scheme = VARIANTS["sm89-fp8-cuda"].numerics.at_head_dim(128)
    ref = emulation.reference(fixture.q, fixture.k, fixture.v)
    off = emulation.errors(emulation.emulate(fixture.q, fixture.k, fixture.v, scheme, smooth_k=False), ref)
    on = emulation.errors(emulation.emulate(fixture.q, fixture.k, fixture.v, scheme, smooth_k=True), ref)
    bound = fixture.bounds["fp8"]
    assert off["rel_l2"] <= bound["max_rel_l2"] and off["cosine"] >= bound["min_cosine"]
    assert on["rel_l2"] > 5 * off["rel_l2"] and on["cosine"] < 0.8
