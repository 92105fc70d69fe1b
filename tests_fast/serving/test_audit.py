"""The sampled audit of served calls (`serving.audit`) on the fake kernels: which calls it audits,
which slice, when its numbers are read, what a miss does, and each execution context."""

import dataclasses
import itertools
import json
import logging
import math
from pathlib import Path

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F

import sage_qual
from sage_qual.fixtures import fileformat
from sage_qual.fixtures.audit_misses import recorded_miss
from sage_qual.fixtures.recorder import AUDIT_PROVENANCE, AuditFolder
from sage_qual.kernels.contexts import CAPTURE
from sage_qual.serving import audit, slice_check
from sage_qual.serving.config import AuditConfig

from ..helpers import SMALL, qkv, records, retired, wrapped

pytestmark = pytest.mark.usefixtures("log_everything")

SM90 = (9, 0)


def config(**audit_options):
    return dataclasses.replace(SMALL, audit=AuditConfig(**audit_options))


def serve_many(count, tensors=None, **kwargs):
    tensors = tensors or qkv()
    with sage_qual.sage_attention_scope() as report:
        for _ in range(count):
            F.scaled_dot_product_attention(*tensors, **kwargs)
    return report


def wrong_after(calls, good):
    """A kernel behaviour right for `good` calls, then finite and wrong (rows shifted)."""
    def make(exact):
        calls[0] += 1
        return exact if calls[0] <= good else exact.roll(1, dims=2) * 3
    return make


# The configuration ------------------------------------------------------------------------------

@pytest.mark.parametrize("options, said", [
    ({"every": -1}, "AuditConfig.every=-1: give a whole number of at least 0 (0 turns the audit off)"),
    ({"every": 2.5}, "AuditConfig.every=2.5"),
    ({"every": True}, "AuditConfig.every=True"),
    ({"rows": 0}, "AuditConfig.rows=0: give a whole number of at least 1"),
    ({"retire": "yes"}, "AuditConfig.retire='yes': give True or False"),
    ({"record": "misses/"}, "AuditConfig.record='misses/': give fixtures.recorder.AuditFolder(path)"),
])
def test_a_bad_audit_option_is_named_with_the_fix(options, said):
    with pytest.raises(ValueError) as caught:
        AuditConfig(**options)
    assert str(caught.value).startswith(said)


def test_the_default_install_audits_served_calls():
    every = sage_qual.WrapperConfig().audit.every
    assert every > 0
    with wrapped(config=dataclasses.replace(SMALL, audit=sage_qual.WrapperConfig().audit)):
        report = serve_many(2 * every)
    assert report.audit.audited == 2 and not report.audit.misses
    assert "audit: 2 calls, worst any family" in report.summary()


@pytest.mark.parametrize("every, calls, audited", [(1, 5, 5), (4, 12, 3), (3, 9, 3), (0, 50, 0)])
def test_one_served_call_in_every_is_audited(every, calls, audited):
    with wrapped(config=config(every=every)):
        report = serve_many(calls)
    assert report.served == calls and report.audit.audited == audited


def test_calls_left_to_torch_are_not_counted_toward_the_audit():
    short = qkv(q_tokens=8)  # under SMALL's 32 query tokens: torch's
    with wrapped(config=config(every=2)):
        with sage_qual.sage_attention_scope() as report:
            for _ in range(5):
                F.scaled_dot_product_attention(*short)
            F.scaled_dot_product_attention(*qkv())
            F.scaled_dot_product_attention(*qkv())
    assert report.fallbacks == {"short": 5} and report.audit.audited == 1  # one in the first block of 2


# The slice --------------------------------------------------------------------------------------

@pytest.mark.parametrize("batch, heads, kv_heads, tokens, rows", [
    (1, 2, 2, 48, 16), (2, 8, 2, 100, 16), (3, 4, 1, 1000, 256), (1, 24, 24, 16384, 256)])
def test_successive_audits_visit_every_sample_head_group_and_row_block(batch, heads, kv_heads, tokens, rows):
    blocks = math.ceil(tokens / rows)
    seen = set()
    for number in range(batch * kv_heads * blocks):
        where = slice_check.audit_slice(number, (batch, heads, tokens), kv_heads, rows)
        sample, query_heads, picked = where.sample, where.heads, where.rows
        assert len(query_heads) == heads // kv_heads and 0 < picked.stop - picked.start <= rows
        seen.add((sample, query_heads.start, picked.start))
    group = heads // kv_heads
    expected = set(itertools.product(range(batch), range(0, heads, group), range(0, tokens, rows)))
    assert seen == expected


