"""Verdicts bounded by the calls they serve (issue 26): a failure on a fixture that stands for a call
site the served range excludes bounds the verdict instead of vetoing it; any other failure vetoes.

The evidence is run 25's H200 report (docs/results/run25-h200/certify/), where every FP8 and FP16 CUDA
kernel gave non-finite output on the IP-Adapter fixtures (4 and 16 keys) and passed everything else of
FLUX.1 and SDXL, flux1_two_images (two batch items) included; edits of its typed records make the cases
around it. Run 22's report predates flux1_two_images.
"""

import dataclasses
from pathlib import Path

import pytest

from sage_qual.qualification import families
from sage_qual.qualification.decide import bounds, checked, verdict
from sage_qual.qualification.decide.verdict import Verdict
from sage_qual.qualification.families import CallSite, cross_attention
from sage_qual.qualification.measure import speed
from sage_qual.qualification.measure.speed import Thresholds
from sage_qual.verdicts.served import Bound

from .. import builders

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"
RUN25 = RESULTS / "run25-h200" / "certify" / "report.json.gz"
RUN22 = RESULTS / "run22-h200" / "certify" / "report.json.gz"
IP_ADAPTER = "flux1_ip_adapter_zero_uncond"


@pytest.fixture(scope="module")
def run25():
    return checked.load(RUN25)


def flux1(report):
    [gpu] = verdict.decide(report)
    return gpu.family("FLUX.1")


def edited_metrics(report, variant, fixture, **numbers):
    """The report with `variant`'s cell on `fixture` given these metrics on every device."""
    def edited(c):
        return dataclasses.replace(c, metrics=dataclasses.replace(c.metrics, **numbers))

    devices = [dataclasses.replace(d, cells=[edited(c) if (c.variant, c.fixture) == (variant, fixture) else c
                                             for c in d.cells]) for d in report.devices]
    return dataclasses.replace(report, devices=devices)


def test_an_ip_adapter_failure_below_the_break_even_bounds_flux1_instead_of_vetoing_it(run25):
    decision = flux1(run25)
    assert (decision.verdict, decision.variant) == (Verdict.ENABLE, "sm90-fp8-cuda")
    assert (decision.served.min_key_tokens, decision.served.max_query_tokens) == (12672, 32768)
    [bound] = decision.served.bounds
    assert (bound.side, bound.below) == ("key", 17)  # the site's 4 to 16 keys stay on torch
    assert bound.reason.startswith(f"{IP_ADAPTER}: sm90-fp8-cuda output not finite")
    assert "FLUX.1's 'IP-Adapter image prompt' call (4 to 16 keys)" in bound.reason
    assert decision.served.text().endswith("; " + bound.text())
    assert "sm90-fp8-cuda" not in decision.results.findings  # bounded, not rejected
    assert "sm90-fp8-cuda" in decision.results.bounded and "sm90-fp8-cuda" not in decision.results.certified


def test_sdxls_fixture_stands_for_both_of_its_ip_adapter_sites(run25, monkeypatch):
    # SDXL's largest call sits within the run-to-run spread of 1x (no speedup with it): without the
    # spread, run 25 enables it, and its bound is what is tested here.
    monkeypatch.setattr(speed, "RUN_TO_RUN_SPREAD", 0.0)
    [gpu] = verdict.decide(run25)
    [bound] = gpu.family("SDXL").served.bounds
    assert (bound.side, bound.below) == ("key", 17)
    assert "'IP-Adapter, 640 ch' and 'IP-Adapter, 1280 ch' calls (4 to 16 keys)" in bound.reason


def test_a_failure_on_a_fixture_no_site_names_still_vetoes(run25):
    broken = edited_metrics(run25, "sm90-fp8-cuda", "flux1_1024", finite=False, rel_l2=None,
                            worst_head_cosine=None)
    decision = flux1(broken)
    assert decision.variant != "sm90-fp8-cuda" and "sm90-fp8-cuda" in decision.results.findings
    assert {f.fixture for f in decision.results.findings["sm90-fp8-cuda"]} == {"flux1_1024", IP_ADAPTER}


