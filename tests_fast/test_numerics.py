"""The numerics model: every registered variant is modelled, its arithmetic (INT8 groups, fp16
accumulator overflow, FP8 V scale without epsilon), and the model against the H200 kernels."""

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from sage_qual.fixtures import numerics
from sage_qual.fixtures.fileformat import load_fixture, shipped_dir
from sage_qual.qualification.measure import budgets
from sage_qual.qualification.selftest import model_check
from sage_qual.serving.variants import VARIANTS

RUN6 = Path(__file__).resolve().parent.parent / "docs/results/run6-h200x2-pytest-slow/gpu_results.json"


def test_declared_numerics_follow_upstream_block_sizes():
    # (Q tile, Q groups, K tile, K groups, P.V type, accumulation, V scale max) at head_dim 128, from
    # upstream quant.py, core.py and the kernels' block sizes
    expected = {
        "sm86-fp16-triton": (128, 1, 64, 1, "fp16", "fp16+fp32", 448.0),
        "sm80-fp16-cuda": (32, 8, 64, 4, "fp16", "fp32", 448.0),
        "sm80-fp16-cuda-fp16acc": (16, 8, 64, 4, "fp16", "fp16+fp32", 448.0),
        "sm89-fp8-cuda": (32, 8, 64, 4, "fp8", "fp32+fp16", 2.25),
        "sm89-fp8-cuda-fp32acc": (32, 8, 64, 4, "fp8", "fp32+fp32", 448.0),
        "sm90-fp8-cuda": (16, 8, 128, 4, "fp8", "fp32+fp32", 448.0),
        "sm120-fp8-perwarp": (32, 1, 64, 1, "fp8", "fp32+fp16", 2.25),
        "sm120-fp8-perwarp-fp32acc": (32, 1, 64, 1, "fp8", "fp32", 448.0),
    }
    assert set(expected) == set(VARIANTS)
    for name, values in expected.items():
        n = VARIANTS[name].numerics.at_head_dim(128)
        assert (n.q_tile, n.q_groups, n.k_tile, n.k_groups, n.pv, n.pv_accumulation, n.v_scale_max) == values
    assert VARIANTS["sm80-fp16-cuda-fp16acc"].numerics.at_head_dim(64).q_tile == 32


@pytest.mark.parametrize("name", list(VARIANTS))
def test_every_registered_variant_is_modelled(name):
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 200, 64, generator=g).bfloat16() for _ in range(3))
    for head_dim in (64, 128):
        numerics.check(VARIANTS[name].numerics.at_head_dim(head_dim), name)
    out = numerics.predict(VARIANTS[name], q, k, v).float()
    ref = numerics.reference(q, k, v)
    assert 0.002 < float((out - ref).norm() / ref.norm()) < 0.1  # lossy, but attention


@pytest.mark.parametrize("change, field", [
    ({"pv_accumulation": "bf16"}, "pv_accumulation"),
    ({"pv": "int4"}, "pv"),
    ({"q_groups": 3}, "q_groups"),
    ({"k_tile": 60}, "k_tile"),
    ({"v_scale_max": 0.0}, "v_scale_max"),
    ({"v_tail": "garbage"}, "v_tail"),
])
def test_a_scheme_the_model_cannot_compute_is_refused(change, field):
    scheme = dataclasses.replace(VARIANTS["sm90-fp8-cuda"].numerics, **change)
    with pytest.raises(numerics.UnmodelledNumerics, match=field):
        numerics.check(scheme, "new-variant")
    variant = dataclasses.replace(VARIANTS["sm90-fp8-cuda"], name="new-variant", numerics=scheme)
    q = torch.zeros(1, 1, 64, 64)
    with pytest.raises(numerics.UnmodelledNumerics, match="new-variant"):
        numerics.predict(variant, q, q, q)