def test_a_defect_in_one_head_only_is_found_once_the_walk_reaches_it():
    def third_head_wrong(exact):
        out = exact.clone()
        out[:, 2] = -out[:, 2]
        return out

    tensors = qkv(heads=4)
    with wrapped(config=config(every=1, rows=16)) as (_, fake):
        with sage_qual.sage_attention_scope():
            F.scaled_dot_product_attention(*tensors)  # the first-call check reads heads 0 only
        fake.return_value(third_head_wrong)
        report = serve_many(4 * 3, tensors)
    [miss] = report.audit.misses
    assert "query head 2" in miss.rows


# When the numbers are read ------------------------------------------------------------------------

def test_the_served_path_never_waits_and_the_scope_reads_its_audits_at_exit():
    calls = [0]
    with wrapped(config=config(every=1)) as (cuda, fake):
        serve_many(1)
        fake.return_value(wrong_after(calls, 0))
        cuda.reads_held = True  # every copy still on its way until waited for
        with sage_qual.sage_attention_scope() as report:
            for _ in range(3):
                F.scaled_dot_product_attention(*qkv())
            assert report.audit.audited == 0 and not retired()  # nothing read on the served path
        assert report.audit.audited == 3 and len(report.audit.misses) == 3
        assert retired().startswith("audit miss: sm90-fp8-cuda on cuda:0 (GPU0, sm_90) for any family")


def test_an_inner_scope_hands_its_audit_to_the_outer_one():
    with wrapped(config=config(every=1)):
        with sage_qual.sage_attention_scope() as outer:
            F.scaled_dot_product_attention(*qkv())
            inner = serve_many(2)
    assert inner.audit.audited == 2 and outer.audit.audited == 3
    assert audit.audit_tally().audited == 3


# What a miss does --------------------------------------------------------------------------------

def test_a_miss_is_counted_warned_once_with_its_numbers_and_moves_the_gpu_to_torch(caplog):
    calls = [0]
    with wrapped(config=config(every=4), names=["Fake H200"]) as (_, fake):
        serve_many(1)
        fake.return_value(wrong_after(calls, 10))
        report = serve_many(40)
    [miss] = report.audit.misses
    assert calls[0] <= 10 + 2 * 4  # caught at the first audit after call 10, acted on at the next
    assert report.fallbacks["device"] == 40 - calls[0]
    [warning] = [m for m in records(caplog, logging.WARNING) if "audit miss" in m]
    assert f"relative L2 {miss.rel_l2:.3g} against PyTorch SDPA, bound 0.3" in warning
    assert "q/k/v [1, 2, 48, 64] [1, 2, 24, 64] [1, 2, 24, 64] float16" in warning
    assert "for any family until this process restarts, its attention runs on PyTorch SDPA" in warning


def test_with_retire_off_a_miss_is_counted_and_warned_once_and_the_kernel_keeps_serving(caplog):
    calls = [0]
    with wrapped(config=config(every=2, retire=False)) as (_, fake):
        serve_many(1)
        fake.return_value(wrong_after(calls, 0))
        report = serve_many(10)
    assert report.served == 10 and len(report.audit.misses) == 5 and not retired()
    assert len([m for m in records(caplog, logging.WARNING) if "audit miss" in m]) == 1


def test_a_miss_keeps_the_gpu_off_that_family_in_a_later_install_of_the_process_only():
    calls = [0]
    with wrapped(config=config(every=1)) as (_, fake):
        sage_qual.install(config=config(every=1), family="Krea-2")
        serve_many(1)
        fake.return_value(wrong_after(calls, 0))
        serve_many(2)
        assert retired()
        fake.behave()
        sage_qual.install(config=config(every=1), family="FLUX.1")
        assert not retired()
        status = sage_qual.install(config=config(every=1), family="krea 2")
        assert retired().startswith("audit miss: sm90-fp8-cuda on cuda:0 (GPU0, sm_90) for Krea-2: relative ")
        assert not status.enabled
        assert "was retired by this process until it restarts: audit miss" in status.reason
        audit.reset_process()
        sage_qual.install(config=config(every=1), family="Krea-2", audit=AuditConfig(every=2))
        assert not retired()


