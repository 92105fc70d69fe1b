"""Span probes in certify (issue 16): certify probes the 32-bit element limit in its workers, a probe
that aborts or faults is a finding of the report (not a crash of certify), and the profile's
`max_span_elements` is what was measured safe for the variants it serves, never above the default.

The sample H200 report serves FLUX.1 with sm90-fp8-cuda and Qwen-Image with sm89-fp8-cuda.
"""

import copy
import dataclasses
import json
from pathlib import Path

import pytest

from sage_qual import limits, records
from sage_qual.qualification.decide import checked, profile, verdict
from sage_qual.qualification.evidence import report_model
from sage_qual.qualification.evidence.report_model import Outcome, SpanProbe
from sage_qual.qualification.render import plots
from sage_qual.qualification.run import plan, run
from sage_qual.qualification.selftest import faults as worker_faults
from sage_qual.records import dump
from sage_qual.verdicts import profile as serving_profile

from .. import builders, fakes

SAMPLE = Path(__file__).parent.parent / "data" / "sample_h200_2gpu.json"
PLANNED = plan.span_cases()
CASES = [case for case, _ in PLANNED]
RUNG = min(c.span for c in CASES)  # 267,911,168: the contiguous rung
BELOW = min(c.span for c in CASES if c.side == "below" and c.span > RUNG * 2)  # 2,146,959,360: contiguous


def test_the_cases_are_a_rung_then_the_boundary_in_each_layout():
    spans = [(c.layout, c.side, c.span) for c in CASES]
    assert spans == [("contiguous", "below", 267_911_168), ("fused_qkv", "below", 268_420_096),
                     ("contiguous", "below", 2_146_959_360), ("contiguous", "above", 2_147_489_792),
                     ("fused_qkv", "below", 2_147_482_624), ("fused_qkv", "above", 2_147_504_128)]
    rung = limits.MAX_SPAN_ELEMENTS // plan.RUNG_FRACTION
    assert [limit for _, limit in PLANNED] == [rung] * 2 + [limits.MAX_SPAN_ELEMENTS] * 4
    assert all(c.span <= rung for c in CASES[:2])
    jobs = plan.span_jobs("v", PLANNED)
    # below cases and the first above case in one worker, the other above case in its own
    assert [[t.side for t in job] for job in jobs] == [["below"] * 4 + ["above"], ["above"]]
    assert len({t.id for job in jobs for t in job}) == 6
    # each task carries its case and the limit it sits at, as the report's probe will
    assert [(t.layout, t.side, t.span, t.limit) for job in jobs for t in job] == sorted(
        [(c.layout, c.side, c.span, limit) for c, limit in PLANNED], key=lambda x: x[1] == "above")


def probes(variant, outcomes=None):
    """One report record per case; `outcomes` maps (layout, side, span) prefixes to a non-pass outcome."""
    records = []
    for case, limit in PLANNED:
        keys = ((case.layout, case.side, case.span), (case.layout, case.side))
        outcome = next((o for key, o in (outcomes or {}).items() if key in keys), "pass")
        found = ({"rel_l2": 0.04, "worst_row": 0.05} if outcome == "pass"
                 else {"detail": "the worker ran this task when it died (killed by SIGABRT)"})
        probe = SpanProbe(variant, **dataclasses.asdict(case), limit=limit, outcome=Outcome(outcome), **found)
        records.append(dump(probe))
    return records


H200_LIKE = {("contiguous", "above"): "crash", ("fused_qkv", "above"): "crash"}  # issue 16's findings


def built(span_by_variant, devices=(0, 1)):
    data = json.loads(SAMPLE.read_text())
    for n, device in enumerate(data["devices"]):
        if n in devices:
            device["span"] = [p for variant, found in span_by_variant.items() for p in found]
            if device["span"]:  # certify ran the long checks before the probes (without them: refused)
                device["long"] = [c for variant in ("sm90-fp8-cuda", "sm89-fp8-cuda")
                                  for c in builders.long_records(variant)]
    typed = checked.parse(data, "sample")
    return data, typed, records.dump(profile.build(typed, verdict.decide(typed)))["gpus"][0]


