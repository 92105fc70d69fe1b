"""Edges of the wrapper that a plausible bug would change without any other test noticing: the
first-call check's bound and its grouped-query slice, what each failure writes into the scope
report and the log, nested scopes after an out-of-memory fallback, torch's argument types, the
kernel choice from box facts, the scope's install seam and the variants' per-head-size numerics."""

import logging

import pytest
import torch
import torch.nn.functional as F

import sage_qual
from sage_qual.serving import scope
from sage_qual.serving.config import KERNEL_TABLE, WrapperConfig
from sage_qual.serving.eligibility import bind
from sage_qual.serving.variants import EXTENSIONS, VARIANTS, BoxFacts

from .helpers import SMALL, TORCH_SDPA, qkv, records, retired, wrapped

pytestmark = pytest.mark.usefixtures("log_everything")


def label(index=0):
    return {d.index: d for d in sage_qual.install_status().devices}[index].label


def describe(q, k, v):
    return "q/k/v %s %s %s %s" % (list(q.shape), list(k.shape), list(v.shape), str(q.dtype)[len("torch."):])


# The first-call check -----------------------------------------------------------------------------
@pytest.mark.parametrize("limit, kept", [(1.0, True), (0.999, False)])
def test_first_call_check_passes_at_exactly_its_limit(limit, kept):
    """A kernel returning twice the right answer is off by exactly 1.0 relative L2."""
    config = WrapperConfig(**{**vars(SMALL), "check_max_rel_l2": limit})
    with wrapped(config=config) as (_, fake), sage_qual.sage_attention_scope() as report:
        fake.return_value(lambda exact: exact * 2)
        F.scaled_dot_product_attention(*qkv())
    assert (report.served == 1) is kept and (not retired()) is kept


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
    why = f"first-call check failed for {describe(*tensors)}: relative L2 2 against PyTorch (limit 0.5)"
    assert report.details == {"kernel_error": why} and retired() == why
    assert records(caplog, logging.WARNING) == [
        f"SageAttention retired on {where}, its attention runs on PyTorch SDPA until restart: {why}"]


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
    from sage_qual.testing import on_device
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
    assert report.summary() == ("attention calls not counted: SageAttention is not installed "
                                f"({report.not_installed}); every call runs on PyTorch SDPA")


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
