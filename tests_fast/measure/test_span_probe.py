"""The span boundary probe (`qualification.span_probe`): its cases sit on the wrapper's limit, its
child reports each case right, wrong or faulted, the parent turns a dead child into findings, and
the largest safe span follows only from probes that were right."""

import json
import sys

import pytest
import torch

from sage_qual import limits, records
from sage_qual.qualification.measure import span_probe
from sage_qual.qualification.measure.span_probe import Checked, SpanCase, SpanFinding, Verdict
from sage_qual.testing import FakeSageAttention


def test_default_cases_straddle_the_wrapper_limit():
    cases = {(c.layout, c.side): (c.tokens, c.span) for c in span_probe.boundary_cases()}
    assert cases == {
        ("contiguous", "below"): (299_520, 2_146_959_360),  # padded to 128 tokens: exactly at 299,520
        ("contiguous", "above"): (299_594, 2_147_489_792),
        ("fused_qkv", "below"): (99_865, 2_147_482_624),
        ("fused_qkv", "above"): (99_866, 2_147_504_128),
    }
    assert limits.MAX_SPAN_ELEMENTS == 2_147_483_647


def test_cases_at_a_limit_a_span_meets_exactly():
    """2 heads of 64 and 32,768 elements: 256 contiguous tokens and 86 fused ones fill the limit to
    the element, and are still served; the next token is past it."""
    cases = span_probe.boundary_cases(32_768, 2, 64, 77)
    assert {(c.layout, c.side): (c.tokens, c.span) for c in cases} == {
        ("contiguous", "below"): (256, 32_768), ("contiguous", "above"): (257, 32_896),
        ("fused_qkv", "below"): (86, 32_768), ("fused_qkv", "above"): (87, 33_152),
    }
    assert {(c.heads, c.head_dim, c.kv_tokens) for c in cases} == {(2, 64, 77)}


@pytest.mark.parametrize("layout, tokens, expected", [
    ("contiguous", 3, (24, 1024)),  # 2 x 3 x 4 elements; the wrapper pads the copy to 128 tokens
    ("fused_qkv", 3, (56, 1024)),  # 1 + 4 + 2 x 24 + 3: rows 3 x 2 x 4 apart
    ("fused_qkv", 200, (4784, 4784)),  # past the padded copy: the span itself
])
def test_the_span_of_a_small_query(layout, tokens, expected):
    assert span_probe._span(layout, tokens, 2, 4) == expected


def finding(layout, side, span, outcome):
    return SpanFinding("v", SpanCase(layout, side, 1, span), outcome)


@pytest.mark.parametrize("outcomes, safe", [
    ({"cb": "ok", "ca": "ok", "fb": "ok", "fa": "ok"}, 2_000),  # the smaller layout's largest
    ({"cb": "ok", "ca": "abort (signal 6)", "fb": "ok", "fa": "fault"}, 1_000),
    ({"cb": "ok", "ca": "ok", "fb": "ok", "fa": "wrong"}, 1_500),
    ({"cb": "wrong", "ca": "ok", "fb": "ok", "fa": "ok"}, None),  # a wrong probe below: nothing certified
])
def test_largest_safe_span_takes_only_probes_right_with_everything_below(outcomes, safe):
    spans = {"cb": 1_000, "ca": 2_000, "fb": 1_500, "fa": 3_000}
    findings = [finding("contiguous" if key[0] == "c" else "fused_qkv",
                        "below" if key[1] == "b" else "above", spans[key], outcome)
                for key, outcome in outcomes.items()]
    assert span_probe.largest_safe_span(findings, "v") == safe
    assert span_probe.largest_safe_span(findings, "other") is None


SMALL_LIMIT = 2 * 64 * 200 - 1