@pytest.mark.parametrize("sm90, sm89, expected", [
    (probes("sm90-fp8-cuda", H200_LIKE), probes("sm89-fp8-cuda", H200_LIKE), BELOW),  # the aborts cap it
    (probes("sm90-fp8-cuda"), probes("sm89-fp8-cuda"), limits.MAX_SPAN_ELEMENTS),  # right above: no raise
    # wrong at the boundary, right at the rung: the rung, far below the default
    (probes("sm90-fp8-cuda", {("contiguous", "below", BELOW): "fail"}), probes("sm89-fp8-cuda"), RUNG),
    # one served variant (sm89) faults already at the rung: nothing is safe, no call is served
    (probes("sm90-fp8-cuda"), probes("sm89-fp8-cuda", {("fused_qkv", "below"): "crash"}), 1),
])
def test_the_profile_takes_the_smallest_safe_span_of_the_served_variants(sm90, sm89, expected):
    _, typed, gpu = built({"sm90-fp8-cuda": sm90, "sm89-fp8-cuda": sm89})
    assert gpu["max_span_elements"] == expected
    # the wrapper reads it back: a call of that span is within its limit, one element more is not
    matched = serving_profile.load(profile.build(typed, verdict.decide(typed)))
    assert matched.gpus[0].max_span_elements == expected


def test_no_span_limit_in_the_profile_unless_every_served_variant_was_probed():
    assert built({})[2]["max_span_elements"] is None  # a report without probes: the wrapper's default
    assert built({"sm90-fp8-cuda": probes("sm90-fp8-cuda")})[2]["max_span_elements"] is None  # sm89 unprobed
    # probed on one device of the model only: its probes count for the model
    assert built({"sm90-fp8-cuda": probes("sm90-fp8-cuda", H200_LIKE),
                  "sm89-fp8-cuda": probes("sm89-fp8-cuda")}, devices=(1,))[2]["max_span_elements"] == BELOW


def test_a_variant_not_served_does_not_limit_the_profile():
    found = {"sm90-fp8-cuda": probes("sm90-fp8-cuda"), "sm89-fp8-cuda": probes("sm89-fp8-cuda"),
             "sm80-fp16-cuda": probes("sm80-fp16-cuda", {("contiguous", "below"): "crash"})}
    data = json.loads(SAMPLE.read_text())
    if "sm80-fp16-cuda" not in data["options"]["variants"]:
        pytest.skip("the sample report has no sm80-fp16-cuda")
    assert built(found)[2]["max_span_elements"] == limits.MAX_SPAN_ELEMENTS


def test_an_edited_span_probe_is_refused():
    data = json.loads(SAMPLE.read_text())
    data["devices"][0]["span"] = probes("sm90-fp8-cuda")
    bad = copy.deepcopy(data)
    del bad["devices"][0]["span"][0]["rel_l2"]
    with pytest.raises(report_model.ReportError, match=r"span\[0\].rel_l2: missing for a span probe"):
        checked.parse(bad, "edited")
    bad = copy.deepcopy(data)
    bad["devices"][0]["span"][0]["variant"] = "sm99-made-up"
    with pytest.raises(report_model.ReportError, match="not in options.variants"):
        checked.parse(bad, "edited")


