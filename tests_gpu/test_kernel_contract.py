"""The registry's kernel contract against the installed SageAttention: each kernel function's keyword
names and defaults, as `sage_qual.serving.variants.KERNEL_FUNCTIONS` declares them (and the fake
kernels of `sage_qual.testing` are made from), and the malformed calls the real kernels refuse
before they launch, which the fakes refuse too.
"""

import inspect

import pytest
import torch

from sage_qual.serving.variants import FP16_TRITON, KERNEL_FUNCTIONS, VARIANTS

pytestmark = [pytest.mark.slow, pytest.mark.gpu]


@pytest.mark.parametrize("function", list(KERNEL_FUNCTIONS))
def test_keyword_contract_matches_the_installed_kernel(function, sage, record):
    real = getattr(sage.module, function, None)
    assert real is not None, f"sageattention {sage.version} has no {function}"
    parameters = list(inspect.signature(real).parameters.values())
    named = [(p.name, p.default) for p in parameters if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    record(test="kernel_contract", kind=function, keywords=", ".join(name for name, _ in named[3:]))
    assert [name for name, _ in named[:3]] == ["q", "k", "v"]
    assert named[3:] == list(KERNEL_FUNCTIONS[function].keywords)
    assert parameters[-1].kind is inspect.Parameter.VAR_KEYWORD  # why every keyword is required by name


def tensors(heads=4, kv_heads=2, q_tokens=256, kv_tokens=128, head_dim=64, dtype=torch.float16, batch=1):
    gen = torch.Generator("cuda").manual_seed(0)

    def make(h, n):
        return torch.randn(batch, h, n, head_dim, device="cuda", dtype=dtype, generator=gen)

    return make(heads, q_tokens), make(kv_heads, kv_tokens), make(kv_heads, kv_tokens)


# Checked before launch by every kernel (core.py's asserts and ValueErrors) or by the CUDA kernels'
# C++ (CHECK_SHAPE, num_qo_heads % num_kv_heads): the Triton kernel does not check shapes and would
# read out of bounds, so it is not called with those here (the fake refuses them for it too). Q has
# the smaller batch and head_dim: upstream's per-thread quantization (triton/quant_per_thread.py)
# sizes K's grid from Q's batch and head_dim, so the other way round it would read past K first.
MALFORMED = {
    "float32": (lambda: tensors(dtype=torch.float32), False),
    "head_dim=256": (lambda: tensors(head_dim=256), False),
    "last_dim_not_contiguous": (lambda: tuple(t.transpose(2, 3).contiguous().transpose(2, 3)
                                              for t in tensors()), False),
    "batch_mismatch": (lambda: (tensors()[0], *tensors(batch=2)[1:]), True),
    "heads_not_a_multiple": (lambda: tensors(heads=4, kv_heads=3), True),
    "head_dim_mismatch": (lambda: (tensors()[0], *tensors(head_dim=128)[1:]), True),
}


@pytest.mark.parametrize("case", list(MALFORMED))
@pytest.mark.parametrize("variant_name", list(VARIANTS))
def test_the_real_kernel_refuses_what_the_fake_refuses(variant_name, case, runnable, sage):
    variant = runnable(variant_name)
    make, shape_check = MALFORMED[case]
    if shape_check and variant.function == FP16_TRITON:
        pytest.skip("upstream's Triton kernel does not check shapes before launching")
    kernel = sage.kernel(variant)
    with pytest.raises((AssertionError, ValueError, RuntimeError)):
        kernel(*make(), **variant.call_keywords(0.125))
    torch.cuda.synchronize()  # the refusal happened before a launch: the context is still usable
