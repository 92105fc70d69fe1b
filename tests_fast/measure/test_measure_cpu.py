"""measure's numbers on CPU tensors, each against a value worked out by hand: the errors certify
stores and every budget is judged by (relative L2, cosines, slices, norm ratio, max abs, finiteness),
the float32 reference, the direct kernel call, and the timing and memory helpers driven by fake CUDA
events (what they compute from the events, never how long anything takes)."""

import math
import types

import pytest
import torch

from sage_qual.kernels.variants import VARIANTS
from sage_qual.qualification.measure import accuracy


def randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def rel(a, b):
    return (torch.linalg.vector_norm(a.double() - b.double()) / torch.linalg.vector_norm(b.double())).item()


# Whole-tensor numbers ------------------------------------------------------------------------------


def test_an_exact_output_has_no_error():
    ref = randn(2, 3, 70, 16)
    found = accuracy.errors(ref.clone(), ref)
    assert found.rel_l2 == 0.0 and found.max_abs_error == 0.0
    assert found.worst_head_rel_l2 == found.worst_batch_rel_l2 == found.worst_block_rel_l2 == 0.0
    assert found.finite is True
    assert found.norm_ratio == pytest.approx(1.0, abs=1e-6)
    assert found.worst_head_cosine == pytest.approx(1.0, abs=1e-12)


def test_relative_l2_norm_ratio_and_max_abs_of_a_known_error():
    ref = randn(1, 2, 64, 8)
    noise = randn(1, 2, 64, 8, seed=1)
    out = 1.25 * ref + 0.1 * noise
    found = accuracy.errors(out, ref)
    assert found.rel_l2 == pytest.approx(rel(out, ref), rel=1e-5)
    norm_ratio = (torch.linalg.vector_norm(out) / torch.linalg.vector_norm(ref)).item()
    assert found.norm_ratio == pytest.approx(norm_ratio, rel=1e-5)
    assert found.norm_ratio > 1.2  # a scale error shows in the norm ratio
    assert found.max_abs_error == pytest.approx((out - ref).abs().max().item(), rel=1e-6)


def test_a_pure_scale_error_keeps_the_cosine_and_moves_the_norm_ratio():
    ref = randn(1, 2, 64, 8)
    found = accuracy.errors(0.5 * ref, ref)
    assert found.worst_head_cosine == pytest.approx(1.0, abs=1e-9)
    assert found.norm_ratio == pytest.approx(0.5, rel=1e-6)
    assert found.rel_l2 == pytest.approx(0.5, rel=1e-6)


def test_the_worst_cosine_is_the_lowest_over_samples_and_heads():
    ref = randn(2, 3, 64, 8)
    out = ref.clone()
    out[1, 2] = randn(64, 8, seed=5)  # one (item, head) replaced by unrelated values
    found = accuracy.errors(out, ref)
    expected = torch.nn.functional.cosine_similarity(
        out[1, 2].flatten().double(), ref[1, 2].flatten().double(), dim=0
    ).item()
    assert found.worst_head_cosine == pytest.approx(expected, abs=1e-9)
    assert found.worst_head_cosine < 0.5


def test_an_anti_correlated_head_gives_cosine_minus_one():
    ref = randn(1, 2, 64, 8)
    out = ref.clone()
    out[0, 1] = -ref[0, 1]
    assert accuracy.errors(out, ref).worst_head_cosine == pytest.approx(-1.0, abs=1e-9)


def test_an_exact_output_near_3500_keeps_its_cosine_at_one():
    # qwen_image_b52_value_offset's values: the cosine is summed in float64 so an exact output
    # stays within rounding of 1 (a float32 sum puts it 4e-5 off, under a bound near 1).
    ref = 3500.0 + randn(1, 4, 256, 128)
    assert accuracy.errors(ref.clone(), ref).worst_head_cosine >= 1.0 - 1e-12


def test_inputs_are_compared_in_float32():
    ref = randn(1, 1, 64, 8)
    out = (ref * 1.01).to(torch.bfloat16)
    found = accuracy.errors(out, ref)
    assert found.rel_l2 == pytest.approx(rel(out.float(), ref), rel=1e-5)


# Finiteness -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_non_finite_output_where_the_reference_is_finite_fails_every_number(bad):
    ref = randn(1, 2, 64, 8)
    out = ref.clone()
    out[0, 1, 3, 2] = bad
    found = accuracy.errors(out, ref)
    assert found.finite is False
    assert math.isnan(found.worst_head_cosine)  # no cosine of a broken output
    assert found.rel_l2 == math.inf
    # A NaN or an infinity where the reference is finite is an infinite element error.
    assert found.max_abs_error == math.inf
    assert found.worst_head_rel_l2 == math.inf and found.worst_block_rel_l2 == math.inf


