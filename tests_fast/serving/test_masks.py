"""Masked calls (issue 42): served only by a variant that takes a mask (comfy-kitchen's), where the
profile certified it on masked calls (`Served.masks`), with the mask as SDPA takes it; every other
masked call stays on torch with the reason `mask`, and a mask the kernel would refuse never reaches it."""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import sage_qual
from sage_qual.kernels.numerics import exact_attention
from sage_qual.kernels.variants import mask_broadcasts
from sage_qual.serving.profile_matching import served_config
from sage_qual.testing import FakeCuda, FakeGpu, FakeSageAttention, on_device
from sage_qual.verdicts import profile as profile_mod
from sage_qual.verdicts.profile import ProfileError
from sage_qual.verdicts.served import Served

from .. import builders
from ..helpers import TORCH_SDPA

CK, SM90 = "ck-int8-cuda", "sm90-fp8-cuda"
TOKENS = 96


@contextlib.contextmanager
def served(variant=CK, masks=True, gpus=1):
    """install() on fake H200s with a profile whose SDXL entry serves `variant` (masks as given)."""
    entry = builders.make_entry(variant, 64, 64, head_dims=(64,), masks=masks)
    profile = builders.make_profile(gpu=FakeGpu((9, 0), "GPU0"), entry=builders.make_entry(SM90, 64, 64),
                                    families={"SDXL": entry})
    fake = FakeSageAttention(comfy_kitchen="0.2.40")
    with FakeCuda([FakeGpu((9, 0), "GPU0")] * gpus), fake.installed():
        status = sage_qual.install(profile=profile, family="SDXL")
        try:
            assert status.enabled, status.reason
            yield fake
        finally:
            sage_qual.uninstall()


def qkv(batch=2, heads=2):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(batch, heads, TOKENS, 64, generator=g).to(torch.float16) for _ in range(3)]


def key_padding(batch=2, kept=(TOKENS, 40)) -> torch.Tensor:
    """[B, 1, 1, N_k] bool, True on each item's own keys: a batch of prompts of unequal length."""
    return torch.arange(TOKENS)[None, :] < torch.tensor(kept)[:, None]


def call(q, k, v, mask):
    """The call in a scope: its output (None where torch itself refused the mask) and the scope's report."""
    with sage_qual.sage_attention_scope() as report:
        try:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        except RuntimeError:  # a mask torch refuses too, after the wrapper passed the call to it
            out = None
    return out, report


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_a_certified_masked_call_is_served_with_its_mask(kind):
    q, k, v = qkv()
    mask = key_padding()[:, None, None, :]
    if kind == "additive":
        mask = torch.zeros(mask.shape, dtype=torch.float16).masked_fill(~mask, float("-inf"))
    with served() as fake:
        out, report = call(q, k, v, mask)
    assert report.served == 1, report.summary()
    [kernel_call] = [c for c in fake.calls if c.q.shape == q.shape]
    assert kernel_call.function == "int8_attention" and kernel_call.keywords["attn_mask"] is mask
    expected = TORCH_SDPA(q.float(), k.float(), v.float(), attn_mask=mask if kind == "bool" else mask.float())
    torch.testing.assert_close(out.float(), expected, atol=2e-3, rtol=2e-3)
    unmasked = TORCH_SDPA(q.float(), k.float(), v.float())
    assert not torch.allclose(out.float()[1], unmasked[1], atol=1e-2)  # the mask changed item 1


def test_masked_calls_not_certified_stay_on_torch():
    q, k, v = qkv()
    with served(masks=False) as fake:
        out, report = call(q, k, v, key_padding()[:, None, None, :])
    assert report.served == 0 and "mask" in report.fallbacks
    assert not [c for c in fake.calls if c.q.shape == q.shape]


def test_a_profile_cannot_serve_masks_with_a_variant_that_takes_none():
    data = builders.make_profile(families={"SDXL": builders.make_entry(SM90, 64, 64)})
    [gpu] = data["gpus"]
    gpu["families"]["SDXL"] = builders.edited(gpu["families"]["SDXL"], masks=True)
    with pytest.raises(ProfileError, match="masks.*sm90-fp8-cuda takes no attn_mask"):
        profile_mod.load(data, "a test profile", "")


def test_a_config_that_allows_masks_still_keeps_them_from_a_kernel_without_one():
    """WrapperConfig(masks=True) over the default table: the sm90 kernel takes no mask, so the call
    stays on torch, named, and the kernel never sees it."""
    q, k, v = qkv()
    config = sage_qual.WrapperConfig(min_query_tokens=16, min_key_tokens=16, masks=True)
    fake = FakeSageAttention()
    with FakeCuda([FakeGpu((9, 0), "GPU0")]), fake.installed():
        assert sage_qual.install(config=config).enabled
        try:
            _, report = call(q, k, v, key_padding()[:, None, None, :])
        finally:
            sage_qual.uninstall()
    assert report.served == 0 and "sm90-fp8-cuda takes none" in report.details["mask"]
    assert not [c for c in fake.calls if c.q.shape == q.shape]


