"""One answer to "what can run here": install(), `sage-qual env`, certify's environment task and the
GPU tests' `runnable` all read `assess()`, so none lists a variant another skips; and the variants'
capability bounds on GPUs older and newer than the ones upstream names."""

import contextlib

import pytest

import sage_qual
from sage_qual import records
from sage_qual.kernels import sage_package
from sage_qual.kernels.variants import FP8_CUDA_SM90, VARIANTS
from sage_qual.qualification.evidence.tasks import EnvTask
from sage_qual.qualification.run.worker import Worker
from sage_qual.serving import environment
from sage_qual.testing import FakeCuda, FakeGpu, FakeSageAttention
from tests_gpu.conftest import assess_device

ALL = {name for name, v in VARIANTS.items() if v.provider == "thu-ml"}
NOT_SM90 = ("_qattn_sm80", "_qattn_sm89", "_fused")


@contextlib.contextmanager
def box(capabilities, torch_cuda=(13, 0), **fake_options):
    gpus = [FakeGpu(cap, "GPU%d" % i) for i, cap in enumerate(capabilities)]
    with FakeCuda(gpus, torch_cuda=torch_cuda), FakeSageAttention(**fake_options).installed():
        yield


BOXES = [
    pytest.param(((9, 0), (7, 5), (8, 7), (8, 9)), (12, 6), {}, id="h200+t4+orin+4090_cuda12.6"),
    pytest.param(((12, 0), (10, 0), (13, 0)), (12, 8), {}, id="sm120+sm100+future_sm130"),
    pytest.param(((8, 6), (12, 1)), (13, 0), {}, id="sm86+sm121"),
    pytest.param(((9, 0), (8, 9)), (12, 8), {"extensions": NOT_SM90}, id="sm90_extension_not_built"),
    pytest.param(((9, 0), (8, 0)), (12, 8), {"signature_drops": ("smooth_k",)}, id="smooth_k_swallowed"),
    pytest.param(((9, 0), (8, 9)), (12, 8), {"missing": (FP8_CUDA_SM90,)}, id="sm90_function_missing"),
    pytest.param(((9, 0),), (12, 8), {"triton": False}, id="sageattention_unusable"),
    pytest.param(((7, 5), (8, 7)), (12, 8), {}, id="only_gpus_without_kernel"),
]


@pytest.mark.parametrize("capabilities, torch_cuda, fake_options", BOXES)
def test_install_env_certify_and_gpu_tests_agree(capabilities, torch_cuda, fake_options):
    with box(capabilities, torch_cuda, **fake_options):
        env = environment.collect()
        certify_env = records.dump(Worker(bench=None).env(EnvTask("env")))
        try:
            gpu0 = assess_device(sage_package.load_all(), 0) if sage_package.load() else None
        except sage_package.SageUnavailable:
            gpu0 = None
        status = sage_qual.install()
        sage_qual.uninstall()
    assert certify_env["environment"]["gpus"] == [vars(g) | {"capability": g.capability} for g in env.gpus]
    for gpu in env.gpus:
        skipped_by_certify = set(certify_env["not_supported"][str(gpu.index)])
        assert set(gpu.runnable_variants) == ALL - skipped_by_certify, gpu
        assert not gpu.kernel or gpu.kernel in gpu.runnable_variants
    if gpu0 is not None:
        assert gpu0.runnable == env.gpus[0].runnable_variants
    if status.enabled:
        by_index = {d.index: d for d in status.devices}
        for gpu in env.gpus:
            device = by_index[gpu.index]
            assert (device.variant.name if device.variant else "") == gpu.kernel
            assert device.no_kernel_reason == gpu.no_kernel_reason
    else:
        assert all(gpu.kernel == "" for gpu in env.gpus)
        for gpu in env.gpus:  # install() says why for each GPU, as env does
            assert gpu.no_kernel_reason in status.reason or env.sageattention_problem in status.reason


# Capability bounds: which variants can run on a GPU, from upstream setup.py and core.py ------------------
# Expected sets typed from upstream: setup.py builds sm_80/sm_86/sm_89 code (which later 8.x GPUs
# also run) and arch-specific sm_90a/sm_100a/sm_120a/sm_121a code; the sm90 kernel needs sm_90a;
# core.py calls the Triton kernel unusable on sm120/sm121; fp32+fp16 accumulation needs CUDA 12.8.
FP8 = {"sm89-fp8-cuda", "sm89-fp8-cuda-fp32acc", "sm120-fp8-perwarp", "sm120-fp8-perwarp-fp32acc"}
SM80 = {"sm80-fp16-cuda", "sm80-fp16-cuda-fp16acc"}


