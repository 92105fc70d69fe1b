"""Edges of the wrapper that a plausible bug would change without any other test noticing: the
first-call check's bound and its grouped-query slice, what each failure writes into the scope
report and the log, nested scopes after an out-of-memory fallback, torch's argument types, the
kernel choice from box facts, the scope's install seam and the variants' per-head-size numerics."""

import copy
import logging
import math
import re

import pytest
import torch
import torch.nn.functional as F

import sage_qual
from sage_qual.kernels.variants import EXTENSIONS, VARIANTS, BoxFacts
from sage_qual.limits import one_line
from sage_qual.serving import audit, scope, slice_check, wrapper
from sage_qual.serving.config import KERNEL_TABLE, WrapperConfig
from sage_qual.serving.eligibility import bind
from sage_qual.testing import FakeCuda, FakeGpu, FakeSageAttention, on_device
from sage_qual.verdicts import conformance

from ..builders import H100 as PROFILED_H100
from ..builders import H200 as PROFILED_H200
from ..builders import make_entry, make_profile
from ..helpers import SMALL, TORCH_SDPA, qkv, records, retired, wrapped

pytestmark = pytest.mark.usefixtures("log_everything")


def label(index=0):
    return {d.index: d for d in sage_qual.install_status().devices}[index].label


def describe(q, k, v):
    return "q/k/v %s %s %s %s" % (list(q.shape), list(k.shape), list(v.shape), str(q.dtype)[len("torch."):])


# The first-call check -----------------------------------------------------------------------------
@pytest.mark.parametrize("limit, fit", [(1.0, True), (0.999, False)])
def test_the_online_judge_passes_at_exactly_its_limit(limit, fit):
    """Twice the reference is off by exactly 1.0 relative L2 (2x - x is exact in floating point): fit
    at a bound of 1.0, not at 0.999; conformance likewise at exactly its bound."""
    judgement = slice_check.judge([2.0, 2.0, math.nan], limit, torch.bfloat16)
    assert judgement.rel_l2 == 1.0 and judgement.fit is fit and judgement.conforms
    assert judgement.text() == f"relative L2 1 against PyTorch SDPA, fitness bound {limit:g}"  # no model said
    model = (1.0 - conformance.UNIT_ROUNDOFF["bfloat16"]) / (1 + conformance.MARGIN)
    on_bound = slice_check.judge([2.0, 2.0, 2.0 * model], limit, torch.bfloat16)
    assert on_bound.conformance_bound == pytest.approx(1.0) and on_bound.model_rel_l2 == pytest.approx(model)
    past = slice_check.judge([2.0, 2.0, 2.0 * model * 0.999], limit, torch.bfloat16)
    assert not past.conforms


def test_first_call_check_is_relative_also_for_small_outputs():
    """Values near 1e-4 give an output norm far below 1: a kernel returning zeros is still 100 % off."""
    q, k, v = qkv()
    with wrapped() as (_, fake), sage_qual.sage_attention_scope() as report:
        fake.return_value(torch.zeros_like)
        F.scaled_dot_product_attention(q, k, v * 1e-4)
    assert report.served == 0 and retired()
    assert "relative L2 1 against PyTorch" in retired()


@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (6, 2), (8, 1)])
def test_first_call_check_of_grouped_heads_passes_a_correct_kernel(heads, kv_heads):
    tensors = qkv(heads=heads, kv_heads=kv_heads)
    with wrapped() as _, sage_qual.sage_attention_scope() as report:
        out = F.scaled_dot_product_attention(*tensors, enable_gqa=True)
    assert report.served == 1 and not retired()
    torch.testing.assert_close(out, TORCH_SDPA(*tensors, enable_gqa=True), atol=2e-3, rtol=2e-3)


