"""What each built-in target hands its integration and claims for it: diffusers' backends (the
variant each runs, its claims, its requirements, every SDPA argument forwarded in diffusers' layout),
upstream sageattn() (its arguments), an app's function (nested attributes, the words of each
refusal), the evidence's wording, and the GPU a target is judged on."""

import sys
import types

import pytest
import torch

from sage_qual.kernels.variants import VARIANTS, BoxFacts
from sage_qual.qualification.integrations import targets
from sage_qual.testing import FakeCuda, FakeGpu, FakeSageAttention

BACKENDS = [
    "sage",
    "sage_varlen",
    "_sage_qk_int8_pv_fp8_cuda",
    "_sage_qk_int8_pv_fp8_cuda_sm90",
    "_sage_qk_int8_pv_fp16_cuda",
    "_sage_qk_int8_pv_fp16_triton",
]


def qkv(heads=2, tokens=16, head_dim=64, dtype=torch.float16):
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, heads, tokens, head_dim, generator=g).to(dtype) for _ in range(3))


def test_the_builtin_names_are_the_wrapper_each_forced_variant_sageattn_and_diffusers_backends():
    assert targets.builtin_names() == [
        "wrapper",
        *(f"wrapper:{v}" for v in VARIANTS),
        "sageattn",
        *(f"diffusers:{b}" for b in BACKENDS),
    ]


# diffusers -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "backend, on_h200",
    [
        ("sage", "sm90-fp8-cuda"),
        ("sage_varlen", "sm86-fp16-triton"),
        ("_sage_qk_int8_pv_fp8_cuda", "sm89-fp8-cuda"),
        ("_sage_qk_int8_pv_fp8_cuda_sm90", "sm90-fp8-cuda"),
        ("_sage_qk_int8_pv_fp16_cuda", "sm80-fp16-cuda"),
        ("_sage_qk_int8_pv_fp16_triton", "sm86-fp16-triton"),
    ],
)
def test_each_diffusers_backend_is_judged_as_the_kernel_it_runs(backend, on_h200):
    target = targets.resolve(f"diffusers:{backend}")
    assert target.name == f"diffusers:{backend}"
    assert target.description == f"diffusers backend {backend!r} through dispatch_attention_fn"
    assert target.variant((9, 0)).name == on_h200
    assert target.accuracy_class((9, 0)) == VARIANTS[on_h200].accuracy_class


def test_the_sage_backend_follows_upstreams_pick_per_gpu_and_has_none_where_upstream_has_none():
    target = targets.resolve("diffusers:sage")
    assert (
        target.variant((8, 0)).name == "sm80-fp16-cuda"
        and target.variant((12, 0)).name == "sm120-fp8-perwarp"
    )
    assert target.variant((7, 5)) is None and target.accuracy_class((7, 5)) is None


def test_diffusers_backends_claim_head_sizes_up_to_128_in_fp16_types():
    target = targets.resolve("diffusers:_sage_qk_int8_pv_fp16_cuda")
    assert target.not_supported_reasons(*qkv(head_dim=128)) == []
    assert target.not_supported_reasons(*qkv(head_dim=80)) == []  # upstream pads it
    assert target.not_supported_reasons(*qkv(head_dim=192)) == ["head_dim=192 (supported: up to 128)"]
    assert target.not_supported_reasons(*qkv(dtype=torch.float32)) == [
        "dtype=float32 (supported: float16, bfloat16)"
    ]


def test_only_the_dispatching_backend_is_limited_to_upstreams_gpus():
    sage = targets.resolve("diffusers:sage").claims
    assert sage.machine_reasons((7, 5)) == [
        "capability=sm_75 (supported: sm_80, sm_86, sm_89, sm_90, sm_120, sm_121)"
    ]
    assert sage.machine_reasons((8, 9)) == []
    fp16 = targets.resolve("diffusers:_sage_qk_int8_pv_fp16_cuda").claims
    assert fp16.machine_reasons((8, 0)) == []  # exactly its registered minimum
    assert fp16.machine_reasons((8, 7)) == [] and fp16.machine_reasons((10, 0)) == []
    assert fp16.machine_reasons((7, 5)) == ["capability=sm_75 (needs >= sm_80)"]
    assert targets.resolve("diffusers:sage_varlen").claims.machine_reasons((7, 5)) == []


