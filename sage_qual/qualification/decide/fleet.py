"""`sage-qual merge`: one fleet table from the certify reports of many hosts, a row per GPU model and
family, each verdict `verdict.decide()`'s, with the range, layouts, head sizes and contexts it serves."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from sage_qual.qualification.decide import verdict
from sage_qual.qualification.decide.verdict import FamilyDecision, Verdict
from sage_qual.qualification.evidence import report_model
from sage_qual.qualification.evidence.report_model import Report
from sage_qual.serving.config import Bound


# merge -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FleetVerdict:
    """One family on one GPU model of a report, as the fleet table and `merge --json` give it."""
    verdict: Verdict
    variant: str | None
    min_query_tokens: int | None
    min_key_tokens: int | None
    max_query_tokens: int | None  # None: no upper bound verified (a report without long checks)
    layouts: list[str] | None
    reasons: list[report_model.ReasonKind]  # each kind once, sorted: the details are in report.md
    contexts: list[str] | None = None  # None: not checked (the variant's built-in rule)
    max_key_tokens: int | None = None  # None: no upper bound verified
    head_dims: list[int] | None = None  # the head sizes served (None: nothing served)
    bounds: list[Bound] = field(default_factory=list)  # calls kept on torch whatever the thresholds

    @classmethod
    def of(cls, decision: FamilyDecision) -> FleetVerdict:
        kinds = sorted({r.kind for r in decision.reasons}, key=lambda kind: kind.value)
        return cls(decision.verdict, decision.variant, decision.min_query_tokens, decision.min_key_tokens,
                   decision.max_query_tokens, decision.layouts, kinds, decision.contexts,
                   decision.max_key_tokens, decision.head_dims, decision.bounds)

    def text(self) -> str:
        """The table cell: what an enabled family serves (variant, tokens, head sizes, layouts,
        contexts), else the verdict and reason kinds."""
        if self.verdict != Verdict.ENABLE:
            return f"{self.verdict.value}: " + ", ".join(kind.value for kind in self.reasons)
        dims = f", head_dim {'/'.join(map(str, self.head_dims))}" if self.head_dims else ""
        if self.max_query_tokens is None:
            return f"enable: {self.variant} >= {self.min_query_tokens}/{self.min_key_tokens}{dims}"
        tokens = f"{self.min_query_tokens:,} to {self.max_query_tokens:,}"
        if self.max_key_tokens is not None and \
                (self.min_key_tokens, self.max_key_tokens) != (self.min_query_tokens, self.max_query_tokens):
            tokens += f" query / {self.min_key_tokens:,} to {self.max_key_tokens:,} key"
        contexts = "" if self.contexts is None else f"; contexts: {', '.join(self.contexts) or 'none'}"
        bounds = "".join(f"; {b.short()}" for b in self.bounds)
        return f"enable: {self.variant} {tokens} tokens{dims} ({', '.join(self.layouts)}{contexts}{bounds})"


@dataclass(frozen=True)
class FleetRow:
    """One GPU model of one report: where it ran and each family's verdict (none for a partial report:
    one row per device then, as no verdict is drawn)."""
    host: str
    report: str  # the report file
    complete: bool
    predicted: bool
    target: str
    driver: str
    torch: str
    sageattention: str
    gpu: str
    capability: list[int]
    devices: list[int]
    families: dict[str, FleetVerdict]


def merge_rows(reports: list[tuple[Path, Report]]) -> list[FleetRow]:
    rows = []
    for path, data in reports:
        env = data.environment
        common = dict(host=data.host, report=str(path), complete=data.complete, predicted=data.predicted,
                      target=data.target, driver=env.driver, torch=env.torch, sageattention=env.sageattention)
        if not data.complete:
            rows += [FleetRow(**common, gpu=device.name, capability=list(device.capability),
                              devices=[device.index], families={}) for device in data.devices]
            continue
        rows += [FleetRow(**common, gpu=gpu.name, capability=list(gpu.capability), devices=gpu.devices,
                          families={v.family: FleetVerdict.of(v) for v in gpu.families})
                 for gpu in verdict.decide(data)]
    return rows