@pytest.mark.parametrize("capability, runnable", [
    pytest.param((7, 5), set(), id="sm75_turing"),
    pytest.param((8, 0), SM80 | {"sm86-fp16-triton"}, id="sm80"),
    pytest.param((8, 7), SM80 | {"sm86-fp16-triton"}, id="sm87_runs_sm80_code"),
    pytest.param((8, 9), SM80 | {"sm86-fp16-triton"} | FP8, id="sm89"),
    pytest.param((9, 0), ALL, id="sm90"),
    pytest.param((10, 0), SM80 | {"sm86-fp16-triton"} | FP8, id="sm100"),
    pytest.param((10, 3), {"sm86-fp16-triton"}, id="sm103_no_build_target"),
    pytest.param((12, 0), SM80 | FP8, id="sm120_no_triton"),
    pytest.param((12, 1), SM80 | FP8, id="sm121_no_triton"),
    pytest.param((13, 0), {"sm86-fp16-triton"}, id="future_sm130"),
])
def test_runnable_variants_per_capability(capability, runnable):
    with box((capability,), torch_cuda=(12, 8)):
        [gpu] = environment.collect().gpus
    assert set(gpu.runnable_variants) == runnable


@pytest.mark.parametrize("capability", [(7, 0), (7, 5), (8, 6), (9, 0), (12, 0), (13, 0)])
def test_comfy_kitchen_runs_from_turing_on_beside_thu_ml(capability):
    """comfy_kitchen/sage_attention.py: compute capability 7.5 or newer, with its CUDA extension;
    thu-ml's variants stay as they were."""
    with box((capability,), torch_cuda=(12, 8)):
        [alone] = environment.collect().gpus
    with box((capability,), torch_cuda=(12, 8), comfy_kitchen="0.2.40"):
        [both] = environment.collect().gpus
    with box((capability,), torch_cuda=(12, 8), comfy_kitchen="0.2.40", ck_extensions=()):
        [unbuilt] = environment.collect().gpus
    added = {"ck-int8-cuda"} if capability >= (7, 5) else set()
    assert set(both.runnable_variants) == set(alone.runnable_variants) | added
    assert set(unbuilt.runnable_variants) == set(alone.runnable_variants)


@pytest.mark.parametrize("capability, kernel", [
    pytest.param((8, 0), "sm80-fp16-cuda", id="sm80"),
    pytest.param((8, 6), "sm86-fp16-triton", id="sm86"),
    pytest.param((8, 9), "sm89-fp8-cuda", id="sm89"),
    pytest.param((9, 0), "sm90-fp8-cuda", id="sm90"),
    pytest.param((12, 0), "sm120-fp8-perwarp", id="sm120"),
    pytest.param((12, 1), "sm120-fp8-perwarp", id="sm121"),
    pytest.param((8, 7), "", id="sm87_upstream_raises"),
    pytest.param((10, 0), "", id="sm100_upstream_raises"),
    pytest.param((13, 0), "", id="sm130_upstream_raises"),
])
def test_wrapper_kernel_per_capability_follows_upstream_sageattn(capability, kernel):
    """sageattn() in upstream core.py: sm80, sm86, sm89, sm90, sm120, sm121 each get one kernel;
    every other capability raises "Unsupported CUDA architecture"."""
    with box((capability,), torch_cuda=(12, 8)):
        [gpu] = environment.collect().gpus
    assert gpu.kernel == kernel
    if not kernel:
        assert "sm_%d%d has no SageAttention kernel" % capability in gpu.no_kernel_reason


def test_a_variant_not_runnable_says_why_for_each_bound():
    with box(((13, 0), (12, 0), (7, 5)), torch_cuda=(12, 4)):
        future, blackwell, turing = environment.collect().gpus
        not_supported = Worker(bench=None).env(EnvTask("env")).not_supported
    assert "builds no code that runs on sm_130" in not_supported["0"]["sm90-fp8-cuda"][0]
    assert "Triton kernel is not usable" in not_supported["1"]["sm86-fp16-triton"][0]
    assert any("needs >= 12.8" in why for why in not_supported["1"]["sm120-fp8-perwarp"])
    assert any("needs >= (8, 0)" in why for why in not_supported["2"]["sm80-fp16-cuda"])
    assert blackwell.kernel == "sm120-fp8-perwarp-fp32acc"  # CUDA 12.4: the fp32 accumulator
    assert future.kernel == turing.kernel == ""
