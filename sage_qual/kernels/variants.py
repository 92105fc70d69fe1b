"""SageAttention kernel variants of every provider: one small object per kernel function and option set.

This registry is the single source of truth for the wrapper's per-GPU kernel table
(`config.KERNEL_TABLE` names variants from here), for what a GPU can run (`assess`), for the fake
kernels of `sage_qual.testing` (generated from `KERNEL_FUNCTIONS`) and for the GPU qualification
suite, which runs every variant the box can execute. Each kernel function names its provider
(`kernels.providers`): thu-ml's SageAttention 2.2, read from its source (sageattention/core.py,
setup.py, csrc/qattn), and comfy-kitchen's INT8 attention, read from comfy_kitchen/sage_attention.py
and backends/cuda/sage_attention/ (github.com/Comfy-Org/comfy-kitchen at 7d86acf, 0.2.31).

K smoothing is always off: with SageAttention's default `smooth_k=True` the outlier replicas of
Qwen-Image / Krea-2 block 0 (one Q/K channel near +600) land at relative L2 1.95-2.10 / cosine
0.59-0.68, against 0.093-0.097 / 0.988-0.989 with it off (H200, docs/results/README.md, run 3).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, Mapping

from sage_qual.kernels.providers import COMFY_KITCHEN, PROVIDERS, THU_ML

Capability = tuple[int, int]


def capability_label(capability: Capability) -> str:
    """(9, 0) -> "sm_90": how every message and report names a compute capability."""
    return "sm_%d%d" % tuple(capability)


def gpu_label(name: str, capability: Capability) -> str:
    """"NVIDIA H200 (sm_90)": a GPU model as reports, profiles and the gate name it."""
    return f"{name} ({capability_label(capability)})"


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
    P.V runs in `pv` ("fp16"; "fp8" e4m3, V scaled per channel to `v_scale_max`; or "int8": P
    unsigned 8-bit of scale 255, V signed 8-bit per channel) and accumulates in `pv_accumulation`.
    `rotation` ("hadamard"): Q and K multiplied by one orthonormal block-Hadamard matrix before
    they are quantized, which keeps their dot products and spreads an outlier channel. `v_tail`:
    what a kernel reads for the key rows past the end of a partial key block: "zero" (V quantized into
    a padded buffer, or a masked load), or "stale" (V loaded
    straight from the caller's tensor with cp.async no-fill, csrc/qattn/attn_utils.cuh
    load_global_to_share: those rows keep whatever shared memory held; their P is 0, but 0 x NaN is
    NaN when no earlier key block overwrote them).
    """

    q_tile: int
    q_groups: int
    k_tile: int
    k_groups: int
    pv: str
    pv_accumulation: str
    v_scale_max: float = 448.0
    q_tile_at_head_dim_128: int | None = None  # a kernel that takes smaller Q tiles for head_dim 128
    v_tail: str = "zero"
    rotation: str = "none"
    # A kernel that takes larger K tiles on long calls: comfy-kitchen's CTA_K of 128 from head_dim
    # 128 on past 1,024 keys (sage_attention.py, _select_cta_k).
    k_tile_past_1024_keys: int | None = None

    @property
    def accuracy_class(self) -> str:
        """Which of a fixture's bounds apply: "fp16" for FP16 P.V kernels, "fp8" for the others
        (INT8 P.V, 8 bits as FP8's, included)."""
        return "fp16" if self.pv == "fp16" else "fp8"

    def at_head_dim(self, head_dim: int, keys: int = 0, masked: bool = False) -> "Numerics":
        """The scheme a call of this head size (and key count; with a mask or not) runs (head_dim
        pads to 64 or 128 upstream)."""
        scheme = self
        if head_dim > 64 and self.q_tile_at_head_dim_128 is not None:
            scheme = dataclasses.replace(scheme, q_tile=self.q_tile_at_head_dim_128,
                                         q_tile_at_head_dim_128=None)
        # comfy-kitchen keeps CTA_K 64 for a masked call (sage_attention.py, _select_cta_k).
        if head_dim > 64 and keys > 1024 and not masked and self.k_tile_past_1024_keys is not None:
            scheme = dataclasses.replace(scheme, k_tile=self.k_tile_past_1024_keys,
                                         k_tile_past_1024_keys=None)
        return scheme


