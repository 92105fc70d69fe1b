"""What a kernel's exception does: out of memory, Triton cache race, anything else."""

import logging
import weakref

import pytest
import torch
import torch.nn.functional as F

import sage_qual
from sage_qual.serving.failures import Failure, classify
from sage_qual.testing import on_device

from ..helpers import TORCH_SDPA, qkv, records, retired, wrapped

pytestmark = pytest.mark.usefixtures("log_everything")

OUT_OF_MEMORY = [
    pytest.param(lambda: torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                 id="torch.OutOfMemoryError"),
    pytest.param(lambda: RuntimeError("Triton Error [CUDA]: out of memory"), id="triton_out_of_memory"),
]
CACHE = [
    pytest.param(lambda: OSError(28, "No space left on device"), id="OSError"),
    pytest.param(lambda: FileExistsError(17, "File exists", "/home/u/.triton/cache/ab/kernel.json"),
                 id="FileExistsError"),
    pytest.param(lambda: PermissionError(13, "Permission denied"), id="PermissionError"),
]
BROKEN = [
    pytest.param(lambda: RuntimeError("CUDA error: an illegal memory access was encountered"),
                 id="illegal_memory_access"),
    pytest.param(lambda: ValueError("Unsupported head_dim: 64"), id="ValueError"),
    pytest.param(lambda: AssertionError("Input tensors must be on cuda."), id="AssertionError"),
    pytest.param(lambda: TypeError("got an unexpected keyword argument 'smooth_k'"), id="TypeError"),
]


@pytest.mark.parametrize("make", OUT_OF_MEMORY)
def test_classify_out_of_memory(make):
    assert classify(make()) is Failure.OUT_OF_MEMORY


@pytest.mark.parametrize("make", CACHE)
def test_classify_cache(make):
    assert classify(make()) is Failure.CACHE


@pytest.mark.parametrize("make", BROKEN)
def test_classify_broken(make):
    assert classify(make()) is Failure.BROKEN


# Out of memory: this call and the rest of the scope on torch, one INFO, the next scope tries again ----

@pytest.mark.parametrize("make", OUT_OF_MEMORY)
def test_out_of_memory_moves_the_rest_of_the_scope_to_torch(caplog, make):
    tensors = qkv()
    expected = TORCH_SDPA(*tensors)
    with wrapped() as (_, fake):
        fake.raise_error(make(), times=1)
        with sage_qual.sage_attention_scope() as report:
            first = F.scaled_dot_product_attention(*tensors)
            rest = [F.scaled_dot_product_attention(*tensors) for _ in range(2)]
        assert len(fake.calls) == 1  # the kernel was not tried again in this scope
        assert torch.equal(first, expected) and all(torch.equal(r, expected) for r in rest)
        assert (report.calls, report.served, dict(report.fallbacks)) == (3, 0, {"memory": 3})
        assert report.out_of_memory
        assert records(caplog, logging.WARNING) == []
        [info] = [m for m in records(caplog, logging.INFO) if "out of memory" in m]
        assert "cuda:0" in info
        assert not retired()
        with sage_qual.sage_attention_scope() as next_scope:
            F.scaled_dot_product_attention(*tensors)
        assert (next_scope.served, dict(next_scope.fallbacks)) == (1, {})
        assert len(fake.calls) == 2


def test_out_of_memory_in_inner_scope_reaches_the_outer_scope():
    with wrapped() as (_, fake):
        fake.raise_error(torch.OutOfMemoryError("CUDA out of memory"), times=1)
        with sage_qual.sage_attention_scope() as outer:
            with sage_qual.sage_attention_scope():
                F.scaled_dot_product_attention(*qkv())
            F.scaled_dot_product_attention(*qkv())
    assert dict(outer.fallbacks) == {"memory": 2} and outer.served == 0
    assert len(fake.calls) == 1


# Triton cache race (OSError): that call on torch; three in a row retire -------------------------------

@pytest.mark.parametrize("make", CACHE)
def test_cache_error_falls_back_for_that_call_only(caplog, make):
    tensors = qkv()
    with wrapped() as (_, fake):
        fake.raise_error(make(), times=1)
        with sage_qual.sage_attention_scope() as report:
            out = F.scaled_dot_product_attention(*tensors)
            F.scaled_dot_product_attention(*tensors)
    assert torch.equal(out, TORCH_SDPA(*tensors))
    assert (report.served, dict(report.fallbacks)) == (1, {"cache_error": 1})
    assert len(fake.calls) == 2
    assert not retired()
    assert records(caplog, logging.WARNING) == []


def run_sequence(fake, outcomes):
    """Per call: "os" raises OSError, "ok" succeeds. Returns the scope report."""
    with sage_qual.sage_attention_scope() as report:
        for outcome in outcomes:
            if outcome == "os":
                fake.raise_error(OSError(17, "File exists"), times=1)
            else:
                fake.behave()
            F.scaled_dot_product_attention(*qkv())
    fake.behave()
    return report


@pytest.mark.parametrize("outcomes, retires", [
    pytest.param(["os", "os"], False, id="os,os"),
    pytest.param(["os", "os", "os"], True, id="os,os,os"),
    pytest.param(["os", "os", "ok", "os", "os"], False, id="os,os,ok,os,os"),
    pytest.param(["ok", "os", "os", "os"], True, id="ok,os,os,os"),
    pytest.param(["os", "ok", "os", "ok", "os"], False, id="os,ok,os,ok,os"),
])
def test_consecutive_cache_errors_retire_the_device(caplog, outcomes, retires):
    with wrapped() as (_, fake):
        report = run_sequence(fake, outcomes)
        assert report.fallbacks["cache_error"] == outcomes.count("os")
        assert bool(retired()) is retires
        calls_before = len(fake.calls)
        with sage_qual.sage_attention_scope() as after:
            F.scaled_dot_product_attention(*qkv())
    warnings = records(caplog, logging.WARNING)
    if retires:
        assert dict(after.fallbacks) == {"device": 1} and len(fake.calls) == calls_before
        [warning] = warnings
        assert "cuda:0" in warning and "Triton cache" in warning
    else:
        assert after.served == 1 and warnings == []