def test_the_default_entry_is_vetoed_by_the_unlinked_ltx2_memory_failure(run25):
    [gpu] = verdict.decide(run25)
    assert gpu.default.verdict == Verdict.KEEP_OFF
    assert {f.fixture for f in gpu.default.results.findings["sm90-fp8-cuda"]} >= {"ltx2_video_self_partial"}


def test_without_a_passing_fixture_of_two_items_the_batch_2_ip_adapter_failure_is_not_bounded(run25):
    """Run 22 predates flux1_two_images: FLUX.1's only fixture of several items was the IP-Adapter's, and a
    kernel that mixes batch items would fail it alone (selftest.detection, batch_items_swapped)."""
    decision = flux1(checked.load(RUN22))
    assert (decision.verdict, decision.served, decision.results.bounded) == (Verdict.NO_SPEEDUP, None, {})
    assert "sm90-fp8-cuda" in decision.results.findings
    swapped = flux1(edited_metrics(run25, "sm90-fp8-cuda", "flux1_two_images", rel_l2=1.4,
                                   worst_head_cosine=0.0))
    assert swapped.variant != "sm90-fp8-cuda"
    assert {f.fixture for f in swapped.results.findings["sm90-fp8-cuda"]} == {"flux1_two_images", IP_ADAPTER}


def test_a_fixture_whose_shape_the_site_does_not_cover_cannot_bound(run25):
    """A record claiming the IP-Adapter fixture with 512 keys no longer stands for the 4-16 key site."""
    fixtures = [dataclasses.replace(f, k=[f.k[0], f.k[1], 512, f.k[3]]) if f.name == IP_ADAPTER else f
                for f in run25.fixtures]
    decision = flux1(dataclasses.replace(run25, fixtures=fixtures))
    assert decision.variant != "sm90-fp8-cuda" and not (decision.served and decision.served.bounds)
    assert "sm90-fp8-cuda" in decision.results.findings


def test_without_call_site_links_the_verdict_is_the_one_before_bounds(run25, monkeypatch):
    monkeypatch.setattr(bounds, "sites_of", lambda fixture, family=None: [])
    decision = flux1(run25)
    assert (decision.verdict, decision.results.certified, decision.served) == (Verdict.NO_SPEEDUP,
                                                                               ["sm86-fp16-triton"], None)


# excluded_bounds on its own -----------------------------------------------------------------------
SITE = CallSite("ip", cross_attention(24, 4096, 4), cross_attention(24, 16384, 16), fixtures=("fx",))


def finding(fixture="fx", variant="sm90-fp8-cuda"):
    return verdict.Finding(variant, fixture, 0, verdict.Reason(verdict.ReasonKind.NON_FINITE, "NaN"))


def fixture_records(k_tokens=4, q_tokens=2048, head_dim=128):
    """The report's record of fixture "fx", of this shape (one batch item: no batch to cover)."""
    return [builders.fixture("fx", q=[1, 1, q_tokens, head_dim], k=[1, 1, k_tokens, head_dim])]


@pytest.fixture
def one_site(monkeypatch):
    monkeypatch.setattr(bounds, "sites_of", lambda fixture, family=None: [(families.find("FLUX.1"), SITE)]
                        if fixture == "fx" else [])


def serving(min_q, min_k):
    return Thresholds(min_query_tokens=min_q, min_key_tokens=min_k, head_dims=[128], served_shapes=1,
                      measured_shapes=1)


