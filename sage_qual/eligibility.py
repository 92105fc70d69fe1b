"""Which SDPA calls SageAttention may serve, each refusal with a named reason.

Only tensor metadata is read (shape, dtype, strides, flags): nothing here may synchronize the
device. Device state (retired, no kernel) and scope state (out of memory) are the wrapper's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .config import WrapperConfig

# Every reason a call in a scope can fall back to PyTorch, in the order they are tested.
REASONS = (
    "arguments",  # positional/keyword arguments torch's SDPA does not have
    "mask",
    "dropout",
    "causal",
    "shape",  # not 4-D tensors, nested, batch or key/value lengths mismatch
    "dtype",  # not fp16/bf16, or mixed
    "head_dim",  # not a supported size, or K/V differ from Q
    "heads",  # query heads differ from K/V heads without enable_gqa, or do not divide
    "short",  # fewer query or key tokens than the break-even
    "layout",  # last dimension not contiguous
    "grad",
    "autocast",
    "device",  # not all on one CUDA device, no kernel for it, or the device was retired
    "memory",  # this scope ran out of memory once
    "kernel_error",  # the kernel raised (the device is retired) or failed its first-call check
    "cache_error",  # Triton cache write failure (OSError) for this call
)


@dataclass(frozen=True)
class SdpaCall:
    query: Any
    key: Any
    value: Any
    attn_mask: Any = None
    dropout_p: float = 0.0
    is_causal: bool = False
    scale: float | None = None
    enable_gqa: bool = False

    @property
    def sm_scale(self) -> float:
        return self.scale if self.scale is not None else self.query.shape[-1] ** -0.5


def _bind(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
          enable_gqa=False, **unknown):  # torch's signature: scale and enable_gqa are keyword-only
    return SdpaCall(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa), unknown


def bind(args: tuple, kwargs: dict) -> tuple[SdpaCall | None, str | None]:
    """Arguments as torch's SDPA reads them, or a refusal for arguments it would not take."""
    try:
        call, unknown = _bind(*args, **kwargs)
    except TypeError as error:
        return None, f"arguments: {error}"
    if unknown:
        return None, f"arguments: unknown keywords {', '.join(sorted(unknown))}"
    return call, None


FP16_TYPES = (torch.float16, torch.bfloat16)


def refusal(call: SdpaCall, config: WrapperConfig, autocast_enabled: bool) -> tuple[str, str] | None:
    """(reason, detail) when SageAttention must not serve the call, None when it may."""
    q, k, v = call.query, call.key, call.value
    if call.attn_mask is not None:
        return "mask", "attn_mask given"
    if call.dropout_p:
        return "dropout", f"dropout_p={call.dropout_p}"
    if call.is_causal:
        return "causal", "is_causal=True"
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return "shape", "query, key and value must be tensors"
    if any(t.is_nested for t in (q, k, v)):
        return "shape", "nested tensor"
    if not q.dim() == k.dim() == v.dim() == 4:
        return "shape", f"dims=({q.dim()}, {k.dim()}, {v.dim()}) (supported: 4)"
    if not q.shape[0] == k.shape[0] == v.shape[0]:
        return "shape", f"batch=({q.shape[0]}, {k.shape[0]}, {v.shape[0]}) (must match)"
    if k.shape[1:3] != v.shape[1:3]:
        return "shape", f"key {tuple(k.shape)} and value {tuple(v.shape)} differ in heads or length"
    if q.dtype not in FP16_TYPES or not q.dtype == k.dtype == v.dtype:
        return "dtype", f"dtype=({q.dtype}, {k.dtype}, {v.dtype}) (supported: one of float16, bfloat16)"
    head_dim = q.shape[-1]
    if head_dim not in config.head_dims:
        return "head_dim", f"head_dim={head_dim} (supported: {', '.join(map(str, config.head_dims))})"
    if not k.shape[-1] == v.shape[-1] == head_dim:
        return "head_dim", f"head_dim=({head_dim}, {k.shape[-1]}, {v.shape[-1]}) (must match)"
    q_heads, kv_heads = q.shape[1], k.shape[1]
    if q_heads != kv_heads:
        if not call.enable_gqa:
            return "heads", f"heads={q_heads}/{kv_heads} without enable_gqa"
        if kv_heads == 0 or q_heads % kv_heads:
            return "heads", f"heads={q_heads}/{kv_heads} (query heads must be a multiple)"
    if q.shape[2] < config.min_query_tokens or k.shape[2] < config.min_key_tokens:
        return "short", (f"tokens={q.shape[2]}/{k.shape[2]} (needs >= "
                         f"{config.min_query_tokens}/{config.min_key_tokens})")
    if any(t.stride(-1) != 1 for t in (q, k, v)):
        return "layout", "last-dim stride != 1"
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return "grad", "an input requires grad (SageAttention has no backward)"
    if autocast_enabled:
        return "autocast", "CUDA autocast is on"
    return None
