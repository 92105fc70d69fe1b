"""Which SDPA calls SageAttention may serve, each refusal with a named reason.

Only tensor metadata is read (shape, dtype, strides, flags, storage pointers): nothing here may
synchronize the device. Device state (retired, no kernel) and scope state (out of memory) are the wrapper's.
A served masked call's query rows that its mask keeps no key for are set on the device to what torch
gives them (`rows_without_keys`).
"""

from __future__ import annotations

import math
import numbers
from typing import Any, NamedTuple

import torch

from sage_qual.kernels.variants import mask_broadcasts
from sage_qual.limits import SPAN_PAD_TOKENS as SPAN_PAD
from sage_qual.serving.config import WrapperConfig

# Every reason a call in a scope can fall back to PyTorch, in the order they are tested.
REASONS = (
    "arguments",  # arguments torch's SDPA does not have or refuses, or a scale the kernel cannot use
    "mask",
    "dropout",
    "causal",
    "shape",  # not 4-D tensors, nested, batch or key/value lengths mismatch
    "short",  # fewer query or key tokens than the break-even
    "long",  # more query or key tokens than the profile verified
    "bound",  # fewer tokens than a bound of the profile (a certified failure there)
    "dtype",  # not fp16/bf16, or mixed
    "head_dim",  # not a supported size, or K/V differ from Q
    "heads",  # query heads differ from K/V heads without enable_gqa, or do not divide
    "layout",  # last dimension not contiguous, or a layout the profile did not verify
    "grad",
    "autocast",
    # A tensor spans or holds more elements than the kernel's 32-bit offsets reach. The last rule of
    # `refusal`: a call refused for it passed every other one, and may be served from copies.
    "span",
    "device",  # not all on one CUDA device, no kernel for it, or the device was retired
    # Execution contexts (`contexts.REASON`) the served variant is not certified safe in:
    "capture",  # the current stream is capturing a CUDA graph
    "stream",  # a side stream
    "compile",  # inside code torch.compile compiled
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
    if attn_mask is not None and not config.masks:
        return "mask", "attn_mask given (no masked call was certified here)", ()
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
    max_q, max_k = config.max_query_tokens, config.max_key_tokens
    if (max_q is not None and qs[2] > max_q) or (max_k is not None and ks[2] > max_k):
        return "long", "tokens=%d/%d (verified up to %s/%s)", (qs[2], ks[2], max_q or "any", max_k or "any")
    for bound in config.bounds:  # usually none or one
        if (qs[2] if bound.side == "query" else ks[2]) < bound.below:
            return "bound", "tokens=%d/%d: %s", (qs[2], ks[2], bound.text())
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
    # stride() once per tensor, indexed: stride(-1) parses its argument and costs more (docs/benchmarks.md).
    qst, kst, vst = q.stride(), k.stride(), v.stride()
    if qst[3] != 1 or kst[3] != 1 or vst[3] != 1:
        return "layout", "last-dim stride != 1", ()
    if config.layouts is not None:
        layout = _layout((q, k, v), (qs, ks, vs), (qst, kst, vst))
        if layout not in config.layouts:
            return "layout", "layout %s (verified: %s)", (layout, ", ".join(config.layouts))
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return "grad", "an input requires grad (SageAttention has no backward)", ()
    if cuda.autocast_enabled():
        return "autocast", "CUDA autocast is on", ()
    if attn_mask is not None:
        refused = _mask_refusal(attn_mask, q, (qs[0], qs[1], qs[2], ks[2]), cuda)
        if refused is not None:
            return refused
    # Checked before the call: past 2^31 elements every kernel faults on a strided view (which
    # poisons the CUDA context) and the sm90 kernel aborts the process, which no except can catch
    # (limits.MAX_SPAN_ELEMENTS). Last of the rules, so that `span` means every other one passed: the
    # wrapper may then serve the call from contiguous copies (issue 28: with `span` before `grad`
    # and `autocast`, a long strided view that required grad was served, and backward() raised).
    limit = config.max_span_elements
    if extent(qs, qst) > limit or extent(ks, kst) > limit or extent(vs, vst) > limit:
        return span_refusal(call, limit)
    return None


# What comfy-kitchen's kernel takes for a mask (sage_attention.py, _validate_inputs; any other
# dtype raises there): bool, True keeping a key, or an additive float bias, -inf dropping one.
MASK_DTYPES = (torch.bool, torch.float16, torch.bfloat16, torch.float32)


def _mask_refusal(mask: torch.Tensor, q: torch.Tensor, scores: tuple[int, ...], cuda) -> Refusal | None:
    """Why a mask cannot go to the kernel as SDPA takes it (None: it can): its dtype, a shape that
    does not broadcast to the scores' [B, H, N_q, N_k], a gradient, or another GPU than q's."""
    if mask.dtype not in MASK_DTYPES:
        return "mask", "attn_mask dtype %s (served: bool, float16, bfloat16, float32)", (mask.dtype,)
    if not mask_broadcasts(mask.shape, scores):
        return "mask", "attn_mask shape %s (must broadcast to %s)", (tuple(mask.shape), scores)
    if mask.requires_grad and torch.is_grad_enabled():
        return "grad", "attn_mask requires grad (SageAttention has no backward)", ()
    if cuda.tensor_device(mask) != cuda.tensor_device(q):
        return "mask", "attn_mask on another device than the query", ()
    return None


def rows_without_keys(mask: torch.Tensor) -> torch.Tensor:
    """[..., N_q, 1], True where `mask` (as SDPA takes it) keeps no key for a query row. torch's SDPA
    gives such a row zeros, and so does the wrapper: comfy-kitchen's kernel gives zeros on the H100, its
    public fake NaN (run 47, docs/providers.md). Computed on the device: deciding a fallback on it
    would read the device at every masked call."""
    if mask.dtype == torch.bool:
        return ~mask.any(-1, keepdim=True)
    return mask.amax(-1, keepdim=True) == float("-inf")  # no mask-sized temporary


# Spans ------------------------------------------------------------------------------------------

def padded_count(shape) -> int:
    """Elements of a contiguous copy of a 4-D tensor with its sequence padded as the kernels pad it
    (limits.SPAN_PAD_TOKENS)."""
    b, h, n, d = shape
    return b * h * ((n + SPAN_PAD - 1) // SPAN_PAD * SPAN_PAD) * d


def extent(shape, stride) -> int:
    """Elements a kernel may address from a 4-D tensor's data pointer: its span, 1 + sum((size-1) *
    stride), or its padded element count where that is larger (`padded_count`; also a stride-0
    view's: the kernel's output and quantized copies hold every element); 0 when it is empty.
    Plain arithmetic: it runs on every served call."""
    b, h, n, d = shape
    count = b * h * ((n + SPAN_PAD - 1) // SPAN_PAD * SPAN_PAD) * d  # padded_count(), without the call
    span = (b - 1) * stride[0] + (h - 1) * stride[1] + (n - 1) * stride[2] + (d - 1) * stride[3] + 1
    return span if span > count and count else count


def span_refusal(call: SdpaCall, limit: int) -> Refusal:
    """The `span` refusal naming the first tensor past `limit`: its span, its padded copy's size."""
    for name, tensor in (("query", call.query), ("key", call.key), ("value", call.value)):
        shape, stride = tensor.shape, tensor.stride()
        if extent(shape, stride) > limit:
            steps = zip(shape, stride, strict=False)
            span = 1 + sum((size - 1) * step for size, step in steps) if tensor.numel() else 0
            return ("span", "span=%d elements of %s, %d in a contiguous copy padded to %d tokens (limit %d)",
                    (span, name, padded_count(shape), SPAN_PAD, limit))
    raise ValueError("span_refusal() called for a call within the limit")


def copies_fit(call: SdpaCall, limit: int) -> bool:
    """Whether contiguous copies of the call's tensors, padded, are all within `limit` elements."""
    return (padded_count(call.query.shape) <= limit and padded_count(call.key.shape) <= limit
            and padded_count(call.value.shape) <= limit)


def within_span(call: SdpaCall, limit: int) -> SdpaCall:
    """The call with a contiguous copy of each tensor past `limit` (the others as given)."""
    return call._replace(**{name: tensor.contiguous() for name, tensor in
                            (("query", call.query), ("key", call.key), ("value", call.value))
                            if extent(tensor.shape, tensor.stride()) > limit})


# Layouts ----------------------------------------------------------------------------------------
# Plain arithmetic on shapes and strides the rules read already: with a profile's layouts, every
# served call is classified.

def _transposed(shape, stride) -> bool:
    """Whether a [B, H, N, D] tensor with a contiguous last dimension is a contiguous [B, N, H, D]
    viewed as [B, H, N, D] (a dimension of size 1 may have any stride, as in is_contiguous())."""
    b, h, n, d = shape
    return ((h == 1 or stride[1] == d) and (n == 1 or stride[2] == h * d)
            and (b == 1 or stride[0] == n * h * d))


def _fused(tensors, shapes, strides) -> bool:
    """q, k and v views into one [B, N, (Hq + 2 Hkv) * D] projection: one storage, and a token's row
    holding all three (a fused QKV linear layer's output, split and viewed as [B, H, N, D])."""
    row = (shapes[0][1] + shapes[1][1] + shapes[2][1]) * shapes[0][3]
    for (b, _, n, _), stride in zip(shapes, strides, strict=False):
        if (n > 1 and stride[2] != row) or (b > 1 and stride[0] != n * row):
            return False
    q, k, v = tensors
    storage = q.untyped_storage().data_ptr()
    return k.untyped_storage().data_ptr() == storage == v.untyped_storage().data_ptr()


def _layout(tensors, shapes, strides) -> str:
    q, k, v = tensors
    if q.is_contiguous() and k.is_contiguous() and v.is_contiguous():
        return "contiguous"
    if _transposed(shapes[0], strides[0]) and _transposed(shapes[1], strides[1]) and \
            _transposed(shapes[2], strides[2]):
        return "transposed"
    if _fused(tensors, shapes, strides):
        return "fused_qkv"
    return "strided"


def layout_of(q, k, v) -> str:
    """The memory layout of a call's 4-D [B, H, N, D] tensors with contiguous last dimensions, each
    name in `variants.LAYOUTS`: "contiguous"; "transposed", each a contiguous [B, N, H, D] viewed as
    [B, H, N, D] (diffusers' projections); "fused_qkv", views into one fused projection; else
    "strided" (also when q, k and v differ, which no profile verifies)."""
    return _layout((q, k, v), (q.shape, k.shape, v.shape), (q.stride(), k.stride(), v.stride()))
