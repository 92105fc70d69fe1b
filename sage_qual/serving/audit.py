"""The audit of served calls: a sample of the calls a device serves, each judged as certify judges a cell.

The first-call check judges one call per device, dtype, head size and context; the audit keeps
judging the calls after it, with the same function (`slice_check`).

**Which calls.** One audit in each block of `every` served calls of a device, at a place in the block
drawn by a seeded generator (`Schedule`): the rate is exactly 1 in `every`, and the audited calls
cannot alias with a model's structure. A model issues its attention calls in the same order every
step, so a fixed period (the 100th, 200th, ... call) sees only L / gcd(every, L) of L layers, forever
(3 of Qwen-Image's 60). Here each served call is audited with probability 1 / `every`, and two calls of
one layer in one block exclude each other, so a defect in one layer that is served k times escapes
with probability at most (1 - 1/every)^k <= exp(-k / every): **found within FOUND_WITHIN x every of
its calls** (FOUND_WITHIN x every x L served calls for a layer of a step of L calls), except with
probability exp(-20), about 2e-9. tests_fast/serving/test_audit_schedule.py checks the bound for
1 to 256 calls per step and `every` in {1, 7, 10, 100, 1000}.

**Which slice.** Each audit draws its slice number n from the same generator and takes
`slice_check.audit_slice(n)` (a sample, the query heads of one K/V head, a block of query rows), so
every layer reaches every slice of its shape in a coupon collector's time.

**Both judges.** Fitness: relative L2 against torch within the family's bound (`verdicts.fitness`); a
miss retires the device for the family (`AuditConfig.retire`). Conformance: within the served
variant's numerics model on the same slice, with certify's margin; a drift is one WARNING with both
numbers, and by default retires the device too (`AuditConfig.drift`): certify fails a cell off its
model, so a kernel off its model is no longer the kernel the family was enabled for, even while its
output is still fit. Either is counted, and with `AuditConfig.record` saved as a `recorded` fixture
that `certify --fixtures FOLDER` runs.

Nothing on the served path waits for the GPU: the slice's norms are computed on the GPU and copied to
host memory without blocking (`CudaPlatform.read_later`); they are judged at the first served call
after that copy has completed, and at the latest when the scope exits.

Contexts: on a side stream and under torch.compile (the operator's body runs eagerly) the audit runs
on the caller's current stream, after the kernel's output; while a CUDA graph is captured the call is
skipped and counted as skipped: its numbers could not be read back.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import random
import threading
from dataclasses import dataclass
from typing import Callable

import torch

from sage_qual.kernels.contexts import CAPTURE
from sage_qual.serving import slice_check
from sage_qual.serving.audit_tally import DRIFT, MISS, WORST, AuditTally, Finding
from sage_qual.serving.config import AuditConfig
from sage_qual.verdicts import fitness

log = logging.getLogger("sage_qual")

ANY_FAMILY = "any family"  # what an install for no family names its calls
FOUND_WITHIN = 20  # the stated bound, in units of `every` calls of the wrong layer (docstring)


class Schedule:
    """The served calls of one device to audit, and each audit's slice number: one audit in each block
    of `every` calls at a seeded random place, its slice number drawn from the same generator. Drawn,
    not counted: with one audit per block, the audit count of a layer's calls is fixed by the layer
    (60 calls per step at every = 10: layer l is always audit n = l div 10 mod 6), so a counted walk
    would show each layer only some slices."""

    def __init__(self, every: int, seed: str):
        self.every = every
        self.random = random.Random(seed)
        self.count = 0  # served calls so far
        self.audits = 0  # audits so far: the block the next one falls in
        self.next = self.random.randrange(every)

    def due(self) -> int | None:
        """This served call's slice number when it is to be audited, else None."""
        count, self.count = self.count, self.count + 1
        if count != self.next:
            return None
        return self.advance()

    def advance(self) -> int:
        """Draw this audit's slice number and place the next audit in the next block."""
        number = self.random.getrandbits(31)
        self.audits += 1
        self.next = self.audits * self.every + self.random.randrange(self.every)
        return number


