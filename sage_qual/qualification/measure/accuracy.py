"""GPU measurements shared by `pytest -m slow` and `sage-qual certify`: accuracy, memory, time.

One implementation, so the suite's numbers and the report's agree. Accuracy follows the
FlashAttention tests: the kernel's error against a float32 reference is reported next to the
error of PyTorch's SDPA in the input precision against the same reference.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from sage_qual.kernels.variants import Variant
from sage_qual.qualification.evidence.report_model import Metrics
from sage_qual.serving.torch_sdpa import TORCH_SDPA  # torch's own, whatever is bound over it

# Query rows per block of the per-block error: the smallest Q tile of any variant's CTA (sm90: 64),
# so a defect confined to one kernel tile shows in at least one block.
ROW_BLOCK = 64


@dataclass(frozen=True)
class Accuracy(Metrics):
    """A kernel's `Metrics` (rel_l2: over the positions where the reference is finite; the worst slice:
    per query head, per batch item, per block of ROW_BLOCK query rows of one (item, head), each against
    its own reference norm or the norm a slice of its size has at the tensor's mean energy when that is
    larger, so a slice whose reference is near zero is not divided by nothing; max_abs_error: the
    element-wise criterion of FlashAttention's and cuDNN's tests, inf where the output is not finite,
    which sees a few wrong elements that move no aggregate: one element off by 3x the output's RMS
    moves its 64-row block's relative L2 by ~0.03), next to PyTorch SDPA's in the input precision."""
    sdpa_rel_l2: float = math.nan
    error_vs_sdpa: float = math.nan  # rel_l2 / sdpa_rel_l2


def reference(q, k, v, scale: float | None = None, attn_mask=None) -> torch.Tensor:
    """Float32 attention through PyTorch's math backend (no TF32, no fused approximations)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    group = q.shape[1] // k.shape[1]
    with sdpa_kernel([SDPBackend.MATH]):
        return TORCH_SDPA(q.float(), k.float(), v.float(), attn_mask=attn_mask, scale=scale,
                          enable_gqa=group > 1)


def compare(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float, bool]:
    """(relative L2, worst per-head cosine, finite where ref is) of `out` against `ref`."""
    found = errors(out, ref)
    return found.rel_l2, found.worst_head_cosine, found.finite


def _slice_errors(diff: torch.Tensor, ref: torch.Tensor, dims: tuple[int, ...]) -> float:
    """Worst relative L2 over the slices that keep `dims` (the rest summed), see Accuracy."""
    others = tuple(d for d in range(diff.dim()) if d not in dims)
    diff_sq = diff.square().sum(others)
    ref_sq = ref.square().sum(others)
    share = ref.square().sum() / ref_sq.numel()
    return (diff_sq / torch.maximum(ref_sq, share).clamp_min(1e-30)).sqrt().max().item()


def errors(out: torch.Tensor, ref: torch.Tensor) -> Metrics:
    """The errors of `out` [B, H, N, D] against `ref` (see Accuracy); non-finite ones as they are."""
    out, ref = out.float(), ref.float()  # float32 sums: 1e-6 relative over 1e7 elements, ample here
    valid = torch.isfinite(ref)
    finite = bool(torch.isfinite(out)[valid].all())
    ref0 = torch.where(valid, ref, 0.0)
    # NaN and +-inf count as infinitely wrong (nan_to_num would map +-inf to float32's largest value).
    diff = torch.where(valid, out - ref, 0.0).nan_to_num(nan=float("inf"), posinf=float("inf"),
                                                         neginf=float("inf"))
    ref_norm = torch.linalg.vector_norm(ref0).clamp_min(1e-30)
    rel_l2 = (torch.linalg.vector_norm(diff) / ref_norm).item()
    flat_out = out.flatten(2).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    flat_ref = ref.flatten(2).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    # In float64: a float32 cosine of a tensor with itself is 1 +- 4e-5 at values near 3500
    # (qwen_image_b52_value_offset), which would put an exact output below a cosine bound near 1.
    cosine = F.cosine_similarity(flat_out.double(), flat_ref.double(), dim=-1, eps=1e-30).min().item()
    if not finite:
        cosine = float("nan")
    b, h, n, d = diff.shape
    pad = -n % ROW_BLOCK
    blocks = F.pad(diff, (0, 0, 0, pad)).view(b, h, -1, ROW_BLOCK, d)
    ref_blocks = F.pad(ref0, (0, 0, 0, pad)).view(b, h, -1, ROW_BLOCK, d)
    return Metrics(
        rel_l2=rel_l2, worst_head_cosine=cosine, finite=finite,
        worst_head_rel_l2=_slice_errors(diff, ref0, (1,)),
        worst_batch_rel_l2=_slice_errors(diff, ref0, (0,)),
        worst_block_rel_l2=_block_errors(blocks, ref_blocks, n),
        norm_ratio=(torch.linalg.vector_norm(torch.where(valid, out, 0.0)) / ref_norm).item(),
        max_abs_error=diff.abs().max().item())


