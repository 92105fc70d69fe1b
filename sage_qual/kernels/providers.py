"""Who ships SageAttention-style kernels: one declaration per provider, read by `sage_package` to
find, import and vet its package, and named by every variant's kernel function
(`variants.KernelFunction.provider`).

- thu-ml: SageAttention 2.2 (github.com/thu-ml/SageAttention), built from source; PyPI's
  `sageattention` is SageAttention 1 and is refused.
- comfy-kitchen: Comfy-Org's kernel library (PyPI `comfy-kitchen`), which ComfyUI runs as a core
  backend; its `comfy_kitchen.sage_attention.int8_attention` is an INT8 Q/K/V, u8 P kernel for
  compute capability 7.5 and newer, launched on torch's current stream.

Not covered: SageAttention3's Blackwell FP4 builds (a separate package for sm100/sm120, and no such
GPU here to certify it on) and FlashInfer's Sage kernels (not yet declared: one module like these).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Provider:
    name: str  # how reports, gates and profiles name it
    title: str  # how a log line names its kernels
    distribution: str  # its package metadata name (the version comes from there)
    package: str  # the import name of its package
    kernels_module: str  # the module whose attributes are its kernel functions
    extensions: tuple[str, ...]  # compiled modules, relative to `package`
    min_version: str
    install_hint: str
    needs_triton: bool = False  # whether importing it needs triton at all
    # What a version below 2 is, where that is another product (thu-ml: SageAttention 1).
    major_1_is: str = ""


THU_ML = Provider(
    "thu-ml", "SageAttention", "sageattention", "sageattention", "sageattention",
    ("_qattn_sm80", "_qattn_sm89", "_qattn_sm90", "_fused"), "2.2.0",
    "build SageAttention 2.2 from source (github.com/thu-ml/SageAttention, see its README)",
    needs_triton=True,
    major_1_is="SageAttention 1, the release on PyPI; it has no INT8/FP8 kernels of 2.x",
)
COMFY_KITCHEN = Provider(
    "comfy-kitchen", "comfy-kitchen", "comfy-kitchen", "comfy_kitchen", "comfy_kitchen.sage_attention",
    ("backends.cuda._C",), "0.2.31",
    "pip install comfy-kitchen (PyPI, a CUDA wheel for Linux and Windows; in a sage-qual checkout: "
    'pip install -e ".[comfy-kitchen]")',
)
PROVIDERS: dict[str, Provider] = {p.name: p for p in (THU_ML, COMFY_KITCHEN)}
