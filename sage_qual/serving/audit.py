"""A sampled audit of served calls: every Nth call a device serves is checked against torch's SDPA.

The first-call check judges one call per device, dtype, head size and context; the audit keeps
judging the calls after it. Audit n of a device (its (n+1)·N-th served call) recomputes a slice with
torch: sample n mod B, the query heads of K/V head (n div B) mod H_kv, and, once per round of
samples and heads, the next query row block of `rows` rows in the order m · 7919 mod blocks (m: the
round), with every key. So B · H_kv · blocks successive audits of one call shape visit every sample,
head group and row block once, and the rows jump across the sequence from round to round (7919 is
prime: any block count below it is visited whole).

Nothing on the served path waits for the GPU: the slice's error norms are computed on the GPU and
copied to host memory without blocking (`CudaPlatform.read_later`); they are judged at the first
served call after that copy has completed, and at the latest when the scope exits. A host that runs
ahead of its GPU runs ahead of the audit too: the wrong calls served before a miss acts are those
the host queued meanwhile (docs/audit.md has what runs 44 and 45 measured).

A miss (relative L2 over the family's fitness bound, `limits.first_call_max_rel_l2`, or a non-finite
output) is counted and said in one WARNING with the numbers; it moves that device to torch for the
family for the rest of the process (`AuditConfig.retire`), and with `AuditConfig.record` (a
`fixtures.recorder.AuditFolder`) is saved as a `recorded` fixture that `certify --fixtures FOLDER` runs.

Contexts: on a side stream and under torch.compile (the operator's body runs eagerly) the audit runs
on the caller's current stream, after the kernel's output; while a CUDA graph is captured the call is
skipped and counted as skipped: a replay would recompute the slice of the captured inputs, but its
error could not be read back.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import threading
from dataclasses import dataclass, field
from typing import Callable

import torch

from sage_qual import limits
from sage_qual.serving.config import AuditConfig
from sage_qual.serving.contexts import CAPTURE

log = logging.getLogger("sage_qual")

ANY_FAMILY = "any family"  # what an install for no family names its calls
ROW_STRIDE = 7919  # a prime: the row-block walk visits every block of any call below 7919 blocks


@dataclass(frozen=True)
class Miss:
    """One audited call over its bound: where, the numbers, and the fixture it was saved as."""
    family: str
    device: str  # its label: "cuda:0 (NVIDIA H200, sm_90)"
    gpu: str
    capability: tuple[int, int]
    variant: str
    build: str  # the provider and version of the kernel's package
    rel_l2: float
    bound: float
    call: str  # shapes, dtype and context
    rows: str  # the audited slice
    fixture: str = ""  # the recorded fixture's path ("" when not recorded)

    def text(self) -> str:
        recorded = f"; recorded as {self.fixture}" if self.fixture else ""
        return (f"{self.variant} on {self.device} for {self.family}: relative L2 {self.rel_l2:.3g} against "
                f"PyTorch SDPA, bound {self.bound:g} ({self.call}, slice {self.rows}){recorded}")


@dataclass
class AuditTally:
    """Calls audited and skipped (per reason), the worst relative L2 per family with its bound, and
    the misses: a scope's (`ScopeReport.audit`) or the process's (`audit_tally()`)."""
    audited: int = 0
    skipped: collections.Counter = field(default_factory=collections.Counter)
    worst: dict[str, float] = field(default_factory=dict)
    bounds: dict[str, float] = field(default_factory=dict)
    misses: list[Miss] = field(default_factory=list)

    def judged(self, family: str, rel_l2: float, bound: float) -> None:
        self.audited += 1
        self._worst(family, rel_l2, bound)

    def add(self, other: AuditTally) -> None:
        self.audited += other.audited
        self.skipped.update(other.skipped)
        for family, rel_l2 in other.worst.items():
            self._worst(family, rel_l2, other.bounds[family])
        self.misses += other.misses

    def _worst(self, family: str, rel_l2: float, bound: float) -> None:
        self.bounds[family] = bound
        worst = self.worst.get(family)
        if worst is None or not rel_l2 <= worst:  # NaN stays the worst
            self.worst[family] = rel_l2

    def summary(self) -> str:
        """"audit: 12 calls (2 skipped: capture), worst Krea-2 0.041 (bound 0.3), 0 misses"."""
        skipped = sum(self.skipped.values())
        why = ", ".join(f"{reason}={count}" for reason, count in self.skipped.items())
        parts = [f"audit: {self.audited} calls" + (f" ({skipped} skipped: {why})" if skipped else "")]
        parts += [f"worst {family} {rel_l2:.3g} (bound {self.bounds[family]:g})"
                  for family, rel_l2 in self.worst.items()]
        return ", ".join(parts + [f"{len(self.misses)} misses"])


@dataclass
class _Pending:
    """An audit whose error norms are on their way to the host."""
    read: Callable[[bool], list[float] | None]  # the norms once copied (wait: block until then)
    tally: AuditTally  # the scope's
    device: object  # the wrapper's DeviceState
    call: str
    rows: str
    keep: dict | None  # the slice's tensors and the call's channel maxima, when misses are recorded


def slice_of(number: int, query_shape, kv_heads: int, rows: int) -> tuple[int, range, slice]:
    """Audit `number`'s slice of a call: (sample, query heads, query rows); module docstring."""
    batch, heads, tokens = query_shape[0], query_shape[1], query_shape[2]
    group = heads // kv_heads
    kv_head = (number // batch) % kv_heads
    blocks = max(1, math.ceil(tokens / rows))
    start = (((number // (batch * kv_heads)) * ROW_STRIDE) % blocks) * rows
    heads = range(kv_head * group, (kv_head + 1) * group)
    return number % batch, heads, slice(start, min(start + rows, tokens))


class Auditor:
    """The audit of one install: counts served calls per device, starts an audit on every Nth, and
    settles audits whose numbers have arrived (`settle`)."""

    def __init__(self, config: AuditConfig, family: str | None, original, retire: Callable,
                 build_of: Callable):
        self.config = config
        self.family = family or ANY_FAMILY
        self.bound = limits.first_call_max_rel_l2(family)
        self.original = original  # torch's SDPA, as the wrapper calls it
        self.retire = retire  # (device, why): the wrapper's retirement
        self.build_of = build_of  # device -> its kernel's provider and version
        self.counts: dict[int, int] = collections.Counter()
        self.pending: collections.deque[_Pending] = collections.deque()
        self.warned: set[int] = set()
        self.lock = threading.Lock()

    def due(self, index: int) -> int | None:
        """The audit number when this served call on device `index` is to be audited, else None."""
        every = self.config.every
        if not every:
            return None
        with self.lock:
            count = self.counts[index]
            self.counts[index] = count + 1
        return count // every if count % every == every - 1 else None

    def served(self, cuda, tally: AuditTally, device, call, out: torch.Tensor, context: tuple[str, ...],
               described: str) -> None:
        """A call the wrapper served: audited when its turn has come (`due`); skipped and counted under
        capture, where its numbers could not be read back, and when the audit itself fails (out of
        memory for its slice), which must not cost the served call. Otherwise an audit on its way is
        judged as soon as its numbers have arrived."""
        number = self.due(device.index)
        if number is None:
            if self.pending:
                self.settle(wait=False)
            return
        if CAPTURE in context:
            skipped(tally, "capture")
            return
        try:
            with cuda.device_guard(device.index):
                self.start(cuda, device, call, out, number, tally, described)
        except Exception as error:  # noqa: BLE001 - the served output stands; the audit says why it did not
            skipped(tally, "error")
            log.debug("audit of %s not run: %s: %s", described, type(error).__name__, error)

    def start(self, cuda, device, call, out: torch.Tensor, number: int, tally: AuditTally, described: str):
        """Recompute audit `number`'s slice with torch and send its error norms to the host."""
        q, k, v = call.query, call.key, call.value
        sample, heads, rows = slice_of(number, q.shape, k.shape[1], self.config.rows)
        kv_head = heads.start // len(heads)
        picked = (slice(sample, sample + 1), slice(heads.start, heads.stop), rows)
        q_slice = q[picked]
        k_slice, v_slice = (t[sample:sample + 1, kv_head:kv_head + 1] for t in (k, v))
        mask = call.attn_mask
        if mask is not None:  # the same slice of the scores' mask: a view, nothing copied
            mask = mask.expand(*q.shape[:3], k.shape[2])[picked]
        expected = self.original(q_slice, k_slice, v_slice, attn_mask=mask, scale=call.scale,
                                 enable_gqa=len(heads) > 1).float()
        got = out[picked].float()
        norms = torch.stack([torch.linalg.vector_norm(got - expected), torch.linalg.vector_norm(expected)])
        keep = None
        if self.config.record is not None:  # copies: the caller may overwrite its tensors before the read
            channels = torch.stack([t.detach().abs().amax(dim=(0, 1, 2)).float() for t in (q, k, v)])
            keep = {name: t.detach().clone() for name, t in (("q", q_slice), ("k", k_slice), ("v", v_slice))}
            keep.update(mask=None if mask is None else mask.detach().clone(), channels=channels,
                        shapes={"q": list(q.shape), "k": list(k.shape), "v": list(v.shape)})
        where = (f"sample {sample}, query heads {heads.start}-{heads.stop - 1}" if len(heads) > 1
             else f"sample {sample}, query head {heads.start}") + f", rows {rows.start}-{rows.stop - 1}"
        pending = _Pending(cuda.read_later(norms), tally, device, described, where, keep)
        with self.lock:
            self.pending.append(pending)
        self.settle(wait=False)

    def settle(self, wait: bool) -> None:
        """Judge the audits whose norms have reached the host, in order (all of them when `wait`)."""
        while True:
            with self.lock:
                if not self.pending:
                    return
                first = self.pending[0]
                try:
                    norms = first.read(wait)
                except Exception as error:  # noqa: BLE001 - a faulted context: the scope's exit must not raise
                    self.pending.popleft()
                    skipped(first.tally, "error")
                    log.debug("audit of %s not read: %s: %s", first.call, type(error).__name__, error)
                    continue
                if norms is None:
                    return
                self.pending.popleft()
            self._judge(first, norms)

    def _judge(self, pending: _Pending, norms: list[float]) -> None:
        error, reference = norms
        rel_l2 = error / max(reference, 1e-12)
        pending.tally.judged(self.family, rel_l2, self.bound)
        with _PROCESS_LOCK:
            PROCESS.judged(self.family, rel_l2, self.bound)
        if rel_l2 <= self.bound:
            return
        device = pending.device
        miss = Miss(self.family, device.label, device.name, tuple(device.capability), device.variant.name,
                    self.build_of(device), rel_l2, self.bound, pending.call, pending.rows)
        if pending.keep is not None:
            try:
                miss = dataclasses.replace(miss, fixture=str(self.config.record(pending.keep, miss)))
            except Exception as error:  # noqa: BLE001 - a full disk must not cost the application
                log.warning("SageAttention audit: could not record the miss (%s): %s: %s", self.config.record,
                            type(error).__name__, error)
        pending.tally.misses.append(miss)
        with _PROCESS_LOCK:
            PROCESS.misses.append(miss)
        if self.config.retire:  # the retirement's WARNING gives the numbers
            RETIRED[(device.index, device.name, _key(self.family))] = f"audit miss for {self.family}"
            self.retire(device, f"audit miss: {miss.text()}")
            return
        with self.lock:
            first = device.index not in self.warned
            self.warned.add(device.index)
        if first:
            log.warning("SageAttention audit miss: %s; it keeps serving (AuditConfig.retire=False), later "
                        "misses are counted only", miss.text())


def _key(family: str) -> str:
    return "".join(c for c in family.lower() if c.isascii() and c.isalnum())


def retired_before(index: int, name: str, family: str | None) -> str:
    """Why an audit of this process moved this device to torch for `family` ("" if none did)."""
    return RETIRED.get((index, name, _key(family or "any family")), "")


def reset_process() -> None:
    """Forget what this process's audits found and retired: as a fresh process (a server that
    redeploys its model, a test)."""
    with _PROCESS_LOCK:
        PROCESS.__init__()
        RETIRED.clear()


def audit_tally() -> AuditTally:
    """What every audit of this process found (a copy)."""
    copy = AuditTally()
    with _PROCESS_LOCK:
        copy.add(PROCESS)
    return copy


def skipped(tally: AuditTally, reason: str) -> None:
    """Count a due audit not run (`reason`: the context that prevents it) in the scope and process."""
    tally.skipped[reason] += 1
    with _PROCESS_LOCK:
        PROCESS.skipped[reason] += 1


# The process's audit: every scope's numbers, and the devices a miss moved to torch per family.
PROCESS = AuditTally()
_PROCESS_LOCK = threading.Lock()
RETIRED: dict[tuple[int, str, str], str] = {}
