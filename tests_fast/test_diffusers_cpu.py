"""Real model code: diffusers' FLUX, Qwen-Image and Wan transformers (tiny configs from the library's
own config classes, random weights) with the wrapper installed on the fake CUDA and fake kernel.

Which calls were served, why the others fell back, outputs identical to torch outside a scope, and
the recorder writing fixtures from the same models. The models are untrained: the calls' shapes,
layouts and arguments are diffusers' own, their statistics are not a real model's.
"""

import pytest
import torch

import sage_qual
from sage_qual.fixtures import fileformat
from sage_qual.fixtures.recorder import record_sdpa
from sage_qual.qualification.integrations import targets
from sage_qual.testing import FakeCuda, FakeGpu, FakeSageAttention, exact_attention

# diffusers (in the test extra) is imported by this module, at collection: before any fake triton.
from .diffusers_models import UNTRAINED, _random, flux, qwen_image, run, wan

TEXT_TOKENS = 16
# Head size 64, the smaller one the kernels take; thresholds low enough for the tiny token counts
# (FLUX: 64 image + 16 text tokens; Wan: 128 video tokens, 16 text keys).
SMALL = sage_qual.WrapperConfig(min_query_tokens=64, min_key_tokens=16, check_rows=16)


@pytest.fixture
def fake_h200():
    fake = FakeSageAttention()
    with FakeCuda([FakeGpu((9, 0), "Fake H200")]), fake.installed():
        yield fake