@pytest.mark.parametrize(("thresholds", "expected"), [
    (serving(9728, 9728), [("key", 17)]),
    (serving(9728, 17), [("key", 17)]),  # the site's 16 keys are just below
    (serving(9728, 16), None),  # a 16-key call would be served: the failure is inside the range
    (serving(20000, 8), [("query", 16385)]),  # every call of the site has fewer queries
    (None, None),  # nothing is served: no range can exclude the site
], ids=["keys-far-below", "keys-just-below", "keys-inside", "queries-below", "nothing-served"])
def test_a_site_is_excluded_only_when_every_call_of_it_is_below_a_threshold(one_site, thresholds, expected):
    found = bounds.excluded_bounds([finding()], [], fixture_records(), None, thresholds)
    assert (None if found is None else [(b.side, b.below) for b in found]) == expected


@pytest.mark.parametrize(("k_tokens", "q_tokens", "head_dim"), [(3, 2048, 128), (17, 2048, 128),
                                                                (4, 16385, 128), (4, 2048, 64)],
                         ids=["fewer-keys", "more-keys", "more-queries", "other-head-dim"])
def test_a_fixture_outside_its_site_does_not_stand_for_it(one_site, k_tokens, q_tokens, head_dim):
    shaped = fixture_records(k_tokens, q_tokens, head_dim)
    assert bounds.excluded_bounds([finding()], [], shaped, None, serving(9728, 9728)) is None


def test_failures_on_two_devices_give_one_bound_with_one_reason(one_site):
    twice = [finding(), dataclasses.replace(finding(), device=1)]
    [bound] = bounds.excluded_bounds(twice, [], fixture_records(), None, serving(9728, 9728))
    assert bound == Bound("key", 17, "fx: sm90-fp8-cuda NaN; it stands for FLUX.1's 'ip' call (4 to 16 keys)")


def test_one_failure_no_site_names_makes_the_whole_set_unbounded(one_site):
    mixed = [finding(), finding("other")]
    fixtures = fixture_records() + [builders.fixture("other")]
    assert bounds.excluded_bounds(mixed, [], fixtures, None, serving(9728, 9728)) is None


@pytest.mark.parametrize(("failed_batch", "passed_batch", "bounded"),
                         [(1, None, True), (2, None, False), (2, 1, False), (2, 2, True), (3, 2, True)],
                         ids=["one-item", "nothing-passed", "passed-one-item", "passed-two", "two-of-three"])
def test_a_failure_of_several_items_is_bounded_only_past_a_pass_of_several(one_site, failed_batch,
                                                                            passed_batch, bounded):
    fixtures = [builders.fixture("fx", q=[failed_batch, 1, 2048, 128], k=[failed_batch, 1, 4, 128])]
    passed = []
    if passed_batch:
        shape = [passed_batch, 1, 1024, 128]
        fixtures.append(builders.fixture("main", q=shape, k=shape))
        passed = ["main"]
    found = bounds.excluded_bounds([finding()], passed, fixtures, None, serving(9728, 9728))
    assert (found is not None) == bounded


def test_a_pass_on_another_site_fixture_does_not_cover_the_batch(one_site, monkeypatch):
    """The fixture that passed must stand for the served calls: one a site names does not."""
    two_items = {"q": [2, 1, 2048, 128], "k": [2, 1, 4, 128]}
    fixtures = [builders.fixture("fx", **two_items), builders.fixture("other_site", **two_items)]
    monkeypatch.setattr(bounds, "sites_of", lambda fixture, family=None: [(families.find("FLUX.1"), SITE)]
                        if fixture in ("fx", "other_site") else [])
    found = bounds.excluded_bounds([finding()], ["other_site"], fixtures, None, serving(9728, 9728))
    assert found is None


