"""Every verdict, drawn from a report's evidence by one function, `decide()`.

gate, report.md/html, merge, certify's summary and the profile all call it; nothing reads a
verdict or a cell's stored outcome as the truth. Each measured cell is judged again from its
stored numbers (`judge.cell_reasons`), and a report whose cells' outcomes disagree with their
numbers is refused (`check_evidence`). A speed comparison trusts the lower end of its 95 %
confidence interval.

Per GPU model (devices of one model count together: a variant passes a fixture only if it
passed on each of them; a shape's speedup is the lowest among them) and family, one of:

- enable: a variant passed every fixture of the family (and the generic ones), and its measured
  break-even serves at least one of the family's own shapes;
- safe, no speedup: a variant passed every fixture, but the measured speed serves none of the
  family's shapes (or they were not timed: a --quick run), so a profile serves nothing;
- keep off: no variant passed, with every reason.

Bounds (issue 26): a variant whose only failures are on fixtures of call sites its break-even
excludes (the IP-Adapter's 4 to 16 keys, below run 25's 10,624) counts as passing, and its decision carries
the bounds that keep those calls on torch whatever the thresholds (`bounds.excluded_bounds`). A
failure within the served range still keeps it off.

An enabled family is enabled over a verified range only (issue 16): up to the longest long check
(`long_check`) of its variant that passed with every shorter one, and in the declared layouts whose
views gave the contiguous output bit for bit in every check within that range. A long check that
fails, faults or is missing at L tokens caps the range below L (to the fixtures' length when no
longer check passed); a range that ends below the break-even serves nothing, and the family is kept
off, with the failing check as its reason. A report from before long checks (`Device.long` null)
has no upper bound and says so.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass, field

from sage_qual.kernels.contexts import CONTEXTS, REASON
from sage_qual.kernels.variants import VARIANTS, gpu_label
from sage_qual.qualification.decide.bounds import excluded_bounds
from sage_qual.qualification.decide.checked import judged, long_judged
from sage_qual.qualification.evidence.report_model import (
    Device,
    LongCheck,
    Outcome,
    Reason,
    ReasonKind,
    Report,
)
from sage_qual.qualification.families import (
    FAMILIES,
    LAYOUTS,
    Family,
    counts_for,
    normalize,
)
from sage_qual.qualification.measure.speed import (
    Thresholds,
    break_even,
    served_bar,
    serves,
    speedup_bounds,
    steady_lower_bounds,
)
from sage_qual.serving.config import KERNEL_TABLE
from sage_qual.verdicts.machine import same_gpu_name
from sage_qual.verdicts.served import Bound, Served


class Verdict(str, enum.Enum):
    ENABLE = "enable"
    NO_SPEEDUP = "safe, no speedup"
    KEEP_OFF = "keep off"


class Evidence(str, enum.Enum):
    """What a family's fixtures say of one variant or integration, speed aside (the summaries of
    certify --target and --emulate, which time nothing)."""
    SAFE = "safe"  # passed every fixture of the family
    NOT_SAFE = "NOT SAFE"  # failed, crashed or ran out of time or memory on one
    NOT_QUALIFIED = "not qualified"  # no evidence: no fixtures, or calls it did not take or serve


@dataclass(frozen=True)
class Finding:
    """Why a variant fails a family on one cell, in parts (a summary groups them without parsing a
    sentence): where, and the cell's own reason."""
    variant: str
    fixture: str
    device: int
    reason: Reason

    def as_reason(self) -> Reason:
        """The finding in one sentence, as gate, report.md and the profile give it."""
        return Reason(self.reason.kind, f"{self.variant} on {self.fixture} (cuda:{self.device}): "
                                        f"{self.reason.detail}")