def test_positions_where_the_reference_is_not_finite_are_left_out():
    ref = randn(1, 2, 64, 8)
    out = 1.1 * ref
    ref_holes, out_holes = ref.clone(), out.clone()
    ref_holes[0, 0, 5, 1] = math.nan
    out_holes[0, 0, 5, 1] = math.nan  # the output may be anything where the reference is not finite
    ref_holes[0, 1, 7, 3] = math.inf
    out_holes[0, 1, 7, 3] = 123.0
    valid = torch.isfinite(ref_holes)
    found = accuracy.errors(out_holes, ref_holes)
    assert found.finite is True
    expected = rel(torch.where(valid, out, 0.0), torch.where(valid, ref, 0.0))
    assert found.rel_l2 == pytest.approx(expected, rel=1e-5)
    assert found.max_abs_error == pytest.approx((out - ref)[valid].abs().max().item(), rel=1e-6)
    assert math.isfinite(found.worst_head_cosine) and math.isfinite(found.norm_ratio)
    assert found.norm_ratio == pytest.approx(1.1, rel=1e-5)


def test_compare_returns_relative_l2_cosine_and_finiteness():
    ref = randn(1, 2, 64, 8)
    out = ref + 0.01 * randn(1, 2, 64, 8, seed=2)
    found = accuracy.errors(out, ref)
    assert accuracy.compare(out, ref) == (found.rel_l2, found.worst_head_cosine, True)
    out[0, 0, 0, 0] = math.nan
    rel_l2, cosine, finite = accuracy.compare(out, ref)
    assert finite is False and math.isnan(cosine)


# Slices ----------------------------------------------------------------------------------------------


def test_a_defect_in_one_head_shows_as_that_heads_error():
    ref = randn(2, 4, 64, 8)
    out = ref.clone()
    out[:, 2] *= 1.5
    found = accuracy.errors(out, ref)
    assert found.worst_head_rel_l2 == pytest.approx(rel(out[:, 2], ref[:, 2]), rel=1e-5)
    assert found.worst_head_rel_l2 == pytest.approx(0.5, rel=1e-5)
    # The batch slices hold every head: the defect is diluted there.
    assert found.worst_batch_rel_l2 == pytest.approx(max(rel(out[b], ref[b]) for b in range(2)), rel=1e-5)
    assert found.worst_batch_rel_l2 < 0.3


def test_a_defect_in_one_batch_item_shows_as_that_items_error():
    ref = randn(3, 2, 64, 8)
    out = ref.clone()
    out[1] *= 0.8
    found = accuracy.errors(out, ref)
    assert found.worst_batch_rel_l2 == pytest.approx(0.2, rel=1e-5)
    assert found.worst_head_rel_l2 == pytest.approx(
        max(rel(out[:, h], ref[:, h]) for h in range(2)), rel=1e-5
    )


def test_a_slice_whose_reference_is_zero_is_measured_against_the_mean_energy():
    # Head 1's reference is zero (attention over zero values): its error is divided by the energy a
    # head has on average, not by nothing.
    ref = randn(1, 2, 64, 8)
    ref[0, 1] = 0.0
    out = ref.clone()
    out[0, 1] = 0.01
    found = accuracy.errors(out, ref)
    mean_share = ref.square().sum() / 2
    expected = math.sqrt(out[0, 1].square().sum().item() / mean_share.item())
    assert found.worst_head_rel_l2 == pytest.approx(expected, rel=1e-5)
    # The same share rule per batch item (one item here: its own norm is the mean).
    assert found.worst_batch_rel_l2 == pytest.approx(rel(out, ref), rel=1e-5)


def test_the_worst_block_is_one_block_of_64_query_rows():
    ref = randn(1, 1, 256, 8)
    ref[0, 0, :128] *= 2  # above the mean energy: each block is measured against its own norm
    out = ref.clone()
    out[0, 0, 64:128] *= 1.3  # the second block only
    found = accuracy.errors(out, ref)
    assert accuracy.ROW_BLOCK == 64
    assert found.worst_block_rel_l2 == pytest.approx(0.3, rel=1e-5)
    assert found.rel_l2 < 0.2
    out[0, 0, 64:128] = ref[0, 0, 64:128]
    out[0, 0, 63] *= 1.3  # one row of the first block: a 64th of its energy
    assert accuracy.errors(out, ref).worst_block_rel_l2 == pytest.approx(
        rel(out[0, 0, :64], ref[0, 0, :64]), rel=1e-5
    )