@pytest.mark.parametrize("mask, reason, words", [
    (torch.ones(2, 1, 1, TOKENS, dtype=torch.int64), "mask", "dtype"),
    (torch.ones(2, 1, 1, TOKENS + 1, dtype=torch.bool), "mask", "must broadcast"),
    (torch.ones(3, 1, 1, TOKENS, dtype=torch.bool), "mask", "must broadcast"),
    (torch.ones(1, 2, 1, 1, TOKENS, dtype=torch.bool), "mask", "must broadcast"),
    (torch.zeros(2, 1, 1, TOKENS, requires_grad=True), "grad", "attn_mask requires grad"),
], ids=["int64", "longer", "batch", "five_dims", "grad"])
def test_a_mask_the_kernel_would_refuse_stays_on_torch_named(mask, reason, words):
    q, k, v = qkv()
    with served() as fake:
        _, report = call(q, k, v, mask)
    assert report.served == 0 and words in report.details[reason], report.details
    assert not [c for c in fake.calls if c.q.shape == q.shape]


def test_each_mask_refusal_says_what_and_why_in_full():
    q, k, v = qkv()
    scores = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    cases = [(torch.ones(2, 1, 1, TOKENS, dtype=torch.int64), "mask",
              "attn_mask dtype torch.int64 (served: bool, float16, bfloat16, float32)"),
             (torch.ones(3, 1, 1, TOKENS, dtype=torch.bool), "mask",
              f"attn_mask shape (3, 1, 1, {TOKENS}) (must broadcast to {scores})"),
             (torch.zeros(2, 1, 1, TOKENS, requires_grad=True), "grad",
              "attn_mask requires grad (SageAttention has no backward)")]
    for mask, reason, detail in cases:
        with served():
            _, report = call(q, k, v, mask)
        assert report.details == {reason: detail}


def test_a_mask_on_another_gpu_stays_on_torch():
    q, k, v = (on_device(t, 1) for t in qkv())
    with served(gpus=2) as fake:
        _, report = call(q, k, v, on_device(key_padding()[:, None, None, :], 0))
    assert report.served == 0 and report.details == {"mask": "attn_mask on another device than the query"}
    assert not [c for c in fake.calls if c.q.shape == q.shape]


def test_the_first_call_check_of_a_masked_call_compares_with_the_mask():
    """The check recomputes a slice with torch: without the mask's slice its result differs from
    the kernel's on every masked item and the GPU would be retired."""
    q, k, v = qkv(batch=1)
    with served():
        _, first = call(q, k, v, key_padding(1, (40,))[:, None, None, :])
        _, second = call(q, k, v, key_padding(1, (40,))[:, None, None, :])
        [device] = sage_qual.install_status().devices
    assert first.served == second.served == 1 and not device.retired, device.retired


def test_served_says_it_serves_masked_calls():
    served_record = Served(CK, 1024, 1024, [128], 32768, 32768, ["contiguous"], ["side_stream"], masks=True)
    assert "masked calls too" in served_record.text() and "; masks" in served_record.short()
    assert served_config(served_record, sage_qual.WrapperConfig(), (7, 5)).masks
    unmasked = Served(CK, 1024, 1024, [128], 32768, 32768)
    assert not served_config(unmasked, sage_qual.WrapperConfig(), (7, 5)).masks


@settings(deadline=None)  # the first call imports torch's broadcasting
@given(scores=st.tuples(*[st.integers(1, 4)] * 4),
       mask_shape=st.lists(st.integers(0, 4), min_size=0, max_size=5).map(tuple))
def test_the_one_broadcast_rule_is_torchs(scores, mask_shape):
    """The wrapper, the fake kernel and the fixture files share mask_broadcasts: it holds exactly
    where torch broadcasts the mask to the scores and leaves their shape as it is."""
    try:
        torch_says = torch.broadcast_shapes(mask_shape, scores) == torch.Size(scores)
    except RuntimeError:
        torch_says = False
    assert mask_broadcasts(mask_shape, scores) is torch_says


@pytest.mark.parametrize("kind", ["bool", "additive"])
@pytest.mark.parametrize("shape", [(2, 1, TOKENS, TOKENS), (1, 2, TOKENS, TOKENS), (TOKENS, TOKENS)],
                         ids=["per-item", "per-head", "2-d"])
def test_a_query_row_the_mask_keeps_no_key_for_gets_what_torch_gives_it(kind, shape):
    """Issue 54: torch gives such a row zeros, the kernel (here comfy-kitchen's fake) NaN; the call is
    still served, and its output is torch's on that row and the kernel's elsewhere."""
    q, k, v = qkv()
    keep = torch.ones(shape, dtype=torch.bool)
    keep[..., 7, :] = False  # query row 7 keeps no key (in every item and head the mask covers)
    keep[..., 9, 50:] = False  # row 9 keeps some
    bias = torch.zeros(shape, dtype=torch.float16).masked_fill(~keep, float("-inf"))
    mask = keep if kind == "bool" else bias
    with served():
        out, report = call(q, k, v, mask)
    assert report.served == 1, report.summary()
    kernel_out = exact_attention(q.float(), k.float(), v.float(), 64 ** -0.5, attn_mask=mask)  # as the fake's
    expected = TORCH_SDPA(q.float(), k.float(), v.float(), attn_mask=mask if kind == "bool" else mask.float())
    assert kernel_out[..., 7, :].isnan().all(), "the fake no longer returns NaN on a keyless row"
    assert out.isfinite().all()
    torch.testing.assert_close(out.float(), expected, atol=2e-3, rtol=2e-3)
