"""JUnit XML: each case's outcome is the element a CI's test view reads, and the suite counts them."""

import xml.etree.ElementTree as ET

from sage_qual.qualification.decide.verdict import FamilyDecision, Verdict
from sage_qual.qualification.evidence.report_model import Reason, ReasonKind
from sage_qual.qualification.render import junit


def test_each_outcome_is_its_element_and_counted(tmp_path):
    cases = [junit.Case("H200", "FLUX.1", junit.Outcome.PASSED, "enable"),
             junit.Case("H200", "SDXL", junit.Outcome.SKIPPED, "safe, no speedup", "speed: never faster"),
             junit.Case("H200", "Wan 2.2", junit.Outcome.FAILURE, "keep off", "crash: died"),
             junit.Case("gate", "Krea-2", junit.Outcome.ERROR, "stale report"),
             junit.Case("H100", "Krea-2", junit.Outcome.FAILURE, "keep off")]
    junit.write(tmp_path / "out.xml", "suite", cases)
    suite = ET.parse(tmp_path / "out.xml").getroot().find("testsuite")
    assert {k: suite.get(k) for k in ("tests", "failures", "skipped", "errors")} == {
        "tests": "5", "failures": "2", "skipped": "1", "errors": "1"}
    found = [[child.tag for child in case] for case in suite.findall("testcase")]
    assert found == [[], ["skipped"], ["failure"], ["error"], ["failure"]]
    assert suite.findall("testcase")[2][0].text == "crash: died"


def test_a_verdict_is_a_case():
    reasons = [Reason(ReasonKind.SPEED, "never faster")]
    no_speedup = FamilyDecision("SDXL", Verdict.NO_SPEEDUP, reasons=reasons)
    assert junit.case("H200", no_speedup).outcome == junit.Outcome.SKIPPED
    assert junit.case("H200", no_speedup, no_speedup_fails=True).outcome == junit.Outcome.FAILURE
    assert junit.case("H200", FamilyDecision("SDXL", Verdict.KEEP_OFF, reasons=reasons)) == junit.Case(
        "H200", "SDXL", junit.Outcome.FAILURE, "keep off", "speed: never faster")