def test_a_failed_first_call_check_is_reported_with_the_call(caplog):
    tensors = qkv()
    with wrapped() as (_, fake), sage_qual.sage_attention_scope() as report:
        fake.return_value(lambda exact: exact * 3)
        F.scaled_dot_product_attention(*tensors)
        where = label()
    # The model's number is this host's arithmetic: read back, then checked in its place in the line.
    why = retired()
    model = re.search(r"its numerics model ([0-9.]+) \(conformance bound ([0-9.]+)\)", why)
    assert why == (f"first-call check failed for {describe(*tensors)}: relative L2 2 against PyTorch SDPA, "
                   f"fitness bound 0.3, its numerics model {model[1]} (conformance bound {model[2]}): "
                   "past the "
                   "fitness bound of the family served (sage_qual/verdicts/fitness.py)")
    assert 0 < float(model[1]) < 0.1
    assert report.details == {"kernel_error": why} and retired() == why
    assert records(caplog, logging.WARNING) == [
        f"SageAttention retired on {where} for every family until this process restarts, its attention runs "
        f"on PyTorch SDPA: {why}"]


def test_a_retirement_holds_for_every_later_install_of_the_process_as_its_warning_says():
    """A first-call failure retires the GPU for every family: install() again, for another family or
    for none, does not serve there and says why (issue 64); a fresh process (reset_process) does."""
    with wrapped() as (_, fake), sage_qual.sage_attention_scope():
        fake.return_value(lambda exact: exact * 3)
        F.scaled_dot_product_attention(*qkv())
        why = retired()
    fake.behave()
    with FakeCuda([FakeGpu((9, 0), "GPU0")]), fake.installed():
        for family in ("FLUX.1", None):
            status = sage_qual.install(config=SMALL, family=family)
            assert not status.enabled and status.reason == one_line(
                f"cuda:0 (GPU0, sm_90) was retired by this process until it restarts: {why}")
            assert retired() == why
            sage_qual.uninstall()
        audit.reset_process()
        assert sage_qual.install(config=SMALL).enabled and not retired()


# What each failure leaves in the report and the log ------------------------------------------------
def test_out_of_memory_detail_and_log(caplog):
    tensors = qkv()
    with wrapped() as (_, fake), sage_qual.sage_attention_scope() as report:
        fake.raise_error(torch.OutOfMemoryError("CUDA out of memory (test)"), times=1)
        F.scaled_dot_product_attention(*tensors)
        where = label()
    function = VARIANTS["sm90-fp8-cuda"].function
    assert report.details == {"memory": f"{function} on {describe(*tensors)}: OutOfMemoryError: "
                                         "CUDA out of memory (test)"}
    assert f"SageAttention ran out of memory on {where} ({describe(*tensors)}); the rest of this " \
           "scope runs on PyTorch SDPA" in records(caplog, logging.INFO)


def test_a_scope_opened_after_out_of_memory_names_it():
    """An inner scope begun after the outer one ran out of memory serves nothing and says why."""
    with wrapped() as (_, fake), sage_qual.sage_attention_scope() as outer:
        fake.raise_error(torch.OutOfMemoryError("CUDA out of memory"), times=1)
        F.scaled_dot_product_attention(*qkv())
        with sage_qual.sage_attention_scope() as inner:
            F.scaled_dot_product_attention(*qkv())
            F.scaled_dot_product_attention(*qkv())
    assert inner.out_of_memory and inner.served == 0
    assert dict(inner.fallbacks) == {"memory": 2}
    assert inner.details == {"memory": "this scope ran out of memory"}
    assert dict(outer.fallbacks) == {"memory": 3} and outer.details["memory"].endswith("CUDA out of memory")
    assert len(fake.calls) == 1


def test_cache_error_detail():
    tensors = qkv()
    with wrapped() as (_, fake), sage_qual.sage_attention_scope() as report:
        fake.raise_error(OSError(28, "No space left on device"), times=1)
        F.scaled_dot_product_attention(*tensors)
    function = VARIANTS["sm90-fp8-cuda"].function
    assert report.details == {"cache_error": f"{function} on {describe(*tensors)}: OSError: [Errno 28] "
                                             "No space left on device"}


def test_kernel_error_detail_and_retirement(caplog):
    tensors = qkv(dtype=torch.bfloat16, head_dim=128)
    with wrapped() as (_, fake), sage_qual.sage_attention_scope() as report:
        fake.raise_error(ValueError("bad launch"))
        F.scaled_dot_product_attention(*tensors)
    detail = f"{VARIANTS['sm90-fp8-cuda'].function} on {describe(*tensors)}: ValueError: bad launch"
    assert report.details == {"kernel_error": detail} and retired() == f"raised: {detail}"
    assert "bfloat16" in detail and "torch." not in detail


