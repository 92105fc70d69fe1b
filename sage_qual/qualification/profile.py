"""Building the profile (read by `sage_qual.serving.profile`) from a report and its decisions."""

from __future__ import annotations

import json
from pathlib import Path

from sage_qual.qualification import span_check
from sage_qual.qualification.report_model import Report
from sage_qual.qualification.verdict import FamilyDecision, GpuDecision
from sage_qual.serving.profile import KIND, SCHEMA_VERSION

ENVIRONMENT_KEYS = ("torch", "torch_cuda", "driver", "sageattention", "triton")


def build(report: Report, decisions: list[GpuDecision]) -> dict:
    """One entry per GPU model of a complete report, each with what defines its machine."""
    env = report.environment
    return {
        "kind": KIND,
        "schema_version": SCHEMA_VERSION,
        "created": report.finished,
        "host": report.host,
        "fixtures": {f.name: f.sha256 for f in report.fixtures},
        "gpus": [{"name": gpu.name, "capability": list(gpu.capability), "memory_gib": gpu.memory_gib,
                  "environment": {key: getattr(env, key) for key in ENVIRONMENT_KEYS},
                  "default": _entry(gpu.default),
                  "families": {f.family: _entry(f) for f in gpu.families}, **_span_limit(report, gpu)}
                 for gpu in decisions],
    }


def _span_limit(report: Report, gpu: GpuDecision) -> dict:
    """{"max_span_elements": N} when the span probes measured one for every variant the GPU's entries
    serve (`span_check.profile_limit`); {} otherwise: the wrapper keeps its default limit."""
    probes = [p for d in report.devices if d.index in gpu.devices for p in d.span or []]
    limit = span_check.profile_limit(probes, {d.variant for d in gpu.families + [gpu.default] if d.variant})
    return {} if limit is None else {"max_span_elements": limit}


def _entry(decision: FamilyDecision) -> dict:
    """What the wrapper serves for one family: the variant from the break-even up to the verified
    length (max_query_tokens, max_key_tokens) in the verified layouts; a report without long checks
    leaves them out (null: no upper bound, any layout)."""
    entry = {"variant": decision.variant, "min_query_tokens": decision.min_query_tokens,
             "min_key_tokens": decision.min_key_tokens, "head_dims": decision.head_dims,
             "reasons": [{"kind": r.kind.value, "detail": r.detail}
                         for r in decision.reasons + decision.range_reasons]}
    # Optional keys (profile contract with sage_qual.serving.profile): absent means null.
    if decision.range_verified:
        entry.update(max_query_tokens=decision.max_query_tokens, max_key_tokens=decision.max_key_tokens,
                     layouts=decision.layouts)
    return entry


def save(profile: dict, path: Path) -> None:
    Path(path).write_text(json.dumps(profile, indent=1) + "\n")