def test_cache_errors_across_scopes_still_count_in_a_row():
    with wrapped() as (_, fake):
        for _ in range(3):
            run_sequence(fake, ["os"])
        assert retired()


# Anything else: device retired, one WARNING, torch's result -------------------------------------------

@pytest.mark.parametrize("make", BROKEN)
def test_other_errors_retire_the_device(caplog, make):
    tensors = qkv()
    error = make()
    with wrapped() as (_, fake):
        fake.raise_error(error)
        with sage_qual.sage_attention_scope() as report:
            out = F.scaled_dot_product_attention(*tensors)
            again = F.scaled_dot_product_attention(*tensors)
        with sage_qual.sage_attention_scope() as later:
            F.scaled_dot_product_attention(*tensors)
    expected = TORCH_SDPA(*tensors)
    assert torch.equal(out, expected) and torch.equal(again, expected)
    assert len(fake.calls) == 1
    assert dict(report.fallbacks) == {"kernel_error": 1, "device": 1}
    assert dict(later.fallbacks) == {"device": 1}
    assert retired()
    [warning] = records(caplog, logging.WARNING)
    for word in ("cuda:0", "[1, 2, 48, 64]", "[1, 2, 24, 64]", "float16", type(error).__name__, str(error)):
        assert word in warning, f"{word!r} not in {warning!r}"


def test_bf16_shapes_and_dtype_in_the_warning(caplog):
    with wrapped() as (_, fake):
        fake.raise_error(RuntimeError("CUDA error: misaligned address"))
        with sage_qual.sage_attention_scope():
            F.scaled_dot_product_attention(*qkv(heads=1, q_tokens=40, k_tokens=20, head_dim=128,
                                               dtype=torch.bfloat16))
    [warning] = records(caplog, logging.WARNING)
    for word in ("[1, 1, 40, 128]", "[1, 1, 20, 128]", "bfloat16", "misaligned address"):
        assert word in warning, f"{word!r} not in {warning!r}"


def test_retiring_one_gpu_leaves_the_other_serving(caplog):
    with wrapped(gpus=((9, 0), (8, 9))) as (_, fake):
        fake.raise_error(RuntimeError("CUDA error: an illegal memory access was encountered"), times=1)
        with sage_qual.sage_attention_scope() as report:
            F.scaled_dot_product_attention(*(on_device(t, 1) for t in qkv()))
            F.scaled_dot_product_attention(*qkv())
            F.scaled_dot_product_attention(*(on_device(t, 1) for t in qkv()))
            F.scaled_dot_product_attention(*qkv())
    assert retired(1) and not retired(0)
    assert report.served == 2
    assert dict(report.fallbacks) == {"kernel_error": 1, "device": 1}
    assert [c.device for c in fake.calls] == [1, 0, 0]
    [warning] = records(caplog, logging.WARNING)
    assert "cuda:1" in warning


def test_keyboard_interrupt_is_not_swallowed():
    with wrapped() as (_, fake):
        fake.raise_error(KeyboardInterrupt())
        with pytest.raises(KeyboardInterrupt), sage_qual.sage_attention_scope():
            F.scaled_dot_product_attention(*qkv())


@pytest.mark.parametrize("make", OUT_OF_MEMORY + CACHE
                         + [pytest.param(lambda: ValueError("bad"), id="broken")])
def test_torch_runs_after_the_kernels_buffers_are_released(monkeypatch, make):
    """A failed kernel's frames (its quantized copies) must be gone before torch's fallback runs:
    an out-of-memory fallback inside the except block runs out of memory too (H200,
    docs/results/README.md, "Out-of-memory fallback")."""
    buffers = []

    class KernelBuffer:  # stands for the int8/fp8 copies the kernel allocated before failing
        pass

    def failing_kernel_result(exact):
        quantized = KernelBuffer()  # a local of the failing frame, reachable from the traceback
        buffers.append(weakref.ref(quantized))
        raise make()

    alive_when_torch_ran = []

    def torch_sdpa(*args, **kwargs):
        alive_when_torch_ran.append([ref() is not None for ref in buffers])
        return TORCH_SDPA(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", torch_sdpa)  # install() wraps this one
    with wrapped() as (_, fake), sage_qual.sage_attention_scope() as report:
        fake.return_value(failing_kernel_result)
        F.scaled_dot_product_attention(*qkv())
    assert report.served == 0 and buffers
    assert alive_when_torch_ran == [[False]]


@pytest.mark.parametrize("garbage", [pytest.param(lambda exact: exact * float("nan"), id="nan")])
def test_torch_runs_after_a_rejected_output_is_dropped(monkeypatch, garbage):
    """The kernel's output that failed the first-call check is released before torch runs."""
    outputs = []

    def keep_ref(exact):
        out = garbage(exact)
        outputs.append(weakref.ref(out))
        return out

    alive = []

    def torch_sdpa(*args, **kwargs):
        alive.append([ref() is not None for ref in outputs])
        return TORCH_SDPA(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", torch_sdpa)
    with wrapped() as (_, fake), sage_qual.sage_attention_scope() as report:
        fake.return_value(keep_ref)
        F.scaled_dot_product_attention(*qkv())
    assert report.fallbacks == {"kernel_error": 1}
    assert alive[-1] == [False]
