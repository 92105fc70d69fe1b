"""install() / uninstall(): rebinding, idempotence, and every reason to keep torch's function."""

import contextlib
import logging
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.nn.functional as F

import sage_qual
from sage_qual.testing import FakeCuda, FakeGpu, FakeSageAttention

TORCH_SDPA = F.scaled_dot_product_attention  # torch's own function, read before any install
SM90 = "sageattn_qk_int8_pv_fp8_cuda_sm90"
BUILD_FROM_SOURCE = "github.com/thu-ml/SageAttention"

pytestmark = pytest.mark.usefixtures("log_everything")


def warnings_of(caplog):
    return [r for r in caplog.records if r.name == "sage_qual" and r.levelno == logging.WARNING]


def infos_of(caplog):
    return [r for r in caplog.records if r.name == "sage_qual" and r.levelno == logging.INFO]


@contextlib.contextmanager
def fake_box(gpus=((9, 0),), fake=None, **cuda_options):
    fake = fake if fake is not None else FakeSageAttention()
    with FakeCuda([FakeGpu(cap, f"GPU{i}") for i, cap in enumerate(gpus)], **cuda_options) as cuda, \
            fake.installed():
        yield cuda, fake


def assert_refused(caplog, status, *words):
    """torch's function kept, one WARNING naming every word, and the same reason for the caller."""
    assert status.enabled is False
    assert F.scaled_dot_product_attention is TORCH_SDPA
    assert sage_qual.install_status() == status
    warnings = warnings_of(caplog)
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    message = warnings[0].getMessage()
    for word in words:
        assert word in message, f"{word!r} not in WARNING {message!r}"
        assert word in status.reason, f"{word!r} not in install_status().reason {status.reason!r}"
    assert not [r for r in infos_of(caplog) if "enabled" in r.getMessage()]


# Rebinding ------------------------------------------------------------------------------------------

def test_install_rebinds_torch_function_and_uninstall_restores_the_exact_object():
    with fake_box():
        status = sage_qual.install()
        assert status.enabled, status.reason
        assert status.version == "2.2.0"
        assert status.reason == ""
        assert F.scaled_dot_product_attention is not TORCH_SDPA
        assert torch.nn.functional.scaled_dot_product_attention is F.scaled_dot_product_attention
        assert sage_qual.install_status().enabled
        sage_qual.uninstall()
    assert F.scaled_dot_product_attention is TORCH_SDPA
    assert not sage_qual.install_status().enabled
    assert sage_qual.install_status().reason


def test_install_twice_rebinds_once(caplog):
    with fake_box():
        first = sage_qual.install()
        wrapped = F.scaled_dot_product_attention
        second = sage_qual.install()
        assert second.enabled and second == first
        assert F.scaled_dot_product_attention is wrapped
        enabled_lines = [r for r in infos_of(caplog) if "enabled" in r.getMessage()]
        assert len(enabled_lines) == 1
        sage_qual.uninstall()
        assert F.scaled_dot_product_attention is TORCH_SDPA


def test_install_again_with_other_arguments_installs_anew_with_them(caplog):
    """A second install() with another family or profile was silently ignored (issue 43): the old
    thresholds stayed and the status said all was well."""
    from .. import builders

    off = builders.make_entry(None, reasons=[builders.reason("speed", "no speedup at its shapes")])
    profile = builders.make_profile(gpu=FakeGpu((9, 0), "GPU0"), entry=off, families={
        "FLUX.1": builders.make_entry("sm90-fp8-cuda", 4096, 512), "SDXL": off})
    with fake_box():
        flux = sage_qual.install(profile=profile, family="FLUX.1")
        wrapped = F.scaled_dot_product_attention
        assert flux.enabled and flux.devices[0].variant.name == "sm90-fp8-cuda"
        assert sage_qual.install(profile=profile, family="FLUX.1") is flux  # the same: nothing changes
        assert F.scaled_dot_product_attention is wrapped
        sdxl = sage_qual.install(profile=profile, family="SDXL")
        assert sage_qual.install_status() is sdxl and sdxl.devices[0].variant is None
        assert F.scaled_dot_product_attention is not wrapped
        assert any("installing anew" in r.getMessage() for r in infos_of(caplog))
        sage_qual.uninstall()
    assert F.scaled_dot_product_attention is TORCH_SDPA


