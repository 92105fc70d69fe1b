"""The one online check of a served call: a slice of its output judged as certify judges a cell.

The first-call check and the audit both call `measure` and `judge`. A slice is one sample, the query
heads of one K/V head and a block of query rows, with every key (cutting keys would change the
softmax). It is recomputed twice on the call's own device: by torch's SDPA (the reference, in the
input dtype) and by the served variant's numerics model (`kernels.numerics`), so the check knows
the error the kernel should have on exactly that call. Two judges, as in certify:

- fitness: the kernel's relative L2 against torch within the family's fitness bound
  (`verdicts.fitness.family_bound`); a non-finite output is unfit;
- conformance: the kernel's relative L2 within its model's, with certify's margin
  (`verdicts.conformance.slice_bound`). A slice the model cannot compute (arithmetic it does not
  model, or a non-finite model output) is judged by fitness alone, and says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from sage_qual.kernels import numerics
from sage_qual.verdicts import conformance, fitness

ROW_ALIGN = 128  # every variant's Q tile divides it: a slice starting here quantizes Q as the call did
ROW_STRIDE = 7919  # a prime: the audit's row-block walk visits every block of any call below 7919 blocks


@dataclass(frozen=True)
class Slice:
    """Sample `sample`, query heads `heads` (those of one K/V head), query rows `rows`, every key."""

    sample: int
    heads: range
    rows: slice

    @property
    def kv_head(self) -> int:
        return self.heads.start // len(self.heads)

    def of_query(self, t: torch.Tensor) -> torch.Tensor:
        return t[self.sample : self.sample + 1, self.heads.start : self.heads.stop, self.rows]

    def of_kv(self, t: torch.Tensor) -> torch.Tensor:
        return t[self.sample : self.sample + 1, self.kv_head : self.kv_head + 1]

    def text(self) -> str:
        heads = (
            f"query heads {self.heads.start}-{self.heads.stop - 1}"
            if len(self.heads) > 1
            else f"query head {self.heads.start}"
        )
        return f"sample {self.sample}, {heads}, rows {self.rows.start}-{self.rows.stop - 1}"


def audit_slice(number: int, query_shape, kv_heads: int, rows: int) -> Slice:
    """Audit `number`'s slice: sample n mod B, the query heads of K/V head (n div B) mod H_kv, and once
    per round of samples and heads the next block of `rows` query rows in the order m * 7919 mod
    blocks (m: the round). B * H_kv * blocks successive audits of one shape visit every slice once."""
    batch, heads, tokens = query_shape[0], query_shape[1], query_shape[2]
    group = heads // kv_heads
    kv_head = (number // batch) % kv_heads
    blocks = max(1, math.ceil(tokens / rows))
    start = (((number // (batch * kv_heads)) * ROW_STRIDE) % blocks) * rows
    return Slice(
        number % batch, range(kv_head * group, (kv_head + 1) * group), slice(start, min(start + rows, tokens))
    )


def first_call_slice(query_shape, kv_heads: int, rows: int) -> Slice:
    """The first-call check's slice: sample 0, the query heads of K/V head 0, the last `rows` query rows
    or a little more, from a multiple of ROW_ALIGN (the call's last rows hold its partial tiles)."""
    tokens = query_shape[2]
    start = max(0, tokens - rows) // ROW_ALIGN * ROW_ALIGN
    return Slice(0, range(query_shape[1] // kv_heads), slice(start, tokens))


def inputs(call, where: Slice):
    """The slice's q, k, v and mask (views, nothing copied)."""
    q = call.query
    mask = call.attn_mask
    if mask is not None:  # the same slice of the scores' mask
        mask = mask.expand(*q.shape[:3], call.key.shape[2])[
            where.sample : where.sample + 1, where.heads.start : where.heads.stop, where.rows
        ]
    return where.of_query(q), where.of_kv(call.key), where.of_kv(call.value), mask


def measure(original, call, out: torch.Tensor, where: Slice, variant) -> torch.Tensor:
    """[|kernel - torch|, |torch|, |model - torch|] on the slice, on the call's device, unread (the
    audit copies it to the host without waiting). The model's norm is NaN where it cannot compute."""
    q, k, v, mask = inputs(call, where)
    expected = original(q, k, v, attn_mask=mask, scale=call.scale, enable_gqa=len(where.heads) > 1).float()
    got = where.of_query(out).float()
    try:
        modelled = numerics.predict(variant, q, k, v, sm_scale=call.sm_scale, attn_mask=mask).float()
        model_error = torch.linalg.vector_norm(modelled - expected)
    except Exception:  # noqa: BLE001 - arithmetic the model lacks: fitness still judges the slice
        model_error = torch.tensor(math.nan, device=expected.device)
    return torch.stack(
        [
            torch.linalg.vector_norm(got - expected),
            torch.linalg.vector_norm(expected),
            model_error.to(expected.device),
        ]
    )


@dataclass(frozen=True)
class Judgement:
    """Both judges on one slice. `model_rel_l2` None: the model could not judge it."""

    rel_l2: float
    fitness_bound: float
    model_rel_l2: float | None
    conformance_bound: float | None

    @property
    def fit(self) -> bool:
        return self.rel_l2 <= self.fitness_bound  # NaN is unfit

    @property
    def conforms(self) -> bool:
        return self.conformance_bound is None or not self.rel_l2 > self.conformance_bound

    def problem(self) -> str:
        """'' when both judges pass; else the numbers and the judge that failed."""
        if not self.fit:
            return f"{self.text()}: past the fitness bound of the family served ({fitness.TABLE_SOURCE})"
        if not self.conforms:
            return f"{self.text()}: off the variant's numerics model by more than certify's margin"
        return ""

    def text(self) -> str:
        """The failing judge's numbers first: "relative L2 0.41 against PyTorch SDPA, fitness bound 0.3"."""
        said = f"relative L2 {self.rel_l2:.3g} against PyTorch SDPA"
        model = (
            ""
            if self.model_rel_l2 is None
            else f", its numerics model {self.model_rel_l2:.3g} "
            f"(conformance bound {self.conformance_bound:.3g})"
        )
        return f"{said}, fitness bound {self.fitness_bound:g}{model}"


def judge(norms, fitness_bound: float, dtype: torch.dtype) -> Judgement:
    """Both judges on `norms` (from `measure`, read to the host)."""
    error, reference, model_error = (float(x) for x in norms)
    scale = max(reference, 1e-12)  # a zero reference: the error itself is the relative error
    rel_l2 = error / scale
    model_rel_l2 = model_error / scale
    if not math.isfinite(model_rel_l2):
        return Judgement(rel_l2, fitness_bound, None, None)
    bound = conformance.slice_bound(model_rel_l2, str(dtype).replace("torch.", ""))
    return Judgement(rel_l2, fitness_bound, model_rel_l2, bound)
