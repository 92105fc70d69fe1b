"""The lines `sage-qual gate` prints for one decision (`decide.gate.GateDecision`)."""

from __future__ import annotations

from sage_qual.qualification.decide.gate import GateDecision
from sage_qual.qualification.decide.verdict import Verdict
from sage_qual.qualification.evidence.report_model import ReasonKind

# The judge a reason comes from, where its kind's name does not say it.
JUDGES = {ReasonKind.ACCURACY: "accuracy (off its model)"}


def lines(decision: GateDecision, require_speedup: bool) -> list[str]:
    """Per GPU model here: what an enabled family serves (`Served.text`) and why the range stops
    there, or the verdict and every reason."""
    if decision.problem:
        return [decision.problem]
    found = ([f"the report applies here, with differences the rules allow: {'; '.join(decision.differences)}"]
             if decision.differences else [])
    for model, family in decision.gpus:
        where = f"{decision.family} on {model}"
        if family.verdict == Verdict.ENABLE:
            found.append(f"{where}: enable {family.variant} {family.served.text()}")
            found += [f"  - range: {r.detail}" for r in family.range_reasons]
            continue
        note = ""
        if family.verdict == Verdict.NO_SPEEDUP:
            results = family.results
            passing = results.certified + [f"{v} (within bounds)" for v in results.bounded]
            note = (" (passes with " + ", ".join(passing) + "; a profile serves no call"
                    + ("" if require_speedup else "; --require-speedup would keep it off") + ")")
        found.append(f"{where}: {family.verdict.value}{note}")
        found += [f"  - {JUDGES.get(r.kind, r.kind.value)}: {r.detail}" for r in family.reasons]
    return found