def test_fewer_keys_than_one_block_is_a_hazard_only_where_v_rows_are_not_filled():
    q = torch.zeros(1, 1, 64, 128, dtype=torch.bfloat16)
    few = torch.zeros(1, 1, 4, 128, dtype=torch.bfloat16)
    block = torch.zeros(1, 1, 64, 128, dtype=torch.bfloat16)
    stale = {name for name, v in VARIANTS.items() if numerics.hazards(v, q, few, few)}
    assert stale == {"sm80-fp16-cuda", "sm80-fp16-cuda-fp16acc"}  # V read without fill (attn_utils.cuh)
    assert not any(numerics.hazards(v, q, block, block) for v in VARIANTS.values())


def test_int8_groups_share_one_scale():
    x = torch.ones(1, 1, 64, 4)
    x[0, 0, 8, 0] = 254.0  # scale 2 for row 8's group: an element of 1 rounds (half away) to 2
    per_thread = numerics.quantize_int8(x, 64, 4)  # K groups: rows {2t, 2t+1} + 8j
    assert per_thread[0, 0, [0, 1, 9, 16], 1].tolist() == [2.0] * 4  # row 8's group
    assert per_thread[0, 0, [2, 3, 10], 1].tolist() == [1.0] * 3  # another group: exact
    per_block = numerics.quantize_int8(x, 64, 1)
    assert per_block[0, 0, [2, 3, 10], 1].tolist() == [2.0] * 3


def _uniform_attention(value: float, head_dim: int = 64, keys: int = 256):
    """Q = 0: every key gets P = 1, so a 64-key block's P.V sum is 64 x value exactly."""
    q = torch.zeros(1, 1, 64, head_dim, dtype=torch.bfloat16)
    k = torch.randn(1, 1, keys, head_dim, generator=torch.Generator().manual_seed(0)).bfloat16()
    v = torch.full((1, 1, keys, head_dim), value, dtype=torch.bfloat16)
    return q, k, v


@pytest.mark.parametrize("value, finite", [(1020.0, True), (1024.0, False)])
def test_fp16_block_sums_overflow_past_65504(value, finite):
    # 64 x 1020 = 65280 <= 65504; 64 x 1024 = 65536 rounds to inf in float16.
    q, k, v = _uniform_attention(value)
    for name in ("sm80-fp16-cuda-fp16acc", "sm86-fp16-triton"):
        out = numerics.predict(VARIANTS[name], q, k, v)
        assert bool(torch.isfinite(out).all()) is finite, name
    for name in ("sm80-fp16-cuda", "sm90-fp8-cuda", "sm89-fp8-cuda"):  # fp32 sums, or V scaled to 2.25
        out = numerics.predict(VARIANTS[name], q, k, v).float()
        assert torch.allclose(out, torch.full_like(out, value), rtol=0.02), name


def test_a_zero_value_channel_is_nan_under_fp8_only():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 1, 128, 64, generator=g).bfloat16() for _ in range(3))
    v[..., 5] = 0.0
    for name, variant in VARIANTS.items():
        out = numerics.predict(variant, q, k, v)
        nan_channels = torch.isnan(out).any(dim=(0, 1, 2)).nonzero().flatten().tolist()
        assert nan_channels == ([5] if variant.numerics.pv == "fp8" else []), name


def test_a_bf16_value_beyond_fp16_is_inf_on_fp16_kernels():
    q, k, v = _uniform_attention(1.0, keys=64)
    v[0, 0, 3, 0] = 70000.0  # representable in bf16, inf once cast to float16
    assert not torch.isfinite(numerics.predict(VARIANTS["sm80-fp16-cuda"], q, k, v)).all()
    assert torch.isfinite(numerics.predict(VARIANTS["sm90-fp8-cuda"], q, k, v)).all()


