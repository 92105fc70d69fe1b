"""What torch.compile sees of an SDPA call once the wrapper is installed: one opaque operator.

Without it, TorchDynamo breaks the graph at the scope's ContextVar (`ContextVar.get` is not
traceable: torch 2.13 says so on the CPU) and traces the rest of the wrapper, the kernel with it, into
the next graph, and `mode="reduce-overhead"` records the legacy-stream CUDA kernels into a CUDA graph
that does not replay them (run 19 measured such a replay 1.0-1.41 relative L2 off for every CUDA
variant, docs/results/run19-h200/).
So, while compiling, the wrapper emits `sage_qual::sdpa` (or `sage_qual::sdpa_outside_cuda_graphs`)
instead, following PyTorch's custom-operator guidance (torch.library.custom_op with a fake
implementation). The operator's body runs when the compiled code runs: it reads the thread's scope
then, applies every rule the eager path applies (the `compile` context among them) and returns
the kernel's or torch's output.

Which operator is emitted is fixed when tracing, per device: where the served variant is not safe
under capture, the operator carries `torch.Tag.cudagraph_unsafe` (read where it exists: torch's
tags.yaml has it, Inductor's graph partition splits on it since pytorch/pytorch PR 149782, and the
device's 2.11 and CI's 2.13 have it), so Inductor's CUDA graphs leave it out: the graph is not recorded (or,
with `torch._inductor.config.graph_partition`, is split around it) and the kernel runs eagerly. On a
torch without the tag, the body still sees the capture and falls back with the reason `capture`.
"""

# No `from __future__ import annotations`: custom_op reads _body's annotations as types, and string
# ones fail to resolve where the function is wrapped (mutmut's trampolines, docs/mutation.md).
import inspect
from typing import Callable, Optional

import torch
from torch import Tensor

_UNSAFE_TAG = getattr(torch.Tag, "cudagraph_unsafe", None)
_TAKES_TAGS = "tags" in inspect.signature(torch.library.custom_op).parameters

# What the operators' bodies call: set by the wrapper at install (wrapper._serve_compiled).
serve: Callable[..., Tensor] | None = None


def _body(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor], dropout_p: float,
          is_causal: bool, scale: Optional[float], enable_gqa: bool) -> Tensor:
    out = serve(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                scale=scale, enable_gqa=enable_gqa)
    return out.contiguous()  # the layout `_fake` promises the compiler (the kernels' own)


def _fake(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    return query.new_empty((*query.shape[:-1], value.shape[-1]))


def _define(name: str, tags: tuple) -> Callable:
    extra = {"tags": tags} if _TAKES_TAGS and tags else {}
    op = torch.library.custom_op(f"sage_qual::{name}", _body, mutates_args=(), **extra)
    op.register_fake(_fake)
    return op


sdpa = _define("sdpa", ())  # the served variant is capture-safe on this device
sdpa_outside_cuda_graphs = _define("sdpa_outside_cuda_graphs", (_UNSAFE_TAG,) if _UNSAFE_TAG else ())
KEEPS_OUT_OF_CUDA_GRAPHS = bool(_TAKES_TAGS and _UNSAFE_TAG)


def traced_call(original, graph_safe_devices: frozenset, query, key, value, attn_mask=None, dropout_p=0.0,
                is_causal=False, *, scale=None, enable_gqa=False, **unknown):
    """What the wrapper returns while Dynamo traces an SDPA call. Calls that need a gradient, run
    under autocast or have arguments torch would refuse are traced as torch's own (the operator has
    no backward, and autocast would change its output type); they are not counted by a scope."""
    tensors = (query, key, value)
    if unknown or not all(isinstance(t, Tensor) for t in tensors) or \
            (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)) or \
            torch.is_autocast_enabled(query.device.type):
        return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                        scale=scale, enable_gqa=enable_gqa, **unknown)
    op = sdpa if query.device.index in graph_safe_devices and query.device.type == "cuda" \
        else sdpa_outside_cuda_graphs
    return op(query, key, value, attn_mask, float(dropout_p), is_causal,
              None if scale is None else float(scale), enable_gqa)
