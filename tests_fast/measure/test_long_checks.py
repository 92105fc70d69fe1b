"""Call spaces and long checks (issue 16): what each family declares, what certify plans to check,
what a check finds on defective kernels, and how the verdict, the profile and gate bound a family by
what was verified. The verdict tests add long checks to the sample H200 report, where FLUX.1 is
enabled with sm90-fp8-cuda from 4608 query tokens and Qwen-Image with sm89-fp8-cuda from 4608."""

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

from sage_qual.kernels import numerics
from sage_qual.kernels.variants import VARIANTS
from sage_qual.qualification import families
from sage_qual.qualification.decide import checked, fleet, gate, profile, verdict
from sage_qual.qualification.evidence import tasks
from sage_qual.qualification.evidence.report_model import Outcome, ReasonKind, ReportError
from sage_qual.qualification.measure import long_check
from sage_qual.qualification.render import fleet as fleet_render
from sage_qual.qualification.render import plots
from sage_qual.qualification.render.gate import lines as gate_lines
from sage_qual.qualification.run import in_process, plan, run

from .. import builders
from ..builders import SAMPLE, emulate_request, long_records, long_task

FP8 = VARIANTS["sm90-fp8-cuda"]


# Declarations ------------------------------------------------------------------------------------
def test_every_family_declares_a_valid_call_space():
    assert families.call_space_problems() == []
    for family in families.FAMILIES:
        assert family.calls and "contiguous" in family.layouts
        assert set(family.layouts) <= set(families.LAYOUTS)
        longest = family.longest
        # the longest call is at least as long as every timed call of the family
        assert all(longest.q_tokens >= shape.q_tokens for _, shape in family.shapes), family.name
    # Wan 2.2 A14B at 1280x720x81: 80 * 45 * 21 tokens, 40 heads (issue 16)
    wan = families.find("Wan 2.2").longest
    assert (wan.q_tokens, wan.kv_tokens, wan.heads, wan.head_dim) == (75600, 75600, 40, 128)
    assert families.find("Krea-2").longest.kv_heads == 12
    assert families.find("SDXL").longest.dtype == "float16"


def test_a_broken_declaration_is_named():
    shape = families.self_attention(24, 4096)
    bad = (families.Family("A", (), calls=()),
           families.Family("B", (), calls=(families.site("x", shape, shape),), layouts=("contiguous", "hnd")),
           families.Family("C", (), calls=(families.site("y", families.self_attention(24, 8192), shape),),
                           layouts=("transposed",)),
           families.Family("D", (), calls=(families.site("z", shape, families.self_attention(30, 8192)),)))
    problems = families.call_space_problems(bad)
    assert problems[0] == "A: no call sites declared"
    assert problems[1].startswith(
        "B: layouts ['contiguous', 'hnd'] (known: contiguous, transposed, fused_qkv, nhd")
    assert any(p.startswith("C: layouts ['transposed']") for p in problems)
    assert "C: y: smallest call is longer than the largest" in problems
    assert "D: z: smallest and largest differ in heads, head_dim or dtype" in problems


# Planning ----------------------------------------------------------------------------------------
def test_the_plan_checks_every_family_longest_call_and_the_sweep_past_the_fixtures():
    planned = plan.long_checks(list(families.FAMILIES), longest_fixture=4608, quick=False)
    lengths = sorted({c.shape.q_tokens for c in planned.values()})
    assert lengths == [8192, 13728, 16384, 16896, 32768, 75600]
    generic = [c for c in planned.values() if all(u.family is None for u in c.uses)]
    assert sorted(c.shape.q_tokens for c in generic) == [8192, 16384, 32768]
    assert all(c.layouts == list(families.LAYOUTS) for c in generic)  # every layout some family declares
    shared = planned[families.self_attention(24, 16896).key]  # FLUX.1 and Qwen-Image: one check
    assert [u.family for u in shared.uses] == ["FLUX.1", "Qwen-Image"]
    assert shared.layouts == ["contiguous", "transposed", "fused_qkv", "nhd"]  # the union of both
    wan = planned[families.self_attention(40, 75600).key]
    assert [u.family for u in wan.uses] == ["Wan 2.2"] and "fused_qkv" in wan.layouts
    assert wan.shape == tasks.shape_spec(families.self_attention(40, 75600).as_dict())
    assert len(planned) <= len(families.FAMILIES) + 3  # the bound the cost estimate rests on