def test_no_fixture_is_named_by_two_families_and_every_named_fixture_fits_its_site():
    """The call spaces as declared; every fixture a site names ships, and its shape fits the site."""
    from sage_qual.fixtures import fileformat

    assert families.call_space_problems() == []
    shipped = {path.stem: path for path in fileformat.list_fixtures(fileformat.shipped_dir())}
    named = [(call, name) for family in families.FAMILIES for call in family.calls for name in call.fixtures]
    assert {name for _, name in named} == {IP_ADAPTER, "sdxl_ip_adapter_zero_uncond"}
    for call, name in named:
        fixture = fileformat.load_fixture(shipped[name])
        assert call.covers(fixture.q.shape[2], fixture.k.shape[2], fixture.q.shape[3]), (call.label, name)
    doubled = families.Family("Twice", families.FAMILIES[0].shapes, calls=(dataclasses.replace(
        families.FAMILIES[0].calls[1]),))
    assert any("names fixture flux1_ip_adapter_zero_uncond, which FLUX.1 names too" in p
               for p in families.call_space_problems(families.FAMILIES + (doubled,)))


def flux1_sites(sites):
    """`sites_of` for fixtures named by FLUX.1's sites only (`sites`: fixture -> its sites)."""
    flux = families.find("FLUX.1")
    return lambda fixture, family=None: [(flux, call) for call in sites.get(fixture, ())
                                         if family is None or family is flux]


@pytest.mark.parametrize(("family", "bounded"), [("FLUX.1", True), ("SDXL", False)])
def test_only_a_site_of_the_family_decided_can_bound_it(monkeypatch, family, bounded):
    monkeypatch.setattr(bounds, "sites_of", flux1_sites({"fx": [SITE]}))
    found = bounds.excluded_bounds([finding()], [], fixture_records(), families.find(family),
                                   serving(9728, 9728))
    assert (found is not None) == bounded


def test_a_pass_named_by_another_familys_site_covers_the_batch_of_this_one(monkeypatch):
    """For SDXL, a fixture only FLUX.1's sites name stands for SDXL's served calls."""
    two_items = {"q": [2, 1, 2048, 128], "k": [2, 1, 4, 128]}
    fixtures = [builders.fixture("fx", **two_items), builders.fixture("flux_site", **two_items)]
    sdxl = families.find("SDXL")
    monkeypatch.setattr(bounds, "sites_of", lambda fixture, family=None: [
        (owner, SITE) for owner, names in ((sdxl, ("fx",)), (families.find("FLUX.1"), ("flux_site",)))
        if fixture in names and family in (None, owner)])
    found = bounds.excluded_bounds([finding()], ["flux_site"], fixtures, sdxl, serving(9728, 9728))
    assert [(b.side, b.below) for b in found] == [("key", 17)]


def test_sites_excluded_on_different_sides_cannot_bound(monkeypatch):
    """One site below the key threshold, the other below the query one: no single bound holds both."""
    few_keys = CallSite("few keys", cross_attention(24, 2048, 4), cross_attention(24, 2048, 8),
                        fixtures=("fx",))
    monkeypatch.setattr(bounds, "sites_of", flux1_sites({"fx": [SITE, few_keys]}))
    assert bounds.excluded_bounds([finding()], [], fixture_records(), None, serving(20000, 10)) is None
    [bound] = bounds.excluded_bounds([finding()], [], fixture_records(), None, serving(20000, 20))
    assert (bound.side, bound.below) == ("key", 17)


def test_two_failing_fixtures_of_one_side_give_one_bound_with_both_reasons(monkeypatch):
    wider = CallSite("wide", cross_attention(24, 4096, 4), cross_attention(24, 16384, 32), fixtures=("fx2",))
    monkeypatch.setattr(bounds, "sites_of", flux1_sites({"fx": [SITE], "fx2": [wider]}))
    fixtures = fixture_records() + [builders.fixture("fx2", q=[1, 1, 2048, 128], k=[1, 1, 20, 128])]
    [bound] = bounds.excluded_bounds([finding(), finding("fx2")], [], fixtures, None, serving(9728, 9728))
    assert (bound.side, bound.below) == ("key", 33)  # the larger of 17 and 33
    assert bound.reason == ("fx: sm90-fp8-cuda NaN; it stands for FLUX.1's 'ip' call (4 to 16 keys); "
                            "fx2: sm90-fp8-cuda NaN; it stands for FLUX.1's 'wide' call (4 to 32 keys)")