@dataclass(frozen=True)
class VariantResults:
    """What a family's fixtures said of each variant that ran: passed every one (`certified`), failed
    only calls the served range excludes (`bounded`, with the bounds that keep those calls on torch),
    or failed (`findings`, every failing cell)."""
    certified: list[str] = field(default_factory=list)
    bounded: dict[str, list[Bound]] = field(default_factory=dict)
    findings: dict[str, list[Finding]] = field(default_factory=dict)

    @property
    def rejected(self) -> dict[str, list[Reason]]:
        """Per variant that failed the family, why, one sentence per cell (`findings`)."""
        return {variant: [f.as_reason() for f in found] for variant, found in self.findings.items()}


@dataclass(frozen=True)
class FamilyDecision:
    """One family's verdict on one GPU model: what a profile serves (`served`, None for nothing) and
    why not more, with each variant's results and the chosen variant's speedups."""
    family: str | None  # None: the default entry, over all fixtures
    verdict: Verdict
    served: Served | None = None
    reasons: list[Reason] = field(default_factory=list)
    range_reasons: list[Reason] = field(default_factory=list)  # why the range, layouts or contexts stop there
    results: VariantResults = field(default_factory=VariantResults)
    speedups: dict[str, float] = field(default_factory=dict)  # own shape label -> lower bound

    @property
    def label(self) -> str:
        return self.family or "default"

    @property
    def variant(self) -> str | None:
        """The variant a profile serves (None: nothing)."""
        return self.served.variant if self.served else None

    def evidence(self, variant: str) -> Evidence:
        if variant in self.results.certified:
            return Evidence.SAFE
        # Skips (calls not taken or not served) and missing fixtures are no evidence either way;
        # anything measured, crashed or left unrun is.
        if all(r.kind in (ReasonKind.NO_FIXTURES, ReasonKind.SKIP) for r in self.why_not(variant)):
            return Evidence.NOT_QUALIFIED
        return Evidence.NOT_SAFE

    def why_not(self, variant: str) -> list[Reason]:
        """Why `variant` was not certified for the family: its own findings, else the family's reasons."""
        return self.results.rejected.get(variant) or self.reasons


@dataclass(frozen=True)
class VariantStatus:
    ran: bool  # any result on this model (a --quick run leaves most variants out)
    runnable: bool
    reasons: list[str]
    break_even: Thresholds | None


@dataclass(frozen=True)
class GpuDecision:
    name: str
    capability: tuple[int, int]
    memory_gib: float
    devices: list[int]
    variants: dict[str, VariantStatus]
    families: list[FamilyDecision]
    default: FamilyDecision
    # (variant, shape key) -> (lower 95 % bound, median ratio) of the speedup over SDPA
    speedups: dict[tuple[str, str], tuple[float, float]] = field(default_factory=dict)
    sm_count: int | None = None  # its devices' fewest (None: one did not record it)

    @property
    def model(self) -> str:
        return gpu_label(self.name, self.capability)

    def family(self, name: str) -> FamilyDecision:
        return next(v for v in self.families if normalize(v.family) == normalize(name))


# The evidence ------------------------------------------------------------------------------------
def _speedups(devices: list[Device], shapes: dict) -> dict[tuple[str, str], tuple[float, float]]:
    """(variant, shape) -> (lower bound, median ratio) of the speedup over the fastest SDPA
    backend; a shape counts only where every device measured it, the slowest device deciding. A
    variant that failed at a shape counts as no speedup there. Self-attention shapes timed with
    samples on both sides get the steady bound fitted over their neighbours of the same head size
    (speed.steady_lower_bounds), so that the break-even does not move with one shape's noise."""
    per_device = []
    for device in devices:
        sdpa = {r.shape: r for r in device.speed if r.kernel == "sdpa" and r.outcome == Outcome.PASS and r.ms}
        found, curves = {}, {}
        for r in device.speed:
            if r.kernel == "sdpa" or r.shape not in sdpa:
                continue
            if r.outcome == Outcome.PASS and r.ms:
                base = sdpa[r.shape]
                low, median, high = speedup_bounds(base.ms, base.samples_ms, r.ms, r.samples_ms)
                found[(r.kernel, r.shape)] = (low, median)
                shape = shapes[r.shape]
                if base.samples_ms and r.samples_ms and shape.q_tokens == shape.kv_tokens:
                    curves.setdefault((r.kernel, shape.head_dim), {})[r.shape] = (shape.q_tokens, low, median,
                                                                                 high)
            else:
                found[(r.kernel, r.shape)] = (0.0, 0.0)
        for (variant, _), curve in curves.items():
            for key, low in steady_lower_bounds(curve).items():
                found[(variant, key)] = (low, found[(variant, key)][1])
        per_device.append(found)
    common = set.intersection(*map(set, per_device)) if per_device else set()
    return {key: (min(d[key][0] for d in per_device), min(d[key][1] for d in per_device)) for key in common}


