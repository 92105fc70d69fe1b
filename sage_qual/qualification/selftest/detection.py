"""The suite's detection power: kernel defects a broken build or a regression could have, injected
into a kernel's output, and which families certify's judgement then keeps off.

A defect is a function of one call (q, k, v, the kernel's output, the softmax scale) that returns the
defective output; it fires only on the calls its trigger describes (grouped-query calls, head_dim
64, a partial last key block, ...). Each carries the families whose real calls can trigger it, from
the families' own shapes (families.py) and the situations every family creates (generic fixtures),
stated by hand: the test compares that statement with what the judgement keeps off.

A family is kept off by a defect when one of its fixtures (its own or a generic one) passes its
budget with the clean kernel and fails it with the defect: a cell that fails without the defect
(a kernel defect of the clean kernel, e.g. NaN on a zero V channel) cannot show another one.
tests_fast/selftest/test_detection.py runs this on the fake kernel (the numerics model's output);
tests_gpu/test_detection.py on a real kernel.

Some defects are built from parameters (a token count, an element span, a number of elements and
a magnitude) and compute their reach from each family's declared call space (`call_space`: its
longest calls, its memory layouts, the element span they give): `CALL_SPACE_DEFECTS` fire only past
what the fixtures hold (long calls, views, large spans), so only certify's call-space checks (long
lengths in every declared layout) can catch them; on the fixtures they must keep nothing off.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from sage_qual.fixtures.fileformat import Fixture
from sage_qual.kernels import numerics
from sage_qual.kernels.contexts import CAPTURE, COMPILE, SIDE_STREAM
from sage_qual.kernels.variants import Numerics, Variant
from sage_qual.qualification.evidence.report_model import Reason
from sage_qual.qualification.families import FAMILIES, counts_for
from sage_qual.qualification.measure import accuracy, budgets, judge
from sage_qual.qualification.render.report import markdown_table
from sage_qual.serving import platform

ALL = frozenset(f.name for f in FAMILIES)
_KEY_BLOCK = 64  # the K tile of every kernel but sm90's (128): a multiple of 128 is one of 64 too
_QUERY_TILE = 128  # the CTA Q tile of the CUDA kernels but sm90's (64)


@dataclass(frozen=True)
class Call:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor  # the kernel's output
    sm_scale: float


@dataclass(frozen=True)
class Defect:
    name: str
    description: str
    reaches: frozenset[str]  # families whose real calls trigger it
    apply: Callable[[Call], torch.Tensor]


def _exact(q, k, v, sm_scale: float) -> torch.Tensor:
    return numerics.reference(q, k, v, sm_scale)


def _gqa_half_swap(c: Call) -> torch.Tensor:
    half = c.q.shape[1] // 2
    if c.q.shape[1] == c.k.shape[1]:
        return c.out
    out = c.out.clone()
    out[:, half:2 * half] = out[:, :half]
    return out


def _scale_head_dim_64(c: Call) -> torch.Tensor:
    return c.out * 1.10 if c.q.shape[-1] == 64 else c.out


def _nan_last_row_partial_keys(c: Call) -> torch.Tensor:
    if c.k.shape[2] % _KEY_BLOCK == 0:
        return c.out
    out = c.out.clone()
    out[:, :, -1] = float("nan")
    return out


def _heads_past_four_zero(c: Call) -> torch.Tensor:
    if c.q.shape[1] <= 4:
        return c.out
    out = c.out.clone()
    out[:, 4:] = 0
    return out


def _softmax_scale_fixed_for_128(c: Call) -> torch.Tensor:
    """The kernel applies 1/sqrt(128) whatever the head size: the change exact attention sees."""
    wrong = 128 ** -0.5
    if math.isclose(c.sm_scale, wrong):
        return c.out
    delta = _exact(c.q, c.k, c.v, wrong) - _exact(c.q, c.k, c.v, c.sm_scale)
    return (c.out.float() + delta).to(c.out.dtype)


def _stale_last_query_tile(c: Call) -> torch.Tensor:
    rows = c.q.shape[2]
    start = rows - rows % _QUERY_TILE
    if rows % _QUERY_TILE == 0 or start == 0:
        return c.out
    out = c.out.clone()
    out[:, :, start:] = out[:, :, start - _QUERY_TILE:start - _QUERY_TILE + (rows - start)]
    return out


def _fp16_partial_sums(c: Call) -> torch.Tensor:
    """P.V summed in float16 per 64-key block: inf where a block's sum passes 65504. With P <= 1
    that needs max |V| > 65504 / 64, so smaller V is left as it is."""
    if c.v.float().abs().max() * _KEY_BLOCK <= numerics.FP16_MAX:
        return c.out
    scheme = Numerics(32, 8, 64, 4, pv="fp16", pv_accumulation="fp16+fp32")
    overflowed = ~torch.isfinite(numerics.attention(c.q, c.k, c.v, scheme, sm_scale=c.sm_scale))
    return torch.where(overflowed, torch.full_like(c.out, float("inf")), c.out)


def _last_partial_key_block_dropped(c: Call) -> torch.Tensor:
    """The key blocks counted with floor division: the keys of a partial last block never seen."""
    keys = c.k.shape[2]
    kept = keys - keys % _KEY_BLOCK
    if kept == keys:
        return c.out
    if kept == 0:
        return torch.full_like(c.out, float("nan"))  # no block at all: 0 / 0
    delta = _exact(c.q, c.k[:, :, :kept], c.v[:, :, :kept], c.sm_scale) - _exact(c.q, c.k, c.v, c.sm_scale)
    return (c.out.float() + delta).to(c.out.dtype)


def _batch_items_swapped(c: Call) -> torch.Tensor:
    if c.q.shape[0] < 2:
        return c.out
    return c.out.roll(1, dims=0)


def _noise(c: Call) -> torch.Tensor:
    g = torch.Generator(device=c.out.device).manual_seed(0)
    noise = torch.randn(c.out.shape, generator=g, device=c.out.device)
    rms = c.out.float().square().mean().sqrt()
    return (c.out.float() + 0.15 * rms * noise).to(c.out.dtype)


# Defects made from parameters, their reach computed from the families' call space ------------------
@dataclass(frozen=True)
class CallSpace:
    """What a family's calls can trigger: its most query tokens over every call site, the memory
    layouts its integrations pass, and the largest element span of a q, k or v tensor any of its
    calls gives in any of those layouts (sum over dimensions of (size - 1) x stride)."""
    max_q_tokens: int
    layouts: frozenset[str]
    max_span: int

    @property
    def strided(self) -> bool:
        """Whether some declared layout gives the kernel memory other than contiguous [B, H, N, D]
        (the [B, H, N, D] view it reads has other strides: transposed, fused-QKV and NHD tensors)."""
        return any(_hnd_strides(layout, 1, 2, 3, 4, 2) != _contiguous_strides((1, 2, 3, 4))
                   for layout in self.layouts)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def _hnd_strides(layout: str, batch: int, heads: int, tokens: int, dim: int, kv_heads: int) -> tuple:
    """Strides of the [B, H, N, D] view of one q (heads) tensor stored in `layout` (families.LAYOUTS)."""
    if layout == "contiguous":
        return _contiguous_strides((batch, heads, tokens, dim))
    if layout in ("transposed", "nhd"):  # [B, N, H, D] memory
        return (tokens * heads * dim, dim, heads * dim, 1)
    if layout == "fused_qkv":  # views into one [B, N, (H + 2 KV) * D] projection
        width = (heads + 2 * kv_heads) * dim
        return (tokens * width, dim, width, 1)
    raise ValueError(f"detection: no strides for layout {layout!r}; add it to detection._hnd_strides")


def element_span(shape: Iterable[int], strides: Iterable[int]) -> int:
    """The elements a view reaches past its first: sum of (size - 1) x stride."""
    return sum((size - 1) * stride for size, stride in zip(shape, strides, strict=True))


def _shape_span(shape, layout: str) -> int:
    b, h, kv, d = shape.batch, shape.heads, shape.kv_heads, shape.head_dim
    if layout == "fused_qkv" and shape.q_tokens != shape.kv_tokens:
        return 0  # one fused projection gives as many queries as keys: no such call
    q = element_span((b, h, shape.q_tokens, d), _hnd_strides(layout, b, h, shape.q_tokens, d, kv))
    # K and V: their own heads; in a fused projection they share the query's row width.
    width_heads = h if layout == "fused_qkv" else kv
    kv_strides = _hnd_strides(layout, b, width_heads, shape.kv_tokens, d, kv)
    return max(q, element_span((b, kv, shape.kv_tokens, d), kv_strides))


def call_space(family) -> CallSpace:
    """A family's call space: the largest call of every declared call site (`calls`, when families.py
    declares them) or its timed shapes, in its declared `layouts` (contiguous when none are declared)."""
    shapes = [site.largest for site in getattr(family, "calls", ())] or [shape for _, shape in family.shapes]
    layouts = frozenset(getattr(family, "layouts", ("contiguous",)))
    return CallSpace(max(s.q_tokens for s in shapes), layouts,
                     max(_shape_span(s, layout) for s in shapes for layout in layouts))


def reached(test: Callable[[CallSpace], bool], families=FAMILIES) -> frozenset[str]:
    return frozenset(f.name for f in families if test(call_space(f)))


def _rms(out: torch.Tensor) -> torch.Tensor:
    finite = out.float()[torch.isfinite(out)]
    return finite.square().mean().sqrt() if finite.numel() else torch.tensor(0.0)


def few_elements_wrong(count: int, magnitude: float, seed: int = 0) -> Defect:
    """`count` output elements, drawn with a seeded generator, off by `magnitude` x the output's RMS
    (a race on one register, a stray store): no aggregate error moves much; every call can have it."""
    def apply(c: Call) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        where = torch.randperm(c.out.numel(), generator=g)[:count].to(c.out.device)
        out = c.out.float().flatten().clone()
        out[where] += magnitude * _rms(c.out).to(out.device)
        return out.view_as(c.out).to(c.out.dtype)
    elements = "element" if count == 1 else "elements"
    return Defect(f"{count}_{elements}_off_{magnitude:g}x_rms",
                  f"{count} {elements} off by {magnitude:g}x the output's RMS", ALL, apply)


def wrong_past_tokens(threshold: int, families=FAMILIES) -> Defect:
    """Query rows from `threshold` on return row (i mod threshold)'s output (a wrapped row offset):
    fires only on calls with more query tokens; reaches the families whose calls have more."""
    def apply(c: Call) -> torch.Tensor:
        rows = c.q.shape[2]
        if rows <= threshold:
            return c.out
        source = torch.arange(rows, device=c.out.device) % threshold
        return c.out[:, :, source]
    return Defect(f"rows_past_{threshold}_wrapped",
                  f"query rows past {threshold:,} tokens get row (i mod {threshold:,})'s output",
                  reached(lambda space: space.max_q_tokens > threshold, families), apply)


def wrong_in_band(threshold: int, start: float = 0.40, end: float = 0.45, magnitude: float = 0.15,
                  families=FAMILIES) -> Defect:
    """On calls of more than `threshold` query tokens, the rows from `start` to `end` of the sequence
    (a band in the middle: between the blocks a long check used to sample at 0, 1/3, 2/3 and the end)
    are off by `magnitude` x the output's RMS; reaches the families whose calls have more tokens."""
    def apply(c: Call) -> torch.Tensor:
        rows = c.q.shape[2]
        if rows <= threshold:
            return c.out
        first, last = int(rows * start), int(rows * end)
        out = c.out.float().clone()
        pattern = torch.linspace(-1.0, 1.0, out[:, :, first:last].numel(), device=out.device)
        band = out[:, :, first:last]
        band += magnitude * _rms(c.out).to(out.device) * pattern.view_as(band)
        return out.to(c.out.dtype)
    return Defect(f"band_past_{threshold}_off",
                  f"past {threshold:,} query tokens, rows {start:.0%} to {end:.0%} of the sequence off by "
                  f"{magnitude:g}x the output's RMS",
                  reached(lambda space: space.max_q_tokens > threshold, families), apply)


