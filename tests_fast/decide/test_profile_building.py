"""decide/profile: what a profile entry takes from a family decision, and a GPU's span limit from
its probes. Each test here kills mutants that survived the 2026-12-03 mutation run (docs/mutation.md)."""

import dataclasses

import pytest

from sage_qual import limits
from sage_qual.qualification.decide import profile as building
from sage_qual.qualification.decide import verdict
from sage_qual.qualification.decide.verdict import FamilyDecision, Verdict
from sage_qual.qualification.evidence.report_model import Outcome, SpanProbe
from sage_qual.qualification.measure import span_probe
from sage_qual.qualification.measure.span_probe import SpanCase
from sage_qual.serving.config import Bound

from .. import builders

RANGE = {"max_query_tokens": 9000, "max_key_tokens": 8000, "layouts": ["contiguous"]}


def decision(**fields) -> FamilyDecision:
    values = {"family": "FLUX.1", "verdict": Verdict.ENABLE, "variant": "sm90-fp8-cuda",
              "min_query_tokens": 2048, "min_key_tokens": 512, "head_dims": [128],
              "contexts": ["eager", "side_stream"], **RANGE}
    return FamilyDecision(**{**values, **fields})


@pytest.mark.parametrize("verified", [True, False], ids=["range-verified", "no-long-checks"])
def test_the_range_and_layouts_reach_the_entry_only_when_verified(verified):
    entry = building._entry(decision(range_verified=verified))
    taken = {name: getattr(entry, name) for name in RANGE}
    assert taken == (RANGE if verified else dict.fromkeys(RANGE))
    assert (entry.min_query_tokens, entry.min_key_tokens, entry.head_dims) == (2048, 512, [128])


def test_contexts_reach_the_entry_only_with_a_variant():
    assert building._entry(decision()).contexts == ["eager", "side_stream"]
    nothing = building._entry(decision(verdict=Verdict.KEEP_OFF, variant=None, range_verified=True))
    assert (nothing.variant, nothing.contexts) == (None, None)


def test_bounds_reach_the_entry_and_no_bounds_are_null():
    bound = Bound("key", 1024, "fx0: short keys failed")
    assert building._entry(decision(bounds=[bound])).bounds == [bound]
    assert building._entry(decision()).bounds is None


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
