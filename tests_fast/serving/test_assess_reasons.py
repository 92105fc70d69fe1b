"""assess() for one GPU and for the machine: each variant's reasons (its box facts first, then the
installed function), the kernel the config gives, and what a machine without a usable sageattention
says for every variant and GPU."""

import pytest

from sage_qual.kernels import sage_package
from sage_qual.kernels.variants import VARIANTS, BoxFacts
from sage_qual.serving import assess
from sage_qual.serving.config import DEFAULT_CONFIG, WrapperConfig
from sage_qual.testing import FakeCuda, FakeGpu, FakeSageAttention

SM90 = "sageattn_qk_int8_pv_fp8_cuda_sm90"


def package_of(fake: FakeSageAttention):
    """Every provider's package as the fake installs it (comfy-kitchen: not installed)."""
    with FakeCuda([FakeGpu((9, 0))]), fake.installed():
        return sage_package.load_all()


def h200_box(extensions=frozenset({"_qattn_sm80", "_qattn_sm89", "_qattn_sm90", "_fused"}), triton=True):
    return BoxFacts((9, 0), (13, 0), frozenset(extensions), triton)


def test_every_variant_is_runnable_or_has_its_reasons():
    gpu = assess.assess(3, h200_box(), package_of(FakeSageAttention()))
    assert gpu.index == 3 and set(gpu.reasons) == set(VARIANTS)
    assert gpu.kernel.name == "sm90-fp8-cuda" and gpu.no_kernel_reason == ""
    comfy_kitchen = package_of(FakeSageAttention())["comfy-kitchen"]  # not installed: its problem
    for name, why in gpu.reasons.items():
        assert isinstance(why, tuple)
        if VARIANTS[name].provider == "comfy-kitchen":
            assert why == (comfy_kitchen,)
        else:
            assert list(why) == VARIANTS[name].not_supported_reasons(h200_box())
    assert gpu.runnable == [n for n in VARIANTS if not gpu.reasons[n]]
    assert gpu.not_supported() == {n: list(w) for n, w in gpu.reasons.items() if w}
    assert "sm90-fp8-cuda" in gpu.runnable
    ampere = assess.assess(
        0,
        BoxFacts((8, 0), (13, 0), frozenset({"_qattn_sm80", "_fused"}), True),
        package_of(FakeSageAttention()),
    )
    assert ampere.runnable == [n for n in VARIANTS if not ampere.reasons[n]]
    assert "sm80-fp16-cuda" in ampere.runnable and "sm80-fp16-cuda" not in ampere.not_supported()
    assert ampere.not_supported()["sm90-fp8-cuda"] == list(ampere.reasons["sm90-fp8-cuda"]) != []


def test_a_function_the_package_lacks_is_a_reason_after_the_box_facts():
    package = package_of(FakeSageAttention(missing=(SM90,)))
    gpu = assess.assess(0, h200_box(), package)
    problem = sage_package.kernel_problem(package["thu-ml"], VARIANTS["sm90-fp8-cuda"])
    assert gpu.reasons["sm90-fp8-cuda"] == (problem,)
    assert SM90 in gpu.reasons["sm90-fp8-cuda"][0]
    # The sm120 variants are refused by the box first; their function is not asked about.
    assert gpu.reasons["sm120-fp8-perwarp"] == tuple(
        VARIANTS["sm120-fp8-perwarp"].not_supported_reasons(h200_box())
    )
    assert gpu.kernel is None
    assert gpu.no_kernel_reason == f"sm90-fp8-cuda: {gpu.reasons['sm90-fp8-cuda'][0]}"


def test_the_config_picks_the_kernel():
    package = package_of(FakeSageAttention())
    config = WrapperConfig(kernel_table={(9, 0): ("sm80-fp16-cuda",)})
    assert assess.assess(0, h200_box(), package, config).kernel.name == "sm80-fp16-cuda"
    gpu = assess.assess(0, BoxFacts((7, 5), (13, 0), frozenset(), True), package, config)
    assert gpu.kernel is None and gpu.no_kernel_reason.startswith("sm_75 has no SageAttention kernel")


