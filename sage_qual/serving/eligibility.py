"""Which SDPA calls SageAttention may serve, each refusal with a named reason.

Only tensor metadata is read (shape, dtype, strides, flags): nothing here may synchronize the
device. Device state (retired, no kernel) and scope state (out of memory) are the wrapper's.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, NamedTuple

import torch

from sage_qual.serving.config import WrapperConfig

# Every reason a call in a scope can fall back to PyTorch, in the order they are tested.
REASONS = (
    "arguments",  # arguments torch's SDPA does not have or refuses, or a scale the kernel cannot use
    "mask",
    "dropout",
    "causal",
    "shape",  # not 4-D tensors, nested, batch or key/value lengths mismatch
    "short",  # fewer query or key tokens than the break-even
    "dtype",  # not fp16/bf16, or mixed
    "head_dim",  # not a supported size, or K/V differ from Q
    "heads",  # query heads differ from K/V heads without enable_gqa, or do not divide
    "layout",  # last dimension not contiguous
    "grad",
    "autocast",
    "device",  # not all on one CUDA device, no kernel for it, or the device was retired
    "memory",  # this scope ran out of memory once
    "kernel_error",  # the kernel raised (the device is retired) or failed its first-call check
    "cache_error",  # Triton cache write failure (OSError) for this call
)


class SdpaCall(NamedTuple):  # a NamedTuple: built on every call in a scope, and cheap to build
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
        return float(self.scale) if self.scale is not None else self.query.shape[-1] ** -0.5


_DEFAULTS = SdpaCall(None, None, None)[3:]


def _bind(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
          enable_gqa=False, **unknown):  # torch's signature: scale and enable_gqa are keyword-only
    return SdpaCall(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa), unknown


def bind(args: tuple, kwargs: dict) -> tuple[SdpaCall | None, str | None]:
    """Arguments as torch's SDPA reads them, or a refusal for arguments it would not take."""
    if not kwargs and len(args) == 3:  # the common call: tuple.__new__ skips the NamedTuple's own
        return tuple.__new__(SdpaCall, args + _DEFAULTS), None  # __new__ (docs/benchmarks.md)
    try:
        call, unknown = _bind(*args, **kwargs)
    except TypeError as error:
        return None, str(error).replace("_bind()", "scaled_dot_product_attention()")
    if unknown:
        return None, f"unknown keywords {', '.join(sorted(unknown))}"
    return call, _refused_types(call)


def _refused_types(call: SdpaCall) -> str | None:
    """What torch's argument parser would refuse, or a scale the kernel cannot use; None if neither.

    Torch takes exactly a bool for the flags (not 0, None or a numpy bool) and a real number for
    dropout_p and scale (a 0-dim tensor too, which the kernel cannot take). A falsy value that
    torch refuses (dropout_p=None, is_causal=0) must not pass the rules as "off": the call goes
    to torch, which raises its own error, and never reaches the kernel.
    """
    _, _, _, attn_mask, dropout_p, is_causal, scale, enable_gqa = call
    if attn_mask is not None and not isinstance(attn_mask, torch.Tensor):
        return f"attn_mask is a {type(attn_mask).__name__} (torch takes a tensor or None)"
    for name, flag in (("is_causal", is_causal), ("enable_gqa", enable_gqa)):
        if flag.__class__ is not bool:
            return f"{name}={flag!r} (torch takes a bool)"
    if not isinstance(dropout_p, numbers.Real):
        return f"dropout_p={dropout_p!r} (torch takes a float)"
    if scale is not None:
        # torch takes int, float and NumPy scalars, not other numbers (Fraction, Decimal): those go to
        # torch, which raises its own error, rather than fail the first-call check and retire the GPU.
        if not isinstance(scale, numbers.Real) or not isinstance(scale, (int, float)) and \
                not hasattr(scale, "dtype"):
            return f"scale={scale!r} (the kernel takes a float)"
        if not (math.isfinite(scale) and scale > 0):
            return f"scale={scale!r} (the kernel needs a finite scale > 0)"
    return None


FP16_TYPES = (torch.float16, torch.bfloat16)


# A refusal: (reason, detail template, values). The detail text is formatted only when a scope
# sees the reason for the first time (`ScopeReport.fell_back`), never on the hot path.
Refusal = tuple[str, str, tuple]


def refusal(call: SdpaCall, config: WrapperConfig, cuda) -> Refusal | None:
    """Why SageAttention must not serve the call (see `Refusal`), None when it may.

    Runs on every call in a scope, so each property is read once and nothing is formatted
    (what a fallback costs is in docs/benchmarks.md).
    """
    q, k, v, attn_mask, dropout_p, is_causal, _, enable_gqa = call
    if attn_mask is not None:
        return "mask", "attn_mask given", ()
    if dropout_p:
        return "dropout", "dropout_p=%s", (dropout_p,)
    if is_causal:
        return "causal", "is_causal=True", ()
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
        return "shape", "query, key and value must be tensors", ()
    if q.is_nested or k.is_nested or v.is_nested:
        return "shape", "nested tensor", ()
    qs, ks = q.shape, k.shape  # each .shape builds a torch.Size (docs/benchmarks.md): v's waits
    if not len(qs) == len(ks) == v.dim() == 4:
        return "shape", "dims=(%d, %d, %d) (supported: 4)", (len(qs), len(ks), v.dim())
    # Tested early: it is the most common fallback inside a denoising loop.
    if qs[2] < config.min_query_tokens or ks[2] < config.min_key_tokens:
        return "short", "tokens=%d/%d (needs >= %d/%d)", (qs[2], ks[2], config.min_query_tokens,
                                                            config.min_key_tokens)
    if not (qs[0] and qs[1] and qs[2] and ks[2]):  # nothing to compute: torch returns the empty result
        return "shape", "empty call: batch=%d, heads=%d, tokens=%d/%d", (qs[0], qs[1], qs[2], ks[2])
    vs = v.shape
    if not qs[0] == ks[0] == vs[0]:
        return "shape", "batch=(%d, %d, %d) (must match)", (qs[0], ks[0], vs[0])
    if ks[1] != vs[1] or ks[2] != vs[2]:
        return "shape", "key %s and value %s differ in heads or length", (tuple(ks), tuple(vs))
    dtype = q.dtype
    if dtype not in FP16_TYPES or k.dtype != dtype or v.dtype != dtype:
        return "dtype", "dtype=(%s, %s, %s) (supported: one of float16, bfloat16)", (dtype, k.dtype, v.dtype)
    head_dim = qs[3]
    if head_dim not in config.head_dims:
        return "head_dim", "head_dim=%d (supported: %s)", (head_dim, ", ".join(map(str, config.head_dims)))
    if ks[3] != head_dim or vs[3] != head_dim:
        return "head_dim", "head_dim=(%d, %d, %d) (must match)", (head_dim, ks[3], vs[3])
    q_heads, kv_heads = qs[1], ks[1]
    if q_heads != kv_heads:
        if not enable_gqa:
            return "heads", "heads=%d/%d without enable_gqa", (q_heads, kv_heads)
        if kv_heads == 0 or q_heads % kv_heads:
            return "heads", "heads=%d/%d (query heads must be a multiple)", (q_heads, kv_heads)
    # stride()[-1]: stride(-1) parses its argument and costs more (docs/benchmarks.md).
    if q.stride()[-1] != 1 or k.stride()[-1] != 1 or v.stride()[-1] != 1:
        return "layout", "last-dim stride != 1", ()
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return "grad", "an input requires grad (SageAttention has no backward)", ()
    if cuda.autocast_enabled():
        return "autocast", "CUDA autocast is on", ()
    return None