def test_the_last_partial_block_is_measured_against_its_own_rows():
    # 70 rows: one full block and one of 6 rows. The partial block's mean-energy share is scaled to
    # the 6 rows it holds, so an error there is neither diluted by padding nor inflated.
    ref = randn(2, 3, 70, 8)
    ref[1, 2, 64:] *= 2  # above its rows' share of the mean energy: measured against its own norm
    out = ref.clone()
    out[1, 2, 64:] *= 1.4
    found = accuracy.errors(out, ref)
    assert found.worst_block_rel_l2 == pytest.approx(0.4, rel=1e-5)


def test_a_partial_block_of_zeros_is_divided_by_its_rows_share_of_the_mean_energy():
    ref = randn(1, 1, 70, 8)
    ref[0, 0, 64:] = 0.0
    out = ref.clone()
    out[0, 0, 64:] = 0.05
    found = accuracy.errors(out, ref)
    share = ref.square().sum().item() * 6 / 70
    expected = math.sqrt(out[0, 0, 64:].square().sum().item() / share)
    assert found.worst_block_rel_l2 == pytest.approx(expected, rel=1e-5)


def test_a_full_block_of_zeros_uses_its_rows_share_across_items_and_heads():
    ref = randn(2, 2, 128, 8)
    ref[1, 0, :64] = 0.0
    out = ref.clone()
    out[1, 0, :64] = 0.05
    found = accuracy.errors(out, ref)
    share = ref.square().sum().item() * 64 / (128 * 2 * 2)
    expected = math.sqrt(out[1, 0, :64].square().sum().item() / share)
    assert found.worst_block_rel_l2 == pytest.approx(expected, rel=1e-5)


# The reference ------------------------------------------------------------------------------------


def _attention(q, k, v, scale):
    weights = torch.softmax((q.double() @ k.double().transpose(-1, -2)) * scale, dim=-1)
    return (weights @ v.double()).float()


def test_the_reference_is_float32_attention_with_the_default_scale():
    q, k, v = (randn(1, 2, 40, 16, seed=s, dtype=torch.bfloat16) for s in (1, 2, 3))
    ref = accuracy.reference(q, k, v)
    assert ref.dtype == torch.float32
    expected = _attention(q.float(), k.float(), v.float(), 16**-0.5)
    assert torch.allclose(ref, expected, atol=1e-5, rtol=1e-5)


def test_the_reference_takes_the_callers_scale():
    q, k, v = (randn(1, 2, 40, 16, seed=s) for s in (1, 2, 3))
    ref = accuracy.reference(q, k, v, scale=0.9)
    assert torch.allclose(ref, _attention(q, k, v, 0.9), atol=1e-5, rtol=1e-5)


def test_the_reference_shares_kv_heads_between_query_heads():
    q = randn(1, 4, 32, 16, seed=1)
    k, v = randn(1, 2, 24, 16, seed=2), randn(1, 2, 24, 16, seed=3)
    ref = accuracy.reference(q, k, v)
    expected = _attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), 16**-0.5)
    assert ref.shape == (1, 4, 32, 16)
    assert torch.allclose(ref, expected, atol=1e-5, rtol=1e-5)


# accuracy(): the kernel next to SDPA in the input precision ------------------------------------------


def test_accuracy_reports_sdpa_in_the_input_precision_and_the_ratio():
    q, k, v = (randn(1, 2, 64, 16, seed=s, dtype=torch.bfloat16) for s in (1, 2, 3))
    ref = accuracy.reference(q, k, v)
    out = (ref * 1.02).to(torch.bfloat16)
    acc = accuracy.accuracy(out, q, k, v)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    sdpa_rel_l2 = accuracy.errors(sdpa, ref).rel_l2
    assert acc.sdpa_rel_l2 == pytest.approx(sdpa_rel_l2, rel=1e-6)
    assert 0 < acc.sdpa_rel_l2 < 0.01  # bf16 rounding, not zero
    assert acc.error_vs_sdpa == pytest.approx(acc.rel_l2 / acc.sdpa_rel_l2, rel=1e-9)
    assert acc == accuracy.Accuracy(**vars(accuracy.errors(out, ref)), sdpa_rel_l2=acc.sdpa_rel_l2,
                                    error_vs_sdpa=acc.error_vs_sdpa)
    # A given reference is used as it is (not recomputed).
    assert accuracy.accuracy(out, q, k, v, ref=ref * 2).rel_l2 == pytest.approx(
        accuracy.errors(out, ref * 2).rel_l2, rel=1e-6
    )


