"""What a certify run prints when it ends, in each mode, read from `verdict.decide()` only.

One line says how the run ended and where its report is; then, for a complete report, per GPU model
and family: certify's verdict (the lines two runs are compared on; `sage-qual compare` does it for
the files), an integration's evidence (certify --target: safe, NOT SAFE or not qualified, with the
reasons), or each variant's predicted evidence and every predicted failure (certify --emulate).
A partial report decides nothing, so it gets the first line only.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from sage_qual.kernels.variants import VARIANTS, capability_label
from sage_qual.qualification.decide import verdict
from sage_qual.qualification.evidence.report_model import ReasonKind, Report
from sage_qual.qualification.selection import LeftOut


def text(written: Report, out: Path, decisions: list[verdict.GpuDecision],
         left_out: Sequence[LeftOut] = ()) -> str:
    """The summary of `written`, from its `decisions` (`verdict.decide(written)`, drawn by the run),
    ending with the fixtures the run's selection left out (`left_out`), each named."""
    mode = "sage-qual certify"
    state = "complete" if written.complete else "PARTIAL: " + written.stopped
    if written.target:
        mode += f" --target {written.target}"
    elif written.predicted:
        mode += " --emulate"
        state += ", PREDICTED (`sage-qual gate` refuses it: certify on the GPU to enable a family)"
    lines = [f"{mode}: {state}; report in {out / 'report.md'}"]
    if written.complete:
        body = _target if written.target else _predicted if written.predicted else _certified
        lines += body(written, decisions)
    if left_out:
        lines.append(
            f"left out by --quick: {len(left_out)} fixture(s), not run (report.md lists what the H200 "
            "measured on each): " + ", ".join(f"{f.fixture} ({f.family})" for f in left_out)
        )
    return "\n".join(lines)


def _certified(written: Report, decisions: list[verdict.GpuDecision]) -> list[str]:
    lines = []
    for gpu in decisions:
        for decision in gpu.families + [gpu.default]:
            if decision.verdict == verdict.Verdict.ENABLE:
                state = f"enable {decision.variant} {decision.served.text()}"
            else:
                reasons = decision.reasons
                state = f"{decision.verdict.value} ({len(reasons)} reason(s), first: {reasons[0].detail})"
            lines.append(f"  {gpu.model}  {decision.label:<12} {state}")
    return lines


def _target(written: Report, decisions: list[verdict.GpuDecision]) -> list[str]:
    """Per GPU and family: safe when the integration passed every fixture of the family, NOT SAFE
    with every reason when one failed, crashed or ran out of time or memory, not qualified when it
    has no evidence (no fixtures, or calls it does not take or did not serve)."""
    lines = []
    for gpu in decisions:
        for family in gpu.families:
            evidence = family.evidence(written.target)
            if evidence == verdict.Evidence.SAFE:
                state = f"{evidence.value}: every fixture of the family passed"
            else:
                state = f"{evidence.value}: " + "; ".join(r.detail for r in family.why_not(written.target))
            lines.append(f"  {gpu.model}  {family.label:<12} {state}")
    return lines


def _predicted(written: Report, decisions: list[verdict.GpuDecision]) -> list[str]:
    """Per variant (and the GPUs that run it by default), which families it would pass or fail,
    then every predicted failure, one line per variant and fixture with its causes."""
    families = [family for gpu in decisions for family in gpu.families
                if not all(r.kind == ReasonKind.NO_FIXTURES for r in family.reasons) or not family.reasons]
    variants = written.options.variants
    lines = [f"PREDICTED (CPU numerics model, no GPU ran): {len(written.fixtures)} fixture(s), "
             f"{len(variants)} variant(s); FAIL = would fail at least one fixture of the family",
             "  it finds non-finite model outputs, named hazards and outputs unfit for the family: a finite "
             "prediction conforms to its own model (report.md says more)"]
    width = max(map(len, variants)) + 2
    lines.append("variant".ljust(width) + "default on".ljust(16)
                 + " ".join(f.label.ljust(10) for f in families))
    for variant in variants:
        native = ",".join(map(capability_label, VARIANTS[variant].native_on)) or "-"
        row = " ".join(("pass" if f.evidence(variant) == verdict.Evidence.SAFE else "FAIL").ljust(10)
                       for f in families)
        lines.append(variant.ljust(width) + native[:15].ljust(16) + row)
    for family in families:
        # One line per fixture and cause, naming every variant it holds for: the same sentence for 9
        # variants was printed 9 times (issue 54).
        failing: dict[tuple[str, str], list[str]] = {}  # (fixture, why) -> the variants
        for variant in variants:
            causes: dict[str, list[str]] = {}  # fixture -> why it would fail there
            for finding in family.results.findings.get(variant, []):
                causes.setdefault(finding.fixture, []).append(finding.reason.detail)
            for fixture, why in causes.items():
                failing.setdefault((fixture, "; ".join(why)), []).append(variant)
        lines += [f"  would fail {family.label}: {', '.join(names)} on {fixture}: {why}"
                  for (fixture, why), names in failing.items()]
    skipped = sorted(set(written.options.families) - {f.label for f in families})
    if skipped:
        lines.append(f"  no fixtures, not predicted: {', '.join(skipped)}")
    return lines
