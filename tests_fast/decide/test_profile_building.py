"""decide/profile: what a profile entry takes from a family decision, and a GPU's span limit from
its probes. Each test here kills mutants that survived the 2026-12-03 mutation run (docs/mutation.md)."""

import dataclasses

import pytest

from sage_qual import limits
from sage_qual.qualification.decide import profile as building
from sage_qual.qualification.decide import verdict
from sage_qual.qualification.decide.verdict import FamilyDecision, Verdict
from sage_qual.qualification.evidence.report_model import Outcome, Reason, ReasonKind, SpanProbe
from sage_qual.qualification.measure import span_probe
from sage_qual.qualification.measure.span_probe import SpanCase
from sage_qual.verdicts.served import Bound, Served

from .. import builders

SERVED = Served("sm90-fp8-cuda", 2048, 512, [128], 9000, 8000, ["contiguous"], ["side_stream"],
                [Bound("key", 1024, "fx0: short keys failed")])


def test_the_entry_carries_the_decisions_served_record_unchanged():
    decided = FamilyDecision(
        "FLUX.1", Verdict.ENABLE, SERVED, range_reasons=[Reason(ReasonKind.LONG, "capped")]
    )
    entry = building._entry(decided)
    assert entry.served is SERVED and [r.detail for r in entry.reasons] == ["capped"]


def test_a_decision_serving_nothing_gives_an_entry_serving_nothing_with_every_reason():
    decided = FamilyDecision(
        "FLUX.1",
        Verdict.KEEP_OFF,
        reasons=[Reason(ReasonKind.LONG, "no verified range")],
        range_reasons=[Reason(ReasonKind.LONG, "capped")],
    )
    entry = building._entry(decided)
    assert entry.served is None and [r.detail for r in entry.reasons] == ["no verified range", "capped"]


def probe(variant="v", outcome="pass", span=1000, layout="contiguous", **fields) -> SpanProbe:
    values = {"side": "below", "tokens": 10, "heads": 4, "head_dim": 25, "kv_tokens": 7, "limit": 1000,
              **fields}
    return SpanProbe(variant, layout, span=span, outcome=Outcome(outcome), **values)


def test_findings_carry_every_field_of_the_probe_case():
    [found] = building.findings([probe(side="above", tokens=11, heads=3, head_dim=64, kv_tokens=5,
                                       outcome="crash"), probe("other")], "v")
    assert found.variant == "v"
    assert found.case == SpanCase("contiguous", "above", 11, 1000, 3, 64, 5)
    assert found.outcome == "crash"
    assert building.findings([probe()], "v")[0].outcome == "ok"


def both_layouts(variant="v", outcome="pass", span=1000) -> list[SpanProbe]:
    return [probe(variant, outcome, span, layout, limit=span) for layout in span_probe.LAYOUTS]


@pytest.mark.parametrize("outcomes, served, expected", [
    ({"v": "pass"}, {"v"}, 1000),
    ({"v": "fail"}, {"v"}, 1),  # probed and nothing right: every call goes to torch
    ({"v": "pass", "w": "crash"}, {"v", "w"}, 1),
    ({"w": "pass"}, {"v", "w"}, None),  # a served variant was not probed: the default limit
], ids=["right", "nothing-right", "one-variant-nothing-right", "not-probed"])
def test_the_profile_limit(outcomes, served, expected):
    probes = [p for variant, outcome in outcomes.items() for p in both_layouts(variant, outcome)]
    assert building.profile_limit(probes, served) == expected


def test_the_profile_limit_never_goes_above_the_wrappers_limit():
    above = limits.MAX_SPAN_ELEMENTS * 2
    assert building.profile_limit(both_layouts(span=above), {"v"}) == limits.MAX_SPAN_ELEMENTS
    assert building.profile_limit(both_layouts(), set()) is None


def test_the_profile_records_the_sageattention_build_it_was_certified_with():
    fixture = builders.fixture()
    report = builders.report([builders.device([builders.cell("sm90-fp8-cuda", fixture)])], [fixture])
    report = dataclasses.replace(report, environment=dataclasses.replace(
        report.environment, sageattention_source="git:abc123"))
    [gpu] = building.build(report, verdict.decide(report)).gpus
    assert gpu.environment.sageattention_source == "git:abc123"
