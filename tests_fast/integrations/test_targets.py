"""Targets: every built-in integration resolves, states its claims in the wrapper's words, is
enabled the way its app enables it, and counts only the calls that reached SageAttention."""

import importlib.machinery
import sys
import types

import pytest
import torch

import sage_qual
from sage_qual.qualification.integrations import targets
from sage_qual.testing import FakeCuda, FakeGpu, FakeSageAttention

from ..helpers import TORCH_SDPA, qkv


@pytest.fixture
def h200():
    fake = FakeSageAttention()
    with FakeCuda([FakeGpu((9, 0), "Fake H200")]), fake.installed():
        yield fake


def test_wrapper_as_installed_names_the_threshold_a_short_call_misses(h200):
    q, k, v = qkv(q_tokens=64, k_tokens=32)
    target = targets.resolve("wrapper")
    assert target.not_supported_reasons(q, k, v) == ["short: tokens=64/32 (needs >= 1536/512)"]
    with target.session() as session:
        out, served = session.call(q, k, v)
    assert not served and h200.calls == []
    assert "short" in session.evidence.not_served_detail()
    assert torch.equal(out, TORCH_SDPA(q, k, v))
    assert not sage_qual.install_status().enabled  # the target uninstalls what it installed


def test_wrapper_with_a_forced_variant_serves_small_calls_with_smoothing_off(h200):
    q, k, v = qkv(q_tokens=64, k_tokens=32)
    target = targets.resolve("wrapper:sm90-fp8-cuda")
    assert target.not_supported_reasons(q, k, v) == []
    with target.session() as session:
        _, served = session.call(q, k, v)
    assert served and session.evidence.served == 1
    assert h200.calls[0].function == "sageattn_qk_int8_pv_fp8_cuda_sm90"
    assert h200.calls[0].keywords["smooth_k"] is False


def test_a_forced_variant_replaces_an_apps_wrapper_for_the_session_and_gives_it_back(h200):
    """An app's wrapper installed first (default table: sm90-fp8-cuda on this H200) must not stand in
    for wrapper:sm80-fp16-cuda: the variant named serves, and the app's installation returns after."""
    q, k, v = qkv(q_tokens=64, k_tokens=32)
    app_config = sage_qual.WrapperConfig(min_query_tokens=1, min_key_tokens=1)
    assert sage_qual.install(config=app_config).enabled
    try:
        target = targets.resolve("wrapper:sm80-fp16-cuda")
        with target.session() as session:
            _, served = session.call(q, k, v)
        assert served and [c.function for c in h200.calls] == ["sageattn_qk_int8_pv_fp16_cuda"]
        status = sage_qual.install_status()
        assert status.enabled and status.devices[0].config is app_config
        assert status.devices[0].variant.name == "sm90-fp8-cuda"
    finally:
        sage_qual.uninstall()


def test_claims_read_as_the_wrapper_words_them():
    q, k, v = qkv(head_dim=96, dtype=torch.float32)
    target = targets.resolve("wrapper:sm90-fp8-cuda")
    assert target.not_supported_reasons(q, k, v) == ["head_dim=96 (supported: 64, 128)",
                                                     "dtype=float32 (supported: float16, bfloat16)"]
    q, k, v = qkv(head_dim=192)
    reasons = targets.resolve("sageattn").not_supported_reasons(q, k, v)
    assert reasons == ["head_dim=192 (supported: up to 128)"]


def test_machine_reasons_name_the_gpu_and_the_missing_package():
    from sage_qual.kernels.variants import BoxFacts

    ampere = BoxFacts((8, 0), (12, 8), frozenset({"_qattn_sm80"}), True)
    reasons = targets.resolve("wrapper:sm90-fp8-cuda").machine_reasons(ampere)
    assert any("capability=(8, 0) (needs >= (9, 0))" in r for r in reasons), reasons
    assert targets.resolve("sageattn").machine_reasons(None) == [
        "no CUDA GPU visible: SageAttention integrations run on NVIDIA GPUs only"]
    turing = BoxFacts((7, 5), None, frozenset(), True)
    reasons = targets.resolve("sageattn").machine_reasons(turing)
    assert reasons[0].startswith("capability=sm_75 (supported: sm_80")


