"""The scope: pass-through outside it, nesting, closing on errors, per-thread isolation, reports, logs."""

import logging
import threading

import pytest
import torch
import torch.nn.functional as F

import sage_qual
from sage_qual.serving.scope import active
from sage_qual.testing import FakeCuda, FakeGpu, FakeSageAttention, on_device

from ..helpers import TORCH_SDPA, qkv, rand, records, wrapped

pytestmark = pytest.mark.usefixtures("log_everything")


# Outside any scope: torch, untouched ----------------------------------------------------------------

def mask():
    return rand(1, 1, 48, 24, seed=7)


FORMS = [
    pytest.param(lambda: (qkv(), {}), id="eligible_plain"),
    pytest.param(lambda: (qkv(dtype=torch.bfloat16), {}), id="eligible_bf16"),
    pytest.param(lambda: ((), dict(zip(("query", "key", "value"), qkv(), strict=True))), id="keywords"),
    pytest.param(lambda: (qkv(), {"attn_mask": mask()}), id="mask"),
    pytest.param(lambda: (qkv() + (mask(),), {}), id="mask_positional"),
    pytest.param(lambda: (qkv(), {"attn_mask": torch.rand(48, 24) > 0.3}), id="bool_mask"),
    pytest.param(lambda: (qkv(), {"dropout_p": 0.2}), id="dropout"),
    pytest.param(lambda: (qkv() + (None, 0.0, True), {}), id="causal_positional"),
    pytest.param(lambda: (qkv(), {"scale": 0.3}), id="scale_keyword"),
    pytest.param(lambda: (qkv() + (None, 0.0, False), {"scale": 0.3}), id="positional_then_scale"),
    pytest.param(lambda: (qkv(heads=4, kv_heads=2), {"enable_gqa": True}), id="gqa"),
    pytest.param(lambda: (qkv(dtype=torch.float32), {}), id="float32"),
    pytest.param(lambda: (tuple(t[0] for t in qkv()), {}), id="3-D"),
]


@pytest.mark.parametrize("make", FORMS)
def test_outside_a_scope_results_are_torchs_bit_for_bit(make):
    args, kwargs = make()
    torch.manual_seed(3)
    expected = TORCH_SDPA(*args, **kwargs)
    with wrapped() as (_, fake):
        torch.manual_seed(3)
        got = F.scaled_dot_product_attention(*args, **kwargs)
    assert fake.calls == []
    assert got.dtype == expected.dtype and torch.equal(got, expected)


@pytest.mark.parametrize("args_extra", [
    pytest.param((None, 0.0, False, 0.3), id="positional_scale"),
    pytest.param((None, 0.0, False, None, False), id="positional_enable_gqa"),
])
def test_outside_a_scope_torchs_type_error_comes_through(args_extra):
    args = qkv() + args_extra
    with pytest.raises(TypeError) as expected:
        TORCH_SDPA(*args)
    with wrapped(), pytest.raises(TypeError) as got:
        F.scaled_dot_product_attention(*args)
    assert str(got.value) == str(expected.value)


def test_outside_a_scope_arguments_reach_torch_as_given():
    seen = []

    def spy(*args, **kwargs):
        seen.append((args, kwargs))
        return TORCH_SDPA(*args, **kwargs)

    q, k, v = qkv()
    m = mask()
    F.scaled_dot_product_attention = spy
    try:
        with wrapped():
            F.scaled_dot_product_attention(q, k, v, m, scale=0.5)
            F.scaled_dot_product_attention(query=q, key=k, value=v, is_causal=True)
            sage_qual.uninstall()
    finally:
        F.scaled_dot_product_attention = TORCH_SDPA
    (args1, kwargs1), (args2, kwargs2) = seen
    assert (len(args1) == 4 and all(a is b for a, b in zip(args1, (q, k, v, m), strict=True))
            and kwargs1 == {"scale": 0.5})
    assert args2 == () and kwargs2.keys() == {"query", "key", "value", "is_causal"}
    assert kwargs2["query"] is q and kwargs2["is_causal"] is True


# Scopes -----------------------------------------------------------------------------------------------

def test_scope_serves_and_closes():
    with wrapped() as (_, fake):
        assert active() is None
        with sage_qual.sage_attention_scope() as report:
            assert active() is report
            F.scaled_dot_product_attention(*qkv())
        assert active() is None
        F.scaled_dot_product_attention(*qkv())
    assert (report.calls, report.served) == (1, 1)
    assert len(fake.calls) == 1


