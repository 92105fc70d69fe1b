"""Every limit sage-qual applies, defined once, each with why and where its number comes from.

Serving (the wrapper), qualification (certify's workers and verdicts) and the GPU tests import
these names; nothing else writes the numbers. A number measured on a GPU cites the file of this
repository that holds the measurement.
"""

from __future__ import annotations

import re

# --- The wrapper -------------------------------------------------------------------------------
# Fewest query / key tokens a call needs before SageAttention serves it: below them quantizing
# costs more than the kernel saves. The break-even the InvokeAI SageAttention backend shipped,
# measured on an RTX 4090 (InvokeAI PR #9657); on an H200 the sm90 kernel only pays from about
# 13.7k-16k tokens (docs/results/README.md, run 2), which a certified profile, or on a GPU measured
# here the built-in defaults (sage_qual/serving/defaults.py), put in their place.
MIN_QUERY_TOKENS = 1536
MIN_KEY_TOKENS = 512

# First-call check: the last CHECK_ROWS query rows of one sample and one K/V group, recomputed with
# torch (a few MiB at most, so the checked call costs no more memory than later ones:
# docs/results/README.md, "Extra memory per call", first checked call and later calls equal).
CHECK_ROWS = 1024
# The first-call check and the audit judge a served call's slice against the family's fitness bound
# (sage_qual/verdicts/fitness.py, `family_bound`) and the variant's numerics model (`serving.slice_check`).
# The audit of served calls (`serving.audit`): one served call in each block of AUDIT_EVERY per device
# recomputes AUDIT_ROWS query rows of one head group with torch. In a 4-layer model at 16,384 tokens
# (24 heads of 128, bf16) on an H100 80GB HBM3, auditing every call with torch alone cost 2.3 % of
# model time (1.013-1.028 over 14 repeats), 1 in 100 0.998x (0.991-1.002): below the repeats' spread,
# where 1 % was the budget
# (docs/results/run43-h100/audit, run44-h100; docs/benchmarks.md, "The audit").
AUDIT_EVERY = 100
AUDIT_ROWS = 256

# Consecutive Triton cache write failures (OSError) before a GPU is retired. A policy, not a
# measurement: one failure is a race between processes sharing a cache, three in a row a cache
# that cannot be written.
CACHE_ERROR_LIMIT = 3

# Largest element span (1 + sum((size-1)*stride) from the data pointer) and element count of one
# tensor the wrapper hands a kernel, unless a certified profile names its own. On one H200
# (SageAttention 2.2.0 for sm90, torch 2.11.0+cu130, issue 16): q, k, v as views into a fused
# [1, N, 3*56*128] bf16 projection gave results bit-identical to contiguous copies at N = 90,000
# (span 1.94e9) and an illegal memory access in the Triton Q/K quantizer all four kernel families
# share at N = 100,000 (2.15e9), which poisons the CUDA context; a contiguous [1, 56, 300000, 128]
# (2.15e9 elements) makes the sm90 extension abort the process (exit 134), 290,000 (2.08e9) runs.
# Field reports of the same 32-bit offsets: thu-ml/SageAttention issue 386 (int32 in the Triton
# quantizers), kijai/ComfyUI-KJNodes pull request 748 (uint32 in the fused V transpose). So every
# offset must fit a signed 32-bit integer: at most 2^31 - 1 elements.
MAX_SPAN_ELEMENTS = 2**31 - 1


def query_span(layout: str, tokens: int, heads: int, head_dim: int) -> int:
    """The elements a span probe's query spans from its data pointer: [1, heads, tokens, head_dim]
    contiguous, or a view into a fused [1, tokens, 3 * heads * head_dim] projection."""
    if layout == "contiguous":
        return heads * tokens * head_dim
    return heads * head_dim + (tokens - 1) * 3 * heads * head_dim


# The element count is taken at the sequence length rounded up to this many tokens: upstream's sm90
# function (sageattention/core.py, sageattn_qk_int8_pv_fp8_cuda_sm90) pads V with zeros to a
# multiple of 128 tokens before its FP8 copy, so a V just under the limit has a copy past it.
SPAN_PAD_TOKENS = 128