def test_a_non_finite_output_is_a_miss():
    with wrapped(config=config(every=1)) as (_, fake):
        serve_many(1)
        fake.return_value(lambda exact: torch.full_like(exact, float("nan")))
        report = serve_many(2)
    assert len(report.audit.misses) >= 1 and math.isnan(report.audit.misses[0].rel_l2)
    assert "worst any family nan" in report.summary()


def test_the_audits_of_a_full_disk_fail_quietly_and_the_miss_still_counts(tmp_path, caplog):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    with wrapped(config=config(every=1, record=AuditFolder(str(blocked / "misses")))) as (_, fake):
        serve_many(1)
        fake.return_value(lambda exact: exact * 3)
        report = serve_many(2)
    assert report.audit.misses and not report.audit.misses[0].fixture
    assert any("could not record the miss" in m for m in records(caplog, logging.WARNING))


def test_a_miss_is_recorded_as_a_recorded_fixture_that_keeps_the_outlier_channels(tmp_path):
    q, k, v = qkv(heads=4, kv_heads=2)
    k[..., 7] *= 40  # an outlier channel of K
    with wrapped(config=config(every=1, rows=16, record=AuditFolder(str(tmp_path))),
                 names=["Fake H200"]) as (_, fake):
        sage_qual.install(config=config(every=1, rows=16, record=AuditFolder(str(tmp_path))), family="Krea-2")
        serve_many(1, (q, k, v), enable_gqa=True)
        fake.return_value(lambda exact: exact * 3)
        report = serve_many(1, (q, k, v), enable_gqa=True)
    [miss] = report.audit.misses
    [path] = tmp_path.glob("audit-*.safetensors")
    assert miss.fixture == str(path)
    fixture = fileformat.load_fixture(path)
    assert fixture.kind == "recorded" and fixture.family == "Krea-2"
    said = f"{AUDIT_PROVENANCE}: sm90-fp8-cuda on Fake H200 (thu-ml 2.2.0) for Krea-2"
    assert fixture.provenance.startswith(said)
    assert list(fixture.q.shape) == [1, 2, 16, 64] and list(fixture.k.shape) == [1, 1, 24, 64]
    assert fixture.bounds["fp8"]["max_rel_l2"] == 0.3
    assert [c for c, _ in fixture.source["full_call"]["channels"]["k"]["outlier_channels"]] == [7]
    recorded = recorded_miss(fixture.source, str(path))
    assert recorded.variant == "sm90-fp8-cuda" and recorded.gpu == "Fake H200" and recorded.rel_l2 > 0.3


# Execution contexts ------------------------------------------------------------------------------

def test_a_side_stream_call_is_audited_on_its_bridged_output():
    with wrapped(config=dataclasses.replace(config(every=1), contexts=("side_stream",))) as (cuda, fake):
        serve_many(1)
        with cuda.side_stream(0):
            report = serve_many(2)
    assert report.served == 2 and report.audit.audited == 2 and not report.audit.misses


def test_a_captured_call_is_skipped_and_counted_as_skipped():
    fake = sage_qual.testing.FakeSageAttention(current_stream=("sageattn_qk_int8_pv_fp8_cuda_sm90",))
    with wrapped(config=dataclasses.replace(config(every=1), contexts=("side_stream", "capture")),
                 fake=fake) as (cuda, _):
        serve_many(1)
        with cuda.capture(0):
            report = serve_many(2)
    assert report.served == 2 and report.audit.audited == 0 and report.audit.skipped == {CAPTURE: 2}
    assert "audit: 0 calls (2 skipped: capture=2)" in report.summary()


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.usefixtures("fresh_dynamo")
def test_a_compiled_call_is_audited_as_its_operator_runs():
    calls = [0]
    with wrapped(config=dataclasses.replace(config(every=1), contexts=("compile",))) as (_, fake):
        serve_many(1)
        run = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v) * 2, backend="aot_eager",
                            fullgraph=True)
        with sage_qual.sage_attention_scope() as report:
            run(*qkv())
            fake.return_value(wrong_after(calls, 0))
            run(*qkv())
    assert report.served == 2 and report.audit.audited == 2 and len(report.audit.misses) == 1
    assert "(compile)" in report.audit.misses[0].call


def test_numbers_that_cannot_be_read_are_counted_skipped_and_the_scope_exits_cleanly():
    """A faulted CUDA context raises on every read: the scope's exit and uninstall() must not."""
    def broken(values):
        def read(wait):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return read

    with wrapped(config=config(every=1)) as (cuda, _):
        cuda.read_later = broken
        report = serve_many(2)
        sage_qual.uninstall()
    assert report.audit.audited == 0 and report.audit.skipped == {"error": 2} and report.served == 2