def mask_broadcasts(mask_shape: tuple[int, ...], scores: tuple[int, int, int, int]) -> bool:
    """Whether a mask of `mask_shape` broadcasts to the scores' [B, H, N_q, N_k] as SDPA broadcasts
    it, leaving their shape as it is: one rule for the wrapper's eligibility, the fake kernel and the
    fixture files. Plain arithmetic, since it runs on every masked call the wrapper is given."""
    trailing = zip(reversed(mask_shape), reversed(scores), strict=False)  # broadcasting aligns the last dims
    return len(mask_shape) <= len(scores) and all(m in (1, n) for m, n in trailing)


@dataclass(frozen=True)
class KernelFunction:
    """One kernel function of the `sageattention` module and its keyword contract.

    `keywords` are the parameters after q, k, v with upstream's defaults, in upstream's order; every
    real kernel ends in **kwargs, which swallows a misspelled or renamed keyword silently, so the
    wrapper requires each keyword it passes to be one of these by name in the installed function
    (`sage_package.kernel_problem`). `choices` are the values upstream accepts for its string
    options; anything else raises (or, for an unknown pv_accum_dtype of the fp8 kernels, fails on
    an unset variable). Q/K/V are [B, H, N, D] ("HND") or [B, N, H, D] ("NHD") of one dtype, fp16
    or bf16, on one CUDA device, last dimension contiguous, K and V of one shape with Q's batch and
    head_dim, query heads a multiple of K/V heads, head_dim at most `max_head_dim` (smaller ones
    are zero-padded to 64 or 128): upstream core.py's asserts and csrc/qattn's CHECK_SHAPE.
    """

    name: str
    keywords: tuple[tuple[str, Any], ...]
    choices: Mapping[str, tuple[Any, ...]]
    max_head_dim: int = 128
    provider: str = THU_ML.name  # a key of `providers.PROVIDERS`
    scale_keyword: str = "sm_scale"
    # What every call passes beside the scale: thu-ml's layout keyword, no causal mask and K
    # smoothing off. A function without `tensor_layout` takes [B, H, N, D] views only, so a call in
    # another layout reaches it transposed (`Variant.invoke`).
    fixed: tuple[tuple[str, Any], ...] = (("tensor_layout", "HND"), ("is_causal", False), ("smooth_k", False))
    # Where its CUDA work runs: "current" (torch's current stream: Triton launches) or "legacy" (the
    # legacy default stream: csrc/qattn/*.cu and csrc/fused/fused.cu launch `<<<grid, block>>>`
    # with no stream). A "legacy" kernel is unordered with a side stream's work and is not recorded
    # by a CUDA-graph capture (`contexts.builtin_safe`).
    launches_on: str = "legacy"
    # The keyword its attention mask goes by (None: it takes none, and a masked call stays on torch):
    # comfy-kitchen's `attn_mask`, bool (True keeps a key) or additive float, broadcast to
    # [B, H, N_q, N_k] (sage_attention.py, _validate_inputs).
    mask_keyword: str | None = None

    @property
    def defaults(self) -> dict[str, Any]:
        return dict(self.keywords)

    # Read on every served call (`Variant.invoke`): computed once.
    @functools.cached_property
    def takes_layout(self) -> bool:
        return "tensor_layout" in self.defaults

    @functools.cached_property
    def can_smooth_k(self) -> bool:
        return "smooth_k" in self.defaults


_LAYOUTS = ("HND", "NHD")
_GRANULARITY = ("per_warp", "per_thread")


