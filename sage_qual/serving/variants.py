"""SageAttention kernel variants: one small object per kernel function and option set.

This registry is the single source of truth for the wrapper's per-GPU kernel table
(`config.KERNEL_TABLE` names variants from here) and for the GPU qualification suite, which runs
every variant the box can execute. K smoothing is always off: with SageAttention's default
`smooth_k=True`, block 0 of Qwen-Image / Krea-2 (one Q/K channel near +600) drops to cosine
0.18 / 0.53 against float32, 0.997 / 0.988 with it off (RTX 4090, seeds/001).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

Capability = tuple[int, int]


@dataclass(frozen=True)
class BoxFacts:
    """What decides whether a variant can run here (read by `sage_qual.serving.platform`)."""

    capability: Capability
    torch_cuda: tuple[int, int] | None  # torch.version.cuda as numbers, None for CPU/ROCm builds
    extensions: frozenset[str]  # compiled SageAttention extensions that import, e.g. "_qattn_sm90"
    has_triton: bool


@dataclass(frozen=True)
class Variant:
    name: str
    function: str  # attribute of the `sageattention` module
    options: Mapping[str, Any]  # keywords passed on top of the common ones (see `call_keywords`)
    native_on: tuple[Capability, ...]  # GPUs whose upstream `sageattn()` picks this kernel
    min_capability: Capability
    max_capability: Capability | None = None  # sm_90a code runs on (9, 0) only
    extension: str | None = None  # compiled module the function needs
    needs_triton: bool = False
    min_torch_cuda: tuple[int, int] | None = None
    description: str = ""

    def fixed_keywords(self) -> dict[str, Any]:
        """The keywords every call of this variant passes: all of `call_keywords` but sm_scale."""
        return {"tensor_layout": "HND", "is_causal": False, "smooth_k": False, **self.options}

    def call_keywords(self, sm_scale: float) -> dict[str, Any]:
        """Every keyword the wrapper passes; each must be a named parameter of the kernel."""
        return {**self.fixed_keywords(), "sm_scale": sm_scale}

    def not_supported_reasons(self, box: BoxFacts) -> list[str]:
        reasons = []
        if box.capability < self.min_capability:
            reasons.append(f"capability={box.capability} (needs >= {self.min_capability})")
        if self.max_capability is not None and box.capability > self.max_capability:
            reasons.append(f"capability={box.capability} (needs <= {self.max_capability})")
        if self.extension is not None and self.extension not in box.extensions:
            reasons.append(f"extension sageattention.{self.extension} not built or does not import")
        if self.needs_triton and not box.has_triton:
            reasons.append("triton not installed")
        if self.min_torch_cuda is not None:
            if box.torch_cuda is None or box.torch_cuda < self.min_torch_cuda:
                have = "none" if box.torch_cuda is None else "%d.%d" % box.torch_cuda
                reasons.append(f"torch CUDA={have} (needs >= %d.%d)" % self.min_torch_cuda)
        return reasons


FP16_CUDA = "sageattn_qk_int8_pv_fp16_cuda"
FP16_TRITON = "sageattn_qk_int8_pv_fp16_triton"
FP8_CUDA = "sageattn_qk_int8_pv_fp8_cuda"
FP8_CUDA_SM90 = "sageattn_qk_int8_pv_fp8_cuda_sm90"
KERNEL_FUNCTIONS = (FP16_CUDA, FP16_TRITON, FP8_CUDA, FP8_CUDA_SM90)
EXTENSIONS = ("_qattn_sm80", "_qattn_sm89", "_qattn_sm90", "_fused")
BLACKWELL = ((10, 0), (12, 0), (12, 1))
# Upstream core.py: fp8 PV with fp16 accumulation ("fp32+fp16") only from CUDA 12.8 on.
CUDA_FOR_FP16_ACCUM = (12, 8)

VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant(
            "sm80-fp16-cuda", FP16_CUDA, {"pv_accum_dtype": "fp32"}, ((8, 0),), (8, 0),
            extension="_qattn_sm80", description="INT8 QK, FP16 PV, fp32 accumulation (A100)",
        ),
        Variant(
            "sm80-fp16-cuda-fp16acc", FP16_CUDA, {"pv_accum_dtype": "fp16+fp32"}, (), (8, 0),
            extension="_qattn_sm80", description="INT8 QK, FP16 PV, fp16+fp32 accumulation",
        ),
        Variant(
            "sm86-fp16-triton", FP16_TRITON, {}, ((8, 6),), (8, 0), needs_triton=True,
            description="INT8 QK, FP16 PV in Triton (RTX 30xx, A10, A40)",
        ),
        Variant(
            "sm89-fp8-cuda", FP8_CUDA, {"pv_accum_dtype": "fp32+fp16"}, ((8, 9),), (8, 9),
            extension="_qattn_sm89", min_torch_cuda=CUDA_FOR_FP16_ACCUM,
            description="INT8 QK, FP8 PV, fp32+fp16 accumulation (RTX 40xx, L40)",
        ),
        Variant(
            "sm89-fp8-cuda-fp32acc", FP8_CUDA, {"pv_accum_dtype": "fp32+fp32"}, ((8, 9),), (8, 9),
            extension="_qattn_sm89", description="INT8 QK, FP8 PV, fp32+fp32 (sm89 before CUDA 12.8)",
        ),
        Variant(
            "sm90-fp8-cuda", FP8_CUDA_SM90, {"pv_accum_dtype": "fp32+fp32"}, ((9, 0),), (9, 0),
            max_capability=(9, 0), extension="_qattn_sm90",
            description="INT8 QK, FP8 PV, Hopper wgmma kernel (H100, H200)",
        ),
        Variant(
            "sm120-fp8-perwarp", FP8_CUDA, {"qk_quant_gran": "per_warp", "pv_accum_dtype": "fp32+fp16"},
            BLACKWELL, (8, 9), extension="_qattn_sm89", min_torch_cuda=CUDA_FOR_FP16_ACCUM,
            description="INT8 QK per warp, FP8 PV, fp32+fp16 (Blackwell)",
        ),
        Variant(
            "sm120-fp8-perwarp-fp32acc", FP8_CUDA, {"qk_quant_gran": "per_warp", "pv_accum_dtype": "fp32"},
            BLACKWELL, (8, 9), extension="_qattn_sm89",
            description="INT8 QK per warp, FP8 PV, fp32 (Blackwell before CUDA 12.8)",
        ),
    )
}


def variant(name: str) -> Variant:
    try:
        return VARIANTS[name]
    except KeyError:
        raise KeyError(f"unknown variant {name!r} (known: {', '.join(VARIANTS)})") from None