@pytest.fixture
def dispatch():
    from diffusers.models import attention_dispatch

    return attention_dispatch


def test_a_diffusers_backend_requires_a_sageattention_diffusers_can_use(dispatch, monkeypatch):
    box = BoxFacts((9, 0), (12, 8), frozenset({"_qattn_sm90"}), True)
    target = targets.resolve("diffusers:_sage_qk_int8_pv_fp8_cuda_sm90")
    with FakeCuda([FakeGpu((9, 0))]), FakeSageAttention().installed():
        monkeypatch.setattr(dispatch, "_CAN_USE_SAGE_ATTN", False)
        assert target.machine_reasons(box) == [
            f"diffusers finds no usable sageattention >= {dispatch._REQUIRED_SAGE_VERSION}"
        ]
        monkeypatch.setattr(dispatch, "_CAN_USE_SAGE_ATTN", True)
        assert target.machine_reasons(box) == []
    with FakeCuda([FakeGpu((9, 0))]), FakeSageAttention(version="1.0.6").installed():
        monkeypatch.setattr(dispatch, "_CAN_USE_SAGE_ATTN", False)
        reasons = target.machine_reasons(box)
        assert len(reasons) == 1 and "SageAttention 1" in reasons[0]  # the package's own problem, once
    with FakeCuda([FakeGpu((9, 0))]), FakeSageAttention().installed():
        monkeypatch.delattr(dispatch, "_CAN_USE_SAGE_ATTN")
        assert target.machine_reasons(box) == []  # a diffusers without the flag is taken at its word


def test_a_diffusers_backend_gets_every_sdpa_argument_in_diffusers_layout(dispatch, monkeypatch):
    seen = []

    def dispatch_attention_fn(q, k, v, **kwargs):
        seen.append((q.shape, kwargs))
        return q * 2

    monkeypatch.setattr(dispatch, "dispatch_attention_fn", dispatch_attention_fn)
    target = targets.resolve("diffusers:_sage_qk_int8_pv_fp16_cuda")
    q, k, v = qkv(heads=2, tokens=16)
    out = target.attention(q, k, v)
    assert seen[-1] == (
        torch.Size([1, 16, 2, 64]),
        {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False},
    )
    assert torch.equal(out, q * 2)  # back in [B, H, N, D]
    mask = torch.ones(16, 16, dtype=torch.bool)
    target.attention(q, k, v, attn_mask=mask, dropout_p=0.1, is_causal=True, scale=0.5, enable_gqa=True)
    kwargs = seen[-1][1]
    assert kwargs["attn_mask"] is mask
    assert (kwargs["dropout_p"], kwargs["is_causal"], kwargs["scale"], kwargs["enable_gqa"]) == (
        0.1,
        True,
        0.5,
        True,
    )


def test_an_unknown_or_hub_backend_names_the_ones_to_use():
    with pytest.raises(targets.TargetError) as error:
        targets.resolve("diffusers:flash")
    assert str(error.value) == (
        "diffusers has no SageAttention backend 'flash' (its SageAttention backends: sage, sage_hub, "
        "sage_blackwell_hub, sage_varlen, _sage_qk_int8_pv_fp8_cuda, _sage_qk_int8_pv_fp8_cuda_sm90, "
        "_sage_qk_int8_pv_fp16_cuda, _sage_qk_int8_pv_fp16_triton)"
    )
    with pytest.raises(targets.TargetError) as error:
        targets.resolve("diffusers:sage_hub")
    assert str(error.value) == (
        "diffusers backend 'sage_hub' downloads its kernel from the Hugging Face Hub when enabled, which an "
        f"offline qualification cannot do; name a local backend ({', '.join(BACKENDS)})"
    )


def test_diffusers_targets_without_diffusers_say_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "diffusers.models.attention_dispatch", None)
    with pytest.raises(
        targets.TargetError,
        match=r"^diffusers targets need diffusers \(.*\): pip install diffusers==0\.42\.1, or pip "
        r"install -e '\.\[diffusers\]' in a sage-qual checkout$",
    ):
        targets.resolve("diffusers:sage")


# Upstream sageattn() -----------------------------------------------------------------------------