@dataclass(frozen=True)
class Variant:
    name: str
    function: str  # attribute of the `sageattention` module
    options: Mapping[str, Any]  # keywords passed on top of the common ones (see `call_keywords`)
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

    @property
    def provider(self) -> str:
        return self.kernel_function.provider

    def fixed_keywords(self) -> dict[str, Any]:
        """The keywords every call of this variant passes: all of `call_keywords` but the scale."""
        return dict(self._fixed)

    @functools.cached_property
    def _fixed(self) -> dict[str, Any]:  # read on every served call: merged once
        return {**dict(self.kernel_function.fixed), **self.options}

    def call_keywords(self, sm_scale: float) -> dict[str, Any]:
        """Every keyword the wrapper passes; each must be a named parameter of the kernel."""
        return {**self._fixed, self.kernel_function.scale_keyword: sm_scale}

    @property
    def takes_mask(self) -> bool:
        return self.kernel_function.mask_keyword is not None

    def invoke(self, function, q, k, v, sm_scale: float, layout: str = "HND", smooth_k: bool = False,
               attn_mask=None):
        """`function` (this variant's kernel, real or fake) called as sage-qual calls every kernel:
        q, k, v in `layout` ([B, H, N, D] "HND" or [B, N, H, D] "NHD"), the output in that layout;
        `attn_mask` as SDPA takes it (over [B, H, N_q, N_k] whatever the layout), for a kernel that
        takes one. K smoothing is asked of thu-ml's kernels only (certify's smoothing check); a
        provider without the option never smooths."""
        keywords = self.call_keywords(sm_scale)
        contract = self.kernel_function
        if smooth_k and not contract.can_smooth_k:
            raise ValueError(f"{self.name} has no K smoothing to turn on")
        if attn_mask is not None:
            if contract.mask_keyword is None:
                raise ValueError(f"{self.name} takes no attn_mask")
            keywords[contract.mask_keyword] = attn_mask
        if contract.can_smooth_k:
            keywords["smooth_k"] = smooth_k
        if contract.takes_layout:
            keywords["tensor_layout"] = layout
        if contract.takes_layout or layout == "HND":
            return function(q, k, v, **keywords)
        return function(*(t.transpose(1, 2) for t in (q, k, v)), **keywords).transpose(1, 2)

    @property
    def native_on(self) -> tuple[Capability, ...]:
        """GPUs whose upstream `sageattn()` calls this kernel: as its pick, or as the pick's
        replacement on an older CUDA (`UPSTREAM_PICKS`)."""
        return tuple(cap for cap, names in UPSTREAM_PICKS.items() if self.name in names)

    @property
    def kernel_function(self) -> KernelFunction:
        return KERNEL_FUNCTIONS[self.function]

    def capability_reasons(self, capability: Capability) -> list[str]:
        """Why a GPU of this capability is outside the variant's range; [] when it is inside."""
        if capability < self.min_capability:
            return [f"capability={capability} (needs >= {self.min_capability})"]
        if self.max_capability is not None and capability > self.max_capability:
            return [f"capability={capability} (needs <= {self.max_capability})"]
        return []

    def not_supported_reasons(self, box: BoxFacts) -> list[str]:
        """Why this box cannot run the variant, from its facts alone (`assess` adds the package's)."""
        reasons = []
        thu_ml_build = self.provider == THU_ML.name and self.extension is not None
        if thu_ml_build and not has_compiled_code(box.capability):
            targets = ", ".join(BUILD_TARGETS.values())
            reasons.append("capability=%s: SageAttention 2.2 builds no code that runs on %s "
                           "(builds for %s)" % (box.capability, capability_label(box.capability), targets))
        if self.needs_triton and box.capability in TRITON_UNUSABLE:
            reasons.append("capability=%s: upstream's Triton kernel is not usable there (sageattention "
                           "core.py)" % (box.capability,))
        reasons += self.capability_reasons(box.capability)
        if self.extension is not None and self.extension not in box.extensions:
            package = PROVIDERS[self.provider].package
            reasons.append(f"extension {package}.{self.extension} not built or does not import")
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
CK_INT8 = "int8_attention"  # comfy_kitchen.sage_attention
# Signatures and accepted values as in upstream core.py (SageAttention 2.2.0).
KERNEL_FUNCTIONS: dict[str, KernelFunction] = {
    f.name: f
    for f in (
        KernelFunction(
            FP16_TRITON,
            (("tensor_layout", "HND"), ("quantization_backend", "triton"), ("is_causal", False),
             ("attn_mask", None), ("sm_scale", None), ("smooth_k", True), ("return_lse", False)),
            {"tensor_layout": _LAYOUTS, "quantization_backend": ("triton", "cuda")},
            launches_on="current",  # Triton quantizers and attention kernel, all on torch's stream
        ),
        KernelFunction(
            FP16_CUDA,
            (("tensor_layout", "HND"), ("is_causal", False), ("qk_quant_gran", "per_thread"),
             ("sm_scale", None), ("pv_accum_dtype", "fp32"), ("smooth_k", True), ("smooth_v", False),
             ("return_lse", False)),
            {"tensor_layout": _LAYOUTS, "qk_quant_gran": _GRANULARITY,
             "pv_accum_dtype": ("fp32", "fp16", "fp16+fp32")},
        ),
        KernelFunction(
            FP8_CUDA,
            (("tensor_layout", "HND"), ("is_causal", False), ("qk_quant_gran", "per_thread"),
             ("sm_scale", None), ("pv_accum_dtype", "fp32+fp16"), ("smooth_k", True), ("smooth_v", False),
             ("return_lse", False)),
            {"tensor_layout": _LAYOUTS, "qk_quant_gran": _GRANULARITY,
             "pv_accum_dtype": ("fp32", "fp32+fp32", "fp32+fp16")},
        ),
        KernelFunction(
            FP8_CUDA_SM90,
            (("tensor_layout", "HND"), ("is_causal", False), ("qk_quant_gran", "per_thread"),
             ("sm_scale", None), ("pv_accum_dtype", "fp32+fp32"), ("smooth_k", True), ("return_lse", False)),
            {"tensor_layout": _LAYOUTS, "qk_quant_gran": _GRANULARITY, "pv_accum_dtype": ("fp32+fp32",)},
        ),
        # comfy_kitchen/sage_attention.py: int8_attention(q, k, v, *, scale=None, attn_mask=None) on
        # [B, H, N, D] fp32/fp16/bf16 with the last dimension contiguous, head_dim up to 256 (padded to
        # 64, 128 or 256), grouped-query heads; it launches on torch's current stream.
        KernelFunction(CK_INT8, (("scale", None), ("attn_mask", None)), {}, max_head_dim=256,
                       launches_on="current", provider=COMFY_KITCHEN.name, scale_keyword="scale", fixed=(),
                       mask_keyword="attn_mask"),
    )
}
EXTENSIONS = THU_ML.extensions
[CK_EXTENSION] = COMFY_KITCHEN.extensions  # its CUDA extension, relative to comfy_kitchen
# The GPUs upstream's sageattn() gives the per-warp fp8 kernel (core.py: "sm120", "sm121"); for any
# other capability outside 8.0/8.6/8.9/9.0 it raises "Unsupported CUDA architecture", sm100 included.
BLACKWELL = ((12, 0), (12, 1))
# What upstream setup.py compiles the CUDA extensions for, per capability. Code for 8.x is plain
# sm_XY and also runs on a later 8.x GPU (sm_87 runs sm_80 code); from 9.0 on it is arch-specific
# ("a") and runs on that capability only; a capability setup.py does not list gets no code.
BUILD_TARGETS: Mapping[Capability, str] = {
    (8, 0): "sm_80", (8, 6): "sm_86", (8, 9): "sm_89", (9, 0): "sm_90a", (10, 0): "sm_100a",
    (12, 0): "sm_120a", (12, 1): "sm_121a",
}
# core.py, sageattn(): "triton kernel is currently not usable on sm120" (and on sm121).
TRITON_UNUSABLE = ((12, 0), (12, 1))