# model, calls per forward pass, served of them, fallback reasons of the rest
CASES = {
    "flux": (flux, 2, 2, {}),  # one joint block, one single block: 80 tokens each
    "wan": (wan, 2, 2, {}),  # self-attention (128 tokens) and text cross-attention (16 keys)
    # Qwen-Image with a padded text mask (prompts of different lengths in one batch): diffusers passes
    # the joint mask on to SDPA, so the wrapper leaves every call to torch; unmasked (one prompt: the
    # pipeline drops an all-ones mask) both joint blocks are served.
    "qwen-image masked": (lambda: qwen_image(mask=True), 2, 0, {"mask": 2}),
    "qwen-image unmasked": (lambda: qwen_image(mask=False), 2, 2, {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_served_calls_and_fallbacks_in_a_real_transformer(fake_h200, case):
    build, calls, served, fallbacks = CASES[case]
    model, inputs = build()
    expected = run(model, inputs)
    assert sage_qual.install(config=SMALL).enabled
    assert torch.equal(run(model, inputs), expected)  # outside a scope: torch's own result, bit for bit
    assert fake_h200.calls == []
    with sage_qual.sage_attention_scope() as report:
        out = run(model, inputs)
    counts = (report.calls, report.served, dict(report.fallbacks))
    assert counts == (calls, served, fallbacks), report.summary()
    assert len(fake_h200.calls) == served
    assert all(c.function == "sageattn_qk_int8_pv_fp8_cuda_sm90" and c.keywords["smooth_k"] is False
               and c.keywords["tensor_layout"] == "HND" for c in fake_h200.calls)
    # The fake kernel computes exact attention in float32: the served model stays within bf16 noise.
    error = (out.float() - expected.float()).norm() / expected.float().norm()
    assert error < 0.02, f"relative L2 {error:.3g} against torch"
    if served:
        assert not torch.equal(out, expected)  # the kernel's result, not torch's, reached the output


def test_default_thresholds_leave_tiny_calls_to_torch_and_say_so(fake_h200):
    model, inputs = flux()
    assert sage_qual.install().enabled
    with sage_qual.sage_attention_scope() as report:
        run(model, inputs)
    assert report.served == 0 and report.fallbacks == {"short": 2}
    # An sm_90 GPU never measured gets the built-in defaults' strictest sm_90 thresholds (the H200's).
    assert report.details["short"] == "tokens=80/80 (needs >= 16384/16384)"


def test_recorder_writes_fixtures_of_the_calls_of_one_block(tmp_path):
    model, inputs = flux()
    with record_sdpa(tmp_path, family="flux.1", model="FluxTransformer2DModel tiny random (diffusers 0.42.1)",
                     select=model.transformer_blocks[0], heads=[1], note=UNTRAINED) as recording:
        run(model, inputs)
    assert recording.calls == 2 and len(recording.paths) == 1 and recording.skipped == []
    fixture = fileformat.load_fixture(recording.paths[0])
    assert fixture.kind == "recorded" and fixture.family == "flux.1"
    assert "untrained model with random weights" in fixture.provenance
    assert list(fixture.q.shape) == [1, 1, 64 + TEXT_TOKENS, 64]  # head 1 of the joint call, all tokens
    assert fixture.source["full_call"]["q"] == [1, 2, 64 + TEXT_TOKENS, 64]
    assert fixture.source["module"] == "FluxTransformerBlock"


def test_recorder_skips_masked_calls_with_the_reason(tmp_path):
    model, inputs = qwen_image(mask=True)
    with record_sdpa(tmp_path, family="qwen-image", model="QwenImage tiny random", select=0,
                     note=UNTRAINED) as recording:
        run(model, inputs)
    assert recording.paths == []
    assert recording.skipped == [(0, "masked, causal or with dropout (fixtures hold plain attention)")]


# diffusers' own SageAttention backends ---------------------------------------------------------
@pytest.fixture
def diffusers_on_fake(fake_h200, monkeypatch):
    """diffusers' attention_dispatch holding the fake kernels, as its import binds the real ones
    (`from sageattention import ...` when a usable sageattention is installed)."""
    import sys

    from diffusers.models import attention_dispatch

    module = sys.modules["sageattention"]
    monkeypatch.setattr(attention_dispatch, "_CAN_USE_SAGE_ATTN", True)
    for name in targets.SAGE_FUNCTIONS:
        if hasattr(module, name):
            monkeypatch.setattr(attention_dispatch, name, getattr(module, name))
    return fake_h200


def test_every_local_sageattention_backend_of_diffusers_is_a_target():
    assert targets.diffusers_backends() == ["sage", "sage_varlen", "_sage_qk_int8_pv_fp8_cuda",
                                            "_sage_qk_int8_pv_fp8_cuda_sm90", "_sage_qk_int8_pv_fp16_cuda",
                                            "_sage_qk_int8_pv_fp16_triton"]
    with pytest.raises(targets.TargetError, match="downloads its kernel from the Hugging Face Hub"):
        targets.resolve("diffusers:sage_hub")
    with pytest.raises(targets.TargetError, match="no SageAttention backend 'flash'"):
        targets.resolve("diffusers:flash")


@pytest.mark.parametrize("backend, function", [
    ("_sage_qk_int8_pv_fp8_cuda_sm90", "sageattn_qk_int8_pv_fp8_cuda_sm90"),
    ("_sage_qk_int8_pv_fp16_cuda", "sageattn_qk_int8_pv_fp16_cuda"),
    ("sage", "sageattn_qk_int8_pv_fp8_cuda_sm90"),
])
def test_a_diffusers_backend_calls_its_kernel_in_nhd_with_smoothing_on(diffusers_on_fake, backend, function):
    q, k, v = (_random(1, 2, 96, 64) for _ in range(3))
    target = targets.resolve(f"diffusers:{backend}")
    with target.session() as session:
        out, served = session.call(q, k, v)
    assert served
    call = diffusers_on_fake.calls[0]
    assert call.function == function
    assert call.keywords["tensor_layout"] == "NHD" and call.keywords["smooth_k"] is True
    assert list(call.q.shape) == [1, 96, 2, 64]  # diffusers' [B, N, H, D]
    assert torch.equal(out, exact_attention(q, k, v, 64 ** -0.5))


def test_a_real_transformer_on_a_diffusers_backend_reaches_the_kernel_in_every_block(diffusers_on_fake):
    model, inputs = flux()
    expected = run(model, inputs)
    target = targets.resolve("diffusers:_sage_qk_int8_pv_fp8_cuda_sm90")
    with target.session() as session:
        out = run(model, inputs)  # FLUX's processors call dispatch_attention_fn with the active backend
    assert session.evidence.functions == {"sageattn_qk_int8_pv_fp8_cuda_sm90": 2}
    assert len(diffusers_on_fake.calls) == 2
    error = (out.float() - expected.float()).norm() / expected.float().norm()
    assert 0 < error < 0.02


def test_a_diffusers_backend_claims_what_its_registered_constraint_checks():
    from sage_qual.serving.variants import BoxFacts

    ada = BoxFacts((8, 9), (12, 8), frozenset({"_qattn_sm89"}), True)
    # diffusers registers the fp8 CUDA backend for sm_90 and newer, though its kernel runs on sm_89.
    target = targets.resolve("diffusers:_sage_qk_int8_pv_fp8_cuda")
    assert target.claims.machine_reasons(ada.capability) == ["capability=sm_89 (needs >= sm_90)"]
    assert target.variant((8, 9)).name == "sm89-fp8-cuda"
    assert targets.resolve("diffusers:_sage_qk_int8_pv_fp16_triton").claims.machine_reasons((8, 9)) == []