def draws(every: int, seed: str, audits: int) -> list[tuple[int, int]]:
    """(served-call number, slice number) of a device's first `audits` audits, as `Schedule` draws them."""
    schedule = Schedule(every, seed)
    found = []
    for _ in range(audits):
        position = schedule.next
        found.append((position, schedule.advance()))
    return found


@dataclass
class _Pending:
    """An audit whose norms are on their way to the host."""

    read: Callable[[bool], list[float] | None]  # the norms once copied (wait: block until then)
    tally: AuditTally  # the scope's
    device: object  # the wrapper's DeviceState
    dtype: torch.dtype
    call: str
    rows: str
    keep: dict | None  # the slice's tensors and the call's channel maxima, when findings are recorded


class Auditor:
    """The audit of one install: schedules served calls per device, starts their audits, and settles
    audits whose numbers have arrived (`settle`)."""

    def __init__(
        self, config: AuditConfig, family: str | None, original, retire: Callable, build_of: Callable
    ):
        self.config = config
        self.family = family or ANY_FAMILY
        self.key = fitness.family_key(self.family)
        self.original = original  # torch's SDPA, as the wrapper calls it
        self.retire = retire  # (device, why): the wrapper's retirement
        self.build_of = build_of  # device -> its kernel's provider and version
        self.schedules: dict[int, Schedule] = {}
        self.pending: collections.deque[_Pending] = collections.deque()
        self.warned: set[tuple[int, str]] = set()
        self.lock = threading.Lock()

    def bound(self, device) -> float:
        """The family's fitness bound for the device's variant (`verdicts.fitness.family_bound`)."""
        return fitness.family_bound(
            None if self.family == ANY_FAMILY else self.family, device.variant.accuracy_class
        )

    def due(self, index: int) -> int | None:
        """The slice number when this served call on device `index` is to be audited, else None."""
        every = self.config.every
        if not every:
            return None
        with self.lock:
            schedule = self.schedules.get(index)
            if schedule is None:
                schedule = self.schedules[index] = Schedule(every, f"{self.config.seed}:{index}")
            return schedule.due()

    def served(
        self,
        cuda,
        tally: AuditTally,
        device,
        call,
        out: torch.Tensor,
        context: tuple[str, ...],
        described: str,
    ) -> None:
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
        """Measure audit `number`'s slice (`slice_check.measure`) and send its norms to the host."""
        q, k, v = call.query, call.key, call.value
        where = slice_check.audit_slice(number, q.shape, k.shape[1], self.config.rows)
        norms = slice_check.measure(self.original, call, out, where, device.variant)
        keep = None
        if self.config.record is not None:  # copies: the caller may overwrite its tensors before the read
            q_slice, k_slice, v_slice, mask = slice_check.inputs(call, where)
            channels = torch.stack([t.detach().abs().amax(dim=(0, 1, 2)).float() for t in (q, k, v)])
            keep = {name: t.detach().clone() for name, t in (("q", q_slice), ("k", k_slice), ("v", v_slice))}
            keep.update(
                mask=None if mask is None else mask.detach().clone(),
                channels=channels,
                shapes={"q": list(q.shape), "k": list(k.shape), "v": list(v.shape)},
            )
        pending = _Pending(cuda.read_later(norms), tally, device, q.dtype, described, where.text(), keep)
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
        device = pending.device
        judgement = slice_check.judge(norms, self.bound(device), pending.dtype)
        variant = device.variant.name
        for tally in (pending.tally, PROCESS):
            with _PROCESS_LOCK:
                tally.judged(
                    self.family, variant, judgement.rel_l2, judgement.fitness_bound, judgement.model_rel_l2
                )
        fine = judgement.fit and judgement.conforms
        if fine or not judgement.fit:
            judge, bound = (WORST if fine else MISS), judgement.fitness_bound
        else:
            judge, bound = DRIFT, judgement.conformance_bound
        finding = Finding(judge, self.family, device.label, device.name, tuple(device.capability), variant,
                          self.build_of(device), judgement.rel_l2, bound, judgement.model_rel_l2,
                          pending.call, pending.rows)
        if fine:  # the folder may keep it as its site's worst real call
            self._keep_worst(pending, finding)
            return
        if pending.keep is not None:
            try:
                finding = dataclasses.replace(finding, fixture=str(self.config.record(pending.keep, finding)))
            except Exception as error:  # noqa: BLE001 - a full disk must not cost the application
                log.warning("SageAttention audit: could not record the %s (%s): %s: %s", judge,
                            self.config.record, type(error).__name__, error)
        with _PROCESS_LOCK:
            pending.tally.found(finding)
            PROCESS.found(finding)
        retire = self.config.retire if judge == MISS else self.config.drift == "retire"
        if retire:  # the retirement's WARNING gives the numbers
            with _PROCESS_LOCK:
                for tally in (pending.tally, PROCESS):
                    tally.retired[device.label] = f"audit {judge} for {self.family}"
            self.retire(device, f"audit {judge}: {finding.text()}", self.family)
            return
        with self.lock:
            first = (device.index, judge) not in self.warned
            self.warned.add((device.index, judge))
        if first:
            keeps = "AuditConfig.retire=False" if judge == MISS else "AuditConfig.drift='warn'"
            log.warning(
                "SageAttention audit %s: %s; it keeps serving (%s), later %s are counted only",
                judge,
                finding.text(),
                keeps,
                "misses" if judge == MISS else "drifts",
            )

    def _keep_worst(self, pending: _Pending, seen: Finding) -> None:
        """Offer a fit audited call to the folder's worst calls per site (`AuditFolder.worst`), where
        the record keeps them; a folder that cannot be written costs a debug line only."""
        keep_worst = getattr(self.config.record, "worst", None)
        if pending.keep is None or keep_worst is None:
            return
        try:
            keep_worst(pending.keep, seen)
        except Exception as error:  # noqa: BLE001 - the served output stands
            log.debug("audit: the worst call of %s not kept: %s: %s", seen.call, type(error).__name__, error)


