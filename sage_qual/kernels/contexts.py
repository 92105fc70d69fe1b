"""Execution contexts: where a served call runs besides eagerly on the default CUDA stream.

A call runs in zero or more of these contexts at once (a compiled graph replayed on a side stream
is all three). Each has the fallback reason the wrapper reports when the served variant is not safe
in it, and certify checks each variant in each (`qualification.context_check`).

Measured on one H200 (SageAttention 2.2.0 from thu-ml's newest source for sm90, torch 2.11.0+cu130,
[1, 24, 16384, 128] bf16, smoothing off; docs/results/run19-h200/): the CUDA kernels launch on the
legacy default stream, so on a busy side stream the FP8 kernels (sm89, sm90, sm120 per-warp) returned
NaN and the sm80 FP16 kernels were 1.0 relative L2 off, and a CUDA-graph replay was 1.0-1.41 off; the
Triton kernel, which launches on torch's current stream, was bit-identical in both.
"""

from __future__ import annotations

from sage_qual.kernels.variants import Variant

SIDE_STREAM = "side_stream"  # torch's current stream is not the device's default stream
CAPTURE = "capture"  # the current stream is capturing a CUDA graph
COMPILE = "compile"  # called from code torch.compile compiled (the `sage_qual::sdpa` operator)
CONTEXTS = (SIDE_STREAM, CAPTURE, COMPILE)

# The checks certify runs (`qualification.context_check`), each in one context: a context is safe for
# a variant when every check of it passed.
CHECKS = {"side_stream": SIDE_STREAM, "capture": CAPTURE, "compile": COMPILE,
          "compile_reduce_overhead": COMPILE}

# The fallback reason of each context, as `eligibility.REASONS` lists them.
REASON = {SIDE_STREAM: "stream", CAPTURE: "capture", COMPILE: "compile"}


def builtin_safe(variant: Variant) -> tuple[str, ...]:
    """The contexts a variant is trusted in without a certified profile saying otherwise.

    A kernel on torch's current stream is safe in all. A legacy-stream kernel is safe on a side
    stream because the wrapper bridges the call onto the legacy stream with events
    (`platform.CudaPlatform.on_legacy_stream`), and under compile because the compiled graph calls
    it eagerly through an opaque operator; never under capture, which cannot record the legacy stream.
    """
    if variant.kernel_function.launches_on == "current":
        return CONTEXTS
    return (SIDE_STREAM, COMPILE)


def check_names(names, where: str) -> None:
    """Raise ValueError naming `where` when `names` is not a tuple or list of context names."""
    if isinstance(names, str) or not isinstance(names, (tuple, list)):
        raise ValueError(f"{where}={names!r}: give a list of context names from {', '.join(CONTEXTS)}")
    unknown = [name for name in names if name not in CONTEXTS]
    if unknown:
        raise ValueError(f"{where}: {unknown[0]!r} is not an execution context sage-qual knows "
                         f"({', '.join(CONTEXTS)})")