def test_sageattn_gets_hnd_the_causal_flag_and_the_scale(monkeypatch):
    seen = []
    module = types.ModuleType("sageattention")
    module.sageattn = lambda q, k, v, **kwargs: seen.append(kwargs) or q
    monkeypatch.setitem(sys.modules, "sageattention", module)
    target = targets.resolve("sageattn")
    assert (target.name, target.description) == (
        "sageattn",
        "upstream sageattention.sageattn(), HND, its default K smoothing on",
    )
    q, k, v = qkv()
    target.attention(q, k, v)
    assert seen[-1] == {"tensor_layout": "HND", "is_causal": False, "sm_scale": None}
    target.attention(q, k, v, is_causal=True, scale=0.25)
    assert seen[-1] == {"tensor_layout": "HND", "is_causal": True, "sm_scale": 0.25}


def test_sageattn_counts_calls_into_a_module_without_an_import_spec(monkeypatch):
    # A sageattention already imported is taken from sys.modules, whatever its spec says.
    module = types.ModuleType("sageattention")
    module.sageattn = lambda q, k, v, **kwargs: q
    monkeypatch.setitem(sys.modules, "sageattention", module)
    with targets.resolve("sageattn").session() as session:
        _, served = session.call(*qkv())
    assert served and session.evidence.functions == {"sageattn": 1}


def test_sageattn_without_a_usable_package_says_why():
    box = BoxFacts((9, 0), (12, 8), frozenset(), True)
    with FakeCuda([FakeGpu((9, 0))]), FakeSageAttention(version="1.0.6").installed():
        reasons = targets.resolve("sageattn").machine_reasons(box)
    assert len(reasons) == 1 and "SageAttention 1" in reasons[0]
    with FakeCuda([FakeGpu((9, 0))]), FakeSageAttention().installed():
        assert targets.resolve("sageattn").machine_reasons(box) == []


# An app's function ---------------------------------------------------------------------------------


@pytest.fixture
def app(monkeypatch):
    module = types.ModuleType("fake_app_nested")

    class Attention:
        @staticmethod
        def forward(q, k, v, **kwargs):
            return q

    module.Attention = Attention
    monkeypatch.setitem(sys.modules, "fake_app_nested", module)
    return module


def test_a_function_target_follows_a_dotted_attribute(app):
    target = targets.resolve("fake_app_nested:Attention.forward")
    assert target.attention is app.Attention.forward
    assert target.name == "fake_app_nested:Attention.forward"


def test_a_function_targets_refusals_say_what_to_do(app):
    with pytest.raises(targets.TargetError) as error:
        targets.resolve("fake_app_nested:Attention:forward")
    assert str(error.value) == (
        "target 'fake_app_nested:Attention:forward': fake_app_nested has no attribute 'Attention:forward'"
    )
    with pytest.raises(targets.TargetError) as error:
        targets.resolve("no_such_app_module_xyz:f")
    assert str(error.value).endswith("; make it importable (install the app or set PYTHONPATH)")
    app.NUMBER = 3
    with pytest.raises(targets.TargetError) as error:
        targets.resolve("fake_app_nested:NUMBER")
    assert str(error.value) == (
        "target 'fake_app_nested:NUMBER' is a int, not a function (q, k, v, **sdpa_kwargs) -> out"
    )


# Evidence and claims ----------------------------------------------------------------------------------


def test_the_not_served_detail_lists_each_reason_with_its_first_detail():
    evidence = targets.Evidence(fallbacks={"install": "no GPU", "short": ""})
    assert evidence.not_served_detail() == "install: no GPU; short"


def test_without_any_reason_the_detail_names_every_function_counted():
    assert targets.Evidence().not_served_detail() == (
        "no SageAttention function was called (counted: sageattention.sageattn, sageattn_varlen, "
        "sageattn_qk_int8_pv_fp16_triton, sageattn_qk_int8_pv_fp16_cuda, sageattn_qk_int8_pv_fp8_cuda, "
        "sageattn_qk_int8_pv_fp8_cuda_sm90)"
    )


def test_claims_on_named_gpus_list_them_all():
    claims = targets.Claims(capabilities=((8, 0), (9, 0)))
    assert claims.machine_reasons((8, 9)) == ["capability=sm_89 (supported: sm_80, sm_90)"]
    assert claims.machine_reasons([9, 0]) == []


