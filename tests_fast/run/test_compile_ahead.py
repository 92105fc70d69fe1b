"""Compile-ahead (`plan.compile_ahead`, `worker.Worker.compile`): a Triton variant's kernels compiled,
not launched, for every call its sweep job makes, in a worker beside the sweep."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from sage_qual.fixtures import fileformat
from sage_qual.qualification import families
from sage_qual.qualification.evidence import tasks
from sage_qual.qualification.evidence.report_model import DType, Outcome, ShapeEntry, ShapeSpec
from sage_qual.qualification.run import plan, worker
from sage_qual.qualification.selection import Selection
from sage_qual.qualification.selftest import faults as worker_faults
from sage_qual.verdicts.env_record import GpuInfo

from .. import builders

BOUNDS = {"fp16": {"max_rel_l2": 0.05, "min_cosine": 0.99}, "fp8": {"max_rel_l2": 0.08, "min_cosine": 0.99}}
TRITON = "sm86-fp16-triton"


class WholeBench(worker_faults.FakeBench):
    """The fake GPU at the planned lengths and heads (the fake bench cuts them; a GPU does not)."""

    def tokens(self, n: int) -> int:
        return n

    def heads(self, heads: int, kv_heads: int) -> int:
        return heads


@pytest.fixture
def bench():
    fake = WholeBench([{"name": "Fake RTX 3090", "capability": [8, 6]}])
    try:
        yield fake
    finally:
        fake._stack.close()


class CallLog(worker.PackageKernels):
    """The installed (fake) kernels, each call's q, k, v recorded as (shape, strides, dtype)."""

    def __init__(self):
        super().__init__()
        self.seen = set()

    def _log(self, *tensors) -> None:
        self.seen.add(tuple((tuple(t.shape), t.stride(), t.dtype) for t in tensors))

    def call(self, variant, q, k, v, smooth_k=False, fixture=None):
        if not smooth_k:  # the smoothing comparison reruns a cell's call on other values
            self._log(q, k, v)
        return super().call(variant, q, k, v, smooth_k=smooth_k, fixture=fixture)

    def long_kernel(self, variant):
        kernel = super().long_kernel(variant)

        def call(q, k, v, tensor_layout):
            self._log(q, k, v)
            return kernel(q, k, v, tensor_layout)

        return call


def small_fixture(tmp_path, heads: int, kv_heads: int, tokens: int) -> fileformat.Fixture:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, heads, tokens, 64, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(1, kv_heads, tokens + 13, 64, generator=g).to(torch.bfloat16) for _ in range(2))
    path = tmp_path / f"f{heads}x{tokens}.safetensors"
    fileformat.save_fixture(path, q, k, v, family="flux.1", kind="replica", source={"test": 1},
                            provenance="random test data", bounds=BOUNDS)
    return fileformat.load_fixture(path)


def planned(tmp_path):
    """A Triton and a CUDA variant's sweep of two fixtures, two timed shapes and a long check in every
    layout, small enough to run whole on the CPU."""
    fixtures = [small_fixture(tmp_path, 4, 4, 96), small_fixture(tmp_path, 8, 2, 40)]
    shapes = {}
    for shape in (families.self_attention(2, 80, 64), families.cross_attention(2, 48, 77)):
        shapes[shape.key] = ShapeEntry(tasks.shape_spec(shape.as_dict()), [])
    long_shape = tasks.shape_spec(families.self_attention(2, 160, 128).as_dict())
    checks = {"long": plan.LongPlan(long_shape, [], list(families.LAYOUTS))}
    variants = [TRITON, "sm80-fp16-cuda"]
    return plan._sweep(variants, fixtures, shapes, checks, quick=False), plan.compile_ahead(
        variants, fixtures, shapes, checks)