class _Model:
    """One GPU model's cells and speed, from all its devices."""

    def __init__(self, report: Report, devices: list[Device], runnable: list[str]):
        self.report, self.devices, self.runnable = report, devices, runnable
        self.shapes = {key: entry.shape for key, entry in report.shapes.items()}
        self.uses = {key: entry.uses for key, entry in report.shapes.items()}
        self.cells = {(c.variant, c.fixture, d.index): c for d in devices for c in d.cells}
        self.masked = {f.name for f in report.fixtures if f.masked}
        self.misses = {f.name: f.audit for f in report.fixtures if f.audit is not None}
        self.speedup = _speedups(devices, self.shapes)
        self.ms = {}
        for device in devices:
            for r in device.speed:
                if r.kernel != "sdpa" and r.ms:
                    key = (r.kernel, r.shape)
                    self.ms[key] = max(self.ms.get(key, 0.0), r.ms)

    def points(self, variant: str, keys: list[str]) -> list[tuple[int, int, int, float]]:
        return [(self.shapes[k].q_tokens, self.shapes[k].kv_tokens, self.shapes[k].head_dim,
                 self.speedup[(variant, k)][0]) for k in keys if (variant, k) in self.speedup]

    def break_even(self, variant: str, keys: list[str], min_speedup: float = 1.0) -> Thresholds | None:
        return break_even(self.points(variant, keys), served_bar(min_speedup)) if variant in self.runnable \
            else None

    def verdict(self, family: Family | None) -> FamilyDecision:
        name = family.name if family else None
        fixtures = [f.name for f in self.report.fixtures if counts_for(family, f.family)]
        # A masked fixture is evidence about masked calls only: it certifies no family alone.
        if not any((family is None or family.owns(f.family)) and not f.masked for f in self.report.fixtures):
            label = family.name if family else "any family"
            return FamilyDecision(name, Verdict.KEEP_OFF, reasons=[
                Reason(ReasonKind.NO_FIXTURES, f"no fixtures of {label} in this run: not certified")])
        if not self.runnable:
            return FamilyDecision(name, Verdict.KEEP_OFF,
                                  reasons=[Reason(ReasonKind.SKIP, "no selected variant ran on this GPU")])
        min_speedup = family.min_speedup if family else 1.0
        own = {k: u.label for k, uses in self.uses.items() for u in uses
               if family is not None and u.family is not None and family.owns(u.family)}
        if family is None:
            relevant = list(self.shapes)
        else:  # its own calls, and the generic sweep at its head sizes
            head_dims = {shape.head_dim for _, shape in family.shapes}
            relevant = list(own) + [k for k, s in self.shapes.items() if s.head_dim in head_dims
                                    and all(u.family is None for u in self.uses[k])]
        results = self._results(family, fixtures, relevant, min_speedup)
        candidates = [v for v in self.runnable if v in results.certified or v in results.bounded]
        if not candidates:
            return FamilyDecision(name, Verdict.KEEP_OFF, results=results,
                                  reasons=[r for failures in results.rejected.values() for r in failures])
        chosen, thresholds = self._choose(candidates, list(own), relevant, min_speedup)
        speedups = {own[k]: self.speedup[(chosen, k)][0] for k in own if (chosen, k) in self.speedup}
        reasons = self._speed_reasons(family, chosen, thresholds, list(own), speedups, min_speedup)
        if reasons:
            return FamilyDecision(name, Verdict.NO_SPEEDUP, reasons=reasons, results=results,
                                  speedups=speedups)
        masks, mask_reasons = self._masks(chosen, fixtures)
        start = Served(chosen, thresholds.min_query_tokens, thresholds.min_key_tokens,
                       list(thresholds.head_dims), bounds=list(results.bounded.get(chosen, [])), masks=masks)
        found = self._range(chosen, family)
        if found is None:  # a report from before long checks: no upper bound verified
            served, range_reasons = start, []
        else:
            max_q, max_k, layouts, range_reasons = found
            if max_q < start.min_query_tokens or max_k < start.min_key_tokens:
                return FamilyDecision(name, Verdict.KEEP_OFF, range_reasons=range_reasons, results=results,
                                      speedups=speedups, reasons=[Reason(
                                          ReasonKind.LONG, f"no verified range: {chosen} pays from "
                                          f"{start.min_query_tokens:,} tokens but was verified only up to "
                                          f"{max_q:,}")] + range_reasons)
            served = dataclasses.replace(start, max_query_tokens=max_q, max_key_tokens=max_k, layouts=layouts)
        contexts, context_reasons = self.contexts(chosen)
        return FamilyDecision(name, Verdict.ENABLE, dataclasses.replace(served, contexts=contexts),
                              range_reasons=range_reasons + context_reasons + mask_reasons, results=results,
                              speedups=speedups)

    def _masks(self, variant: str, fixtures: list[str]) -> tuple[bool, list[Reason]]:
        """Whether the variant serves the family's masked calls (it takes a mask, the family has
        masked fixtures, and it passed every one on every device), and why not where it failed one:
        a masked call's failure keeps masked calls on torch, not the family."""
        masked = [f for f in fixtures if f in self.masked]
        if not (masked and _takes_mask(variant)):
            return False, []
        failed = [finding for f in masked for finding in self._failures(variant, f)]
        return not failed, [Reason(f.reason.kind, f"masked calls stay on torch: {f.variant} on {f.fixture} "
                                                  f"(cuda:{f.device}): {f.reason.detail}") for f in failed]

    def _results(self, family: Family | None, fixtures: list[str], relevant: list[str],
                 min_speedup: float) -> VariantResults:
        """Each runnable variant on the family's fixtures: certified, bounded or failing."""
        certified, bounded, findings = [], {}, {}
        for variant in self.runnable:
            # A masked call is evidence about masked calls only (`_masks`).
            per_fixture = {fixture: self._failures(variant, fixture) for fixture in fixtures
                           if fixture not in self.masked}
            failures = [r for found in per_fixture.values() for r in found]
            if not failures:
                certified.append(variant)
                continue
            passed = [name for name, found in per_fixture.items() if not found]
            bounds = excluded_bounds(failures, passed, self.report.fixtures, family,
                                     self.break_even(variant, relevant, min_speedup))
            if bounds is None:
                findings[variant] = failures
            else:
                bounded[variant] = bounds
        return VariantResults(certified, bounded, findings)

    def _speed_reasons(self, family: Family | None, chosen: str, thresholds: Thresholds | None,
                       own: list[str], speedups: dict[str, float], min_speedup: float) -> list[Reason]:
        """Why the chosen variant serves none of the family's calls ([] when it serves some)."""
        if thresholds is None:
            bar = served_bar(min_speedup)
            return [Reason(ReasonKind.SPEED, f"{chosen} never measured faster than {bar:g}x the fastest SDPA "
                                             "backend (lower 95 % bound)")]
        if family is None:
            return []
        points = self.points(chosen, own)
        if not points:
            return [Reason(ReasonKind.SPEED, f"{family.name}'s own shapes were not timed (a --quick run): "
                                             "speedup unknown")]
        if not any(serves(thresholds, q, k, d) for q, k, d, _ in points):
            listed = ", ".join(f"{label} {x:.2f}x" for label, x in speedups.items())
            start = Served(chosen, thresholds.min_query_tokens, thresholds.min_key_tokens,
                           list(thresholds.head_dims))
            return [Reason(ReasonKind.SPEED, f"no speedup at its shapes: {chosen} pays only from "
                                             f"{start.start()}, which serves none of them ({listed})")]
        return []

    def contexts(self, variant: str) -> tuple[list[str] | None, list[Reason]]:
        """The contexts `variant` passed every check of on every device that ran context checks, and
        why each other one is left out; (None, []) when no device ran them."""
        checked = [d for d in self.devices if d.contexts is not None]
        if not checked:
            return None, []
        safe, reasons = set(CONTEXTS), []
        for device in checked:
            where = f"{variant} on cuda:{device.index}"
            found = [c for c in device.contexts if c.variant == variant]
            if not found or not found[-1].measured:
                why = "not run" if not found else f"{found[-1].outcome.value}: {found[-1].detail}"
                reasons.append(Reason(ReasonKind.CONTEXT,
                                      f"{where}: context check {why}; default stream only"))
                safe = set()
                continue
            safe &= set(found[-1].safe_contexts)
            for run in found[-1].runs:
                if not run.passed:
                    why = (f"{where}, {run.name}: {run.failure()}; falls back there "
                           f"({REASON[run.context]})")
                    reasons.append(Reason(ReasonKind.CONTEXT, why))
        return [name for name in CONTEXTS if name in safe], reasons

    def _range(self, variant: str, family: Family | None
               ) -> tuple[int, int, list[str], list[Reason]] | None:
        """The variant's verified range for the family from its long checks (module docstring): the
        longest query and key tokens, the layouts, and why they stop there; None for a report from
        before long checks."""
        if all(d.long is None for d in self.devices):
            return None
        declared = list(family.layouts) if family else list(LAYOUTS)
        by_call: dict[tuple[int, int, str], dict[int, LongCheck]] = {}
        for device in self.devices:
            for check in device.long or []:
                if check.variant == variant and long_check_counts(check, family):
                    call = (check.shape.q_tokens, check.shape.kv_tokens, _call_key(check))
                    by_call.setdefault(call, {})[device.index] = check
        fixtures = [f for f in self.report.fixtures if counts_for(family, f.family)]
        max_q = max((f.q[2] for f in fixtures), default=0)
        max_k = max((f.k[2] for f in fixtures), default=0)
        broken: dict[str, Reason] = {}
        reasons: list[Reason] = []
        compared = {"contiguous"}  # the reference layout; the others once a view matched it
        for (q_tokens, kv_tokens, _), checks in sorted(by_call.items()):
            failures = []
            for device in self.devices:
                where = f"{variant} at {q_tokens:,} / {kv_tokens:,} tokens (cuda:{device.index})"
                check = checks.get(device.index)
                if check is None:
                    failures.append(Reason(ReasonKind.LONG, f"{where}: long check not run"))
                    continue
                for reason in long_judged(check):
                    if reason.kind == ReasonKind.LAYOUT:
                        name = reason.detail.split(":")[0].removeprefix("layout ")
                        broken.setdefault(name, Reason(reason.kind, f"{where}: {reason.detail}"))
                    else:
                        failures.append(Reason(reason.kind, f"{where}: {reason.detail}"))
            if failures:
                reasons.append(Reason(ReasonKind.LONG, f"verified only below {q_tokens:,} query tokens: the "
                                                       f"long check there failed ({failures[0].detail})"))
                reasons += failures
                break
            max_q, max_k = max(max_q, q_tokens), max(max_k, kv_tokens)
            compared |= {name for check in checks.values() for name, same in check.identical.items()
                         if same and name in check.layouts}
        layouts = [name for name in declared if name not in broken and name in compared]
        return max_q, max_k, layouts, reasons + list(broken.values())

    def _failures(self, variant: str, fixture: str) -> list[Finding]:
        """Each device's reasons against the variant on the fixture: its cell's, and a miss the
        wrapper's audit recorded there with this variant on a GPU of this model, whatever the cell says
        now (a kernel wrong only on later calls, or in a context certify's cell did not recreate)."""
        found = []
        miss = self.misses.get(fixture)
        for device in self.devices:
            cell = self.cells.get((variant, fixture, device.index))
            missing = [Reason(ReasonKind.INCOMPLETE, "not run")]
            reasons = missing if cell is None else judged(self.report, cell)
            if miss is not None and miss.variant == variant and same_gpu_name(miss.gpu, device.name):
                reasons = [*reasons, Reason(ReasonKind.AUDIT, miss.reason())]
            found += [Finding(variant, fixture, device.index, reason) for reason in reasons]
        return found

    def _choose(self, candidates: list[str], own: list[str], relevant: list[str],
                min_speedup: float) -> tuple[str, Thresholds | None]:
        """The fastest candidate at the family's shapes (or all relevant ones) among those whose
        break-even serves one of its shapes, else among those that pay anywhere, else the fastest."""
        keys = own or relevant

        def total(variant):  # unmeasured ones rank last, in the order of preference
            if keys and all((variant, k) in self.ms for k in keys):
                return sum(self.ms[(variant, k)] for k in keys)
            return math.inf

        ranked = sorted(candidates, key=lambda v: (total(v), candidates.index(v)))
        thresholds = {v: self.break_even(v, relevant, min_speedup) for v in ranked}
        serving = [v for v in ranked if thresholds[v] and any(
            serves(thresholds[v], q, k, d) for q, k, d, _ in self.points(v, own))]
        paying = [v for v in ranked if thresholds[v]]
        chosen = (serving or paying or ranked)[0]
        return chosen, thresholds[chosen]