def test_online_softmax_matches_one_global_maximum_in_fp32():
    # With fp32 P and fp32 sums the online softmax is exact attention of the quantized Q/K.
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 1, 96, 64, generator=g) for _ in range(3))
    exact = dataclasses.replace(VARIANTS["sm80-fp16-cuda"].numerics, pv="fp16")
    out = numerics.attention(q, k, v, exact).float()
    q_hat = numerics.quantize_int8(q, exact.q_tile, exact.q_groups)
    k_hat = numerics.quantize_int8(k, exact.k_tile, exact.k_groups)
    expected = torch.softmax(q_hat @ k_hat.transpose(-1, -2) / 8.0, -1) @ v.half().float()
    assert torch.allclose(out, expected, atol=2e-3)


@pytest.mark.parametrize("name", ["qwen_image_b0_outlier_head", "krea2_b0_outlier_gqa"])
def test_smoothing_breaks_the_outlier_replicas(name):
    fixture = load_fixture(shipped_dir() / f"{name}.safetensors")
    variant = VARIANTS["sm89-fp8-cuda"]  # the RTX 4090 kernel of the published numbers
    ref = numerics.reference(fixture.q, fixture.k, fixture.v)

    def rel(out):
        return float((out.float() - ref).norm() / ref.norm())

    off = rel(numerics.predict(variant, fixture.q, fixture.k, fixture.v, smooth_k=False))
    on = rel(numerics.predict(variant, fixture.q, fixture.k, fixture.v, smooth_k=True))
    assert on > 5 * off and off < 0.2


# The full table (every fixture of run 6) is docs/numerics.md; here three of them, one per risk: an
# fp16 accumulator overflowing, grouped-query attention, identical padding keys.
@pytest.mark.parametrize("fixture_name", ["qwen_image_b52_value_offset", "krea2_b0_outlier_gqa",
                                          "wan22_ti2v5b_text_cross"])
def test_model_agrees_with_the_h200_kernels(fixture_name, tmp_path):
    # Every variant within 10 % of H200 run 6, non-finite exactly where the kernel was.
    (tmp_path / f"{fixture_name}.safetensors").symlink_to(shipped_dir() / f"{fixture_name}.safetensors")
    rows = model_check.from_results(RUN6, tmp_path)
    assert len(rows) == len(VARIANTS)
    bad = [(r.variant, r.kernel_rel_l2, r.model_rel_l2, r.kernel_finite, r.model_finite)
           for r in rows if not r.agrees]
    assert not bad
    worst = max((abs(r.ratio - 1) for r in rows if not math.isnan(r.ratio)), default=0.0)
    assert worst <= budgets.MEASURED_SPREAD  # the spread the suite's margin was chosen from
    assert budgets.MARGIN <= 0.25 and budgets.MARGIN >= 2 * budgets.MEASURED_SPREAD


def test_budget_is_the_expectation_grown_by_the_margin():
    expected = {"rel_l2": 0.05, "worst_head_rel_l2": 0.06, "worst_batch_rel_l2": 0.05,
                "worst_block_rel_l2": 0.08, "norm_ratio": 0.999, "worst_head_cosine": 0.9988,
                "max_abs_error": 0.3, "rounding": 0.05}
    budget = budgets.from_expected(expected, margin=0.1)
    assert budget.max_rel_l2 == pytest.approx(0.055) and budget.max_block_rel_l2 == pytest.approx(0.088)
    assert budget.min_norm_ratio == pytest.approx(0.994)
    assert budget.max_norm_ratio == pytest.approx(1.005)  # a kernel nearer exact than the model passes
    assert budget.min_cosine == pytest.approx(1 - 0.0012 * 1.21, abs=1e-6)
    assert budget.max_abs == pytest.approx(0.65)  # not grown by the margin: 2x plus rounding
    # stored in this order (report.json's bounds, gate's budget cache)
    assert list(budget.limits()) == ["max_rel_l2", "max_head_rel_l2", "max_batch_rel_l2", "max_block_rel_l2",
                                     "min_norm_ratio", "max_norm_ratio", "min_cosine", "max_abs"]

