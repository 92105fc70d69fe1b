"""Random attention inputs on the GPU shared by the wrapper's GPU tests (test_wrapper_gpu,
test_served_overhead): test modules import this, never each other."""

import torch

# [B, Hq, Hkv, Nq, Nk, D], dtype: the shapes SageAttention's accuracy tests used (InvokeAI PR #9657)
# and the families' own (sage_qual/qualification/families.py).
SHAPES = {
    "flux1-1024": ((1, 24, 24, 4608, 4608, 128), torch.bfloat16),
    "sdxl-1024-level1": ((2, 10, 10, 4096, 4096, 64), torch.float16),
    "krea2-gqa-48q-12kv": ((1, 48, 12, 4608, 4608, 128), torch.bfloat16),
    "partial-tile-cross": ((1, 24, 24, 4429, 845, 128), torch.bfloat16),
}


def make_qkv(shape, dtype, seed=0):
    b, hq, hkv, nq, nk, d = shape
    gen = torch.Generator("cuda").manual_seed(seed)
    q = torch.randn(b, hq, nq, d, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(b, hkv, nk, d, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(b, hkv, nk, d, device="cuda", dtype=dtype, generator=gen)
    return q, k, v