def test_tensors_on_two_gpus_are_named():
    q, k, v = qkv()
    with wrapped(gpus=((9, 0), (9, 0))), sage_qual.sage_attention_scope() as report:
        F.scaled_dot_product_attention(on_device(q, 0), on_device(k, 1), on_device(v, 0))
    assert report.details == {"device": "tensors not all on one CUDA device"}


# Torch's argument types --------------------------------------------------------------------------
@pytest.mark.parametrize("keywords, why", [
    ({"attn_mask": [[True]]}, "attn_mask is a list (torch takes a tensor or None)"),
    ({"is_causal": 0}, "is_causal=0 (torch takes a bool)"),
    ({"enable_gqa": 1}, "enable_gqa=1 (torch takes a bool)"),
])
def test_arguments_torch_would_refuse_are_named(keywords, why):
    q, k, v = qkv()
    assert bind((q, k, v), keywords)[1] == why


# Kernel choice from box facts ---------------------------------------------------------------------
@pytest.mark.parametrize("capability", sorted(KERNEL_TABLE))
def test_kernel_for_a_complete_box_is_the_tables_first(capability):
    box = BoxFacts(capability, (13, 0), frozenset(EXTENSIONS), True)
    variant, why = WrapperConfig().kernel_for(box)
    assert (variant.name if variant else None, why) == (KERNEL_TABLE[capability][0], "")


def test_kernel_for_names_every_reason_when_none_runs():
    box = BoxFacts((9, 0), (13, 0), frozenset(), True)
    variant, why = WrapperConfig().kernel_for(box)
    assert variant is None
    assert why == "sm90-fp8-cuda: " + "; ".join(VARIANTS["sm90-fp8-cuda"].not_supported_reasons(box))


# The scope's install seam ---------------------------------------------------------------------------
def test_a_scope_without_install_says_calls_are_not_counted():
    with sage_qual.sage_attention_scope() as report:
        pass
    assert report.not_installed == sage_qual.install_status().reason != ""
    assert report.summary() == ("attention calls not counted, all on PyTorch SDPA: the wrapper serves "
                                f"nothing here: {report.not_installed}")


def test_the_scope_asks_the_installed_check(monkeypatch):
    monkeypatch.setattr(scope, "_not_installed", scope._not_installed)  # restored after the test
    scope.report_installs_with(lambda: "checked here")
    with sage_qual.sage_attention_scope() as report:
        pass
    assert report.not_installed == "checked here"


# Numerics per head size -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(VARIANTS))
@pytest.mark.parametrize("head_dim", [32, 64, 65, 96, 128])
def test_a_smaller_query_tile_applies_above_64_only_where_declared(name, head_dim):
    numerics = VARIANTS[name].numerics
    scheme = numerics.at_head_dim(head_dim)
    smaller = numerics.q_tile_at_head_dim_128
    assert scheme.q_tile == (smaller if smaller is not None and head_dim > 64 else numerics.q_tile)
    assert scheme.q_tile_at_head_dim_128 is None or head_dim <= 64
    assert (scheme.k_tile, scheme.pv, scheme.pv_accumulation) == (numerics.k_tile, numerics.pv,
                                                                  numerics.pv_accumulation)


# Why install() keeps torch's function: the exact reason a user reads ------------------------------------
@pytest.mark.parametrize("gpus, rocm, reason", [
    ([], False, "no CUDA GPU is visible (CPU-only torch build, no driver, or CUDA_VISIBLE_DEVICES empty): "
                "install a CUDA build of torch"),
    ([(9, 0)], True, "this is a ROCm build of torch; SageAttention runs on NVIDIA CUDA GPUs only"),
    ([(7, 5), (7, 0)], False, "no GPU of compute capability 8.0 or newer (cuda:0 sm_75, cuda:1 sm_70); "
                              "SageAttention 2 needs Ampere or newer"),
])
def test_install_names_why_this_box_gets_no_kernel(gpus, rocm, reason):
    with FakeCuda([FakeGpu(cap) for cap in gpus], rocm=rocm), FakeSageAttention().installed():
        status = sage_qual.install()
    assert not status.enabled and status.reason.endswith(reason)