# The second judge: conformance -------------------------------------------------------------------

def scaled_after(calls, good, factor):
    """Right for `good` calls, then `factor` x torch's output: 20 % off is under the fitness bound 0.3
    but several times the sm90 model's error on these tensors (0.03-0.05 per slice)."""
    def make(exact):
        calls[0] += 1
        return exact if calls[0] <= good else exact * factor
    return make


def test_a_kernel_off_its_model_but_fit_is_a_drift_that_retires_the_gpu_by_default(caplog):
    calls = [0]
    with wrapped(config=config(every=1)) as (_, fake):
        serve_many(1)
        fake.return_value(scaled_after(calls, 1, 1.2))
        report = serve_many(3)
    [drift] = report.audit.drifts
    assert not report.audit.misses and drift.judge == "drift"
    assert drift.rel_l2 == pytest.approx(0.2, rel=1e-2) and drift.rel_l2 < 0.3
    assert drift.model_rel_l2 is not None and drift.model_rel_l2 < drift.bound < drift.rel_l2
    said = "audit drift: sm90-fp8-cuda on cuda:0 (GPU0, sm_90) for any family: relative L2 "
    assert retired().startswith(said)
    assert "where its numerics model gives" in retired()
    assert report.audit.retired == {"cuda:0 (GPU0, sm_90)": "audit drift for any family"}
    assert audit.retired_before(0, "GPU0", None) == retired()
    assert "0 misses, 1 drifts" in report.summary()


def test_with_drift_warn_the_kernel_keeps_serving_and_warns_once(caplog):
    calls = [0]
    with wrapped(config=config(every=1, drift="warn")) as (_, fake):
        serve_many(1)
        fake.return_value(scaled_after(calls, 0, 1.2))
        report = serve_many(4)
    assert report.served == 4 and len(report.audit.drifts) == 4 and not retired()
    [warning] = [m for m in records(caplog, logging.WARNING) if "audit drift" in m]
    assert "it keeps serving (AuditConfig.drift='warn'), later drifts are counted only" in warning


def test_a_kernel_closer_to_torch_than_its_model_conforms():
    """Conformance bounds the kernel's error from above only: exact output is no drift."""
    with wrapped(config=config(every=1)):
        report = serve_many(5)
    assert report.audit.audited == 5 and not report.audit.drifts and not report.audit.misses
    [(key, ratio)] = report.audit.worst_ratio.items()
    assert key == ("any family", "sm90-fp8-cuda") and ratio < 1


def test_a_bad_drift_or_seed_option_is_named():
    with pytest.raises(ValueError, match="AuditConfig.drift='stop': give 'retire' or 'warn'"):
        AuditConfig(drift="stop")
    with pytest.raises(ValueError, match="AuditConfig.seed=1.5: give a whole number"):
        AuditConfig(seed=1.5)


# The calls CPU fakes make easy to skip -------------------------------------------------------------

def test_a_batch_of_two_is_audited_in_both_samples_and_a_defect_in_the_second_is_found():
    """Classifier-free guidance: sample 1 (the conditional half) wrong only."""
    def second_sample_wrong(exact):
        out = exact.clone()
        out[1] = -out[1]
        return out

    tensors = qkv(batch=2)
    with wrapped(config=config(every=1)) as (_, fake):
        serve_many(1, tensors)
        fake.return_value(second_sample_wrong)
        report = serve_many(8, tensors)
    assert report.audit.misses and all("sample 1" in m.rows for m in report.audit.misses)


def test_a_masked_call_is_judged_on_its_mask_slice_and_the_mask_is_saved_with_a_miss(tmp_path):
    q, k, v = qkv(batch=2)
    mask = torch.ones(2, 1, 1, k.shape[2], dtype=torch.bool)
    mask[1, ..., 8:] = False  # the second item's last keys are padding
    # comfy-kitchen's kernel takes a mask (thu-ml's take none).
    masked = dataclasses.replace(config(every=1, record=AuditFolder(str(tmp_path))), masks=True,
                                 kernel_table={SM90: ("ck-int8-cuda",)})
    with_ck = sage_qual.testing.FakeSageAttention(comfy_kitchen="0.2.40")
    with wrapped(config=masked, fake=with_ck) as (_, fake):
        with sage_qual.sage_attention_scope() as report:
            for _ in range(4):
                F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        assert report.served == 4 and report.audit.audited == 4, report.summary()
        assert not report.audit.misses and not report.audit.drifts  # judged with the mask: exact output fits
        fake.return_value(lambda exact: exact * 3)
        wrong = serve_many(2, (q, k, v), attn_mask=mask)
    [miss, *_] = wrong.audit.misses
    saved = fileformat.load_fixture(miss.fixture)
    sample = int(miss.rows.split(",")[0].removeprefix("sample "))
    assert torch.equal(saved.mask, mask[sample:sample + 1].expand(1, 1, saved.q.shape[2], k.shape[2]))