# The GPU a target is judged on ---------------------------------------------------------------------------


def test_box_facts_are_the_first_gpus():
    with FakeCuda([FakeGpu((8, 9)), FakeGpu((9, 0))], torch_cuda=(12, 8)), FakeSageAttention().installed():
        box = targets.box_facts()
    assert box.capability == (8, 9) and box.torch_cuda == (12, 8)


def test_box_facts_without_a_gpu_are_none():
    with FakeCuda([]), FakeSageAttention().installed():
        assert targets.box_facts() is None


# Our wrapper as a target ---------------------------------------------------------------------------


@pytest.fixture
def h200():
    with FakeCuda([FakeGpu((9, 0))]), FakeSageAttention().installed() as fake:
        yield fake


def test_the_wrapper_target_describes_itself_and_claims_the_tables_gpus():
    target = targets.resolve("wrapper")
    assert (target.name, target.description) == (
        "wrapper",
        "sage_qual.install() as installed: default kernel table and thresholds",
    )
    assert target.claims.machine_reasons((7, 5)) == [
        "capability=sm_75 (supported: sm_80, sm_86, sm_89, sm_90, sm_120, sm_121)"
    ]
    assert target.variant((7, 5)) is None and target.variant((9, 0)).name == "sm90-fp8-cuda"
    forced = targets.resolve("wrapper:sm80-fp16-cuda")
    assert (forced.name, forced.description) == (
        "wrapper:sm80-fp16-cuda",
        "sage_qual.install() with sm80-fp16-cuda forced, no thresholds",
    )
    assert forced.variant((9, 0)).name == "sm80-fp16-cuda" and forced.variant((7, 5)) is None


def test_the_wrapper_target_on_a_gpu_it_serves_has_no_machine_reason():
    box = BoxFacts((9, 0), (13, 0), frozenset({"_qattn_sm90", "_fused"}), True)
    assert targets.resolve("wrapper").machine_reasons(box) == []
    old_cuda = BoxFacts((9, 0), (12, 0), frozenset(), True)
    reasons = targets.resolve("wrapper").machine_reasons(old_cuda)
    assert len(reasons) == 1 and reasons[0].startswith("sm90-fp8-cuda: ")


def test_the_wrapper_targets_rules_add_to_its_claims_without_repeating_them(h200):
    target = targets.resolve("wrapper:sm90-fp8-cuda")
    q, k, v = qkv(tokens=16)
    assert target.not_supported_reasons(q, k, v) == []
    assert target.not_supported_reasons(q, k, v, is_causal=True) == [
        "is_causal given (supported: plain attention)",
        "causal: is_causal=True",
    ]
    assert target.not_supported_reasons(*qkv(head_dim=96)) == ["head_dim=96 (supported: 64, 128)"]
    assert targets.resolve("wrapper").not_supported_reasons(q, k, v) == [
        "short: tokens=16/16 (needs >= 1536/512)"
    ]


def test_an_unknown_forced_variant_lists_the_known_ones():
    with pytest.raises(targets.TargetError) as error:
        targets.resolve("wrapper:sm99")
    assert str(error.value) == (
        f"unknown variant 'sm99' for target wrapper:VARIANT (known: {', '.join(VARIANTS)})"
    )


def test_only_the_first_colon_splits_a_builtin_target_name():
    with pytest.raises(targets.TargetError, match="unknown variant 'sm90-fp8-cuda:x'"):
        targets.resolve("wrapper:sm90-fp8-cuda:x")
    with pytest.raises(targets.TargetError, match="no SageAttention backend 'sage:x'"):
        targets.resolve("diffusers:sage:x")
    assert targets.resolve("  sageattn ").name == "sageattn"


def test_the_wrapper_target_calls_torchs_name_as_bound_at_call_time(monkeypatch):
    seen = []
    monkeypatch.setattr(
        torch.nn.functional,
        "scaled_dot_product_attention",
        lambda q, k, v, **kwargs: seen.append(kwargs) or q,
    )
    q, k, v = qkv()
    targets.resolve("wrapper").attention(q, k, v, scale=0.5, is_causal=True)
    assert seen == [{"scale": 0.5, "is_causal": True}]


