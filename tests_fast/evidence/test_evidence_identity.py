"""Every kind of evidence record is unique per its declared IDENTITY, and its order is no evidence
(issue 43): on a committed H200 report, each record of every kind held twice (a failing copy
appended after it, as an edit would) is refused naming the kind; every list re-ordered decides the
same verdicts. The kinds are read from the report model's types, so a new kind is covered here."""

import copy
import gzip
import json

import pytest

from sage_qual.qualification.decide import checked, verdict
from sage_qual.qualification.evidence.identity import evidence_lists
from sage_qual.qualification.evidence.report_model import ReportError

from ..helpers import newest_h200_run

NEWEST = sorted(newest_h200_run().glob("certify*/report.json.gz"))[0]
REPORT = json.loads(gzip.decompress(NEWEST.read_bytes()))
KINDS = [name for name, _ in evidence_lists(checked.parse(copy.deepcopy(REPORT), "report").devices[0])]


def test_the_committed_report_holds_every_kind_of_evidence():
    """So the tests below try each: cells, timings, long checks, span probes and context checks."""
    assert KINDS == ["cells", "speed", "long", "span", "contexts"]


def verdicts(data: dict) -> list:
    return [(gpu.model, d.label, d.verdict, d.served, d.reasons, d.range_reasons)
            for gpu in verdict.decide(checked.parse(data, "report")) for d in gpu.families + [gpu.default]]


def spread(count: int, wanted: int = 12) -> list[int]:
    """`wanted` indices spread evenly from the first to the last: each copy parses the whole report,
    and all 300-odd timings took 39 s."""
    return sorted({round(i * (count - 1) / (wanted - 1)) for i in range(wanted)}) if count > 1 else [0]


@pytest.mark.parametrize("kind", KINDS)
def test_any_record_held_twice_is_refused(kind):
    data = copy.deepcopy(REPORT)
    records_ = data["devices"][0][kind]
    for m in spread(len(records_)):
        twin = copy.deepcopy(data)
        twin["devices"][0][kind].append(copy.deepcopy(records_[m]))
        with pytest.raises(ReportError) as error:
            checked.parse(twin, "report")
        assert f"devices[0].{kind}[{len(records_)}]: a second result for " in str(error.value)
        assert f"(the first is {kind}[{m}])" in str(error.value)


def test_a_passing_context_check_after_a_failing_one_is_refused():
    """Issue 43's case: a passing copy of sm90-fp8-cuda's context check appended after the failing
    one once made gate serve the kernel under CUDA-graph capture."""
    data = copy.deepcopy(REPORT)
    checks = data["devices"][0]["contexts"]
    failing = next(c for c in checks if c["variant"] == "sm90-fp8-cuda")
    passing = copy.deepcopy(next(c for c in checks if c["outcome"] == "pass"))
    passing["variant"] = failing["variant"]
    checks.append(passing)
    with pytest.raises(ReportError, match=r"contexts\[\d+\]: a second result for sm90-fp8-cuda "):
        checked.parse(data, "report")


def test_a_context_check_of_a_variant_not_run_is_refused():
    data = copy.deepcopy(REPORT)
    data["options"]["variants"].remove(data["devices"][0]["contexts"][0]["variant"])
    data["devices"][0]["cells"] = [c for c in data["devices"][0]["cells"]
                                   if c["variant"] in data["options"]["variants"]]
    data["devices"][0]["speed"] = [s for s in data["devices"][0]["speed"]
                                   if s["kernel"] in ("sdpa", *data["options"]["variants"])]
    for kind in ("long", "span"):
        data["devices"][0][kind] = [r for r in data["devices"][0][kind]
                                    if r["variant"] in data["options"]["variants"]]
    with pytest.raises(
        ReportError, match=r"devices\[0\]\.contexts\[0\]\.variant: .* is not in options.variants"
    ):
        checked.parse(data, "report")


def test_re_ordered_evidence_decides_the_same():
    expected = verdicts(copy.deepcopy(REPORT))
    for kind in KINDS:
        data = copy.deepcopy(REPORT)
        data["devices"][0][kind].reverse()
        assert verdicts(data) == expected, kind