def test_install_again_after_uninstall_works():
    with fake_box():
        assert sage_qual.install().enabled
        sage_qual.uninstall()
        assert sage_qual.install().enabled
        assert F.scaled_dot_product_attention is not TORCH_SDPA
        sage_qual.uninstall()
    assert F.scaled_dot_product_attention is TORCH_SDPA


def test_uninstall_without_install_keeps_torch_function():
    sage_qual.uninstall()
    sage_qual.uninstall()
    assert F.scaled_dot_product_attention is TORCH_SDPA


class SlowProbeCuda(FakeCuda):
    """Probing takes a while, so two threads calling install() overlap."""

    def device_count(self):
        time.sleep(0.2)
        return super().device_count()


def test_concurrent_installs_rebind_once():
    fake = FakeSageAttention()
    with SlowProbeCuda([FakeGpu((9, 0))]), fake.installed():
        statuses = []
        threads = [threading.Thread(target=lambda: statuses.append(sage_qual.install())) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert [s.enabled for s in statuses] == [True, True]
        q = torch.randn(1, 1, 8, 64)
        # Outside a scope the call must reach torch once, not the wrapper wrapping itself.
        assert torch.equal(F.scaled_dot_product_attention(q, q, q), TORCH_SDPA(q, q, q))
        sage_qual.uninstall()
    assert F.scaled_dot_product_attention is TORCH_SDPA


def test_wrapper_held_by_reference_still_works_after_uninstall():
    """`from torch.nn.functional import scaled_dot_product_attention` keeps the wrapper object."""
    with fake_box():
        sage_qual.install()
        held = F.scaled_dot_product_attention
        sage_qual.uninstall()
        q = torch.randn(1, 1, 8, 64)
        assert torch.equal(held(q, q, q), TORCH_SDPA(q, q, q))
        with sage_qual.sage_attention_scope():
            assert torch.equal(held(q, q, q), TORCH_SDPA(q, q, q))


# Never raises -------------------------------------------------------------------------------------

class BrokenCuda(FakeCuda):
    def __init__(self, broken: str):
        super().__init__([FakeGpu((9, 0))])
        self.broken = broken

    def device_count(self):
        if self.broken == "device_count":
            raise RuntimeError("CUDA driver initialization failed")
        return super().device_count()

    def capability(self, index):
        if self.broken == "capability":
            raise RuntimeError("CUDA error: unknown error")
        return super().capability(index)

    def device_name(self, index):
        if self.broken == "device_name":
            raise AssertionError("Torch not compiled with CUDA enabled")
        return super().device_name(index)


@pytest.mark.parametrize("broken", ["device_count", "capability", "device_name"])
def test_install_never_raises(caplog, broken):
    with BrokenCuda(broken), FakeSageAttention().installed():
        status = sage_qual.install()
    assert status.enabled is False
    assert F.scaled_dot_product_attention is TORCH_SDPA
    assert len(warnings_of(caplog)) == 1
    assert "Error" in status.reason
    assert status == sage_qual.install_status()


def test_install_on_this_cpu_build_without_fakes(caplog):
    """The real platform of a CPU-only torch: no GPU, one WARNING, torch kept."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    status = sage_qual.install()
    assert_refused(caplog, status, "no CUDA GPU", "install a CUDA build of torch")


# Every reason to keep torch's function, with its fix ----------------------------------------------

@contextlib.contextmanager
def sageattention_absent():
    with FakeCuda([FakeGpu((9, 0))]), FakeSageAttention().installed():
        sys.modules["sageattention"] = None  # find_spec answers None; the fake restores the entry
        yield


REFUSALS = [
    pytest.param(lambda: fake_box(rocm=True), ("ROCm", "NVIDIA"), id="rocm_build"),
    pytest.param(lambda: fake_box(gpus=()), ("no CUDA GPU", "install a CUDA build of torch"), id="no_gpu"),
    pytest.param(lambda: fake_box(gpus=((7, 5), (6, 1))), ("8.0", "sm_75", "sm_61", "Ampere"),
                 id="only_gpus_below_sm80"),
    pytest.param(lambda: fake_box(gpus=((8, 7),)), ("sm_87", "no SageAttention kernel"),
                 id="only_sm87_without_kernel"),
    pytest.param(lambda: fake_box(gpus=((11, 0),)), ("sm_110", "no SageAttention kernel"),
                 id="only_unknown_capability"),
    pytest.param(sageattention_absent, ("sageattention is not installed", BUILD_FROM_SOURCE),
                 id="sageattention_missing"),
    pytest.param(lambda: fake_box(fake=FakeSageAttention(triton=False)),
                 ("triton is not installed", "pip install triton"), id="triton_missing"),
    pytest.param(lambda: fake_box(fake=FakeSageAttention(version=None)),
                 ("no package metadata", BUILD_FROM_SOURCE), id="no_package_metadata"),
    pytest.param(lambda: fake_box(fake=FakeSageAttention(import_error=OSError(
        "[WinError 127] DLL load failed while importing _qattn_sm80")),
    ), ("OSError", "DLL load failed", BUILD_FROM_SOURCE), id="import_dll_load_error"),
    pytest.param(lambda: fake_box(fake=FakeSageAttention(import_error=ImportError(
        "_qattn_sm90.so: undefined symbol: _ZN3c104cuda")),
    ), ("ImportError", "undefined symbol", BUILD_FROM_SOURCE), id="import_abi_mismatch"),
    pytest.param(lambda: fake_box(fake=FakeSageAttention(version="1.0.6")),
                 ("1.0.6", "SageAttention 1, the release on PyPI", "uninstall it", BUILD_FROM_SOURCE),
                 id="version=1.0.6"),
    pytest.param(lambda: fake_box(fake=FakeSageAttention(version="2.1.1")),
                 ("2.1.1", "older than 2.2.0", BUILD_FROM_SOURCE), id="version=2.1.1"),
    pytest.param(lambda: fake_box(fake=FakeSageAttention(version="2.0.1")),
                 ("2.0.1", "older than 2.2.0"), id="version=2.0.1"),
    pytest.param(lambda: fake_box(fake=FakeSageAttention(version="2.1.1+cu130torch2.10.0andhigher.post6")),
                 ("older than 2.2.0",), id="version=2.1.1+local_label"),
    pytest.param(lambda: fake_box(fake=FakeSageAttention(version="not-a-version")),
                 ("not a version number", BUILD_FROM_SOURCE), id="version_unparsable"),
    pytest.param(lambda: fake_box(fake=FakeSageAttention(missing=(SM90,))),
                 (SM90, BUILD_FROM_SOURCE), id="kernel_function_missing"),
    pytest.param(lambda: fake_box(fake=FakeSageAttention(extensions=("_qattn_sm80", "_qattn_sm89"))),
                 ("_qattn_sm90",), id="extension_for_this_gpu_not_built"),
]


@pytest.mark.parametrize("make_box, words", REFUSALS)
def test_install_refuses_with_one_warning_naming_cause_and_fix(caplog, make_box, words):
    with make_box():
        status = sage_qual.install()
    assert_refused(caplog, status, *words)


@pytest.mark.parametrize("keyword, capability", [
    pytest.param("smooth_k", (9, 0), id="smooth_k"),
    pytest.param("sm_scale", (9, 0), id="sm_scale"),
    pytest.param("tensor_layout", (9, 0), id="tensor_layout"),
    pytest.param("is_causal", (9, 0), id="is_causal"),
    pytest.param("pv_accum_dtype", (9, 0), id="pv_accum_dtype"),
    pytest.param("qk_quant_gran", (12, 0), id="qk_quant_gran_on_sm120"),
    pytest.param("pv_accum_dtype", (8, 0), id="pv_accum_dtype_on_sm80"),
    pytest.param("smooth_k", (8, 6), id="smooth_k_on_sm86_triton"),
])
def test_install_refuses_kernel_whose_signature_swallows_a_keyword(caplog, keyword, capability):
    """Real kernels end in **kwargs: a keyword they stopped naming would be silently ignored."""
    with fake_box(gpus=(capability,), fake=FakeSageAttention(signature_drops=(keyword,))):
        status = sage_qual.install()
    assert_refused(caplog, status, keyword, "**kwargs")


def test_keyword_the_wrapper_does_not_pass_may_be_missing():
    with fake_box(fake=FakeSageAttention(signature_drops=("return_lse", "qk_quant_gran"))):
        status = sage_qual.install()
    assert status.enabled, status.reason


def test_kernel_function_of_another_gpu_may_be_missing():
    with fake_box(gpus=((9, 0),), fake=FakeSageAttention(missing=("sageattn_qk_int8_pv_fp16_triton",))):
        status = sage_qual.install()
    assert status.enabled, status.reason


@pytest.mark.parametrize("version", [
    pytest.param("2.2.0", id="2.2.0"),
    pytest.param("2.2.0.post3", id="2.2.0.post3"),
    pytest.param("2.2.0+cu130torch2.10.0andhigher.post6", id="2.2.0+local_label"),
    pytest.param("2.2.1", id="2.2.1"),
    pytest.param("2.10.0", id="2.10.0_numeric_not_string_compare"),
    pytest.param("2.3", id="2.3"),
])
def test_install_accepts_versions_from_2_2_0(version):
    with fake_box(fake=FakeSageAttention(version=version)):
        status = sage_qual.install()
    assert status.enabled, status.reason
    assert status.version == version
    assert F.scaled_dot_product_attention is not TORCH_SDPA


def test_install_enables_when_some_gpus_have_no_kernel():
    with fake_box(gpus=((8, 7), (9, 0))):
        status = sage_qual.install()
    assert status.enabled, status.reason
    by_index = {d.index: d for d in status.devices}
    assert by_index[0].variant is None and "sm_87" in by_index[0].no_kernel_reason
    assert by_index[1].variant is not None and by_index[1].variant.function == SM90


def test_importing_sage_qual_imports_neither_sageattention_nor_triton():
    code = ("import sage_qual, sage_qual.testing, sys; "
            "bad = [m for m in ('sageattention', 'triton') if m in sys.modules]; "
            "assert not bad, bad")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_measure_imported_after_install_times_torch_own_sdpa(monkeypatch):
    """The qualification suite's SDPA is torch's own, whatever was bound over it before its import."""
    import importlib

    import sage_qual.qualification.measure.accuracy  # bound on the package, so monkeypatch can restore it

    monkeypatch.setattr(sage_qual.qualification.measure, "accuracy", sage_qual.qualification.measure.accuracy,
                        raising=False)
    with fake_box():
        assert sage_qual.install().enabled
        assert F.scaled_dot_product_attention is not TORCH_SDPA
        monkeypatch.delitem(sys.modules, "sage_qual.qualification.measure.accuracy")
        measure = importlib.import_module("sage_qual.qualification.measure.accuracy")
    assert measure.TORCH_SDPA is TORCH_SDPA


COMPILE_INSIDE_THE_FAKE = """
import torch, torch.nn.functional as F
import sage_qual
from sage_qual.testing import FakeCuda, FakeGpu, FakeSageAttention

with FakeCuda([FakeGpu((9, 0), "Fake H200")]), FakeSageAttention().installed() as fake:
    config = sage_qual.WrapperConfig(min_query_tokens=32, min_key_tokens=16, check_rows=16)
    assert sage_qual.install(config).enabled
    compiled = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v))
    q = torch.randn(1, 2, 64, 64, dtype=torch.bfloat16)
    with sage_qual.sage_attention_scope() as scope:
        out = compiled(q, q, q)
    print(scope.served, len(fake.calls), out.shape == q.shape)
