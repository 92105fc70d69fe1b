"""JUnit XML for CI: one test case per GPU model and family, named so a CI's test view reads it.

An "enable" verdict is a passing case, "keep off" a failure, and "safe, no speedup" a skipped
case (nothing to switch on) unless the caller counts it as a failure.
"""

from __future__ import annotations

import enum
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

from sage_qual.errors import UsageError
from sage_qual.qualification.decide.verdict import FamilyDecision, Verdict


class Outcome(str, enum.Enum):
    """A test case's result; every one but PASSED is the name of the element JUnit XML marks it with."""
    PASSED = "passed"
    FAILURE = "failure"
    SKIPPED = "skipped"
    ERROR = "error"


@dataclass(frozen=True)
class Case:
    classname: str  # the GPU model
    name: str  # the family
    outcome: Outcome
    message: str = ""
    details: str = ""


def case(model: str, decision: FamilyDecision, no_speedup_fails: bool = False) -> Case:
    details = "\n".join(f"{r.kind.value}: {r.detail}" for r in decision.reasons)
    if decision.verdict == Verdict.ENABLE:
        return Case(model, decision.label, Outcome.PASSED,
                    f"enable: {decision.variant} {decision.served.text()}")
    if decision.verdict == Verdict.NO_SPEEDUP and not no_speedup_fails:
        return Case(model, decision.label, Outcome.SKIPPED, decision.verdict.value, details)
    return Case(model, decision.label, Outcome.FAILURE, decision.verdict.value, details)


def write(path: Path, suite: str, cases: list[Case]) -> None:
    root = ET.Element("testsuites")
    counts = {kind: sum(c.outcome == kind for c in cases) for kind in Outcome}
    element = ET.SubElement(root, "testsuite", name=suite, tests=str(len(cases)),
                            failures=str(counts[Outcome.FAILURE]), skipped=str(counts[Outcome.SKIPPED]),
                            errors=str(counts[Outcome.ERROR]))
    for c in cases:
        testcase = ET.SubElement(element, "testcase", classname=c.classname, name=c.name)
        if c.outcome != Outcome.PASSED:
            child = ET.SubElement(testcase, c.outcome.value, message=c.message)
            child.text = c.details
    try:
        ET.ElementTree(root).write(path, encoding="utf-8", xml_declaration=True)
    except OSError as error:
        raise UsageError(f"cannot write {path}: {error.strerror or error}") from None
