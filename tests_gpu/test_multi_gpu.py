"""Two GPUs: per-thread scopes serve each thread on its own device, a thread outside any scope is
never served, and tensors on cuda:1 are served there while the thread's current device is cuda:0."""

import functools
import threading

import pytest
import torch
import torch.nn.functional as F

import sage_qual

pytestmark = [pytest.mark.slow, pytest.mark.gpu]

needs_two = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")


@pytest.fixture
def kernel_log(sage, monkeypatch):
    """Install with the default table and 1536/512 thresholds (the H200's built-in 16,384 would leave
    the 4,608-token calls to torch), recording (tensor device, current device, thread) per call."""
    sage_qual.uninstall()
    status = sage_qual.install(config=sage_qual.WrapperConfig())
    assert status.enabled, status.reason
    calls = []
    sage_qual.uninstall()
    for function in {d.variant.function for d in status.devices if d.variant}:
        real = getattr(sage.module, function)

        @functools.wraps(real)  # keep the real signature: install() checks its keywords
        def spy(q, k, v, _real=real, **keywords):
            calls.append((q.device.index, torch.cuda.current_device(), threading.current_thread().name))
            return _real(q, k, v, **keywords)

        monkeypatch.setattr(sage.module, function, spy)
    assert sage_qual.install(config=sage_qual.WrapperConfig()).enabled
    yield calls
    sage_qual.uninstall()


def qkv(device, seed):
    gen = torch.Generator(device).manual_seed(seed)
    return [torch.randn(1, 24, 4608, 128, device=device, dtype=torch.bfloat16, generator=gen)
            for _ in range(3)]


@needs_two
def test_two_scoped_threads_on_two_gpus_and_one_unscoped(kernel_log):
    barrier = threading.Barrier(3)
    reports, errors = {}, []

    def scoped(index):
        try:
            torch.cuda.set_device(index)
            q, k, v = qkv(f"cuda:{index}", index)
            barrier.wait()
            with sage_qual.sage_attention_scope() as report:
                for _ in range(3):
                    F.scaled_dot_product_attention(q, k, v)
            reports[index] = (report.served, report.calls)
        except Exception as error:  # surfaced below: a thread's assertion would be lost
            errors.append(error)

    def unscoped():
        try:
            q, k, v = qkv("cuda:0", 7)
            barrier.wait()
            for _ in range(3):
                F.scaled_dot_product_attention(q, k, v)
        except Exception as error:
            errors.append(error)

    threads = [threading.Thread(target=scoped, args=(i,), name=f"gpu{i}") for i in (0, 1)]
    threads.append(threading.Thread(target=unscoped, name="unscoped"))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not errors, errors
    assert reports == {0: (3, 3), 1: (3, 3)}
    assert sorted(kernel_log) == sorted([(0, 0, "gpu0")] * 3 + [(1, 1, "gpu1")] * 3)


@needs_two
def test_tensors_on_cuda1_are_served_there_while_cuda0_is_current(kernel_log):
    torch.cuda.set_device(0)
    q, k, v = qkv("cuda:1", 1)
    with sage_qual.sage_attention_scope() as report:
        out = F.scaled_dot_product_attention(q, k, v)
    assert report.served == 1, dict(report.fallbacks)
    assert out.device == torch.device("cuda:1")
    assert kernel_log == [(1, 1, threading.current_thread().name)]
    assert torch.cuda.current_device() == 0