def child_output(capsys, cases, behave=None):
    fake = FakeSageAttention()
    with fake.installed():
        if behave:
            behave(fake)
        payload = json.dumps([c.__dict__ for c in cases])
        assert span_probe.main(["sm90-fp8-cuda", payload, "--device", "cpu"]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def small_cases():
    return span_probe.boundary_cases(limit=SMALL_LIMIT, heads=2, head_dim=64, kv_tokens=16)


def test_the_child_reports_a_right_kernel_ok_on_every_case(capsys):
    reported = child_output(capsys, small_cases())
    assert [r["outcome"] for r in reported] == ["ok"] * 4
    assert all(r["rel_l2"] < 0.01 for r in reported)


def test_the_child_reports_a_kernel_wrong_in_the_last_rows_only(capsys):
    def last_rows_wrong(fake):
        fake.return_value(lambda exact: torch.cat([exact[:, :, :-1], -exact[:, :, -1:]], dim=2))

    reported = child_output(capsys, small_cases(), last_rows_wrong)
    assert [r["outcome"] for r in reported] == ["wrong"] * 4
    assert all(r["rel_l2"] < 0.5 < r["worst_row"] for r in reported)  # the rows, not the mean, catch it


def test_the_child_stops_at_a_fault(capsys):
    def fault(fake):
        fake.raise_error(RuntimeError("an illegal memory access was encountered"))

    reported = child_output(capsys, small_cases(), fault)
    assert [records.parse(Checked, line, "child", "") for line in reported] == [
        Checked(Verdict.FAULT, error="RuntimeError: an illegal memory access was encountered")]


def test_the_child_sends_a_non_finite_error_as_null(capsys):
    def nan(fake):
        fake.return_value(lambda exact: exact * float("nan"))

    reported = child_output(capsys, small_cases()[:1], nan)
    assert reported == [{"outcome": "wrong", "rel_l2": None, "worst_row": None, "error": ""}]


@pytest.mark.parametrize("line, key", [
    ('{"outcome": "fine", "rel_l2": 0.01}', "outcome"),
    ('{"outcome": "ok", "rel_l2": "0.01"}', "rel_l2"),
    ('{"outcome": "ok", "relative_l2": 0.01}', "relative_l2"),
])
def test_a_child_line_the_parent_cannot_read_is_one_line_naming_the_key(line, key):
    with pytest.raises(records.RecordError) as raised:
        span_probe.run_probe("sm90-fp8-cuda", small_cases()[:1], command=fake_child(f"print({line!r})"),
                             timeout=30)
    assert raised.value.key == key and "\n" not in str(raised.value) and "sage-qual bug" in str(raised.value)


def fake_child(body: str) -> list[str]:
    """A child command without torch: prints what `body` prints, then ends as `body` ends."""
    return [sys.executable, "-c", "import json, os, sys, time\n" + body]


OK_LINE = 'print(json.dumps({"outcome": "ok", "rel_l2": 0.01, "worst_row": 0.02}), flush=True)\n'


@pytest.mark.parametrize("body, outcomes", [
    (OK_LINE + "os.abort()", ["ok", "abort (signal 6)", "not run: an earlier case ended the child"]),
    (OK_LINE * 2 + "sys.exit(3)", ["ok", "ok", "exit 3"]),
    (OK_LINE + "time.sleep(30)", ["ok", "timeout", "not run: an earlier case ended the child"]),
])
def test_the_parent_turns_a_dead_child_into_findings(body, outcomes):
    cases = small_cases()[:3]
    # The child imports no torch (under 0.1 s here): 1.5 s is ample, and what the sleeping one costs.
    found = span_probe.run_probe("sm90-fp8-cuda", cases, command=fake_child(body), timeout=1.5)
    assert [f.outcome for f in found] == outcomes
    assert [f.case for f in found] == cases and found[0].rel_l2 == 0.01


def test_probe_runs_below_cases_together_and_each_above_case_alone(tmp_path):
    log = tmp_path / "calls"
    body = (f"open({str(log)!r}, 'a').write(sys.argv[1] + ' ' + str(len(json.loads(sys.argv[2]))) + '\\n')\n"
            "for _ in json.loads(sys.argv[2]):\n    " + OK_LINE)
    found = span_probe.probe(["a", "b"], small_cases(), workers=2, command=fake_child(body))
    assert sorted(log.read_text().split("\n")[:-1]) == ["a 1", "a 1", "a 2", "b 1", "b 1", "b 2"]
    assert len(found) == 8 and {f.outcome for f in found} == {"ok"}