def test_scope_closes_when_its_block_raises():
    with wrapped() as (_, fake):
        with pytest.raises(ZeroDivisionError):
            with sage_qual.sage_attention_scope() as report:
                F.scaled_dot_product_attention(*qkv())
                raise ZeroDivisionError("division by zero")
        assert active() is None
        F.scaled_dot_product_attention(*qkv())
    assert report.served == 1 and len(fake.calls) == 1


def test_scopes_nest():
    with wrapped() as (_, fake):
        with sage_qual.sage_attention_scope() as outer:
            F.scaled_dot_product_attention(*qkv())
            with sage_qual.sage_attention_scope() as inner:
                assert active() is inner
                F.scaled_dot_product_attention(*qkv())
                F.scaled_dot_product_attention(*qkv(), is_causal=True)
            assert active() is outer
            assert (inner.calls, inner.served, dict(inner.fallbacks)) == (2, 1, {"causal": 1})
            F.scaled_dot_product_attention(*qkv(), dropout_p=0.5)
        assert active() is None
    assert (outer.calls, outer.served, dict(outer.fallbacks)) == (4, 2, {"causal": 1, "dropout": 1})
    assert outer.details == {"causal": "is_causal=True", "dropout": "dropout_p=0.5"}
    assert len(fake.calls) == 2


def test_inner_scope_that_raises_hands_back_to_the_outer_scope():
    with wrapped() as (_, fake):
        with sage_qual.sage_attention_scope() as outer:
            with pytest.raises(RuntimeError):
                with sage_qual.sage_attention_scope() as inner:
                    F.scaled_dot_product_attention(*qkv())
                    raise RuntimeError("pipeline failed")
            assert active() is outer
            F.scaled_dot_product_attention(*qkv())
        assert active() is None
    assert inner.calls == 1
    assert (outer.calls, outer.served) == (2, 2)


def test_report_counts_fallbacks_by_reason():
    with wrapped(gpus=((9, 0), (8, 7))) as (_, fake):
        with sage_qual.sage_attention_scope() as report:
            F.scaled_dot_product_attention(*qkv())
            F.scaled_dot_product_attention(*qkv(), attn_mask=mask())
            F.scaled_dot_product_attention(*qkv(), attn_mask=mask())
            F.scaled_dot_product_attention(*qkv(q_tokens=8))
            F.scaled_dot_product_attention(*qkv(dtype=torch.float32))
            F.scaled_dot_product_attention(*(on_device(t, 1) for t in qkv()))
            F.scaled_dot_product_attention(*qkv())
    assert (report.calls, report.served) == (7, 2)
    assert dict(report.fallbacks) == {"mask": 2, "short": 1, "dtype": 1, "device": 1}
    # Each reason's first call's detail would make the line too long: they stay in report.details.
    assert report.summary() == ("7 attention calls, 2 on SageAttention; on PyTorch SDPA: mask=2, short=1, "
                                "dtype=1, device=1 (first call of each: report.details)")
    assert report.details == {
        "mask": "attn_mask given (no masked call was certified here)",
        "short": "tokens=8/24 (needs >= 32/16)",
        "dtype": "dtype=(torch.float32, torch.float32, torch.float32) (supported: one of float16, bfloat16)",
        "device": "no SageAttention kernel for this GPU",
    }


def test_a_scope_without_install_leaves_calls_to_torch():
    q, k, v = qkv()
    with sage_qual.sage_attention_scope() as report:
        out = F.scaled_dot_product_attention(q, k, v)
    assert torch.equal(out, TORCH_SDPA(q, k, v))
    assert report.calls == 0



def test_a_scope_whose_install_was_refused_says_so_instead_of_counting_zero_calls():
    with FakeCuda([FakeGpu((7, 5), "T4")]), FakeSageAttention().installed():
        status = sage_qual.install()
        assert not status.enabled
        with sage_qual.sage_attention_scope() as report:
            for _ in range(3):
                F.scaled_dot_product_attention(*qkv())
    assert report.not_installed == status.reason
    assert report.summary() == ("attention calls not counted, all on PyTorch SDPA: the wrapper serves "
                                f"nothing here: {status.reason}")


def test_a_scope_that_began_while_installed_counts_its_calls():
    with wrapped():
        with sage_qual.sage_attention_scope() as report:
            F.scaled_dot_product_attention(*qkv())
    assert report.not_installed == ""
    assert report.summary().startswith("1 attention calls, 1 on SageAttention")


# Out of memory and nested scopes ----------------------------------------------------------------------