def test_install_lists_every_gpus_reason_when_none_has_a_kernel():
    with FakeCuda([FakeGpu((8, 7), "Orin"), FakeGpu((8, 7), "Orin")]), FakeSageAttention().installed():
        status = sage_qual.install()
    why = WrapperConfig().choose((8, 7), {})[1]
    assert not status.enabled
    assert status.reason == f"cuda:0 (Orin, sm_87) and 1 more GPUs (install_status().devices): {why}"
    assert [(d.label, d.no_kernel_reason) for d in status.devices] == [
        (f"cuda:{i} (Orin, sm_87)", why) for i in (0, 1)]


def test_the_first_served_call_announces_the_kernel(caplog):
    with wrapped() as (_, fake), sage_qual.sage_attention_scope():
        F.scaled_dot_product_attention(*qkv())
        F.scaled_dot_product_attention(*qkv())
        where, doc = label(), F.scaled_dot_product_attention.__doc__
    variant = VARIANTS["sm90-fp8-cuda"]
    announced = [m for m in records(caplog, logging.INFO) if " serves attention on " in m]
    assert announced == [f"SageAttention 2.2.0 serves attention on {where} with {variant.function} "
                         f"(variant {variant.name})"]
    assert doc == "SageAttention-aware SDPA (installed by sage_qual.install())."


# What a GPU cannot run, in the words `sage-qual env` and install() print -----------------------------
def facts_of(capability, torch_cuda=(13, 0), extensions=EXTENSIONS, triton=True):
    return BoxFacts(capability, torch_cuda, frozenset(extensions), triton)


@pytest.mark.parametrize("name, facts, reasons", [
    ("sm90-fp8-cuda", facts_of((9, 1)), [
        "capability=(9, 1): SageAttention 2.2 builds no code that runs on sm_91 (builds for sm_80, sm_86, "
        "sm_89, sm_90a, sm_100a, sm_120a, sm_121a)", "capability=(9, 1) (needs <= (9, 0))"]),
    ("sm86-fp16-triton", facts_of((12, 0), triton=False), [
        "capability=(12, 0): upstream's Triton kernel is not usable there (sageattention core.py)",
        "triton not installed"]),
    ("sm89-fp8-cuda", facts_of((8, 6), torch_cuda=None, extensions=()), [
        "capability=(8, 6) (needs >= (8, 9))",
        "extension sageattention._qattn_sm89 not built or does not import",
        "torch CUDA=none (needs >= 12.8)"]),
    ("sm89-fp8-cuda", facts_of((8, 9), torch_cuda=(12, 4)), ["torch CUDA=12.4 (needs >= 12.8)"]),
    ("sm89-fp8-cuda", facts_of((8, 9), torch_cuda=(12, 8)), []),
])
def test_not_supported_reasons_are_exact(name, facts, reasons):
    assert VARIANTS[name].not_supported_reasons(facts) == reasons


def test_choose_names_a_capability_without_kernels_and_the_known_ones():
    config = WrapperConfig(kernel_table={(9, 0): ("sm90-fp8-cuda",), (8, 0): ("sm80-fp16-cuda",)})
    assert config.choose((8, 7), {}) == (None,
                                         "sm_87 has no SageAttention kernel (kernels for: sm_80, sm_90)")


def test_choose_skips_a_table_entry_that_is_not_a_registered_variant():
    config = WrapperConfig(kernel_table={(9, 0): ("sm90-typo", "sm90-fp8-cuda")})
    assert config.choose((9, 0), {"sm90-fp8-cuda": []}) == (VARIANTS["sm90-fp8-cuda"], "")
    assert config.choose((9, 0), {"sm90-fp8-cuda": ["a", "b"]}) == (
        None, "sm90-typo: not a registered variant | sm90-fp8-cuda: a; b")


# What install() logs -----------------------------------------------------------------------------------
def test_install_logs_each_gpus_kernel_or_why_none(caplog):
    gpus = [FakeGpu((9, 0), "H200"), FakeGpu((8, 7), "Orin")]
    with FakeCuda(gpus), FakeSageAttention().installed():
        assert sage_qual.install().enabled
    why = WrapperConfig().choose((8, 7), {})[1]
    assert records(caplog, logging.INFO)[-1] == (
        "SageAttention 2.2.0 enabled for SDPA calls inside sage_attention_scope(): cuda:0 (H200, sm_90) -> "
        f"sm90-fp8-cuda; no kernel for cuda:1 (Orin, sm_87): {why}; audit: 1 served call in 100 per GPU")