"""


def test_torch_compile_works_inside_the_public_fake_in_a_fresh_interpreter():
    """Dynamo and Inductor, imported for the first time inside `FakeSageAttention().installed()`: its
    bare `triton` module made the first compile die (AttributeError: module 'triton' has no attribute
    'language'), and the project's own tests imported them first to get by (issue 43)."""
    done = subprocess.run([sys.executable, "-c", COMPILE_INSIDE_THE_FAKE], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["1", "1", "True"], done.stdout


def test_a_profile_naming_comfy_kitchens_variant_serves_it_from_its_provider(caplog):
    """A profile entry can name comfy-kitchen's variant: install() then calls
    comfy_kitchen.sage_attention.int8_attention (scale by name, no layout or smoothing keywords),
    and a family the entry keeps on thu-ml's kernel still gets that one."""
    from .. import builders

    sdxl = builders.make_entry("ck-int8-cuda", 64, 64, head_dims=(64,))
    default = builders.make_entry("sm90-fp8-cuda", 64, 64)
    profile = builders.make_profile(gpu=FakeGpu((9, 0), "GPU0"), entry=default, families={"SDXL": sdxl})
    q, k, v = (torch.randn(1, 2, 128, 64, dtype=torch.float16) for _ in range(3))
    with fake_box(fake=FakeSageAttention(comfy_kitchen="0.2.40")) as (_, fake):
        status = sage_qual.install(profile=profile, family="SDXL")
        assert status.enabled and status.devices[0].variant.name == "ck-int8-cuda"
        with sage_qual.sage_attention_scope() as report:
            out = F.scaled_dot_product_attention(q, k, v)
        sage_qual.uninstall()
    assert report.served == 1, report.summary()
    served = [c for c in fake.calls if c.q.shape == q.shape]
    assert {c.function for c in served} == {"int8_attention"}
    assert set(served[-1].keywords) == {"scale", "attn_mask"} and served[-1].keywords["scale"] == 64 ** -0.5
    torch.testing.assert_close(out.float(), TORCH_SDPA(q.float(), k.float(), v.float()), atol=2e-3, rtol=2e-3)
    assert any("comfy-kitchen 0.2.40 serves attention" in r.getMessage() for r in infos_of(caplog))


def test_without_comfy_kitchen_a_profile_naming_its_variant_says_so():
    from .. import builders

    profile = builders.make_profile(gpu=FakeGpu((9, 0), "GPU0"), families={
        "SDXL": builders.make_entry("ck-int8-cuda", 64, 64, head_dims=(64,))})
    with fake_box():
        status = sage_qual.install(profile=profile, family="SDXL")
        sage_qual.uninstall()
    assert not status.enabled and "comfy-kitchen is not installed" in status.devices[0].no_kernel_reason


@pytest.mark.parametrize("thu_ml", [dict(triton=False), dict(import_error=ImportError("No module named 'x'")),
                                    dict(version=None)], ids=["no-triton", "thu-ml-fails-to-import",
                                                             "thu-ml-without-metadata"])
def test_comfy_kitchen_serves_without_triton_or_thu_mls_package_and_is_named_so(thu_ml, caplog):
    """Issue 54: nothing tested that comfy-kitchen needs neither (its kernels are CUDA, its package its
    own); the enable line then named comfy-kitchen's version as SageAttention's."""
    config = sage_qual.WrapperConfig(kernel_table={(8, 9): ("ck-int8-cuda",)})
    fake = FakeSageAttention(comfy_kitchen="0.2.40", **thu_ml)
    gpus = FakeCuda([FakeGpu((8, 9), "RTX 4090")])
    with gpus, fake.installed(), caplog.at_level(logging.INFO, "sage_qual"):
        status = sage_qual.install(config=config)
        sage_qual.uninstall()
    assert status.enabled and status.devices[0].variant.name == "ck-int8-cuda", status.reason
    enabled = [r.getMessage() for r in caplog.records if "enabled for SDPA calls" in r.getMessage()]
    assert enabled and enabled[0].startswith("comfy-kitchen 0.2.40 enabled"), enabled


def test_no_install_hint_names_a_sage_qual_package_on_pypi():
    """sage-qual is not on PyPI: `pip install "sage-qual[...]"` would fetch whatever took the name."""
    from sage_qual.kernels.providers import PROVIDERS

    for provider in PROVIDERS.values():
        assert "sage-qual[" not in provider.install_hint.replace('-e ".[', ""), provider.install_hint
