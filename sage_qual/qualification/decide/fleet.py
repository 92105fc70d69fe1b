"""`sage-qual merge`: one fleet table from the certify reports of many hosts, a row per GPU model and
family, each verdict `verdict.decide()`'s, with the range, layouts, head sizes and contexts it serves."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sage_qual import records
from sage_qual.qualification.decide import checked, verdict
from sage_qual.qualification.decide.verdict import FamilyDecision, Verdict
from sage_qual.qualification.evidence import report_model
from sage_qual.qualification.evidence.report_model import Report
from sage_qual.serving.served import Served


# merge -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FleetVerdict:
    """One family on one GPU model of a report, as the fleet table and `merge --json` give it: the
    verdict, what a profile serves (null: nothing) and the kinds of reason it serves no more."""
    verdict: Verdict
    served: Served | None
    reasons: tuple[report_model.ReasonKind, ...]  # each kind once, sorted: the details are in report.md

    def __post_init__(self):
        records.tuples(self)

    @classmethod
    def of(cls, decision: FamilyDecision) -> FleetVerdict:
        kinds = sorted({r.kind for r in decision.reasons}, key=lambda kind: kind.value)
        return cls(decision.verdict, decision.served, kinds)


@dataclass(frozen=True)
class FleetRow:
    """One GPU model of one report: where it ran and each family's verdict (none for a report that
    decides nothing, `undecidable` saying why)."""
    host: str
    report: str  # the report file
    complete: bool
    predicted: bool
    target: str
    driver: str
    torch: str
    sageattention: str
    sageattention_source: str  # its build fingerprint ("" where the report has none)
    gpu: str
    capability: tuple[int, ...]
    devices: tuple[int, ...]
    families: dict[str, FleetVerdict]
    # The other providers' packages that served certify ("comfy-kitchen 0.2.40 (sha256:...)").
    other_providers: tuple[str, ...] = ()
    # Why the report decides nothing, in the words gate and compare refuse it with
    # (`checked.undecidable`); "" when it decides. A --quick report's "pass" is not a family's.
    undecidable: str = ""

    def __post_init__(self):
        records.tuples(self)


def merge_rows(reports: list[tuple[Path, Report]]) -> list[FleetRow]:
    rows = []
    for path, data in reports:
        env = data.environment
        common = dict(host=data.host, report=str(path), complete=data.complete, predicted=data.predicted,
                      target=data.target, driver=env.driver, torch=env.torch, sageattention=env.sageattention,
                      sageattention_source=env.sageattention_source,
                      other_providers=[f"{o.provider} {o.version}" + (f" ({o.source})" if o.source else "")
                                       for o in env.other_providers if o.version])
        problem = checked.undecidable(data, str(path))
        if problem:  # no verdict: one row per GPU model the run saw
            models: dict[tuple, list[int]] = {}
            for device in data.devices:
                models.setdefault(device.model, []).append(device.index)
            rows += [FleetRow(**common, gpu=name, capability=capability, devices=indices, families={},
                              undecidable=problem) for (name, capability), indices in models.items()]
            continue
        rows += [FleetRow(**common, gpu=gpu.name, capability=gpu.capability, devices=gpu.devices,
                          families={v.family: FleetVerdict.of(v) for v in gpu.families})
                 for gpu in verdict.decide(data)]
    return rows