def test_the_compile_ahead_task_makes_every_call_its_variants_sweep_job_makes(tmp_path, bench):
    """Each kernel call of the Triton variant's job (shapes, strides, dtype: what a Triton kernel
    specializes on) is among the compile-ahead's: a call path added to a job but not to the plan of
    its compile-ahead fails here."""
    jobs, ahead = planned(tmp_path)
    [compiling] = ahead
    assert compiling.variant == TRITON  # the CUDA variant's kernels are compiled when it is built
    [job] = [job for job in jobs[1:] if job[0].variant == TRITON]
    in_job, in_ahead = CallLog(), CallLog()
    for task in job:
        assert worker.Worker(bench, kernels=in_job).run(task).outcome in (Outcome.PASS, Outcome.FAIL)
    result = worker.Worker(bench, kernels=in_ahead).run(compiling)
    assert result.outcome == Outcome.PASS, result.detail
    assert result.calls == len(compiling.calls) == len(in_ahead.seen)
    assert in_job.seen <= in_ahead.seen, in_job.seen - in_ahead.seen


def test_a_full_run_plans_a_compile_ahead_for_its_triton_variants_only(tmp_path):
    gpu = GpuInfo(index=0, name="Fake RTX 3090", capability=[8, 6], memory_gib=24.0, kernel=TRITON)
    machine = plan.Machine(builders.environment([builders.device()]), [plan.DeviceFacts(gpu, {})])
    chosen = Selection([families.find("FLUX.1")], [], [], [])
    for quick, variants, expected in ((False, [TRITON, "sm80-fp16-cuda"], [f"compile:{TRITON}"]),
                                      (False, ["sm80-fp16-cuda"], []), (True, [TRITON], [])):
        built = plan.build(builders.gpu_request(tmp_path, quick=quick), chosen, machine, variants,
                           in_process=False)
        assert [task.id for task in built.ahead[0]] == expected


@pytest.fixture
def fake_triton(monkeypatch):
    """A `triton.runtime.jit` whose JITFunction records how it was run, and its compiled kernel
    whether its launcher was built (`CompiledKernel.run`)."""
    runs = []

    class Compiled:
        @property
        def run(self):
            runs.append("launcher built")
            return lambda *args: None

    class JITFunction:
        def run(self, *args, grid, warmup, **kwargs):
            runs.append("compiled only" if warmup else "launched")
            return Compiled()

    module = types.ModuleType("triton.runtime.jit")
    module.JITFunction = JITFunction
    for name, value in (("triton", types.ModuleType("triton")), ("triton.runtime", types.ModuleType("x")),
                        ("triton.runtime.jit", module)):
        monkeypatch.setitem(sys.modules, name, value)
    return JITFunction, runs


def test_launches_off_compiles_and_loads_each_kernel_and_launches_none(fake_triton):
    JITFunction, runs = fake_triton
    launch = JITFunction.run
    with worker.triton_launches_off():
        JITFunction().run(1, grid=(1,), warmup=False)
    assert runs == ["compiled only", "launcher built"]
    assert JITFunction.run is launch
    JITFunction().run(1, grid=(1,), warmup=False)
    assert runs[-1] == "launched"


def test_launches_off_restores_triton_after_an_error(fake_triton):
    JITFunction, _ = fake_triton
    launch = JITFunction.run
    with pytest.raises(RuntimeError), worker.triton_launches_off():
        raise RuntimeError("a kernel's wrapper failed")
    assert JITFunction.run is launch


def test_each_call_gets_tensors_of_its_shape_in_its_layout(bench):
    arranged = worker.Worker(bench)._empty
    for layout in families.LAYOUTS:  # fused_qkv: as many query as key tokens and heads
        q, k, v, tensor_layout = arranged(ShapeSpec(8, 8, 40, 40, 64, DType("bfloat16"), 1), layout)
        hnd = [t.transpose(1, 2) if tensor_layout == "NHD" else t for t in (q, k, v)]
        assert [tuple(t.shape) for t in hnd] == [(1, 8, 40, 64)] * 3
    q, k, v, _ = arranged(ShapeSpec(8, 2, 40, 56, 64, DType("bfloat16"), 1), "contiguous")
    assert (tuple(q.shape), tuple(k.shape), q.dtype) == ((1, 8, 40, 64), (1, 2, 56, 64), torch.bfloat16)