def _block_errors(blocks: torch.Tensor, ref_blocks: torch.Tensor, rows: int) -> float:
    """Worst relative L2 over the (item, head, row block) slices; a last, partial block's
    mean-energy share is scaled to the rows it holds."""
    diff_sq = blocks.square().sum((-1, -2))
    ref_sq = ref_blocks.square().sum((-1, -2))
    sizes = torch.full(diff_sq.shape[-1:], float(ROW_BLOCK), dtype=diff_sq.dtype, device=diff_sq.device)
    sizes[-1] = rows - ROW_BLOCK * (sizes.numel() - 1)
    share = ref_blocks.square().sum() * sizes / (rows * diff_sq.shape[0] * diff_sq.shape[1])
    return (diff_sq / torch.maximum(ref_sq, share).clamp_min(1e-30)).sqrt().max().item()


def call_kernel(package, variant: Variant, q, k, v, scale: float | None = None, smooth_k: bool = False,
                attn_mask=None):
    """Call one variant directly (never through sageattn()), K smoothing as asked, with the call's mask."""
    sm_scale = scale if scale is not None else q.shape[-1] ** -0.5
    return variant.invoke(package.kernel(variant), q, k, v, sm_scale, smooth_k=smooth_k, attn_mask=attn_mask)


def accuracy(out, q, k, v, ref=None, scale: float | None = None, attn_mask=None) -> Accuracy:
    ref = reference(q, k, v, scale, attn_mask) if ref is None else ref
    found = errors(out, ref)
    sdpa = TORCH_SDPA(q, k, v, attn_mask=attn_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    sdpa_rel_l2 = errors(sdpa, ref).rel_l2
    ratio = found.rel_l2 / sdpa_rel_l2 if sdpa_rel_l2 > 0 else float("inf")
    return Accuracy(**vars(found), sdpa_rel_l2=sdpa_rel_l2, error_vs_sdpa=ratio)


def extra_peak_bytes(fn: Callable[[], torch.Tensor], device: int) -> tuple[torch.Tensor, int]:
    """Run fn once; return its result and the peak bytes it allocated beyond its own output."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    out = fn()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    return out, peak - out.numel() * out.element_size()


def elements(*tensors) -> int:
    return sum(t.numel() for t in tensors)


def pipelined_ms(fn: Callable[[], object], calls: int = 20) -> tuple[float, float]:
    """(GPU ms per call, host us per call) for `calls` back-to-back calls with no synchronization
    between them, as a pipeline issues them: the GPU time hides host time that fits under it."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    host_start = time.perf_counter()
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    host_us = (time.perf_counter() - host_start) * 1e6 / calls
    end.synchronize()
    return start.elapsed_time(end) / calls, host_us


def median_ms(fn: Callable[[], object], warmup: int = 5, repeats: int = 20) -> float:
    """Median time of fn in milliseconds, timed with CUDA events after warm-up."""
    return statistics.median(timings_ms(fn, warmup, repeats))


def timings_ms(fn: Callable[[], object], warmup: int = 5, repeats: int = 20) -> list[float]:
    """Each of `repeats` calls of fn in milliseconds, timed with CUDA events after warm-up (certify
    keeps them all, for a confidence interval of the median)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times