def test_sageattn_target_calls_upstream_with_its_defaults_and_counts_served_calls(h200):
    q, k, v = qkv()
    target = targets.resolve("sageattn")
    assert target.accuracy_class((9, 0)) == "fp8" and target.accuracy_class((8, 6)) == "fp16"
    with target.session() as session:
        out, served = session.call(q, k, v)
    assert served and session.evidence.functions["sageattn"] == 1
    assert h200.calls[0].keywords["smooth_k"] is True  # what most apps get: smoothing on
    assert h200.calls[0].keywords["tensor_layout"] == "HND"
    module = sys.modules["sageattention"]
    assert module.sageattn.__name__ == "sageattn" and not hasattr(module.sageattn, "__wrapped__")


class _LoadsOnImport:
    """A finder that hands out `module` when `sageattention` is imported (not imported yet)."""

    def __init__(self, module):
        self.module = module

    def find_spec(self, name, path=None, target=None):
        if name == "sageattention":
            return importlib.machinery.ModuleSpec(name, self)

    def create_module(self, spec):
        return self.module

    def exec_module(self, module):
        pass


def test_the_first_call_of_a_fresh_process_is_counted(h200, monkeypatch):
    """A process whose first sageattention import happens inside the first call (certify's first
    cell, run 8: 'no SageAttention function was called' on cross_attention_partial_tiles) must
    count that call: the counting imports the package before it patches it."""
    module = sys.modules.pop("sageattention")
    monkeypatch.setattr(sys, "meta_path", [_LoadsOnImport(module), *sys.meta_path])
    q, k, v = qkv()
    with targets.resolve("sageattn").session() as session:
        out, served = session.call(q, k, v)
    assert served and session.evidence.functions["sageattn"] == 1


def test_a_function_target_that_never_calls_sageattention_is_not_served(h200, monkeypatch):
    app = types.ModuleType("fake_app_attention")
    app.plain = lambda q, k, v, **kw: TORCH_SDPA(q, k, v, **kw)
    from sageattention import sageattn

    app.sageattn = sageattn  # bound by `from sageattention import sageattn`, as apps do

    def sage(q, k, v, **kw):
        return app.sageattn(q, k, v, tensor_layout="HND", sm_scale=kw.get("scale"))

    app.sage = sage
    monkeypatch.setitem(sys.modules, "fake_app_attention", app)
    q, k, v = qkv()
    with targets.resolve("fake_app_attention:plain").session() as session:
        _, served = session.call(q, k, v)
    assert not served and "no SageAttention function was called" in session.evidence.not_served_detail()
    with targets.resolve("fake_app_attention:sage").session() as session:
        _, served = session.call(q, k, v)
    assert served and session.evidence.functions["sageattn"] == 1
    assert app.sageattn is sageattn  # restored


@pytest.mark.parametrize("name, message", [
    ("nonsense", "unknown target 'nonsense'"),
    ("wrapper:sm99", "unknown variant 'sm99'"),
    ("no_such_module_xyz:f", "cannot import no_such_module_xyz"),
    ("os:no_such_function", "os has no attribute 'no_such_function'"),
    ("os:sep", "is a str, not a function"),
    ("os:", "is not module:function"),
])
def test_bad_target_names_get_one_line_with_the_fix(name, message):
    with pytest.raises(targets.TargetError, match=message) as error:
        targets.resolve(name)
    assert "\n" not in str(error.value)


def test_a_module_attribute_that_is_a_target_is_taken_as_it_is(monkeypatch):
    app = types.ModuleType("fake_app_target")
    app.TARGET = targets.resolve("wrapper:sm90-fp8-cuda")
    monkeypatch.setitem(sys.modules, "fake_app_target", app)
    assert targets.resolve("fake_app_target:TARGET") is app.TARGET