# Claims and sessions ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, says",
    [
        ({"attn_mask": torch.ones(16, 16, dtype=torch.bool)}, "attn_mask given (supported: plain attention)"),
        ({"is_causal": True}, "is_causal given (supported: plain attention)"),
        ({"dropout_p": 0.1}, "dropout_p given (supported: plain attention)"),
        (
            {"attn_mask": torch.ones(16, 16, dtype=torch.bool), "dropout_p": 0.1},
            "attn_mask, dropout_p given (supported: plain attention)",
        ),
    ],
)
def test_claims_of_plain_attention_name_each_extra_argument(kwargs, says):
    assert targets.Claims().call_reasons(*qkv(), **kwargs) == [says]
    assert targets.Claims(masks=True).call_reasons(*qkv(), **kwargs) == []
    assert targets.Claims().call_reasons(*qkv(), is_causal=False, dropout_p=0.0, attn_mask=None) == []


def test_an_apps_function_claims_nothing_and_needs_sageattention(app):
    target = targets.resolve("fake_app_nested:Attention.forward")
    assert target.description == "fake_app_nested:Attention.forward (an application's attention function)"
    q, k, v = qkv(head_dim=256, dtype=torch.float32)
    assert (
        target.not_supported_reasons(q, k, v, is_causal=True, attn_mask=torch.ones(16, 16, dtype=torch.bool))
        == []
    )
    assert target.variant((9, 0)).name == "sm90-fp8-cuda" and target.variant((7, 5)) is None
    box = BoxFacts((9, 0), (13, 0), frozenset(), True)
    with FakeCuda([FakeGpu((9, 0))]), FakeSageAttention(version="1.0.6").installed():
        reasons = target.machine_reasons(box)
    assert len(reasons) == 1 and "SageAttention 1" in reasons[0]


def test_a_session_counts_every_call_and_the_served_ones(monkeypatch):
    module = types.ModuleType("sageattention")
    module.sageattn = lambda q, k, v, **kwargs: q
    monkeypatch.setitem(sys.modules, "sageattention", module)
    seen = []

    def attention(q, k, v, **kwargs):
        seen.append(kwargs)
        return module.sageattn(q, k, v) if kwargs.get("serve") else q

    target = targets.Target("t", "test", attention, lambda: targets.counting_sage_calls(targets.Evidence()))
    q, k, v = qkv()
    with target.session() as session:
        assert session.call(q, k, v, serve=True) == (q, True)
        assert session.call(q, k, v) == (q, False)
        assert session.call(q, k, v, serve=True)[1] is True
    assert (session.evidence.calls, session.evidence.served) == (3, 2)
    assert seen[0] == {"serve": True}
    assert module.sageattn(q, k, v) is q  # the counting wrapper is gone


def test_a_targets_reasons_are_its_claims_then_its_rules():
    claims = targets.Claims(head_dims=(64,), masks=False)
    rules = []
    target = targets.Target(
        "t",
        "test",
        lambda q, k, v, **kw: q,
        None,
        claims,
        call_rules=lambda q, k, v, **kw: rules.append(kw) or ["rule: says no"],
    )
    q, k, v = qkv(head_dim=128)
    assert target.not_supported_reasons(q, k, v, is_causal=True) == [
        "head_dim=128 (supported: 64)",
        "is_causal given (supported: plain attention)",
        "rule: says no",
    ]
    assert rules == [{"is_causal": True}]
    assert target.accuracy_class((9, 0)) is None  # no kernel named for it


def test_the_wrappers_own_scope_details_come_first_in_the_not_served_detail():
    from sage_qual.serving.scope import ScopeReport

    scope = ScopeReport()
    scope.fell_back("short", "tokens=%d", (16,))
    evidence = targets.Evidence(scope=scope, fallbacks={"install": "no GPU"})
    assert evidence.not_served_detail() == "short: tokens=16; install: no GPU"


def test_an_unknown_target_lists_every_builtin_name_and_the_app_form():
    with pytest.raises(targets.TargetError) as error:
        targets.resolve("nonsense")
    assert str(error.value) == (
        f"unknown target 'nonsense': give one of {', '.join(targets.builtin_names())} or "
        "an app's module:function"
    )