# --- Certify ----------------------------------------------------------------------------------
# The call each variant is checked at in every execution context (`qualification.context_check`):
# issue 24's [1, 24, 16384, 128] bf16, where the legacy-stream CUDA kernels gave NaN or 1.0 relative L2
# on a busy side stream and 1.0-1.41 after a graph replay (one H200, docs/results/run19-h200/).
CONTEXT_CHECK_SHAPE = (1, 24, 16384, 128)

# Extra peak memory per call, bytes per element of q+k+v. SageAttention's quantized copies cost
# fp8 1.36-1.72 and fp16 1.19-1.39 on the H200 (docs/results/README.md, run 3); 2.5 leaves room
# and still catches a kernel that copies its inputs twice.
MEMORY_BOUND = 2.5

# Seconds a worker may send nothing before it is killed (`certify --timeout`'s default). The
# slowest task measured took 8.6 s (docs/results/run2-h200-certify-full/report.json.gz, a first
# fixture with kernel compilation): 90 s is ten times that, and a hung kernel still costs little.
TASK_TIMEOUT = 90.0
# The first task of a worker initializes CUDA and compiles kernels (Triton into an empty cache):
# it gets at least this long. A margin over TASK_TIMEOUT for a cold cache on a slower host, not a
# measurement.
STARTUP_TIMEOUT = 120.0

# Workers of one job that may crash or hang before the rest of its tasks are skipped, so one
# broken variant cannot use up the time of the whole run. A policy, not a measurement.
MAX_WORKER_FAILURES = 2

# Largest JSON file (report, profile) sage-qual reads: a full certify report of eight variants on
# two H200s is 0.44 MB (docs/results/run8-h200x2-final/certify/certify-a/report.json.gz), and reading
# takes about three times the file's size in memory. A policy with a wide margin, not a measurement.
MAX_JSON_BYTES = 32 * 2**20


def startup_timeout(task_timeout: float) -> float:
    """What a worker's first task gets when tasks get `task_timeout`."""
    return max(STARTUP_TIMEOUT, task_timeout)


# --- What a person reads ------------------------------------------------------------------------
# Longest status line sage-qual shows (install()'s reason, a device's profile note, a scope's
# summary, the profile warning): a policy, so that a line fits a log viewer and can be acted on
# (issue 17: a 1,785-character reason could not). The full lists stay in attributes.
STATUS_LINE_LIMIT = 200


def one_line(text: str, limit: int = STATUS_LINE_LIMIT) -> str:
    """`text` in at most `limit` characters. The lists in parentheses go first, the longest first,
    each left as "(...)": they are the supporting detail (SDXL's reason kept its seven per-shape
    speedups and lost "27,520 key tokens" to a plain cut, issue 54). An aside that is no list, as
    "(run sage-qual certify here)", is advice and stays. Only then is the end cut, to "...": a
    message puts its number and its advice before that point. Linear in the text: the asides are
    found in one pass (4,000 of them took 22 s when each cut searched the text again, issue 64)."""
    if len(text) <= limit:
        return text
    excess, chosen = len(text) - limit, []
    # The longest first; among equals the last, as a reader meets the earlier ones first.
    for start, end in sorted(_list_asides(text), key=lambda span: (span[1] - span[0], span[0]), reverse=True):
        if excess <= 0:
            break
        chosen.append((start, end))
        excess -= end - start - len("(...)")
    pieces, at = [], 0
    for start, end in sorted(chosen):
        pieces += [text[at:start], "(...)"]
        at = end
    text = "".join(pieces) + text[at:]
    if len(text) > limit:  # an aside the cut splits goes whole: "(..." would read as "(...)"
        return re.sub(r"\s*\([^()]*$", "", text[: limit - 3]).rstrip() + "..."
    return text


def _list_asides(text: str) -> list[tuple[int, int]]:
    """(start, end) of every balanced top-level "(...)" holding a list (", ")."""
    depth, opened, found, comma = 0, 0, [], False
    for at, char in enumerate(text):
        if char == "(":
            if depth == 0:
                opened, comma = at, False
            depth += 1
        elif char == ")" and depth:
            depth -= 1
            if depth == 0 and comma:
                found.append((opened, at + 1))
        elif char == "," and depth and text.startswith(", ", at):
            comma = True
    return found
