"""Building the profile (read by `sage_qual.serving.profile`) from a report and its decisions."""

from __future__ import annotations

import json
from pathlib import Path

from sage_qual import records
from sage_qual.qualification import span_check
from sage_qual.qualification.report_model import Report
from sage_qual.qualification.verdict import FamilyDecision, GpuDecision
from sage_qual.serving.profile import (
    KIND,
    SCHEMA_VERSION,
    Entry,
    Profile,
    ProfileEnvironment,
    ProfileGpu,
)


def build(report: Report, decisions: list[GpuDecision]) -> Profile:
    """One entry per GPU model of a complete report, each with what defines its machine."""
    env = report.environment
    machine = ProfileEnvironment(env.torch, env.torch_cuda, env.driver, env.sageattention, env.triton)
    fixtures = {f.name: f.sha256 for f in report.fixtures}
    return Profile(KIND, SCHEMA_VERSION, report.finished, report.host, fixtures,
                   [ProfileGpu(gpu.name, list(gpu.capability), gpu.memory_gib, machine, _entry(gpu.default),
                               {f.family: _entry(f) for f in gpu.families}, _span_limit(report, gpu))
                    for gpu in decisions])


def _span_limit(report: Report, gpu: GpuDecision) -> int | None:
    """The span limit when the span probes measured one for every variant the GPU's entries serve
    (`span_check.profile_limit`); None otherwise: the wrapper keeps its default limit."""
    probes = [p for d in report.devices if d.index in gpu.devices for p in d.span or []]
    return span_check.profile_limit(probes, {d.variant for d in gpu.families + [gpu.default] if d.variant})


def _entry(decision: FamilyDecision) -> Entry:
    """What the wrapper serves for one family: the variant from the break-even up to the verified
    length (max_query_tokens, max_key_tokens) in the verified layouts and contexts; for a report
    without long checks (context checks) these stay null: no upper bound, any layout (the variant's
    built-in contexts)."""
    verified = decision.range_verified
    reasons = decision.reasons + decision.range_reasons
    return Entry(decision.variant, decision.min_query_tokens, decision.min_key_tokens, decision.head_dims,
                 reasons, decision.max_query_tokens if verified else None,
                 decision.max_key_tokens if verified else None, decision.layouts if verified else None,
                 decision.contexts if decision.variant else None)


def save(profile: Profile, path: Path) -> None:
    """profile.json, as `records.dump` writes it: checked by the reader's rules first."""
    Path(path).write_text(json.dumps(records.dump(profile), indent=1) + "\n")