def test_accuracy_with_gqa_and_a_scale_compares_like_for_like():
    q = randn(1, 4, 64, 16, seed=1, dtype=torch.bfloat16)
    k, v = (
        randn(1, 2, 64, 16, seed=2, dtype=torch.bfloat16),
        randn(1, 2, 64, 16, seed=3, dtype=torch.bfloat16),
    )
    ref = accuracy.reference(q, k, v, scale=0.3)
    acc = accuracy.accuracy(ref.to(torch.bfloat16), q, k, v, scale=0.3)
    # SDPA with the same scale and shared heads lands at rounding, as the kernel's exact output does.
    assert acc.sdpa_rel_l2 < 0.01 and acc.rel_l2 < 0.01


def test_accuracy_shares_kv_heads_whatever_the_token_counts():
    # 4 query heads over 2 K/V heads, with as many query tokens as K/V heads and as many K/V tokens
    # as query heads: the grouping is read from the head counts only.
    q = randn(1, 4, 2, 16, seed=1, dtype=torch.bfloat16)
    k, v = randn(1, 2, 4, 16, seed=2, dtype=torch.bfloat16), randn(1, 2, 4, 16, seed=3, dtype=torch.bfloat16)
    ref = accuracy.reference(q, k, v)
    acc = accuracy.accuracy(ref.to(torch.bfloat16), q, k, v, ref=ref)
    assert acc.sdpa_rel_l2 < 0.01 and acc.rel_l2 < 0.01


def test_accuracy_of_an_input_precision_that_sdpa_reproduces_exactly_is_an_infinite_ratio(monkeypatch):
    q, k, v = (randn(1, 1, 64, 16, seed=s) for s in (1, 2, 3))
    ref = accuracy.reference(q, k, v)
    monkeypatch.setattr(accuracy, "TORCH_SDPA", lambda *a, **kw: ref.clone())
    acc = accuracy.accuracy(ref * 1.1, q, k, v, ref=ref)
    assert acc.sdpa_rel_l2 == 0.0 and acc.error_vs_sdpa == math.inf


# The direct kernel call ------------------------------------------------------------------------------


def test_call_kernel_calls_the_variants_function_with_its_keywords():
    seen = []

    def kernel(q, k, v, **keywords):
        seen.append(keywords)
        return q

    variant = VARIANTS["sm90-fp8-cuda"]
    package = types.SimpleNamespace(kernel=lambda asked: kernel if asked is variant else None)
    q = randn(1, 1, 8, 64)
    assert accuracy.call_kernel(package, variant, q, q, q) is q
    assert seen[-1] == {**variant.call_keywords(64**-0.5), "smooth_k": False}
    accuracy.call_kernel(package, variant, q, q, q, scale=0.5, smooth_k=True)
    assert seen[-1] == {**variant.call_keywords(0.5), "smooth_k": True}


def test_elements_counts_every_tensor():
    assert accuracy.elements(torch.zeros(2, 3), torch.zeros(5)) == 11
    assert accuracy.elements() == 0


# Timing and memory helpers on fake CUDA ---------------------------------------------------------------


class FakeCudaClock:
    """torch.cuda's events, synchronize and memory counters as the helpers use them; elapsed
    times come from a list, so the helpers' arithmetic is checked, not the machine."""

    def __init__(self, elapsed, memory=()):
        self.elapsed, self.memory = list(elapsed), list(memory)
        self.recorded, self.synchronized, self.reset, self.devices = 0, 0, 0, []
        clock = self

        class Event:
            def __init__(self, enable_timing=False):
                assert enable_timing

            def record(self):
                clock.recorded += 1

            def synchronize(self):
                pass

            def elapsed_time(self, end):
                assert isinstance(end, Event) and end is not self  # from this event to the end event
                return clock.elapsed.pop(0)

        self.Event = Event

    def install(self, monkeypatch):
        monkeypatch.setattr(torch.cuda, "Event", self.Event)
        monkeypatch.setattr(torch.cuda, "synchronize", self._synchronize)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", self._reset)
        monkeypatch.setattr(torch.cuda, "memory_allocated", self._memory)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", self._memory)
        return self

    def _synchronize(self, device=None):
        self.synchronized += 1
        self.devices.append(device)

    def _reset(self, device=None):
        self.reset += 1
        self.devices.append(device)

    def _memory(self, device=None):
        self.devices.append(device)
        return self.memory.pop(0)


def counter():
    calls = []

    def fn():
        calls.append(1)
        return torch.zeros(4)

    return fn, calls