def has_compiled_code(capability: Capability) -> bool:
    """Whether SageAttention 2.2's compiled kernels can run on a GPU of this capability."""
    for target, arch in BUILD_TARGETS.items():
        if target == capability:
            return True
        if not arch.endswith("a") and target[0] == capability[0] and target[1] <= capability[1]:
            return True
    return False

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
            "sm80-fp16-cuda", FP16_CUDA, {"pv_accum_dtype": "fp32"}, (8, 0),
            extension="_qattn_sm80", description="INT8 QK, FP16 PV, fp32 accumulation (A100)",
            numerics=Numerics(**_PER_THREAD, pv="fp16", pv_accumulation="fp32", v_tail="stale"),
        ),
        Variant(
            "sm80-fp16-cuda-fp16acc", FP16_CUDA, {"pv_accum_dtype": "fp16+fp32"}, (8, 0),
            extension="_qattn_sm80", description="INT8 QK, FP16 PV, fp16+fp32 accumulation",
            numerics=Numerics(**_PER_THREAD, pv="fp16", pv_accumulation="fp16+fp32",
                              q_tile_at_head_dim_128=16, v_tail="stale"),
        ),
        Variant(
            "sm86-fp16-triton", FP16_TRITON, {}, (8, 0), needs_triton=True,
            description="INT8 QK, FP16 PV in Triton (RTX 30xx, A10, A40)",
            # triton/attn_qk_int8_per_block.py: `acc += tl.dot(p, v, out_dtype=tl.float16)`, each
            # 64-key block summed in fp16 and added to an fp32 accumulator.
            numerics=Numerics(128, 1, 64, 1, pv="fp16", pv_accumulation="fp16+fp32"),
        ),
        Variant(
            "sm89-fp8-cuda", FP8_CUDA, {"pv_accum_dtype": "fp32+fp16"}, (8, 9),
            extension="_qattn_sm89", min_torch_cuda=CUDA_FOR_FP16_ACCUM,
            description="INT8 QK, FP8 PV, fp32+fp16 accumulation (RTX 40xx, L40)",
            numerics=Numerics(**_PER_THREAD, pv="fp8", pv_accumulation="fp32+fp16", v_scale_max=2.25),
        ),
        Variant(
            "sm89-fp8-cuda-fp32acc", FP8_CUDA, {"pv_accum_dtype": "fp32+fp32"}, (8, 9),
            extension="_qattn_sm89", description="INT8 QK, FP8 PV, fp32+fp32 (sm89 before CUDA 12.8)",
            numerics=Numerics(**_PER_THREAD, pv="fp8", pv_accumulation="fp32+fp32"),
        ),
        Variant(
            "sm90-fp8-cuda", FP8_CUDA_SM90, {"pv_accum_dtype": "fp32+fp32"}, (9, 0),
            max_capability=(9, 0), extension="_qattn_sm90",
            description="INT8 QK, FP8 PV, Hopper wgmma kernel (H100, H200)",
            numerics=Numerics(16, 8, 128, 4, pv="fp8", pv_accumulation="fp32+fp32"),
        ),
        Variant(
            "sm120-fp8-perwarp", FP8_CUDA, {"qk_quant_gran": "per_warp", "pv_accum_dtype": "fp32+fp16"},
            (8, 9), extension="_qattn_sm89", min_torch_cuda=CUDA_FOR_FP16_ACCUM,
            description="INT8 QK per warp, FP8 PV, fp32+fp16 (Blackwell)",
            numerics=Numerics(**_PER_WARP, pv="fp8", pv_accumulation="fp32+fp16", v_scale_max=2.25),
        ),
        Variant(
            "sm120-fp8-perwarp-fp32acc", FP8_CUDA, {"qk_quant_gran": "per_warp", "pv_accum_dtype": "fp32"},
            (8, 9), extension="_qattn_sm89",
            description="INT8 QK per warp, FP8 PV, fp32 (Blackwell before CUDA 12.8)",
            numerics=Numerics(**_PER_WARP, pv="fp8", pv_accumulation="fp32"),
        ),
        Variant(
            "ck-int8-cuda", CK_INT8, {}, (7, 5), extension=CK_EXTENSION,
            description="INT8 QK (block-Hadamard rotated), INT8 PV (comfy-kitchen; Turing and newer)",
            # sage_attention.py and quant_qk_int8.cu: Q per thread in 128-row blocks of 32 scales,
            # K in blocks of CTA_K (64, or 128 for head_dim 128+ past 1,024 keys) of 4 scales;
            # qk_int_sv_i8_cuda.cuh: P as u8 at S_U8_OFFSET = log2(255), V int8 per channel over all
            # keys (quant_v_int8.cu: max |v| / 127), P.V summed in int32.
            numerics=Numerics(**_PER_THREAD, pv="int8", pv_accumulation="int32", v_scale_max=127.0,
                              rotation="hadamard", k_tile_past_1024_keys=128),
        ),
    )
}

