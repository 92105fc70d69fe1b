"""Building the profile (read by `sage_qual.verdicts.profile`) from a report and its decisions.

A GPU's `max_span_elements` is `profile_limit()` of its span probes. Why the profile never goes
above `limits.MAX_SPAN_ELEMENTS`, even when an above case was right: the probe's long tensor is the
query only, so a right call says nothing of K and V past 2^31 (the fused V transpose's uint32
offsets, kijai/ComfyUI-KJNodes pull request 748). And past 2^31 an int32 offset overflows term by
term (batch, head, sequence), so one shape right there does not make every shape of that span right.
An above case is a finding of the report; it raises nothing."""

from __future__ import annotations

import json
from pathlib import Path

from sage_qual import limits, records
from sage_qual.qualification.decide.verdict import FamilyDecision, GpuDecision
from sage_qual.qualification.evidence.report_model import Report
from sage_qual.qualification.measure import span_probe
from sage_qual.qualification.measure.span_probe import SpanCase, SpanFinding
from sage_qual.verdicts.profile import (
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
    machine = ProfileEnvironment(env.torch, env.torch_cuda, env.driver, env.sageattention, env.triton,
                                 env.sageattention_source,
                                 {o.provider: o.source for o in env.other_providers if o.source})
    fixtures = {f.name: f.sha256 for f in report.fixtures}
    return Profile(KIND, SCHEMA_VERSION, report.finished, report.host, fixtures,
                   [ProfileGpu(gpu.name, list(gpu.capability), gpu.memory_gib, machine, _entry(gpu.default),
                               {f.family: _entry(f) for f in gpu.families}, _span_limit(report, gpu),
                               gpu.sm_count)
                    for gpu in decisions])


def _span_limit(report: Report, gpu: GpuDecision) -> int | None:
    """The span limit when the span probes measured one for every variant the GPU's entries serve
    (`profile_limit`); None otherwise: the wrapper keeps its default limit."""
    probes = [p for d in report.devices if d.index in gpu.devices for p in d.span or []]
    return profile_limit(probes, {d.variant for d in gpu.families + [gpu.default] if d.variant})


def _entry(decision: FamilyDecision) -> Entry:
    """What the wrapper serves for one family: the decision's `Served` (from the break-even up to the
    verified length in the verified layouts and contexts, never below its bounds; for a report
    without long checks (context checks) these are null: no upper bound, any layout (the variant's
    built-in contexts)), with every reason it serves no more."""
    return Entry(decision.served, decision.reasons + decision.range_reasons)


def save(profile: Profile, path: Path) -> None:
    """profile.json, as `records.dump` writes it: checked by the reader's rules first."""
    Path(path).write_text(json.dumps(records.dump(profile), indent=1) + "\n")


def findings(probes, variant: str) -> list[SpanFinding]:
    """The report's probes (report_model.SpanProbe) of `variant` as span_probe findings."""
    return [SpanFinding(p.variant, SpanCase(p.layout, p.side, p.tokens, p.span, p.heads, p.head_dim,
                                            p.kv_tokens),
                        "ok" if p.outcome.value == "pass" else p.outcome.value)
            for p in probes if p.variant == variant]


def largest_safe(probes, variant: str) -> int | None:
    """The largest span right in every layout with every smaller probe right (None: none was)."""
    return span_probe.largest_safe_span(findings(probes, variant), variant)


def profile_limit(probes, served: set[str]) -> int | None:
    """A GPU's `max_span_elements` for the variants its profile entries serve: the smallest of their
    largest safe spans, never above `limits.MAX_SPAN_ELEMENTS` (the module docstring says why); 1
    when a served variant was probed and nothing was right (every call then goes to torch); None,
    the default, when nothing is served or a served variant was not probed."""
    probed = {p.variant for p in probes}
    if not served or not served <= probed:
        return None
    safe = [largest_safe(probes, variant) for variant in sorted(served)]
    if any(span is None for span in safe):
        return 1
    return min(min(safe), limits.MAX_SPAN_ELEMENTS)


