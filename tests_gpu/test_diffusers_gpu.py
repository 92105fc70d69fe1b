"""Real model code on the GPU: diffusers' FLUX, Qwen-Image and Wan transformers (tiny configs of the
library's own config classes, random weights, head_dim 128, about a thousand tokens per call) with
the wrapper serving each runnable variant, and diffusers' own SageAttention backends.

Per attention block: the call served by SageAttention against the same block recomputed with
PyTorch SDPA on the same inputs (so one block's error does not feed the next), relative L2 within
the recorder's default bound for the variant's class (sage_qual.fixtures.recorder.DEFAULT_BOUNDS:
a few times each class's error on random data on the H200). Rows go to $SAGE_QUAL_RESULTS_DIR.
"""

import pytest
import torch

import sage_qual
from sage_qual.fixtures.recorder import DEFAULT_BOUNDS
from sage_qual.qualification.integrations import targets

pytest.importorskip("diffusers", reason="diffusers is not installed: pip install 'sage-qual[diffusers]'")
from tests_fast.diffusers_models import flux, qwen_image, run, wan  # noqa: E402

from .conftest import VARIANT_NAMES  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.gpu]

SIZE = dict(heads=4, head_dim=128)
MODELS = {
    # 1024 image + 256 text tokens in a joint block and a single-stream block
    "flux": (lambda: flux(image_tokens=1024, text_tokens=256, device="cuda", **SIZE), 2),
    # 32 x 32 image tokens + 256 text tokens, two joint blocks (no text mask: see the masked test)
    "qwen-image": (lambda: qwen_image(mask=False, side=32, text_tokens=256, device="cuda", **SIZE), 2),
    # 4 frames of 32 x 32 latents -> 1024 video tokens; self- and text cross-attention
    "wan": (lambda: wan(frames=4, side=32, text_tokens=256, device="cuda", **SIZE), 2),
}


def attention_modules(model) -> list[torch.nn.Module]:
    """Every attention module of the transformer (diffusers' Attention classes own a processor)."""
    return [m for m in model.modules() if hasattr(m, "processor") and hasattr(m, "to_q")]


def _flat(output) -> torch.Tensor:
    parts = output if isinstance(output, tuple) else (output,)
    return torch.cat([p.float().flatten() for p in parts if isinstance(p, torch.Tensor)])


def per_block_errors(model, inputs) -> tuple[list[float], sage_qual.ScopeReport]:
    """Run the model in a scope, keeping each attention module's inputs and output; then recompute
    each module on its own inputs outside the scope (PyTorch SDPA) and compare."""
    seen = []
    hooks = [m.register_forward_hook(lambda mod, args, kwargs, out: seen.append((mod, args, kwargs, out)),
                                     with_kwargs=True) for m in attention_modules(model)]
    try:
        with torch.no_grad(), sage_qual.sage_attention_scope() as report:
            model(**inputs)
    finally:
        for hook in hooks:
            hook.remove()
    errors = []
    with torch.no_grad():
        for module, args, kwargs, out in seen:
            ref = _flat(module(*args, **kwargs))
            errors.append(float((_flat(out) - ref).norm() / ref.norm()))
    return errors, report


@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("variant_name", VARIANT_NAMES)
def test_every_block_is_served_and_close_to_sdpa(model_name, variant_name, runnable, wrapper_serving, record):
    variant = runnable(variant_name)
    build, calls = MODELS[model_name]
    model, inputs = build()
    expected = run(model, inputs)
    with wrapper_serving(variant):
        assert torch.equal(run(model, inputs), expected)  # outside a scope: torch's own
        errors, report = per_block_errors(model, inputs)
    bound = DEFAULT_BOUNDS[variant.accuracy_class]["max_rel_l2"]
    record(test="diffusers-block", variant=variant.name, fixture=model_name, kind="untrained model",
           served=report.served, calls=report.calls, worst_block_rel_l2=max(errors), bound=bound)
    assert (report.calls, report.served) == (calls, calls), report.summary()
    assert len(errors) == calls and all(e <= bound for e in errors), errors


def test_qwen_image_padded_text_mask_leaves_every_call_to_torch(runnable, wrapper_serving, box):
    from sage_qual.serving.config import KERNEL_TABLE

    variant = runnable(KERNEL_TABLE[box.capability][0])
    model, inputs = qwen_image(mask=True, side=32, text_tokens=256, device="cuda", **SIZE)
    with wrapper_serving(variant), torch.no_grad(), sage_qual.sage_attention_scope() as report:
        model(**inputs)
    assert report.served == 0 and report.fallbacks == {"mask": 2}


@pytest.mark.parametrize("backend", targets.DIFFUSERS_KERNELS)
def test_a_diffusers_backend_serves_every_block(backend, box, record):
    target = targets.resolve(f"diffusers:{backend}")
    reasons = target.machine_reasons(box)
    if reasons:
        pytest.skip(f"diffusers:{backend} cannot run here: {'; '.join(reasons)}")
    model, inputs = flux(image_tokens=1024, text_tokens=256, device="cuda", **SIZE)
    expected = run(model, inputs)
    with target.session() as session:
        out = run(model, inputs)
    served = sum(session.evidence.functions.values())
    error = float((out.float() - expected.float()).norm() / expected.float().norm())
    record(test="diffusers-backend", variant=f"diffusers:{backend}", fixture="flux", kind="untrained model",
           served=served, functions=dict(session.evidence.functions), model_rel_l2=error)
    assert served >= 2, session.evidence.not_served_detail()
    assert torch.isfinite(out).all()