# Upstream sageattn()'s choice per compute capability, declared once (config.KERNEL_TABLE is this
# table; `Variant.native_on` and `upstream_pick` read it). The first choice is the kernel and options
# upstream sageattn() calls on that capability (core.py); where it raises "Unsupported CUDA
# architecture" (8.7, 10.0, anything newer than 12.1) there is no kernel. The second choice
# replaces fp32+fp16 accumulation where torch's CUDA is older than 12.8.
UPSTREAM_PICKS: Mapping[Capability, tuple[str, ...]] = {
    (8, 0): ("sm80-fp16-cuda",),
    (8, 6): ("sm86-fp16-triton",),
    (8, 9): ("sm89-fp8-cuda", "sm89-fp8-cuda-fp32acc"),
    (9, 0): ("sm90-fp8-cuda",),
    **{cap: ("sm120-fp8-perwarp", "sm120-fp8-perwarp-fp32acc") for cap in BLACKWELL},
}


def upstream_pick(capability: Capability) -> Variant | None:
    """The kernel upstream sageattn() picks on this GPU (its first choice), or None where it has none."""
    names = UPSTREAM_PICKS.get(tuple(capability))
    return VARIANTS[names[0]] if names else None


# Memory layouts a profile may list as verified (`WrapperConfig.layouts`); `eligibility.layout_of`
# names a call's layout. "nhd" is a kernel called with tensor_layout="NHD" (certify's name for it):
# the wrapper always calls with "HND", so none of its calls has that layout.
LAYOUTS = ("contiguous", "transposed", "fused_qkv", "nhd")

# Head sizes the kernels take: upstream pads others, which the wrapper refuses (eligibility, head_dim).
KERNEL_HEAD_DIMS = (64, 128)