OOM = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def test_a_scope_nested_after_out_of_memory_stays_on_torch_and_hands_it_back():
    with wrapped() as (_, fake):
        fake.raise_error(OOM, times=1)
        with sage_qual.sage_attention_scope() as outer:
            F.scaled_dot_product_attention(*qkv())  # out of memory: the rest of the scope on torch
            with sage_qual.sage_attention_scope() as inner:
                assert inner.out_of_memory
                q, k, v = qkv()
                assert torch.equal(F.scaled_dot_product_attention(q, k, v), TORCH_SDPA(q, k, v))
            F.scaled_dot_product_attention(*qkv())
        with sage_qual.sage_attention_scope() as later:  # a new top-level scope serves again
            F.scaled_dot_product_attention(*qkv())
    assert (inner.calls, inner.served, dict(inner.fallbacks)) == (1, 0, {"memory": 1})
    assert (outer.calls, outer.served, dict(outer.fallbacks)) == (3, 0, {"memory": 3})
    assert outer.out_of_memory and not later.out_of_memory
    assert (later.calls, later.served) == (1, 1)
    assert len(fake.calls) == 2  # the call that ran out of memory, and the later scope's


def test_out_of_memory_in_an_inner_scope_reaches_the_outer_one():
    with wrapped() as (_, fake):
        with sage_qual.sage_attention_scope() as outer:
            F.scaled_dot_product_attention(*qkv())
            with sage_qual.sage_attention_scope() as inner:
                fake.raise_error(OOM, times=1)
                F.scaled_dot_product_attention(*qkv())
                F.scaled_dot_product_attention(*qkv())
            F.scaled_dot_product_attention(*qkv())
            with sage_qual.sage_attention_scope() as sibling:
                F.scaled_dot_product_attention(*qkv())
    assert inner.out_of_memory and outer.out_of_memory and sibling.out_of_memory
    assert dict(inner.fallbacks) == {"memory": 2}
    assert (outer.calls, outer.served, dict(outer.fallbacks)) == (5, 1, {"memory": 4})
    assert sibling.served == 0
    assert not sage_qual.install_status().devices[0].retired


# Threads ----------------------------------------------------------------------------------------------