def _takes_mask(subject: str) -> bool:
    """A variant that takes a mask; an integration (`certify --target`) runs no masked call."""
    return subject in VARIANTS and VARIANTS[subject].takes_mask


def long_check_counts(check: LongCheck, family: Family | None) -> bool:
    """Whether a long check bounds the family's range: one of its own calls, or a generic sweep
    call at one of its head sizes (every check for the default entry, `family` None)."""
    if family is None:
        return True
    head_dims = {shape.head_dim for _, shape in family.shapes}
    return any(u.family is not None and family.owns(u.family) for u in check.uses) or (
        all(u.family is None for u in check.uses) and check.shape.head_dim in head_dims)


def _call_key(check: LongCheck) -> str:
    shape = check.shape
    return f"h{shape.heads}/{shape.kv_heads} d{shape.head_dim} {shape.dtype.value}"


def decide(report: Report) -> list[GpuDecision]:
    """Per GPU model of a complete report: each variant's break-even, a verdict per certified
    family and a default verdict over all fixtures. Empty for a partial report: no verdict is
    drawn from a run that did not finish."""
    if not report.complete:
        return []
    groups: dict[tuple, list[Device]] = {}
    for device in report.devices:
        groups.setdefault(device.model, []).append(device)
    selected = report.options.variants
    decided = []
    for (name, capability), devices in groups.items():
        table = KERNEL_TABLE.get(capability, ())
        preference = [v for v in table if v in selected] + [v for v in selected if v not in table]
        ran = {v for d in devices for v in [c.variant for c in d.cells] + [r.kernel for r in d.speed]}
        unsupported = {v for d in devices for v in d.not_supported}
        runnable = [v for v in preference if v in ran and v not in unsupported]
        model = _Model(report, devices, runnable)
        chosen = [f for f in FAMILIES if f.name in report.options.families]
        decided.append(GpuDecision(
            name=name, capability=capability, memory_gib=min(d.memory_gib for d in devices),
            devices=[d.index for d in devices],
            variants={v: VariantStatus(
                ran=v in ran, runnable=v in runnable,
                reasons=sorted({r for d in devices for r in d.not_supported.get(v, [])}),
                break_even=model.break_even(v, list(report.shapes)))
                      for v in selected},
            families=[model.verdict(f) for f in chosen],
            default=model.verdict(None), speedups=model.speedup,
            sm_count=None if any(d.sm_count is None for d in devices) else min(d.sm_count for d in devices)))
    return decided