EVERY_FAMILY = "*"  # RETIRED's key of a retirement for every family (a kernel error, a first-call failure)


def remember_retired(index: int, name: str, family: str | None, why: str) -> None:
    """Record that this process moved a device to torch for `family` (None: every family)."""
    key = EVERY_FAMILY if family is None else fitness.family_key(family)
    with _PROCESS_LOCK:
        RETIRED.setdefault((index, name, key), why)


def retired_before(index: int, name: str, family: str | None) -> str:
    """Why this process moved this device to torch for `family`, or for every family ("" if it did not)."""
    key = fitness.family_key(family or ANY_FAMILY)
    return RETIRED.get((index, name, key)) or RETIRED.get((index, name, EVERY_FAMILY), "")


@contextlib.contextmanager
def retirements_set_aside():
    """Within: no retirement of this process holds (a qualification trial installs the wrapper afresh);
    after: exactly those of before hold again."""
    with _PROCESS_LOCK:
        saved = dict(RETIRED)
        RETIRED.clear()
    try:
        yield
    finally:
        with _PROCESS_LOCK:
            RETIRED.clear()
            RETIRED.update(saved)


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
    with _PROCESS_LOCK:
        tally.skipped[reason] += 1
        PROCESS.skipped[reason] += 1


# The process's audit: every scope's numbers, and the devices moved to torch per family ("*": all).
PROCESS = AuditTally()
_PROCESS_LOCK = threading.Lock()
RETIRED: dict[tuple[int, str, str], str] = {}