def run_threads(*targets):
    errors = []

    def guarded(target):
        def run():
            try:
                target()
            except BaseException as error:  # surfaced in the main thread below
                errors.append(error)
        return run

    threads = [threading.Thread(target=guarded(t)) for t in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors, errors


def test_a_scope_serves_only_its_own_thread():
    barrier = threading.Barrier(2, timeout=10)
    reports, outside = {}, {}
    q, k, v = qkv()

    def in_scope():
        with sage_qual.sage_attention_scope() as report:
            reports["scoped"] = report
            barrier.wait()  # the other thread calls while this scope is open
            F.scaled_dot_product_attention(q, k, v)
            barrier.wait()

    def outside_scope():
        barrier.wait()
        outside["active"] = active()
        outside["out"] = F.scaled_dot_product_attention(q, k, v)
        barrier.wait()

    with wrapped() as (_, fake):
        run_threads(in_scope, outside_scope)
    assert reports["scoped"].served == 1 and reports["scoped"].calls == 1
    assert outside["active"] is None
    assert torch.equal(outside["out"], TORCH_SDPA(q, k, v))
    assert len(fake.calls) == 1


def test_concurrent_scopes_count_only_their_own_calls():
    barrier = threading.Barrier(2, timeout=10)
    reports = {}

    def worker(name, served_calls, masked_calls):
        def run():
            with sage_qual.sage_attention_scope() as report:
                reports[name] = report
                barrier.wait()
                for _ in range(served_calls):
                    F.scaled_dot_product_attention(*qkv())
                for _ in range(masked_calls):
                    F.scaled_dot_product_attention(*qkv(), attn_mask=mask())
                barrier.wait()
        return run

    with wrapped() as (_, fake):
        run_threads(worker("a", 3, 0), worker("b", 1, 2))
    assert (reports["a"].calls, reports["a"].served, dict(reports["a"].fallbacks)) == (3, 3, {})
    assert (reports["b"].calls, reports["b"].served, dict(reports["b"].fallbacks)) == (3, 1, {"mask": 2})
    assert len(fake.calls) == 4


def test_a_new_thread_does_not_inherit_the_scope():
    seen = {}
    with wrapped() as (_, fake), sage_qual.sage_attention_scope() as report:
        def child():
            seen["active"] = active()
            F.scaled_dot_product_attention(*qkv())
        run_threads(child)
    assert seen["active"] is None
    assert report.calls == 0 and fake.calls == []


# Logs ---------------------------------------------------------------------------------------------------

def test_install_logs_one_info_with_version_and_gpus_without_kernel(caplog):
    with wrapped(gpus=((8, 7), (9, 0)), names=["Jetson Orin", "H200"],
                 fake=FakeSageAttention(version="2.2.0.post3")):
        pass
    infos = records(caplog, logging.INFO)
    assert len(infos) == 1
    [info] = infos
    for word in ("2.2.0.post3", "cuda:0", "Jetson Orin", "sm_87", "no kernel", "cuda:1", "H200", "sm_90"):
        assert word in info, f"{word!r} not in {info!r}"
    assert records(caplog, logging.WARNING) == []


def test_first_served_call_logs_one_info_per_device(caplog):
    with wrapped(gpus=((9, 0), (8, 9)), names=["H200", "RTX 4090"]) as (_, fake):
        caplog.clear()
        with sage_qual.sage_attention_scope():
            F.scaled_dot_product_attention(*qkv(), attn_mask=mask())  # not served: no INFO yet
            assert records(caplog, logging.INFO) == []
            for _ in range(3):
                F.scaled_dot_product_attention(*qkv())
        with sage_qual.sage_attention_scope():
            for _ in range(2):
                F.scaled_dot_product_attention(*(on_device(t, 1) for t in qkv()))
            F.scaled_dot_product_attention(*qkv())
    infos = records(caplog, logging.INFO)
    assert len(infos) == 2
    first, second = infos
    for word in ("2.2.0", "H200", "sm_90", "sageattn_qk_int8_pv_fp8_cuda_sm90", "cuda:0"):
        assert word in first, f"{word!r} not in {first!r}"
    for word in ("2.2.0", "RTX 4090", "sm_89", "sageattn_qk_int8_pv_fp8_cuda", "cuda:1"):
        assert word in second, f"{word!r} not in {second!r}"
    assert "sm90" not in second


def test_scope_exit_logs_one_debug_summary(caplog):
    with wrapped() as (_, fake):
        caplog.clear()
        with sage_qual.sage_attention_scope():
            F.scaled_dot_product_attention(*qkv())
            F.scaled_dot_product_attention(*qkv(), is_causal=True)
            F.scaled_dot_product_attention(*qkv(), is_causal=True)
            F.scaled_dot_product_attention(*qkv(head_dim=96))
        debugs = records(caplog, logging.DEBUG)
        assert debugs == ["4 attention calls, 1 on SageAttention; on PyTorch SDPA: "
                          "causal=2 [is_causal=True], head_dim=1 [head_dim=96 (supported: 64, 128)]"]
        caplog.clear()
        with sage_qual.sage_attention_scope():
            F.scaled_dot_product_attention(*qkv())
        assert records(caplog, logging.DEBUG) == [
            "1 attention calls, 1 on SageAttention; on PyTorch SDPA: none"]


def test_scope_exit_logs_also_when_the_block_raises(caplog):
    with wrapped():
        caplog.clear()
        with pytest.raises(KeyError), sage_qual.sage_attention_scope():
            F.scaled_dot_product_attention(*qkv(), dropout_p=0.1)
            raise KeyError("x")
    assert records(caplog, logging.DEBUG) == [
        "1 attention calls, 0 on SageAttention; on PyTorch SDPA: dropout=1 [dropout_p=0.1]"]


def test_a_family_a_profile_keeps_off_is_said_as_such_not_as_not_installed():
    """Issue 54: a scope under a profile that keeps the family off read "SageAttention is not installed"."""
    from ..builders import H200, make_profile

    kept_off = {"served": None, "reasons": [{"kind": "unfit", "detail": "ck-int8-cuda on krea2: unfit"}]}
    certified = make_profile(gpu=H200, families={"Krea-2": kept_off})
    with FakeCuda([FakeGpu((9, 0), H200.name, H200.memory_gib)]), FakeSageAttention().installed():
        status = sage_qual.install(profile=certified, family="Krea-2")
        assert not status.enabled and "family Krea-2" in status.reason
        with sage_qual.sage_attention_scope() as report:
            F.scaled_dot_product_attention(*qkv())
    assert "not installed" not in report.summary()
    assert report.summary().startswith("attention calls not counted, all on PyTorch SDPA: the wrapper serves "
                                       "nothing here: ")
    assert "family Krea-2" in report.summary()
    sage_qual.uninstall()