def test_a_quick_plan_checks_the_longest_call_only_and_cross_calls_never_fuse():
    quick = plan.long_checks(list(families.FAMILIES), 4608, quick=True)
    assert sorted(c.shape.q_tokens for c in quick.values()) == [16384, 75600]
    cross = families.Family("X", (), calls=(families.site("c", families.cross_attention(8, 100, 20000),
                                                          families.cross_attention(8, 100, 20000)),),
                            layouts=("contiguous", "fused_qkv", "nhd"))
    (check,) = plan.long_checks([cross], 4608, quick=False, sweep_tokens=()).values()
    assert check.layouts == ["contiguous", "nhd"]


# The check itself --------------------------------------------------------------------------------
SHAPE = families.self_attention(4, 300, 64, kv_heads=2)


def tensors():
    return long_check.synthetic(SHAPE, "cpu")


def test_layouts_hold_the_same_values_with_their_own_strides():
    q, k, v = tensors()
    for name in families.LAYOUTS:
        *views, tensor_layout = long_check.arrange(q, k, v, name)
        assert tensor_layout == ("NHD" if name == "nhd" else "HND"), name  # SageAttention's spelling
        for view, original in zip(views, (q, k, v), strict=True):
            assert torch.equal(long_check.as_hnd(view, tensor_layout), original), name
    fq, fk, fv, _ = long_check.arrange(q, k, v, "fused_qkv")
    assert fq.stride(2) == fk.stride(2) == fv.stride(2) == (4 + 2 * 2) * 64  # sequence stride (H + 2 KV) D
    assert fk.data_ptr() - fq.data_ptr() == 4 * 64 * q.element_size()
    tq, *_ = long_check.arrange(q, k, v, "transposed")
    assert not tq.is_contiguous() and tq.stride(1) == 64 and tq.stride(2) == 4 * 64
    nq, *_, layout = long_check.arrange(q, k, v, "nhd")
    assert layout == "NHD" and nq.is_contiguous() and nq.shape == (1, 300, 4, 64)


def test_an_unknown_layout_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match=re.escape(
            "unknown layout 'strided' (known: contiguous, transposed, fused_qkv, nhd)")):
        long_check.arrange(*tensors(), "strided")


def test_synthetic_tensors_are_seeded_and_carry_an_outlier_k_channel():
    q, k, v = tensors()
    again = tensors()
    assert all(torch.equal(a, b) for a, b in zip((q, k, v), again, strict=True))
    channel_means = k.float().mean(dim=(0, 1, 2))
    assert channel_means[long_check.OUTLIER_CHANNEL] > 7 and channel_means[1:].abs().max() < 0.5
    assert k[..., long_check.OUTLIER_CHANNEL].float().std() > 0.9  # offset, not replaced: still random
    assert {t.dtype for t in (q, k, v)} == {torch.bfloat16}  # the shape's dtype
    # q drawn at scale 2, k and v at 1 (76,800 and 38,400 draws: the estimates hold to a few percent)
    assert 1.9 < q.float().std() < 2.1 and 0.95 < v.float().std() < 1.05
    assert "synthetic" in long_check.INPUTS


def test_sampled_rows_are_tile_aligned_spread_and_include_the_last_row():
    starts = long_check.sample_starts(75600)
    assert len(starts) == long_check.SAMPLE_BLOCKS and starts[0] == 0
    assert all(s % long_check.SAMPLE_ROWS == 0 for s in starts)
    assert starts[-1] <= 75599 < starts[-1] + long_check.SAMPLE_ROWS
    assert long_check.sample_starts(300) == [0, 128, 256]  # fewer blocks than sampled: every row
    assert long_check.sample_starts(257) == [0, 128, 256]  # one row into the third block
    assert long_check.sample_starts(512) == [0, 128, 256, 384]  # as many blocks as sampled
    assert long_check.sample_starts(513) == [0, 128, 384, 512]  # one block more: spread, the last kept


