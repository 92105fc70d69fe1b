"""Masked calls in a verdict (issue 42): a masked fixture is evidence about masked calls only. The
variant chosen for a family serves them (`Served.masks`) when it takes a mask and passed every masked
fixture of the family; a variant that takes none is never judged on them (certify does not run it
there), and a failed masked call keeps masked calls, not the family, on torch."""

import dataclasses

from sage_qual import records
from sage_qual.qualification.decide import checked, verdict

from .. import builders
from .test_family_choice import FAMILY, sample, shape_keys, timed_report

CK, SM90 = "ck-int8-cuda", "sm90-fp8-cuda"
MASKED = "flux1_masked_batch"


def decided(fastest: str, masked_outcome: str | None = "pass", masked_family: str = "flux.1"):
    """FLUX.1 on one H200 where `fastest` takes a quarter of SDPA's time and the other half of it, with
    a masked fixture that only ck-int8-cuda ran (`masked_outcome`; None: it has no cell there)."""
    own, sweep, _ = shape_keys(sample())
    ms = {(fastest, key): 0.25 for key in own + sweep}
    ms.update({(v, key): 0.5 for v in (CK, SM90) if v != fastest for key in own + sweep})
    data = timed_report([ms], variants=(CK, SM90))
    typed = checked.parse(data, "test report")
    masked = builders.fixture(MASKED, masked_family, masked=True)
    device = typed.devices[0]
    cells = list(device.cells)
    if masked_outcome is not None:
        fields = {"rel_l2": 0.5, "reasons": [builders.reason("accuracy", "relative L2 0.5 > 0.12")]} \
            if masked_outcome == "fail" else {}
        cells.append(builders.cell(CK, masked, masked_outcome, **fields))
    typed = dataclasses.replace(typed, fixtures=[*typed.fixtures, masked],
                                devices=[dataclasses.replace(device, cells=cells)])
    (gpu,) = verdict.decide(checked.parse(records.dump(typed), "test report"))
    return gpu.family(FAMILY.name)


def test_a_variant_that_passed_the_masked_calls_serves_them():
    decision = decided(CK)
    assert decision.verdict.value == "enable" and decision.variant == CK
    assert decision.served.masks and "masked calls too" in decision.served.text()


def test_a_variant_without_a_mask_is_not_judged_on_masked_calls():
    """sm90-fp8-cuda has no cell for the masked fixture (certify never runs it there): it is still
    certified, and serves no masked call."""
    decision = decided(SM90)
    assert decision.verdict.value == "enable" and decision.variant == SM90
    assert decision.served.masks is False and not decision.range_reasons


def test_a_failed_masked_call_keeps_masked_calls_on_torch_not_the_family():
    decision = decided(CK, "fail")
    assert decision.verdict.value == "enable" and decision.variant == CK and decision.served.masks is False
    assert any(r.detail.startswith(f"masked calls stay on torch: {CK} on {MASKED}") for r in decision.range_reasons)


def test_a_masked_call_not_run_serves_no_masked_call():
    decision = decided(CK, None)
    assert decision.variant == CK and decision.served.masks is False
    assert any("masked calls stay on torch" in r.detail and "not run" in r.detail for r in decision.range_reasons)


def test_a_masked_fixture_alone_certifies_no_family():
    typed = checked.parse(timed_report([{}], variants=(CK,)), "test report")
    masked = builders.fixture(MASKED, "z-image", masked=True)  # the sample has no Z-Image fixture
    typed = dataclasses.replace(typed, fixtures=[*typed.fixtures, masked], devices=[
        dataclasses.replace(typed.devices[0], cells=[*typed.devices[0].cells, builders.cell(CK, masked)])],
        options=dataclasses.replace(typed.options, families=[*typed.options.families, "Z-Image"]))
    (gpu,) = verdict.decide(checked.parse(records.dump(typed), "test report"))
    decision = gpu.family("Z-Image")
    assert decision.verdict.value == "keep off" and decision.reasons[0].kind.value == "no_fixtures"


def test_an_old_report_without_the_field_reads_as_unmasked():
    data = timed_report([{}], variants=(SM90,))
    for fixture in data["fixtures"]:
        assert fixture.pop("masked") is False
    assert not any(f.masked for f in checked.parse(data, "an old report").fixtures)