def test_a_zero_reference_slice_is_judged_by_its_absolute_error():
    """V zero in every key: torch's output is zero, so any output off zero is a miss (not a division by
    zero), and an exact zero output is fit."""
    q, k, v = qkv()
    zero_v = torch.zeros_like(v)
    with wrapped(config=config(every=1)) as (_, fake):
        report = serve_many(2, (q, k, zero_v))
        assert not report.audit.misses and report.audit.worst["any family"] == 0
        fake.return_value(lambda exact: exact + 1)
        wrong = serve_many(1, (q, k, zero_v))
    assert wrong.audit.misses and wrong.audit.misses[0].rel_l2 > 1e6


def test_an_install_without_a_family_retires_for_any_family_and_a_later_install_for_none_stays_off():
    calls = [0]
    with wrapped(config=config(every=1)) as (_, fake):
        serve_many(1)
        fake.return_value(wrong_after(calls, 0))
        serve_many(2)
        assert audit.retired_before(0, "GPU0", None).startswith("audit miss: sm90-fp8-cuda on cuda:0 (GPU0, ")
        fake.behave()
        assert not sage_qual.install(config=config(every=2)).enabled
        assert retired().startswith("audit miss: ")
        assert audit.retired_before(0, "GPU0", "FLUX.1") == ""


# What a service reads -----------------------------------------------------------------------------

def test_the_tally_is_a_json_snapshot_with_every_number():
    calls = [0]
    with wrapped(config=config(every=1, retire=False)) as (_, fake):
        sage_qual.install(config=config(every=1, retire=False), family="Krea-2")
        serve_many(2)
        fake.return_value(wrong_after(calls, 0))
        serve_many(1)
        fake.return_value(lambda exact: torch.full_like(exact, float("nan")))
        serve_many(1)
    snapshot = json.loads(json.dumps(audit.audit_tally().snapshot(), allow_nan=False))
    assert snapshot["audited"] == 4 and snapshot["skipped"] == {}
    [worst] = snapshot["worst"]
    assert (worst["family"], worst["variant"], worst["fitness_bound"]) == ("Krea-2", "sm90-fp8-cuda", 0.3)
    assert worst["rel_l2"] is None  # the NaN output: not finite
    assert [m["judge"] for m in snapshot["misses"]] == ["miss", "miss"] and snapshot["drifts"] == []
    first = snapshot["misses"][0]
    assert first["rel_l2"] > 0.3 and first["gpu"] == "GPU0" and first["capability"] == [9, 0]
    assert snapshot["retired"] == []


def test_the_tally_as_prometheus_metrics():
    prometheus_client = pytest.importorskip("prometheus_client")
    from sage_qual.serving import audit_tally

    calls = [0]
    with wrapped(config=config(every=1)) as (_, fake):
        serve_many(1)
        fake.return_value(wrong_after(calls, 0))
        serve_many(2)
    registry = prometheus_client.CollectorRegistry()
    registry.register(audit_tally.prometheus_collector(audit.audit_tally))
    text = prometheus_client.generate_latest(registry).decode()
    assert "sage_qual_audit_calls_total 2.0" in text
    found = 'sage_qual_audit_findings_total{family="any family",judge="miss",variant="sm90-fp8-cuda"} 1.0'
    assert found in text
    assert "sage_qual_audit_retired_devices 1.0" in text
    assert 'sage_qual_audit_fitness_bound{family="any family"} 0.3' in text
    documented = (Path(__file__).resolve().parents[2] / "docs" / "audit.md").read_text()
    assert all(f"`{name}`" in documented for name in audit_tally.METRICS)


@pytest.mark.parametrize("folder", ["", "  ", None])
def test_an_audit_folder_must_name_a_folder(folder):
    with pytest.raises(ValueError, match=r"give the folder to record into"):
        AuditFolder(folder)