def test_timings_warm_up_then_time_each_repeat(monkeypatch):
    FakeCudaClock([3.0, 1.0, 2.0]).install(monkeypatch)
    fn, calls = counter()
    assert accuracy.timings_ms(fn, warmup=2, repeats=3) == [3.0, 1.0, 2.0]
    assert len(calls) == 5


def test_median_ms_is_the_median_of_the_timed_calls(monkeypatch):
    FakeCudaClock([5.0, 1.0, 9.0, 2.0, 3.0]).install(monkeypatch)
    fn, calls = counter()
    assert accuracy.median_ms(fn, warmup=1, repeats=5) == 3.0
    assert len(calls) == 6


def test_median_ms_defaults_to_five_warm_up_calls_and_twenty_repeats(monkeypatch):
    FakeCudaClock([float(i) for i in range(20)]).install(monkeypatch)
    fn, calls = counter()
    assert accuracy.median_ms(fn) == 9.5
    assert len(calls) == 25


def test_pipelined_ms_divides_one_span_by_the_calls(monkeypatch):
    clock = FakeCudaClock([40.0]).install(monkeypatch)
    fn, calls = counter()
    gpu_ms, host_us = accuracy.pipelined_ms(fn, calls=8)
    assert gpu_ms == 5.0
    assert len(calls) == 9  # one warm-up call, then 8 back to back
    assert clock.recorded == 2 and host_us >= 0


def test_pipelined_ms_defaults_to_twenty_calls(monkeypatch):
    FakeCudaClock([40.0]).install(monkeypatch)
    fn, calls = counter()
    assert accuracy.pipelined_ms(fn)[0] == 2.0 and len(calls) == 21


def test_extra_peak_bytes_leaves_out_the_output(monkeypatch):
    # 1000 bytes held before; the peak reaches 1000 + 4096; the output is 64 float32 = 256 bytes.
    clock = FakeCudaClock([], memory=[1000, 1000 + 4096]).install(monkeypatch)
    out, extra = accuracy.extra_peak_bytes(lambda: torch.zeros(64), device=3)
    assert out.shape == (64,) and extra == 4096 - 256
    assert clock.reset == 1 and clock.synchronized == 2
    assert clock.devices == [3] * 5  # every counter of the device asked about


def test_timings_default_to_five_warm_up_calls_and_twenty_repeats(monkeypatch):
    FakeCudaClock([1.0] * 20).install(monkeypatch)
    fn, calls = counter()
    assert accuracy.timings_ms(fn) == [1.0] * 20 and len(calls) == 25


def test_pipelined_host_time_is_microseconds_per_call(monkeypatch):
    FakeCudaClock([40.0]).install(monkeypatch)
    ticks = iter([10.0, 10.004])
    monkeypatch.setattr(accuracy, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks)))
    fn, _ = counter()
    gpu_ms, host_us = accuracy.pipelined_ms(fn, calls=8)
    assert gpu_ms == 5.0 and host_us == pytest.approx(500.0, rel=1e-9)  # 4 ms of host time over 8 calls


def test_relative_errors_do_not_depend_on_the_outputs_scale():
    # Attention outputs can be far below 1 (values near zero): no floor of 1 on any norm.
    ref = randn(2, 3, 70, 8)
    out = ref + 0.05 * randn(2, 3, 70, 8, seed=1)
    big, small = accuracy.errors(out, ref), accuracy.errors(out * 1e-4, ref * 1e-4)
    for name in (
        "rel_l2",
        "worst_head_rel_l2",
        "worst_batch_rel_l2",
        "worst_block_rel_l2",
        "norm_ratio",
        "worst_head_cosine",
    ):
        assert getattr(small, name) == pytest.approx(getattr(big, name), rel=1e-4), name


def test_the_cosine_leaves_out_positions_where_the_reference_is_not_finite():
    ref = randn(1, 1, 64, 8)
    out = ref + 0.3 * randn(1, 1, 64, 8, seed=1)
    ref_holes, out_holes = ref.clone(), out.clone()
    for (row, col), ref_value, out_value in (
        ((3, 1), math.nan, math.nan),
        ((5, 2), math.inf, math.inf),
        ((7, 3), -math.inf, -math.inf),
    ):
        ref_holes[0, 0, row, col], out_holes[0, 0, row, col] = ref_value, out_value
    valid = torch.isfinite(ref_holes)
    expected = torch.nn.functional.cosine_similarity(
        torch.where(valid, out, 0.0).flatten().double(),
        torch.where(valid, ref, 0.0).flatten().double(),
        dim=0,
    ).item()
    found = accuracy.errors(out_holes, ref_holes)
    assert found.finite is True
    assert found.worst_head_cosine == pytest.approx(expected, abs=1e-9)
