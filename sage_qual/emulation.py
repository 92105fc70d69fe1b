"""A CPU emulation of SageAttention 2's quantization, for pre-calibrating replica fixtures.

This is an approximation, not the kernel. It reproduces what decides accuracy, as read from the
upstream source (sageattention/core.py, quant.py, triton/quant_per_*.py, csrc/qattn):

- Q and K in INT8 with one scale (max |x| / 127, round half away from zero) per group of rows.
  The groups depend on the kernel: per block (Triton kernel: Q 128 rows, K 64 rows), per warp
  (Q 32 rows, K 64 rows) or per thread (each warp's rows split into 8 interleaved groups for Q and
  each K block into 4; sm90 uses Q warps of 16 and K blocks of 128).
- Optional K smoothing: subtract the per-channel mean of K over tokens, in K's dtype, before
  quantizing. The mean shifts every score of a query row equally, so it cancels in the softmax.
- P·V either in FP16 (P and V cast to float16) or in FP8 e4m3 (P scaled by 448; V per channel
  with scale max |v| / scale_max over all tokens, scale_max 448, or 2.25 with fp16 accumulation).
  The softmax denominator sums the quantized P, as the kernels do.

Not emulated: the online softmax's running maximum (one global row maximum is used instead),
fp16 accumulators, and the exact order of floating-point sums. Numbers from here are labelled
"CPU emulation, not the kernel" wherever they are stored.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .variants import FP8_CUDA_SM90, FP16_TRITON, Variant

_FP8_P_SCALE = 448.0  # exp2(8.807): the kernels' S_FP8_OFFSET puts P's maximum at e4m3's maximum


@dataclass(frozen=True)
class Scheme:
    """How one kernel quantizes. Tiles are rows per scale group set; groups split a tile."""

    q_tile: int
    q_groups: int
    k_tile: int
    k_groups: int
    pv: str  # "fp16" or "fp8"
    v_scale_max: float = 448.0

    def describe(self) -> str:
        return (f"Q {self.q_tile}/{self.q_groups}, K {self.k_tile}/{self.k_groups}, PV {self.pv}"
                + (f" (V scale max {self.v_scale_max})" if self.pv == "fp8" else ""))


def scheme_for(variant: Variant, head_dim: int = 128) -> Scheme:
    """The quantization scheme upstream's kernel function uses with this variant's options."""
    options = variant.options
    accum = options.get("pv_accum_dtype", "")
    if variant.function == FP16_TRITON:
        return Scheme(128, 1, 64, 1, "fp16")
    if variant.function == FP8_CUDA_SM90:
        q_tile, k_tile = 16, 128
    elif "pv_fp16" in variant.function and head_dim == 128 and accum == "fp16+fp32":
        q_tile, k_tile = 16, 64
    else:
        q_tile, k_tile = 32, 64
    per_thread = options.get("qk_quant_gran", "per_thread") == "per_thread"
    q_groups, k_groups = (8, 4) if per_thread else (1, 1)
    if "pv_fp16" in variant.function:
        return Scheme(q_tile, q_groups, k_tile, k_groups, "fp16")
    return Scheme(q_tile, q_groups, k_tile, k_groups, "fp8", 2.25 if accum.endswith("fp16") else 448.0)


def _group_ids(tile: int, groups: int) -> torch.Tensor:
    rows = torch.arange(tile)
    if groups == 1:
        return torch.zeros(tile, dtype=torch.long)
    if groups == 8:  # per-thread Q: rows i, i+8, i+16, ... of a warp share a scale
        return rows % 8
    if groups == 4:  # per-thread K: rows {2t, 2t+1} + 8j of a block share a scale
        return (rows % 8) // 2
    raise ValueError(f"unsupported group count {groups}")


def quantize_int8(x: torch.Tensor, tile: int, groups: int = 1) -> torch.Tensor:
    """Quantize [B, H, N, D] to INT8 per row group and return the dequantized float32 tensor."""
    b, h, n, d = x.shape
    padded = -(-n // tile) * tile
    x = torch.nn.functional.pad(x.float(), (0, 0, 0, padded - n)).view(b, h, padded // tile, tile, d)
    row_max = x.abs().amax(-1)  # [b, h, tiles, tile]
    ids = _group_ids(tile, groups)
    scale = torch.empty_like(row_max)
    for g in range(groups):
        rows = ids == g
        scale[..., rows] = row_max[..., rows].amax(-1, keepdim=True) / 127.0
    scale = scale.clamp_min(1e-7).unsqueeze(-1)
    scaled = x / scale
    quantized = torch.trunc(scaled + 0.5 * torch.sign(scaled)).clamp(-127, 127)
    return (quantized * scale).view(b, h, padded, d)[:, :, :n]


def _e4m3(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float8_e4m3fn).float()


def emulate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scheme: Scheme, *,
            smooth_k: bool, sm_scale: float | None = None) -> torch.Tensor:
    """SageAttention's output as this scheme would compute it, in q's dtype (HND, no mask)."""
    sm_scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    if smooth_k:
        k = k - k.mean(dim=2, keepdim=True)  # in K's dtype, as upstream's torch code does
    q_hat = quantize_int8(q, scheme.q_tile, scheme.q_groups)
    k_hat = quantize_int8(k, scheme.k_tile, scheme.k_groups)
    group = q.shape[1] // k.shape[1]
    k_hat = k_hat.repeat_interleave(group, 1)
    scores = (q_hat @ k_hat.transpose(-1, -2)) * sm_scale
    p = torch.exp(scores - scores.amax(-1, keepdim=True))
    if scheme.pv == "fp16":
        p = p.half().float()
        v_hat = v.half().float()
    else:
        p = _e4m3(p * _FP8_P_SCALE) / _FP8_P_SCALE
        v_scale = (v.float().abs().amax(dim=2, keepdim=True) / scheme.v_scale_max).clamp_min(1e-12)
        v_hat = _e4m3(v.float() / v_scale) * v_scale
    v_hat = v_hat.repeat_interleave(group, 1)
    return ((p @ v_hat) / p.sum(-1, keepdim=True)).to(q.dtype)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              sm_scale: float | None = None) -> torch.Tensor:
    """Exact attention in float32 (the yardstick every accuracy number here is measured against)."""
    sm_scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    group = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
    return torch.softmax((q.float() @ k.transpose(-1, -2)) * sm_scale, -1) @ v


def errors(out: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """Relative L2 and cosine of `out` against `ref`, over the whole tensor."""
    out, ref = out.double().flatten(), ref.double().flatten()
    rel = (out - ref).norm() / ref.norm().clamp_min(1e-30)
    cos = torch.nn.functional.cosine_similarity(out, ref, dim=0)
    return {"rel_l2": float(rel), "cosine": float(cos)}