def test_install_logs_the_kernels_of_a_box_where_every_gpu_has_one(caplog):
    gpus = [FakeGpu((9, 0), "H200"), FakeGpu((8, 9), "L40S")]
    with FakeCuda(gpus, torch_cuda=(13, 0)), FakeSageAttention().installed():
        assert sage_qual.install().enabled
    assert records(caplog, logging.INFO)[-1] == (
        "SageAttention 2.2.0 enabled for SDPA calls inside sage_attention_scope(): cuda:0 (H200, sm_90) -> "
        "sm90-fp8-cuda, cuda:1 (L40S, sm_89) -> sm89-fp8-cuda; audit: 1 served call in 100 per GPU")


def test_install_logs_the_audit_off(caplog):
    with FakeCuda([FakeGpu((9, 0), "H200")]), FakeSageAttention().installed():
        assert sage_qual.install(audit=sage_qual.AuditConfig(every=0)).enabled
    assert records(caplog, logging.INFO)[-1].endswith("-> sm90-fp8-cuda; audit off")


def test_install_warns_once_with_the_reason(caplog):
    with FakeCuda([FakeGpu((7, 5))]), FakeSageAttention().installed():
        status = sage_qual.install()
    assert records(caplog, logging.WARNING) == [
        f"SageAttention not enabled, attention stays on PyTorch SDPA: {status.reason}"]


# A profile per device: the family's entry, the caller's config elsewhere, calls without a GPU ----------
def profiled_call(tokens: int, device: int = 0, head_dim: int = 128):
    q = on_device(torch.randn(1, 1, tokens, head_dim, dtype=torch.bfloat16), device)
    with sage_qual.sage_attention_scope() as report:
        F.scaled_dot_product_attention(q, q, q)
    return report


def test_install_takes_the_family_entry_of_the_profile():
    families = {"FLUX.1": make_entry("sm90-fp8-cuda", 4096, 512)}
    certified = make_profile(entry=make_entry("sm89-fp8-cuda", 1024, 512), families=families)
    with FakeCuda([PROFILED_H200]), FakeSageAttention().installed():
        status = sage_qual.install(profile=copy.deepcopy(certified), family="FLUX.1")
        assert status.devices[0].variant.name == "sm90-fp8-cuda"
        assert dict(profiled_call(2048).fallbacks) == {"short": 1}
        sage_qual.uninstall()
        status = sage_qual.install(profile=copy.deepcopy(certified))
        assert status.devices[0].variant.name == "sm89-fp8-cuda"
        assert profiled_call(2048).served == 1


def test_a_device_the_profile_does_not_describe_keeps_the_callers_config():
    certified = make_profile(entry=make_entry("sm89-fp8-cuda", 4096, 512))
    with FakeCuda([PROFILED_H200, PROFILED_H100]), FakeSageAttention().installed():
        assert sage_qual.install(config=SMALL, profile=certified).enabled
        assert profiled_call(64, device=1).served == 1  # SMALL's 32-token threshold, not the default 1536
        assert dict(profiled_call(64, device=0).fallbacks) == {"short": 1}


def test_per_device_rules_leave_a_call_without_tensors_to_torch():
    certified = make_profile(entry=make_entry("sm89-fp8-cuda", 16, 16))
    q = torch.randn(1, 1, 32, 64)
    with FakeCuda([PROFILED_H200, PROFILED_H100]), FakeSageAttention().installed():
        assert sage_qual.install(profile=certified).enabled
        with sage_qual.sage_attention_scope() as report, pytest.raises(TypeError) as raised:
            F.scaled_dot_product_attention(q.tolist(), q, q)
    with pytest.raises(TypeError) as expected:
        TORCH_SDPA(q.tolist(), q, q)
    assert str(raised.value) == str(expected.value)
    assert dict(report.fallbacks) == {"shape": 1}