def wrong_on_views(magnitude: float = 0.15, seed: int = 0, families=FAMILIES) -> Defect:
    """Noise of `magnitude` x the output's RMS whenever q, k or v is not contiguous (strides read
    wrong); reaches the families whose integrations pass views."""
    def apply(c: Call) -> torch.Tensor:
        if all(t.is_contiguous() for t in (c.q, c.k, c.v)):
            return c.out
        g = torch.Generator().manual_seed(seed)
        noise = torch.randn(c.out.shape, generator=g).to(c.out.device)
        return (c.out.float() + magnitude * _rms(c.out) * noise).to(c.out.dtype)
    return Defect(f"views_noise_{magnitude:g}", f"noise of {magnitude:g}x the output's RMS on non-contiguous "
                  "inputs", reached(lambda space: space.strided, families), apply)


def wrong_past_span(limit: int, families=FAMILIES) -> Defect:
    """When the element span of q, k or v passes `limit` (a 32-bit offset), the output rows past the
    share of the sequence that lies within the limit are zeros; reaches the families whose calls, in
    a declared layout, pass it."""
    def apply(c: Call) -> torch.Tensor:
        span = max(element_span(t.shape, t.stride()) for t in (c.q, c.k, c.v))
        if span <= limit:
            return c.out
        out = c.out.clone()
        out[:, :, c.q.shape[2] * limit // span:] = 0
        return out
    return Defect(f"span_past_{limit}", f"output rows past an element span of {limit:,} are zeros",
                  reached(lambda space: space.max_span > limit, families), apply)


# Which families' calls trigger each defect, from families.py's shapes: only Krea-2 calls
# grouped-query attention (48 query / 12 K/V heads) and has more than four query heads per call in
# the fixtures; only SDXL runs head_dim 64; only Qwen-Image's V reaches ~3500 (block 52); SDXL and
# FLUX.1 run IP-Adapters, whose classifier-free-guidance batch has two items; partial key and query
# tiles come with every family's prompt lengths or resolutions (the generic fixtures).
DEFECTS: tuple[Defect, ...] = (
    Defect("gqa_second_half_gets_first",
           "GQA: the second half of the query heads get the first half's output",
           frozenset({"Krea-2"}), _gqa_half_swap),
    Defect("head_dim_64_scaled_1.10", "every head_dim-64 call's output scaled by 1.10",
           frozenset({"SDXL"}), _scale_head_dim_64),
    Defect("nan_last_row_partial_keys", "NaN in the last query row when the key count is no multiple of 64",
           ALL, _nan_last_row_partial_keys),
    Defect("heads_past_four_zero", "query heads past the fourth get zeros (a launch grid too small)",
           frozenset({"Krea-2"}), _heads_past_four_zero),
    Defect("softmax_scale_fixed", "softmax scale 1/sqrt(128) whatever the head size",
           frozenset({"SDXL"}), _softmax_scale_fixed_for_128),
    Defect("stale_last_query_tile", "a partial last query tile returns the previous tile's rows",
           ALL, _stale_last_query_tile),
    Defect("fp16_overflow_large_v", "P.V summed in fp16 per 64-key block: inf when V is large",
           frozenset({"Qwen-Image"}), _fp16_partial_sums),
    Defect("last_partial_key_block_dropped", "keys of a partial last key block ignored (floor division)",
           ALL, _last_partial_key_block_dropped),
    Defect("batch_items_swapped", "batch items get each other's output (a batch stride bug)",
           frozenset({"SDXL", "FLUX.1"}), _batch_items_swapped),
    Defect("noise_15_percent", "Gaussian noise of 15 % of the output's RMS everywhere",
           ALL, _noise),
    # A few wrong elements: the element-wise limit (max |out - ref|) sees them where no aggregate does.
    few_elements_wrong(1, 3.0),
    few_elements_wrong(4, 2.0, seed=1),
    # Wrong past a length every family's calls pass, inside the fixtures' lengths.
    wrong_past_tokens(1024),
)

# Wrong only past the fixtures (at most 4,429 query tokens, contiguous): a long call, a view, a span;
# caught by the call-space checks only.
CALL_SPACE_DEFECTS: tuple[Defect, ...] = (
    wrong_past_tokens(20_000),
    wrong_in_band(20_000),
    wrong_on_views(),
    wrong_past_span(2 ** 27),
)


# Wrong only in an execution context: the eager cells see nothing, so they must keep no family off;
# certify's context checks (`context_check`) must take exactly their context from the variant.
@dataclass(frozen=True)
class ContextDefect:
    name: str
    description: str
    contexts: frozenset[str]  # where it fires
    magnitude: float = 0.15

    @property
    def reaches(self) -> frozenset[str]:
        """The contexts certify must not certify: where it fires, and capture when it fires on a side
        stream (a CUDA graph is captured on one: torch refuses the default stream)."""
        return self.contexts | ({CAPTURE} if SIDE_STREAM in self.contexts else set())

    def apply(self, out: torch.Tensor, context: tuple[str, ...]) -> torch.Tensor:
        """A fixed pattern of `magnitude` x the output's RMS (no generator: it must also run during a
        capture) when the call's contexts meet the defect's."""
        if not self.contexts & set(context):
            return out
        pattern = torch.linspace(-1.0, 1.0, out.numel(), device=out.device).view_as(out)
        rms = out.float().square().mean().sqrt()
        return (out.float() + self.magnitude * rms * pattern).to(out.dtype)


CONTEXT_DEFECTS: tuple[ContextDefect, ...] = (
    ContextDefect("side_stream_pattern", "15 % of the output's RMS off when the caller is on a side stream",
                  frozenset({SIDE_STREAM})),
    ContextDefect("capture_pattern", "15 % off when the call is captured into a CUDA graph (and so replayed)",
                  frozenset({CAPTURE})),
    ContextDefect("compile_pattern", "15 % off when called from code torch.compile compiled",
                  frozenset({COMPILE})),
)


@contextlib.contextmanager
def injected(defect: ContextDefect):
    """The served calls' kernels, while the block runs, with `defect` applied to their output (the
    platform's `launch`, which knows each call's contexts; the fake CUDA's or the real one)."""
    cuda = platform.current()
    launch = cuda.launch

    def defective(index, context, legacy_stream, call):
        return defect.apply(launch(index, context, legacy_stream, call), context)

    cuda.launch = defective
    try:
        yield
    finally:
        del cuda.launch


def owners(fixture: Fixture) -> frozenset[str]:
    """The families whose verdict reads this fixture."""
    return frozenset(f.name for f in FAMILIES if counts_for(f, fixture.family))


def fails(variant: Variant, fixture: Fixture, out: torch.Tensor, ref: torch.Tensor) -> list[Reason]:
    """certify's judgement of one output against the float32 reference (memory not measured here)."""
    return judge.cell_reasons(accuracy.errors(out, ref), 0.0, budgets.budget(variant, fixture), math.inf,
                              fitness=fixture.fitness(variant))


def failing(variant: Variant, fixtures: list[Fixture], clean: dict[str, torch.Tensor],
            references: dict[str, torch.Tensor]) -> frozenset[str]:
    """The fixtures whose cell fails with the clean kernel (a kernel defect without injection)."""
    return frozenset(f.name for f in fixtures if fails(variant, f, clean[f.name], references[f.name]))


def kept_off(variant: Variant, fixtures: list[Fixture], clean: dict[str, torch.Tensor],
             references: dict[str, torch.Tensor], defect: Defect,
             already_failing: frozenset[str]) -> tuple[frozenset[str], dict[str, list[Reason]]]:
    """(families a fixture that passed with the clean kernel now keeps off, those fixtures with their
    reasons). `clean`: the kernel's output per fixture name; `references`: float32 attention;
    `already_failing`: `failing(...)` (such a cell cannot show another defect)."""
    caught = {}
    for fixture in fixtures:
        if fixture.name in already_failing:
            continue
        call = Call(fixture.q, fixture.k, fixture.v, clean[fixture.name], fixture.q.shape[-1] ** -0.5)
        reasons = fails(variant, fixture, defect.apply(call), references[fixture.name])
        if reasons:
            caught[fixture.name] = reasons
    families = frozenset().union(*(owners(f) for f in fixtures if f.name in caught))
    return families, caught


def matrix_markdown(newly: dict[str, frozenset[str]], baseline: frozenset[str], title: str) -> str:
    """defect x family: caught (reached and newly kept off), MISSED (reached, still enabled), FALSE
    ALARM (kept off, not reached), "off already" (the clean kernel keeps the family off), "-"."""
    names = [f.name for f in FAMILIES]
    rows = []
    for defect in DEFECTS:
        if defect.name not in newly:
            continue
        cells = []
        for family in names:
            reached, stopped = family in defect.reaches, family in newly[defect.name]
            cells.append("caught" if reached and stopped else "FALSE ALARM" if stopped else
                         "off already" if family in baseline else "MISSED" if reached else "-")
        rows.append([f"{defect.name}: {defect.description}", *cells])
    return "\n".join([f"### {title}", "", *markdown_table(["defect", *names], rows)]) + "\n"
