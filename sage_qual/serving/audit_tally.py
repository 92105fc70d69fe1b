"""What the audit of served calls found: one record per finding, and the tally an inference service reads.

A finding is an audited call one of the two judges failed (`slice_check`): a **miss** (fitness: past
the family's bound, or not finite) or a **drift** (conformance: off the served variant's numerics
model by more than certify's margin). The tally counts calls audited and skipped (per reason), the
worst relative L2 per family and variant with its bound, the findings and the GPUs retired; it reads
as one line (`summary`), as a JSON-ready snapshot (`snapshot`), and as Prometheus metrics
(`prometheus_collector`, with the optional `prometheus_client` package; names in docs/audit.md).
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field

MISS, DRIFT = "miss", "drift"
WORST = "worst"  # a fit audited call, offered to the folder as its site's worst (never a finding)


@dataclass(frozen=True)
class Finding:
    """One audited call a judge failed: where, the numbers, and the fixture it was saved as."""

    judge: str  # MISS (fitness) or DRIFT (conformance); WORST: a fit call offered to the folder
    family: str
    device: str  # its label: "cuda:0 (NVIDIA H200, sm_90)"
    gpu: str
    capability: tuple[int, int]
    variant: str
    build: str  # the provider and version of the kernel's package
    rel_l2: float
    bound: float  # the failed judge's: the fitness bound (miss) or the conformance bound (drift)
    model_rel_l2: float | None  # the numerics model's on the same slice (None: not modelled)
    call: str  # shapes, dtype and context
    rows: str  # the audited slice
    fixture: str = ""  # the recorded fixture's path ("" when not recorded)

    def text(self) -> str:
        recorded = f"; recorded as {self.fixture}" if self.fixture else ""
        if self.judge == DRIFT:
            numbers = (
                f"relative L2 {self.rel_l2:.3g} against PyTorch SDPA where its numerics model gives "
                f"{self.model_rel_l2:.3g}, conformance bound {self.bound:.3g}"
            )
        else:
            numbers = f"relative L2 {self.rel_l2:.3g} against PyTorch SDPA, bound {self.bound:g}"
        return (
            f"{self.variant} on {self.device} for {self.family}: {numbers} ({self.call}, slice "
            f"{self.rows}){recorded}"
        )


def _worse(rel_l2: float, worst: float | None) -> bool:
    """Whether `rel_l2` replaces `worst`: a NaN (an output not finite) is the worst and stays it."""
    return worst is None or not math.isnan(worst) and not rel_l2 <= worst


@dataclass
class AuditTally:
    """A scope's (`ScopeReport.audit`) or the process's (`audit_tally()`) audit numbers."""

    audited: int = 0
    skipped: collections.Counter = field(default_factory=collections.Counter)
    worst: dict[str, float] = field(default_factory=dict)  # per family
    bounds: dict[str, float] = field(default_factory=dict)  # per family: its fitness bound
    worst_by_variant: dict[tuple[str, str], float] = field(default_factory=dict)  # (family, variant)
    worst_ratio: dict[tuple[str, str], float] = field(
        default_factory=dict
    )  # kernel / model, (family, variant)
    misses: list[Finding] = field(default_factory=list)
    drifts: list[Finding] = field(default_factory=list)
    retired: dict[str, str] = field(default_factory=dict)  # device label -> why

    def judged(
        self, family: str, variant: str, rel_l2: float, bound: float, model_rel_l2: float | None
    ) -> None:
        self.audited += 1
        self._worst(family, variant, rel_l2, bound, model_rel_l2)

    def found(self, finding: Finding) -> None:
        (self.drifts if finding.judge == DRIFT else self.misses).append(finding)

    def add(self, other: AuditTally) -> None:
        self.audited += other.audited
        self.skipped.update(other.skipped)
        for family, rel_l2 in other.worst.items():
            if _worse(rel_l2, self.worst.get(family)):
                self.worst[family] = rel_l2
            self.bounds[family] = other.bounds[family]
        for table, theirs in (
            (self.worst_by_variant, other.worst_by_variant),
            (self.worst_ratio, other.worst_ratio),
        ):
            for key, value in theirs.items():
                if _worse(value, table.get(key)):
                    table[key] = value
        self.misses += other.misses
        self.drifts += other.drifts
        self.retired.update(other.retired)

    def _worst(
        self, family: str, variant: str, rel_l2: float, bound: float, model_rel_l2: float | None
    ) -> None:
        self.bounds[family] = bound
        if _worse(rel_l2, self.worst.get(family)):
            self.worst[family] = rel_l2
        if _worse(rel_l2, self.worst_by_variant.get((family, variant))):
            self.worst_by_variant[(family, variant)] = rel_l2
        if model_rel_l2 is not None:
            ratio = rel_l2 / max(model_rel_l2, 1e-12)
            if _worse(ratio, self.worst_ratio.get((family, variant))):
                self.worst_ratio[(family, variant)] = ratio

    def summary(self) -> str:
        """ "audit: 12 calls (2 skipped: capture=2), worst Krea-2 0.041 (bound 0.3), 0 misses, 0 drifts"."""
        skipped = sum(self.skipped.values())
        why = ", ".join(f"{reason}={count}" for reason, count in self.skipped.items())
        parts = [f"audit: {self.audited} calls" + (f" ({skipped} skipped: {why})" if skipped else "")]
        parts += [
            f"worst {family} {rel_l2:.3g} (bound {self.bounds[family]:g})"
            for family, rel_l2 in self.worst.items()
        ]
        return ", ".join(parts + [f"{len(self.misses)} misses", f"{len(self.drifts)} drifts"])

    def snapshot(self) -> dict:
        """The tally as JSON-ready data (`json.dumps(tally.snapshot())`): non-finite numbers as None."""

        def number(x: float | None) -> float | None:
            return x if x is not None and math.isfinite(x) else None

        def finding(f: Finding) -> dict:
            return {
                "judge": f.judge,
                "family": f.family,
                "device": f.device,
                "gpu": f.gpu,
                "capability": list(f.capability),
                "variant": f.variant,
                "build": f.build,
                "rel_l2": number(f.rel_l2),
                "bound": f.bound,
                "model_rel_l2": number(f.model_rel_l2),
                "call": f.call,
                "slice": f.rows,
                "fixture": f.fixture,
            }

        return {
            "audited": self.audited,
            "skipped": dict(self.skipped),
            "worst": [
                {
                    "family": family,
                    "variant": variant,
                    "rel_l2": number(rel_l2),
                    "fitness_bound": self.bounds.get(family),
                    "kernel_over_model": number(self.worst_ratio.get((family, variant))),
                }
                for (family, variant), rel_l2 in self.worst_by_variant.items()
            ],
            "misses": [finding(f) for f in self.misses],
            "drifts": [finding(f) for f in self.drifts],
            "retired": [{"device": device, "why": why} for device, why in self.retired.items()],
        }


# Prometheus metric names (docs/audit.md lists them with their labels).
METRICS = {
    "sage_qual_audit_calls_total": "served calls audited",
    "sage_qual_audit_skipped_total": "audits due but not run, by reason",
    "sage_qual_audit_worst_rel_l2": "worst relative L2 against torch by family and variant (NaN: not finite)",
    "sage_qual_audit_fitness_bound": "the family's fitness bound",
    "sage_qual_audit_worst_kernel_over_model": "worst kernel relative L2 over its numerics model's",
    "sage_qual_audit_findings_total": "audited calls a judge failed, by judge, family and variant",
    "sage_qual_audit_retired_devices": "GPUs the audit moved to torch",
}


def prometheus_collector(tally_of):
    """A Prometheus collector of `tally_of()` (e.g. `sage_qual.audit_tally`), for
    `prometheus_client.REGISTRY.register(...)`; ImportError with the fix without the package."""
    try:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    except ImportError:
        raise ImportError(
            "prometheus_client is not installed: pip install prometheus_client, or the extra: "
            'pip install -e ".[metrics]" in this checkout'
        ) from None

    class AuditCollector:
        def collect(self):
            tally = tally_of()
            calls = CounterMetricFamily("sage_qual_audit_calls", METRICS["sage_qual_audit_calls_total"])
            calls.add_metric([], tally.audited)
            skipped = CounterMetricFamily(
                "sage_qual_audit_skipped", METRICS["sage_qual_audit_skipped_total"], labels=["reason"]
            )
            for reason, count in tally.skipped.items():
                skipped.add_metric([reason], count)
            worst = GaugeMetricFamily(
                "sage_qual_audit_worst_rel_l2",
                METRICS["sage_qual_audit_worst_rel_l2"],
                labels=["family", "variant"],
            )
            ratio = GaugeMetricFamily(
                "sage_qual_audit_worst_kernel_over_model",
                METRICS["sage_qual_audit_worst_kernel_over_model"],
                labels=["family", "variant"],
            )
            for (family, variant), rel_l2 in tally.worst_by_variant.items():
                worst.add_metric([family, variant], rel_l2)
                if (family, variant) in tally.worst_ratio:
                    ratio.add_metric([family, variant], tally.worst_ratio[(family, variant)])
            bound = GaugeMetricFamily(
                "sage_qual_audit_fitness_bound", METRICS["sage_qual_audit_fitness_bound"], labels=["family"]
            )
            for family, value in tally.bounds.items():
                bound.add_metric([family], value)
            findings = CounterMetricFamily(
                "sage_qual_audit_findings",
                METRICS["sage_qual_audit_findings_total"],
                labels=["judge", "family", "variant"],
            )
            counted = collections.Counter((f.judge, f.family, f.variant) for f in tally.misses + tally.drifts)
            for labels, count in counted.items():
                findings.add_metric(list(labels), count)
            retired = GaugeMetricFamily(
                "sage_qual_audit_retired_devices", METRICS["sage_qual_audit_retired_devices"]
            )
            retired.add_metric([], len(tally.retired))
            yield from (calls, skipped, worst, ratio, bound, findings, retired)

    return AuditCollector()