def test_the_report_renders_the_probes_and_the_largest_safe_span(tmp_path, monkeypatch):
    data, _, _ = built({"sm90-fp8-cuda": probes("sm90-fp8-cuda", H200_LIKE)}, devices=(0,))
    monkeypatch.setattr(plots, "plots", lambda *args: {})
    builders.rendered(checked.parse(data, "r.json"), tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "### Span limits" in md
    assert "sm90-fp8-cuda: 2,146,959,360 elements" in md
    assert ("| sm90-fp8-cuda | contiguous | above 2,147,483,647 | 2,147,489,792 | 299,594 x 56 heads x 128, "
            "1,024 keys | crash | - | the worker ran this task when it died (killed by SIGABRT) |") in md
    assert "Span limits" in (tmp_path / "report.html").read_text()


# End to end on a fake GPU: workers really abort ------------------------------------------------------
def test_certify_probes_in_workers_and_records_an_abort_and_a_fault_as_findings(tmp_path, monkeypatch):
    fixtures = tmp_path / "fixtures"
    fixtures.mkdir()
    bounds = {name: {"max_rel_l2": 0.08, "min_cosine": 0.99} for name in ("fp16", "fp8")}
    fakes.random_fixture(fixtures, "c-flux", "flux.1", bounds, tokens=64)
    # The fake sm90 kernel aborts its worker past 1e9 elements contiguous (from the boundary's below
    # case on) and raises an illegal memory access past the limit on the fused view.
    rules = [{"above": 10**9, "fault": "crash", "layouts": ["contiguous"]},
             {"above": limits.MAX_SPAN_ELEMENTS, "fault": "illegal-address", "layouts": ["fused_qkv"]}]
    hook = {"gpus": [{"name": "Fake H200", "capability": [9, 0]}], "span_faults": {"sm90-fp8-cuda": rules}}
    monkeypatch.setenv(worker_faults.TEST_HOOK, json.dumps(hook))
    out = tmp_path / "out"
    data = records.dump(run.certify(builders.gpu_request(
        out, devices="0", variants=["sm90-fp8-cuda"], families=["FLUX.1"], fixture_dirs=[str(fixtures)],
        timeout=30.0)))
    assert data["complete"] and not data["stopped"]
    found = {(p["layout"], p["side"], p["span"]): p for p in data["devices"][0]["span"]}
    assert set(found) == {(c.layout, c.side, c.span) for c in CASES}  # the default kernel, every case
    outcomes = {key: p["outcome"] for key, p in found.items()}
    assert outcomes == {("contiguous", "below", RUNG): "pass", ("fused_qkv", "below", 268_420_096): "pass",
                        ("contiguous", "below", BELOW): "crash",
                        ("contiguous", "above", 2_147_489_792): "crash",
                        ("fused_qkv", "below", 2_147_482_624): "pass",
                        ("fused_qkv", "above", 2_147_504_128): "crash"}
    assert "SIGABRT" in found[("contiguous", "below", BELOW)]["detail"]
    assert "illegal memory access" in found[("fused_qkv", "above", 2_147_504_128)]["detail"]
    assert found[("fused_qkv", "below", 2_147_482_624)]["ran_heads"] == 1  # cut down on the fake
    typed = checked.load(out / "report.json")
    assert profile.largest_safe(typed.devices[0].span, "sm90-fp8-cuda") == RUNG
    assert profile.profile_limit(typed.devices[0].span, {"sm90-fp8-cuda"}) == RUNG
    gpu = json.loads((out / "profile.json").read_text())["gpus"][0]
    served = {e["served"]["variant"] for e in [gpu["default"], *gpu["families"].values()] if e["served"]}
    assert gpu.get("max_span_elements") == (RUNG if served else None)  # the fake's speed decides `served`
    md = (out / "report.md").read_text()
    assert "### Span limits" in md and "sm90-fp8-cuda: 267,911,168 elements" in md


def test_span_probes_without_the_long_checks_are_refused():
    """Removing a report's long checks would lift the verdict's upper bound on the tokens served
    while its span probes still stand: the reader names the device and the fix (issue 28)."""
    data = built({"sm90-fp8-cuda": probes("sm90-fp8-cuda"), "sm89-fp8-cuda": probes("sm89-fp8-cuda")})[0]
    checked.parse(data, "untouched")
    for removed in ([], None):
        bad = copy.deepcopy(data)
        bad["devices"][1]["long"] = removed
        with pytest.raises(report_model.ReportError,
                           match=r"edited: devices\[1\]\.long: no long check beside \d+ span probe"):
            checked.parse(bad, "edited")