def test_the_model_of_a_head_dim_128_call_takes_the_variants_head_dim_128_q_tile():
    """sm80-fp16-cuda-fp16acc runs 16-row Q tiles at head_dim 128: the model's rows must too."""
    variant = VARIANTS["sm80-fp16-cuda-fp16acc"]
    q, k, v = long_check.synthetic(families.self_attention(2, 40, 128), "cpu")
    starts, model_rows, _ = long_check._model_on_sampled_rows(variant, q, k, v)
    q_rows = long_check.take_rows(q, starts)
    tiled = numerics.attention(q_rows, k, v, dataclasses.replace(variant.numerics, q_tile=16,
                                                                 q_tile_at_head_dim_128=None))
    untiled = numerics.attention(q_rows, k, v, variant.numerics)
    assert torch.equal(model_rows, tiled) and not torch.equal(model_rows, untiled)


def test_bit_identity_sees_one_changed_bit():
    out = torch.randn(1, 2, 8, 16).to(torch.bfloat16)
    changed = out.clone()
    changed.view(torch.int16)[0, 1, 7, 15] ^= 1
    assert long_check.bit_identical(out, out.clone()) and not long_check.bit_identical(out, changed)
    assert not long_check.bit_identical(out, out.float())


def exact(q, k, v, tensor_layout):
    """A correct kernel: exact attention, whatever the strides (computed from contiguous copies)."""
    q, k, v = (long_check.as_hnd(t, tensor_layout).contiguous() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(group, 1).float() for t in (k, v))
    out = (torch.softmax((q.float() @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5, -1) @ v).to(q.dtype)
    return out.transpose(1, 2).contiguous() if tensor_layout == "NHD" else out


def test_a_correct_kernel_passes_in_every_layout():
    task = long_task(SHAPE, families.LAYOUTS)
    result = long_check.check(task, *tensors(), exact)
    assert result.outcome == Outcome.PASS and result.reasons == []
    assert result.identical == {"transposed": True, "fused_qkv": True, "nhd": True}
    assert result.metrics.rel_l2 < result.budget.max_rel_l2 and result.metrics.finite
    assert result.model_finite is True
    assert (result.rows, result.row_block) == ([0, 128, 256], long_check.SAMPLE_ROWS)
    # the task's call, as the report stores it
    assert (result.variant, result.shape, result.uses) == (task.variant, task.shape, task.uses)
    assert result.layouts == task.layouts


def test_a_prediction_calls_every_layout_but_contiguous_identical():
    result = long_check.check(long_task(SHAPE, families.LAYOUTS), *tensors(), None)
    assert result.identical == {"transposed": True, "fused_qkv": True, "nhd": True}
    assert result.outcome == Outcome.PASS and result.rows_identical is None


def test_a_kernel_wrong_only_on_views_fails_its_layouts():
    def strided_bug(q, k, v, tensor_layout):
        out = exact(q, k, v, tensor_layout)
        return out + 1e-2 if not v.is_contiguous() else out

    result = long_check.check(long_task(SHAPE, families.LAYOUTS), *tensors(), strided_bug)
    assert result.identical == {"transposed": False, "fused_qkv": False, "nhd": True}
    assert [r.detail for r in result.reasons] == [
        "layout transposed: output differs from the same kernel's on contiguous copies",
        "layout fused_qkv: output differs from the same kernel's on contiguous copies"]


def test_a_kernel_wrong_only_in_the_last_rows_fails_its_accuracy():
    def tail_bug(q, k, v, tensor_layout):
        out = exact(q, k, v, tensor_layout).clone()
        out[:, :, -40:] = 0  # rows past an offset limit left unwritten
        return out

    result = long_check.check(long_task(SHAPE, ["contiguous"]), *tensors(), tail_bug)
    assert result.outcome == Outcome.FAIL
    assert any(r.detail.startswith("worst query-row block's relative L2") for r in result.reasons)


def test_a_non_finite_kernel_fails():
    def nan(*args):
        return exact(*args) * float("nan")

    result = long_check.check(long_task(SHAPE, ["contiguous"]), *tensors(), nan)
    assert result.outcome == Outcome.FAIL and result.metrics.finite is False
    assert result.reasons[0].kind == ReasonKind.NON_FINITE


# The verdict's range -----------------------------------------------------------------------------
def decided(fail_at=None, how="accuracy", devices=(0, 1)):
    data = json.loads(SAMPLE.read_text())
    for n, device in enumerate(data["devices"]):
        device["long"] = []
        for variant in ("sm90-fp8-cuda", "sm89-fp8-cuda"):
            device["long"] += long_records(variant, fail_at if n in devices else None, how)
    typed = checked.parse(data, "sample")
    (gpu,) = verdict.decide(typed)
    return typed, gpu


def test_a_family_is_enabled_up_to_its_longest_passing_check():
    _, gpu = decided()
    flux = gpu.family("FLUX.1")
    assert flux.verdict == verdict.Verdict.ENABLE and flux.served.range_verified
    # its own longest call (16,896) and the generic sweep at its head size (to 32,768)
    assert (flux.served.max_query_tokens, flux.served.max_key_tokens) == (32768, 32768)
    assert (
        flux.served.layouts == ("contiguous", "transposed", "nhd", "fused_qkv") and flux.range_reasons == []
    )
    assert flux.served.text() == ("from 4,608 to 32,768 query / 512 to 32,768 key tokens, head_dim 128 "
                                   "(layouts: contiguous, transposed, nhd, fused_qkv)")
    qwen = gpu.family("Qwen-Image")
    assert qwen.served.layouts == ("contiguous", "transposed", "nhd")  # what Qwen-Image declares


@pytest.mark.parametrize("how", ["accuracy", "crash"])
def test_a_failing_long_check_caps_the_range_below_its_length(how):
    _, gpu = decided(fail_at=16384, how=how)
    flux = gpu.family("FLUX.1")
    assert flux.verdict == verdict.Verdict.ENABLE and flux.served.max_query_tokens == 8192
    first = flux.range_reasons[0]
    assert first.kind.value == "long" and first.detail.startswith("verified only below 16,384 query tokens")
    assert "sm90-fp8-cuda at 16,384 / 16,384 tokens (cuda:0)" in first.detail


def test_a_check_failing_on_one_device_only_caps_the_model():
    _, gpu = decided(fail_at=32768, devices=(1,))
    assert gpu.family("FLUX.1").served.max_query_tokens == 16896
    assert "(cuda:1)" in gpu.family("FLUX.1").range_reasons[0].detail


def test_a_missing_check_caps_the_range():
    data = json.loads(SAMPLE.read_text())
    for device in data["devices"]:
        device["long"] = [r for r in long_records("sm90-fp8-cuda") + long_records("sm89-fp8-cuda")
                          if device["index"] == 0 or r["shape"]["q_tokens"] != 16896]
    (gpu,) = verdict.decide(checked.parse(data, "sample"))
    flux = gpu.family("FLUX.1")
    assert flux.served.max_query_tokens == 16384 and "long check not run" in flux.range_reasons[1].detail


def test_nothing_verified_past_the_break_even_keeps_the_family_off():
    _, gpu = decided(fail_at=8192)
    qwen = gpu.family("Qwen-Image")  # its fixture has 4352 tokens, its break-even is 4608
    assert qwen.verdict == verdict.Verdict.KEEP_OFF and qwen.served is None
    assert qwen.reasons[0].kind.value == "long"
    assert qwen.reasons[0].detail == ("no verified range: sm89-fp8-cuda pays from 4,608 tokens but was "
                                      "verified only up to 4,352")
    flux = gpu.family("FLUX.1")  # its fixture has 4608 tokens: the range shrinks to that one length
    assert flux.verdict == verdict.Verdict.ENABLE and flux.served.max_query_tokens == 4608


def test_a_layout_whose_view_differs_is_dropped_not_the_range():
    _, gpu = decided(fail_at=16384, how="layout")
    flux = gpu.family("FLUX.1")
    assert flux.served.max_query_tokens == 32768 and flux.served.layouts == ("contiguous", "nhd", "fused_qkv")
    first = flux.range_reasons[0]
    assert first.kind.value == "layout" and "layout transposed" in first.detail


def test_a_report_without_long_checks_has_no_upper_bound():
    (gpu,) = verdict.decide(checked.load(SAMPLE))
    flux = gpu.family("FLUX.1")
    assert flux.verdict == verdict.Verdict.ENABLE and not flux.served.range_verified
    assert flux.served.max_query_tokens is None and flux.served.layouts is None
    assert "no upper bound verified" in flux.served.text()


def with_long_checks() -> dict:
    data = json.loads(SAMPLE.read_text())
    for device in data["devices"]:
        device["long"] = long_records("sm90-fp8-cuda")
    checked.parse(data, "sample")  # as certify plans them, they read
    return data


@pytest.mark.parametrize("edit, says", [
    # FLUX.1's check relabelled to 10^6 tokens: it would enable FLUX.1 up to there (issue 28)
    (lambda checks: checks[3]["shape"].update(q_tokens=10**6, kv_tokens=10**6),
     "shape: not FLUX.1's longest call (16896 query / 16896 key tokens, 24 heads x 128)"),
    # an extra sweep check at 10^9 tokens: every family's range would reach it
    (lambda checks: checks.append({**checks[2], "shape": {**checks[2]["shape"], "q_tokens": 10**9,
                                                          "kv_tokens": 10**9}}),
     "shape: not the generic sweep's self-attention (24 heads x 128 at 1024, 2048, 4096, 8192, 16384, "
     "32768 tokens)"),
    (lambda checks: checks[2]["shape"].update(heads=12), "shape: not the generic sweep's self-attention"),
    # Wan 2.2's check claimed for LTX-2 too, whose longest call it is not
    (lambda checks: checks[4]["uses"].append({"family": "LTX-2", "label": "test"}),
     "shape: not LTX-2's longest call (13728 query / 13728 key tokens, 32 heads x 128)"),
    (lambda checks: checks[4]["uses"].append({"family": "Sora", "label": "test"}),
     "uses: 'Sora' is not a family of this run"),
])
def test_a_long_check_certify_does_not_plan_is_refused(edit, says):
    data = with_long_checks()
    edit(data["devices"][0]["long"])
    with pytest.raises(ReportError, match=r"devices\[0\]\.long\[\d\] \(sm90-fp8-cuda at \d+ tokens\): "
                                          + re.escape(says)):
        checked.parse(data, "sample")


def test_a_layout_compared_but_not_declared_is_refused():
    """Issue 28: checks declaring contiguous only, with the other layouts claimed identical in
    `identical`, got all four layouts enabled."""
    data = with_long_checks()
    check = data["devices"][0]["long"][0]
    check["layouts"] = ["contiguous"]
    with pytest.raises(ReportError, match=r"devices\[0\]\.long\[0\]\.identical: 'fused_qkv' is not among "
                                          r"the layouts checked \(contiguous\)"):
        checked.parse(data, "sample")


def test_an_edited_long_check_is_refused():
    data = json.loads(SAMPLE.read_text())
    for device in data["devices"]:
        device["long"] = long_records("sm90-fp8-cuda")
    data["devices"][0]["long"][0]["metrics"]["rel_l2"] = 0.5  # beyond its bound, outcome still pass
    edited = r"devices\[0\]\.long\[0\] \(sm90-fp8-cuda at 8192 tokens\): outcome"
    with pytest.raises(ReportError, match=edited):
        checked.parse(data, "sample")
    data["devices"][0]["long"][0]["metrics"]["rel_l2"] = -0.1
    with pytest.raises(ReportError, match="metrics.rel_l2"):
        checked.parse(data, "sample")


@pytest.mark.parametrize("outcome, how, key, missing", [
    ("pass", None, "budget", "missing for a long check whose outcome is 'pass'"),
    ("fail", "accuracy", "metrics", "missing for a long check whose outcome is 'fail'"),
    ("crash", "crash", "detail", "empty for a long check whose outcome is 'crash' (it says why)")])
def test_a_long_check_without_what_its_outcome_needs_is_refused_naming_the_key(outcome, how, key, missing):
    data = json.loads(SAMPLE.read_text())
    data["devices"][0]["long"] = long_records("sm90-fp8-cuda", fail_at=8192 if how else None, how=how)
    assert data["devices"][0]["long"][0]["outcome"] == outcome
    checked.parse(data, "sample")  # as built, it reads (parsing leaves data as it is)
    data["devices"][0]["long"][0][key] = None if key != "detail" else ""
    with pytest.raises(ReportError, match=rf"devices\[0\]\.long\[0\]\.{key}: {re.escape(missing)}"):
        checked.parse(data, "sample")


# Profile, gate, merge ----------------------------------------------------------------------------
def test_the_profile_holds_the_range_and_layouts():
    typed, gpu = decided(fail_at=16384)
    built = profile.build(typed, [gpu])
    flux = built.gpus[0].families["FLUX.1"]
    assert (flux.served.max_query_tokens, flux.served.max_key_tokens) == (8192, 8192)
    assert flux.served.layouts == ("contiguous", "transposed", "nhd", "fused_qkv")
    assert flux.reasons[0].kind == "long"
    off = built.gpus[0].families["Wan 2.2"]  # kept off: no range
    assert off.served is None
    legacy = profile.build(checked.load(SAMPLE), verdict.decide(checked.load(SAMPLE)))
    legacy_flux = legacy.gpus[0].families["FLUX.1"]  # enabled, but no long checks: no bound known
    assert legacy_flux.variant and (legacy_flux.served.max_query_tokens, legacy_flux.served.layouts) == (
        None,
        None,
    )


def test_gate_and_merge_say_the_verified_range():
    typed, gpu = decided(fail_at=32768)
    decision = gate.GateDecision("FLUX.1", 0, gpus=[(gpu.model, gpu.family("FLUX.1"))])
    lines = gate_lines(decision, False)
    assert lines[0] == ("FLUX.1 on NVIDIA H200 (sm_90): enable sm90-fp8-cuda from 4,608 to 16,896 query / "
                        "512 to 16,896 key tokens, head_dim 128 "
                        "(layouts: contiguous, transposed, nhd, fused_qkv)")
    assert lines[1].startswith("  - range: verified only below 32,768 query tokens")
    (row,) = fleet.merge_rows([(Path("r.json"), typed)])
    assert row.families["FLUX.1"].served.max_query_tokens == 16896
    assert ("enable: sm90-fp8-cuda 4,608 to 16,896 query / 512 to 16,896 key tokens, head_dim 128 "
            "(contiguous, transposed, nhd, fused_qkv)") in fleet_render.merge_markdown([row])


def test_the_report_renders_the_long_checks(tmp_path, monkeypatch):
    data = json.loads(SAMPLE.read_text())
    for device in data["devices"]:
        device["long"] = long_records("sm90-fp8-cuda", fail_at=32768)
    monkeypatch.setattr(plots, "plots", lambda *args: {})
    builders.rendered(checked.parse(data, "r.json"), tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "### Long calls and layouts" in md
    assert ("| sm90-fp8-cuda | 75,600 / 75,600 tokens, 40 heads x 128 bfloat16 | Wan 2.2 test | pass | "
            "0.05 (<= 0.06) | transposed yes, fused_qkv yes, nhd yes |  |") in md
    assert "| FLUX.1 | enable | sm90-fp8-cuda | from 4,608 to 16,896 query / 512 to 16,896 key tokens" in md


# The CPU path: certify --emulate -----------------------------------------------------------------
def test_emulate_predicts_the_long_checks(tmp_path, capsys):
    options = emulate_request(tmp_path, variants=["sm90-fp8-cuda"], families=["Qwen-Image"], quick=True)
    checks = run.certify(options).devices[0].long
    assert sorted(c.shape.q_tokens for c in checks) == [16384, 16896]
    for check in checks:
        assert check.outcome == "pass" and check.detail == in_process.PREDICTED
        assert check.ran_heads == 1 and check.metrics.finite and check.inputs == long_check.INPUTS
        last_tile = (check.shape.q_tokens - 1) // 128 * 128
        assert check.rows == [0, last_tile]  # EMULATE_BLOCKS: the first and the last block
    checked.load(tmp_path / "report.json")  # reads back, its evidence consistent


@pytest.mark.parametrize("name", ["ck-int8-cuda", "sm90-fp8-cuda"])
def test_a_long_checks_model_runs_the_scheme_of_its_key_count(name):
    """The sampled rows' model is `numerics.predict` on those rows: comfy-kitchen's key tile is 128
    past 1,024 keys, and a long check modelled with 64 at every length (issue 54, a bug found by
    reading) judged its kernel against another kernel's arithmetic."""
    variant = VARIANTS[name]
    generator = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, n, 128, generator=generator).to(torch.bfloat16) for n in (512, 1152, 1152))
    k[..., 5] += 30  # an outlier channel, so the key blocks' INT8 scales differ with their size
    starts, model_rows, _ = long_check._model_on_sampled_rows(variant, q, k, v, blocks=2)
    expected = numerics.predict(variant, long_check.take_rows(q, starts), k, v)
    assert torch.equal(model_rows, expected)
