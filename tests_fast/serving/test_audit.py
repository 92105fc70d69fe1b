"""The sampled audit of served calls (`serving.audit`) on the fake kernels: which calls it audits,
which slice, when its numbers are read, what a miss does, and each execution context."""

import dataclasses
import itertools
import logging
import math

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F

import sage_qual
from sage_qual.fixtures import fileformat
from sage_qual.fixtures.audit_misses import recorded_miss
from sage_qual.fixtures.recorder import AUDIT_PROVENANCE, AuditFolder
from sage_qual.serving import audit, slice_check
from sage_qual.serving.config import AuditConfig
from sage_qual.serving.contexts import CAPTURE

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
    assert "its attention runs on PyTorch SDPA until restart" in warning


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
        sage_qual.install(config=config(every=1), family="krea 2")
        assert retired() == "audit miss for Krea-2"
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
    [path] = tmp_path.glob("*.safetensors")
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
