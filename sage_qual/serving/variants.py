"""SageAttention kernel variants: one small object per kernel function and option set.

This registry is the single source of truth for the wrapper's per-GPU kernel table
(`config.KERNEL_TABLE` names variants from here) and for the GPU qualification suite, which runs
every variant the box can execute. K smoothing is always off: with SageAttention's default
`smooth_k=True`, block 0 of Qwen-Image / Krea-2 (one Q/K channel near +600) drops to cosine
0.18 / 0.53 against float32, 0.997 / 0.988 with it off (RTX 4090, seeds/001).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
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
class Numerics:
    """How a kernel quantizes, read from upstream's source (sageattention/core.py, quant.py,
    triton/quant_per_*.py, csrc/qattn) and declared here, next to the variant, never guessed from names.

    Q and K are INT8 with one scale per group of rows: a tile of `q_tile` (`k_tile`) rows is split
    into `q_groups` (`k_groups`) interleaved groups (8/4: per thread; 1: per warp or per block).
    P.V runs in `pv` ("fp16" or "fp8" e4m3, V scaled per channel to `v_scale_max`) and accumulates
    in `pv_accumulation`.
    """

    q_tile: int
    q_groups: int
    k_tile: int
    k_groups: int
    pv: str
    pv_accumulation: str
    v_scale_max: float = 448.0
    q_tile_at_head_dim_128: int | None = None  # a kernel that takes smaller Q tiles for head_dim 128

    @property
    def accuracy_class(self) -> str:
        """Which of a fixture's bounds apply: "fp16" for FP16 P.V kernels, "fp8" for the others."""
        return "fp16" if self.pv == "fp16" else "fp8"

    def at_head_dim(self, head_dim: int) -> "Numerics":
        """The scheme a call of this head size runs (head_dim pads to 64 or 128 upstream)."""
        if head_dim > 64 and self.q_tile_at_head_dim_128 is not None:
            return dataclasses.replace(self, q_tile=self.q_tile_at_head_dim_128, q_tile_at_head_dim_128=None)
        return self


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
    numerics: Numerics = field(kw_only=True)

    @property
    def accuracy_class(self) -> str:
        return self.numerics.accuracy_class

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
# INT8 Q/K granularity per kernel family (upstream quant.py / triton quant_per_*.py):
# per thread on the CUDA kernels (Q warps of 32 rows in 8 groups, K blocks of 64 in 4), per warp on
# Blackwell's option, per block on Triton (Q 128, K 64); the sm90 kernel uses Q warps of 16 and K
# blocks of 128. fp32+fp16 accumulation scales V to 2.25 so that the fp16 partial sums cannot overflow.
_PER_THREAD = {"q_tile": 32, "q_groups": 8, "k_tile": 64, "k_groups": 4}
_PER_WARP = {"q_tile": 32, "q_groups": 1, "k_tile": 64, "k_groups": 1}

VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant(
            "sm80-fp16-cuda", FP16_CUDA, {"pv_accum_dtype": "fp32"}, ((8, 0),), (8, 0),
            extension="_qattn_sm80", description="INT8 QK, FP16 PV, fp32 accumulation (A100)",
            numerics=Numerics(**_PER_THREAD, pv="fp16", pv_accumulation="fp32"),
        ),
        Variant(
            "sm80-fp16-cuda-fp16acc", FP16_CUDA, {"pv_accum_dtype": "fp16+fp32"}, (), (8, 0),
            extension="_qattn_sm80", description="INT8 QK, FP16 PV, fp16+fp32 accumulation",
            numerics=Numerics(**_PER_THREAD, pv="fp16", pv_accumulation="fp16+fp32",
                              q_tile_at_head_dim_128=16),
        ),
        Variant(
            "sm86-fp16-triton", FP16_TRITON, {}, ((8, 6),), (8, 0), needs_triton=True,
            description="INT8 QK, FP16 PV in Triton (RTX 30xx, A10, A40)",
            numerics=Numerics(128, 1, 64, 1, pv="fp16", pv_accumulation="fp32"),
        ),
        Variant(
            "sm89-fp8-cuda", FP8_CUDA, {"pv_accum_dtype": "fp32+fp16"}, ((8, 9),), (8, 9),
            extension="_qattn_sm89", min_torch_cuda=CUDA_FOR_FP16_ACCUM,
            description="INT8 QK, FP8 PV, fp32+fp16 accumulation (RTX 40xx, L40)",
            numerics=Numerics(**_PER_THREAD, pv="fp8", pv_accumulation="fp32+fp16", v_scale_max=2.25),
        ),
        Variant(
            "sm89-fp8-cuda-fp32acc", FP8_CUDA, {"pv_accum_dtype": "fp32+fp32"}, ((8, 9),), (8, 9),
            extension="_qattn_sm89", description="INT8 QK, FP8 PV, fp32+fp32 (sm89 before CUDA 12.8)",
            numerics=Numerics(**_PER_THREAD, pv="fp8", pv_accumulation="fp32+fp32"),
        ),
        Variant(
            "sm90-fp8-cuda", FP8_CUDA_SM90, {"pv_accum_dtype": "fp32+fp32"}, ((9, 0),), (9, 0),
            max_capability=(9, 0), extension="_qattn_sm90",
            description="INT8 QK, FP8 PV, Hopper wgmma kernel (H100, H200)",
            numerics=Numerics(16, 8, 128, 4, pv="fp8", pv_accumulation="fp32+fp32"),
        ),
        Variant(
            "sm120-fp8-perwarp", FP8_CUDA, {"qk_quant_gran": "per_warp", "pv_accum_dtype": "fp32+fp16"},
            BLACKWELL, (8, 9), extension="_qattn_sm89", min_torch_cuda=CUDA_FOR_FP16_ACCUM,
            description="INT8 QK per warp, FP8 PV, fp32+fp16 (Blackwell)",
            numerics=Numerics(**_PER_WARP, pv="fp8", pv_accumulation="fp32+fp16", v_scale_max=2.25),
        ),
        Variant(
            "sm120-fp8-perwarp-fp32acc", FP8_CUDA, {"qk_quant_gran": "per_warp", "pv_accum_dtype": "fp32"},
            BLACKWELL, (8, 9), extension="_qattn_sm89",
            description="INT8 QK per warp, FP8 PV, fp32 (Blackwell before CUDA 12.8)",
            numerics=Numerics(**_PER_WARP, pv="fp8", pv_accumulation="fp32"),
        ),
    )
}


def variant(name: str) -> Variant:
    try:
        return VARIANTS[name]
    except KeyError:
        raise KeyError(f"unknown variant {name!r} (known: {', '.join(VARIANTS)})") from None