def test_without_a_package_every_variant_carries_its_providers_problem():
    missing = {"thu-ml": "sageattention is not installed: build it",
               "comfy-kitchen": "comfy-kitchen is not installed"}
    gpu = assess.assess(1, h200_box(), missing, DEFAULT_CONFIG)
    assert gpu.reasons == {name: (missing[v.provider],) for name, v in VARIANTS.items()}
    assert gpu.kernel is None and gpu.no_kernel_reason == assess.UNUSABLE_PACKAGE
    assert gpu.runnable == [] and set(gpu.not_supported()) == set(VARIANTS)


def test_each_variant_is_judged_by_its_own_providers_package():
    """comfy-kitchen installed beside sageattention: its variant runs from compute capability 7.5,
    needing its own extension; without it, only its variant carries comfy-kitchen's problem."""
    both = package_of(FakeSageAttention(comfy_kitchen="0.2.40"))
    box = h200_box(extensions={"_qattn_sm90", "_fused", "backends.cuda._C"})
    assert "ck-int8-cuda" in assess.assess(0, box, both).runnable
    assert assess.assess(0, h200_box(), both).reasons["ck-int8-cuda"] == (
        "extension comfy_kitchen.backends.cuda._C not built or does not import",)
    turing = assess.assess(0, BoxFacts((7, 5), (13, 0), frozenset({"backends.cuda._C"}), True), both)
    assert turing.runnable == ["ck-int8-cuda"]
    alone = package_of(FakeSageAttention())
    assert alone["comfy-kitchen"].startswith("comfy-kitchen is not installed")
    assert assess.assess(0, box, alone).reasons["ck-int8-cuda"] == (alone["comfy-kitchen"],)


def test_box_facts_read_the_gpu_the_package_and_triton(monkeypatch):
    fake = FakeSageAttention(extensions=("_qattn_sm80", "_fused"))
    with FakeCuda([FakeGpu((8, 0)), FakeGpu((8, 9))], torch_cuda=(12, 6)) as cuda, fake.installed():
        packages = sage_package.load_all()
        box = assess.box_facts(cuda, 1, packages)
        assert box == BoxFacts((8, 9), (12, 6), frozenset({"_qattn_sm80", "_fused"}), True)
        unusable = assess.box_facts(cuda, 0, {"thu-ml": "not installed"})
        assert unusable == BoxFacts((8, 0), (12, 6), frozenset(), True)
        monkeypatch.setattr(sage_package, "has_triton", lambda: False)
        assert assess.box_facts(cuda, 0, packages).has_triton is False


def test_the_machine_is_every_gpu_with_the_package():
    with FakeCuda([FakeGpu((9, 0)), FakeGpu((8, 9))]), FakeSageAttention().installed():
        machine = assess.assess_machine()
    assert machine.problem == "" and machine.package.version == "2.2.0"
    assert [g.index for g in machine.gpus] == [0, 1]
    assert [g.kernel.name for g in machine.gpus] == ["sm90-fp8-cuda", "sm89-fp8-cuda"]
    assert [g.box.capability for g in machine.gpus] == [(9, 0), (8, 9)]


@pytest.mark.parametrize(
    "fake, says",
    [
        (FakeSageAttention(version="1.0.6"), "SageAttention 1"),
        (FakeSageAttention(triton=False), "triton is not installed"),
    ],
)
def test_a_machine_without_a_usable_package_says_why_for_every_gpu(fake, says):
    with FakeCuda([FakeGpu((9, 0)), FakeGpu((8, 9))]), fake.installed():
        machine = assess.assess_machine()
    assert machine.package is None and says in machine.problem
    assert len(machine.gpus) == 2
    for gpu in machine.gpus:
        assert gpu.reasons["sm90-fp8-cuda"] == (machine.problem,)
        assert gpu.kernel is None and gpu.no_kernel_reason == assess.UNUSABLE_PACKAGE


def test_a_machine_without_gpus_has_none():
    with FakeCuda([]), FakeSageAttention().installed():
        machine = assess.assess_machine(WrapperConfig())
    assert machine.gpus == [] and machine.problem == ""
