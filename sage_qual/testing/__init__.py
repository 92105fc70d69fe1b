"""A fake `sageattention` (and, when asked, a fake `comfy_kitchen`) and a fake CUDA, for our tests
and for downstream apps' tests.

    from sage_qual.testing import FakeCuda, FakeGpu, FakeSageAttention, on_device

    fake = FakeSageAttention(version="2.2.0")
    with FakeCuda([FakeGpu((8, 9), "RTX 4090")]), fake.installed():
        sage_qual.install()
        with sage_qual.sage_attention_scope():
            out = F.scaled_dot_product_attention(q, k, v)   # CPU tensors, served by the fake
    assert fake.calls[0].keywords["smooth_k"] is False

CPU tensors count as CUDA tensors on fake device 0, or on the device `on_device()` gives them;
meta tensors count as not on a GPU. The fake kernels are made from the variant registry
(`sage_qual.kernels.variants.KERNEL_FUNCTIONS`): one per kernel function, with its keyword
signature. Each records every call, refuses what the real kernel refuses (see `check_call`), and
returns the exact attention computed in float32 (cast to the input dtype, as the real kernels
return), unless told to raise or return something else.

Execution contexts: `with cuda.side_stream():` and `with cuda.capture():` make calls run as if on a
side stream or during a CUDA-graph capture. The fake kernels of thu-ml's CUDA functions then return
zeros, as a launch on the legacy stream does there (unordered, or not recorded); the Triton one, which
launches on the current stream, stays right (`FakeSageAttention.current_stream` changes which).

`FakeSageAttention(comfy_kitchen="0.2.40")` also installs a fake comfy-kitchen whose
`comfy_kitchen.sage_attention.int8_attention` is made the same way; without it a real comfy-kitchen
is hidden for the block, so a test sees the same machine wherever it runs.
"""


from sage_qual.kernels.numerics import exact_attention
from sage_qual.testing.cuda import FakeCuda, FakeGpu, on_device
from sage_qual.testing.kernels import FakeSageAttention, KernelCall, check_call

__all__ = ["FakeCuda", "FakeGpu", "FakeSageAttention", "KernelCall", "check_call", "exact_attention",
           "on_device"]