def test_an_unexpected_error_in_install_is_a_reason_not_a_crash(caplog, monkeypatch):
    from sage_qual.serving import wrapper

    def broken(*args, **kwargs):
        raise RuntimeError("boom (test)")

    monkeypatch.setattr(wrapper, "_probe", broken)
    with FakeCuda([FakeGpu((9, 0))]), FakeSageAttention().installed():
        status = sage_qual.install()
    assert (status.enabled, status.reason) == (False, "unexpected RuntimeError: boom (test)")
    assert records(caplog, logging.WARNING) == [
        "SageAttention not enabled, attention stays on PyTorch SDPA: unexpected RuntimeError: boom (test)"]


def test_install_joins_every_gpu_without_a_kernel(caplog):
    gpus = [FakeGpu((9, 0), "H200"), FakeGpu((8, 7), "Orin"), FakeGpu((8, 7), "Orin")]
    with FakeCuda(gpus), FakeSageAttention().installed():
        assert sage_qual.install().enabled
    why = WrapperConfig().choose((8, 7), {})[1]
    assert records(caplog, logging.INFO)[-1].endswith(
        f"; no kernel for cuda:1 (Orin, sm_87): {why}; cuda:2 (Orin, sm_87): {why}; audit: 1 served call in "
        "100 per GPU")


def test_a_config_without_a_kernel_for_a_gpu_gives_the_tables_reason():
    config = WrapperConfig(kernel_table={**KERNEL_TABLE, (8, 9): ()})
    with FakeCuda([FakeGpu((9, 0), "H200"), FakeGpu((8, 9), "L40S")]), FakeSageAttention().installed():
        status = sage_qual.install(config=config)
    h200, l40s = status.devices
    assert (h200.variant.name, h200.no_kernel_reason) == ("sm90-fp8-cuda", "")
    assert l40s.variant is None and l40s.no_kernel_reason == config.choose((8, 9), {})[1]


def test_a_profiled_gpu_with_a_kernel_has_no_reason_and_its_note_is_logged(caplog):
    certified = make_profile(entry=make_entry("sm89-fp8-cuda", 4096, 512))
    with FakeCuda([PROFILED_H200]), FakeSageAttention().installed():
        status = sage_qual.install(profile=certified)
    (device,) = status.devices
    assert device.variant.name == "sm89-fp8-cuda" and device.no_kernel_reason == ""
    assert f"{device.label}: {device.profile_note}" in records(caplog, logging.INFO)


def test_uninstall_leaves_a_status_that_says_so():
    with wrapped():
        sage_qual.uninstall()
        status = sage_qual.install_status()
    assert status.enabled is False and status.reason == "uninstall() was called"


@pytest.mark.parametrize("given, served", [("krea 2", "Krea-2"), ("FLUX.1 ", "FLUX.1"),
                                           ("wan-2.2", "Wan 2.2")])
def test_install_takes_a_family_in_any_spelling_by_its_one_name(given, served):
    with wrapped():
        assert sage_qual.install(config=SMALL, family=given).enabled
        assert wrapper._installed.auditor.family == served


@pytest.mark.parametrize("given", ["Flux", "Wan 2.1", "", "FLUX.1\nenabled", 7])
def test_install_refuses_an_unknown_family_with_the_known_names(given, caplog):
    with wrapped():
        status = sage_qual.install(config=SMALL, family=given)
        assert not status.enabled and wrapper._installed is None
    assert status.reason.startswith(f"unknown family {given!r} (known: FLUX.1, FLUX.2, Z-Image, Qwen-Image, ")
    assert status.reason.endswith("install(family=..., own_family=True) for a family of your own")
    assert "\n" not in status.reason  # a name from a file cannot forge a log line


def test_a_family_of_your_own_is_served_with_the_loosest_fitness_bound():
    from sage_qual.verdicts import fitness

    with wrapped():
        assert sage_qual.install(config=SMALL, family="Wan 2.1", own_family=True).enabled
        device = sage_qual.install_status().devices[0]
        assert wrapper._installed.auditor.bound(device) == fitness.family_bound(None)


def test_a_family_of_your_own_spelt_as_a_known_one_is_the_known_one():
    with wrapped():
        assert sage_qual.install(config=SMALL, family="flux 1", own_family=True).enabled
        assert wrapper._installed.auditor.family == "FLUX.1"
