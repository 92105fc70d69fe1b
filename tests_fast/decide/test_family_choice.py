"""Which variant a family gets on a GPU model (verdict.decide), as properties over timings (hypothesis):
the fastest variant that pays at the family's own shapes, ties in the preference order, the slowest
device of a model deciding, and shapes the family never uses changing nothing.

Reports are built from the H200 sample (certify's format, synthetic numbers): every cell passes and
the timings are the test's. FLUX.1's own calls are its two joint shapes; its break-even also sees
the sweep at head_dim 128. SDPA takes 1 ms everywhere, so a variant's speedup at a shape is 1 / ms.
"""

import dataclasses
import json
import statistics
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sage_qual import records
from sage_qual.qualification import families
from sage_qual.qualification.decide import checked, verdict
from sage_qual.qualification.measure import speed

from .. import builders

# Each example parses and decides whole reports (~0.1 s): few examples, chosen to tie often.
PROPERTY = settings(max_examples=10, deadline=None, derandomize=True, database=None)
SAMPLE = Path(__file__).parent.parent / "data" / "sample_h200_2gpu.json"
FAMILY = families.find("FLUX.1")
VARIANTS = ("sm90-fp8-cuda", "sm89-fp8-cuda", "sm80-fp16-cuda")
SLOWER = 2.0  # a variant's time where the test sets none: half SDPA's speed
MS = st.sampled_from([0.25, 0.5, 0.8, 1.0, 1.5, 3.0])  # 1.0: exactly SDPA's time, no speedup


def sample() -> dict:
    return json.loads(SAMPLE.read_text())


def shape_keys(data, family=FAMILY):
    """(the family's own shapes, the sweep at its head sizes, every other shape)."""
    own = [k for k, s in data["shapes"].items() if any(u["family"] == family.name for u in s["uses"])]
    head_dims = {shape.head_dim for _, shape in family.shapes}
    sweep = [k for k, s in data["shapes"].items() if not any(u["family"] for u in s["uses"])
             and s["shape"]["head_dim"] in head_dims]
    foreign = [k for k in data["shapes"] if k not in own and k not in sweep]
    return own, sweep, foreign


def timed_report(ms_per_device: list[dict], variants=VARIANTS, every_shape=False) -> dict:
    """A complete report with one H200 per entry of `ms_per_device`, each passing every cell and
    taking ms[(variant, shape key)] (SLOWER where not given). FLUX.1's shapes only, unless
    `every_shape`."""
    typed = checked.parse(sample(), "sample")
    shapes = typed.shapes
    if not every_shape:
        own, sweep, _ = shape_keys(sample())
        shapes = {k: shapes[k] for k in own + sweep}
    template = typed.devices[0]
    best = next(t for t in template.speed if t.kernel == "sdpa").best_backend
    gpu = (template.name, template.capability, template.memory_gib)
    devices = []
    for index, ms in enumerate(ms_per_device):
        cells = [builders.cell(v, f) for v in variants for f in typed.fixtures]
        speed = []
        for key in shapes:
            speed.append(builders.timing("sdpa", key, best_backend=best, backends={best: 1.0}))
            speed += [builders.timing(v, key, ms.get((v, key), SLOWER), seconds=0.1) for v in variants]
        devices.append(builders.device(cells, speed, index, gpu))
    return records.dump(builders.report(devices, typed.fixtures, shapes, variants, [FAMILY.name, "SDXL"]))


def family_verdict(data: dict, family=FAMILY) -> dict:
    (gpu,) = verdict.decide(checked.parse(data, "test report"))
    decision = gpu.family(family.name)
    return {"verdict": decision.verdict.value, "variant": decision.variant,
            "min_query_tokens": decision.served and decision.served.min_query_tokens,
            "min_key_tokens": decision.served and decision.served.min_key_tokens,
            "head_dims": decision.served and decision.served.head_dims, "speedups": decision.speedups,
            "reasons": [(r.kind.value, r.detail) for r in decision.reasons]}


@st.composite
def timings(draw, keys, variants=VARIANTS):
    return {(v, k): draw(MS) for v in variants for k in keys}


def expected_choice(data, ms_by_device):
    """The documented rule from the timings alone: the variant with the least time at the family's
    own shapes (on the slowest device) among those whose break-even serves one of them; ties in
    preference order (the GPU's own kernel first, then the order given). None when none serves."""
    own, sweep, _ = shape_keys(data)
    slowest = {key: max(ms.get(key, SLOWER) for ms in ms_by_device) for key in ms_by_device[0]}

    def points(v, keys):
        shapes = [data["shapes"][k]["shape"] for k in keys]
        return [(s["q_tokens"], s["kv_tokens"], s["head_dim"], 1.0 / slowest.get((v, k), SLOWER))
                for s, k in zip(shapes, keys, strict=True)]

    def total(v):
        return sum(slowest.get((v, k), SLOWER) for k in own)

    ranked = sorted(VARIANTS, key=lambda v: (total(v), VARIANTS.index(v)))
    for v in ranked:
        thresholds = speed.break_even(points(v, own + sweep))
        if thresholds and any(speed.serves(thresholds, q, k, d) for q, k, d, _ in points(v, own)):
            return v, thresholds
    return None, None


@PROPERTY
@given(st.data())
def test_the_family_gets_the_fastest_variant_that_pays_at_its_shapes(draw):
    own, sweep, _ = shape_keys(sample())
    ms = draw.draw(timings(own + sweep))
    data = timed_report([ms])
    found = family_verdict(data)
    chosen, thresholds = expected_choice(data, [ms])
    if chosen is None:
        assert (found["verdict"], found["variant"]) == ("safe, no speedup", None)
        assert found["reasons"] and {kind for kind, _ in found["reasons"]} == {"speed"}
    else:
        assert (found["verdict"], found["variant"]) == ("enable", chosen)
        assert (found["min_query_tokens"], found["min_key_tokens"], found["head_dims"]) == \
            (thresholds.min_query_tokens, thresholds.min_key_tokens, tuple(thresholds.head_dims))
        assert found["speedups"] == {u["label"]: 1.0 / ms[(chosen, k)] for k in own
                                     for u in data["shapes"][k]["uses"] if u["family"] == FAMILY.name}


@pytest.mark.parametrize("order", [VARIANTS, VARIANTS[::-1], (VARIANTS[1], VARIANTS[0], VARIANTS[2])],
                         ids=["table_order", "reversed", "sm89_first"])
def test_equal_timings_go_to_the_gpus_own_kernel_then_the_order_given(order):
    own, sweep, _ = shape_keys(sample())
    same = {(v, k): 0.5 for v in order for k in own + sweep}
    assert family_verdict(timed_report([same], variants=order))["variant"] == "sm90-fp8-cuda"  # H200's own
    others = [v for v in order if v != "sm90-fp8-cuda"]
    same = {(v, k): 0.5 for v in others for k in own + sweep}
    assert family_verdict(timed_report([same], variants=order))["variant"] == others[0]


def test_a_faster_variant_that_does_not_pay_at_the_family_shapes_is_passed_over():
    """sm90 takes less time in total at FLUX.1's shapes, but it is slower than SDPA at the larger one
    and so pays only above both (at the sweep's longest shape); sm89 pays at both: FLUX.1 gets sm89."""
    data = sample()
    own, sweep, _ = shape_keys(data)
    small, large = sorted(own, key=lambda k: data["shapes"][k]["shape"]["q_tokens"])
    longest = max(sweep, key=lambda k: data["shapes"][k]["shape"]["q_tokens"])
    ms = {("sm90-fp8-cuda", small): 0.2, ("sm90-fp8-cuda", large): 1.5, ("sm90-fp8-cuda", longest): 0.1,
          **{("sm89-fp8-cuda", k): 0.95 for k in own + sweep}}
    found = family_verdict(timed_report([ms]))
    assert (found["verdict"], found["variant"]) == ("enable", "sm89-fp8-cuda")
    only_sm90 = family_verdict(timed_report([ms], variants=("sm90-fp8-cuda",)))
    assert (only_sm90["verdict"], only_sm90["variant"]) == ("safe, no speedup", None)


@PROPERTY
@given(st.data(), st.sampled_from([1.0, 1.5, 2.5, 5.0]))
def test_the_slowest_device_of_a_model_decides(draw, factor):
    """A second device of the model, slower by `factor` everywhere, gives the verdict that device
    alone gives, in either order; a faster second device changes nothing."""
    own, sweep, _ = shape_keys(sample())
    ms = draw.draw(timings(own + sweep))
    slow = {key: value * factor for key, value in ms.items()}
    alone = family_verdict(timed_report([slow]))
    assert family_verdict(timed_report([ms, slow])) == alone
    assert family_verdict(timed_report([slow, ms])) == alone


@PROPERTY
@given(st.data())
def test_shapes_the_family_never_uses_do_not_change_its_verdict(draw):
    own, sweep, foreign = shape_keys(sample())
    ms = draw.draw(timings(own + sweep))
    noise = draw.draw(timings(foreign))
    quiet = family_verdict(timed_report([ms], every_shape=True))
    assert family_verdict(timed_report([{**ms, **noise}], every_shape=True)) == quiet


def test_the_shapes_left_out_above_decide_other_families():
    """The invariance above is not empty: the sample holds other families' shapes and sweep
    shapes of other head sizes, and timings there decide those families."""
    own, sweep, foreign = shape_keys(sample())
    assert own and sweep and len(foreign) > 10
    sdxl = families.find("SDXL")
    fast_foreign = {(v, k): 0.25 for v in VARIANTS for k in foreign}
    assert family_verdict(timed_report([{}], every_shape=True), sdxl)["variant"] is None
    assert family_verdict(timed_report([fast_foreign], every_shape=True), sdxl)["variant"] == "sm90-fp8-cuda"


# The evidence behind a choice ------------------------------------------------------------------------
def model_decision(data: dict):
    (gpu,) = verdict.decide(checked.parse(data, "test report"))
    return gpu


def record(data, device, kernel, key):
    return next(r for r in data["devices"][device]["speed"] if r["kernel"] == kernel and r["shape"] == key)


def test_ranking_takes_each_variants_slowest_device():
    """sm90 is the fastest on one device but the slowest on the other; per variant its slower
    device counts, so sm89 wins in either device order."""
    own, sweep, _ = shape_keys(sample())
    sm90_fast = {("sm90-fp8-cuda", k): 0.3 for k in own + sweep}
    sm90_slow = {("sm90-fp8-cuda", k): 0.9 for k in own + sweep}
    sm89 = {("sm89-fp8-cuda", k): 0.6 for k in own + sweep}
    fast_first = [{**sm90_fast, **sm89}, {**sm90_slow, **sm89}]
    for devices in (fast_first, fast_first[::-1]):
        assert family_verdict(timed_report(devices))["variant"] == "sm89-fp8-cuda"


def test_ranking_is_by_the_familys_own_shapes_not_the_sweep():
    own, sweep, _ = shape_keys(sample())
    ms = {**{("sm90-fp8-cuda", k): 0.5 for k in own}, **{("sm90-fp8-cuda", k): 0.9 for k in sweep},
          **{("sm89-fp8-cuda", k): 0.6 for k in own}, **{("sm89-fp8-cuda", k): 0.1 for k in sweep}}
    assert family_verdict(timed_report([ms]))["variant"] == "sm90-fp8-cuda"


def test_the_default_verdict_ranks_by_every_shape():
    """With no family the fastest over all shapes is chosen, not the first in preference order."""
    keys = list(sample()["shapes"])
    ms = {**{("sm90-fp8-cuda", k): 0.8 for k in keys}, **{("sm89-fp8-cuda", k): 0.4 for k in keys}}
    default = model_decision(timed_report([ms], every_shape=True)).default
    assert (default.verdict.value, default.variant) == ("enable", "sm89-fp8-cuda")


def test_no_speedup_names_the_variant_that_pays_elsewhere():
    """sm89 takes the least time at FLUX.1's shapes but never pays (its fast shape has a slower one
    above it); sm90 pays only above FLUX.1's shapes: the reason names sm90 and where it pays."""
    data = sample()
    own, sweep, _ = shape_keys(data)
    small, large = sorted(own, key=lambda k: data["shapes"][k]["shape"]["q_tokens"])
    longest = max(sweep, key=lambda k: data["shapes"][k]["shape"]["q_tokens"])
    ms = {("sm89-fp8-cuda", small): 0.2, ("sm89-fp8-cuda", large): 1.5,
          ("sm90-fp8-cuda", small): 1.5, ("sm90-fp8-cuda", large): 1.5, ("sm90-fp8-cuda", longest): 0.1}
    found = family_verdict(timed_report([ms]))
    assert (found["verdict"], found["variant"]) == ("safe, no speedup", None)
    [(kind, detail)] = found["reasons"]
    q = data["shapes"][longest]["shape"]["q_tokens"]
    assert kind == "speed"
    assert detail.startswith(f"no speedup at its shapes: sm90-fp8-cuda pays only from {q:,} query")
    labels = {k: u["label"] for k in own for u in data["shapes"][k]["uses"] if u["family"] == FAMILY.name}
    listed = ", ".join(f"{labels[k]} {1 / ms[('sm90-fp8-cuda', k)]:.2f}x" for k in own)
    assert detail.endswith(f", which serves none of them ({listed})")


def test_speedups_count_only_where_sdpa_was_timed_and_failures_as_none():
    data = timed_report([{}])
    _, sweep, _ = shape_keys(data)
    no_baseline, failed = sweep[0], sweep[1]
    record(data, 0, "sdpa", no_baseline).update(outcome="oom", ms=None, backends={}, best_backend="",
                                                detail="OutOfMemoryError (test)")
    record(data, 0, "sm90-fp8-cuda", failed).update(outcome="crash", ms=None, detail="killed (test)")
    timed_out = sweep[2]  # a timing cut off by the timeout still counts as no speedup
    record(data, 0, "sm90-fp8-cuda", timed_out).update(outcome="timeout", ms=0.25, detail="timed out (test)")
    gpu = model_decision(data)
    assert {variant for variant, _ in gpu.speedups} == set(VARIANTS)
    assert not any(key == no_baseline for _, key in gpu.speedups)
    assert gpu.speedups[("sm90-fp8-cuda", failed)] == (0.0, 0.0)
    assert gpu.speedups[("sm90-fp8-cuda", timed_out)] == (0.0, 0.0)
    assert gpu.speedups[("sm89-fp8-cuda", failed)] == (1 / SLOWER, 1 / SLOWER)


def test_speedup_lower_bound_uses_both_sides_samples():
    data = timed_report([{}])
    key = shape_keys(data)[0][0]
    ours = record(data, 0, "sm90-fp8-cuda", key)
    ours.update(ms=0.5, samples_ms=[0.5 * (1 + 0.5 * (i - 9.5) / 9.5) for i in range(20)])
    ours["ms"] = statistics.median(ours["samples_ms"])
    record(data, 0, "sdpa", key)["samples_ms"] = [1.0] * 20
    low, median = model_decision(data).speedups[("sm90-fp8-cuda", key)]
    assert median == 1.0 / ours["ms"]
    assert low == 1.0 / speed.median_interval(ours["samples_ms"])[1] < median


def test_each_variants_break_even_uses_the_plain_speedup_and_only_where_it_runs():
    """A variant 1.5x faster everywhere pays from the smallest shape (the bar is 1x, not more); a
    variant the GPU cannot run has none."""
    keys = list(sample()["shapes"])
    fast = {(v, k): 1 / 1.5 for v in ("sm89-fp8-cuda", "sm80-fp16-cuda") for k in keys}
    data = timed_report([fast], every_shape=True)
    data["devices"][0]["not_supported"] = {"sm80-fp16-cuda": ["capability (test)"]}
    gpu = model_decision(data)
    thresholds = gpu.variants["sm89-fp8-cuda"].break_even
    assert thresholds is not None and thresholds.served_shapes == thresholds.measured_shapes == len(keys)
    assert not gpu.variants["sm80-fp16-cuda"].runnable and gpu.variants["sm80-fp16-cuda"].break_even is None


# Masked calls ------------------------------------------------------------------------------------
# Masked calls in a verdict (issue 42): a masked fixture is evidence about masked calls only. The
# variant chosen for a family serves them (`Served.masks`) when it takes a mask and passed every masked
# fixture of the family; a variant that takes none is never judged on them (certify does not run it
# there), and a failed masked call keeps masked calls, not the family, on torch.
CK, SM90 = "ck-int8-cuda", "sm90-fp8-cuda"
MASKED = "flux1_masked_batch"


def decided(fastest: str, masked_outcome: str | None = "pass", masked_family: str = "flux.1",
            *more_outcomes: str):
    """FLUX.1 on one H200 where `fastest` takes a quarter of SDPA's time and the other half of it, with
    a masked fixture that only ck-int8-cuda ran (`masked_outcome`; None: it has no cell there), and one
    more masked fixture of the family per `more_outcomes`."""
    own, sweep, _ = shape_keys(sample())
    ms = {(fastest, key): 0.25 for key in own + sweep}
    ms.update({(v, key): 0.5 for v in (CK, SM90) if v != fastest for key in own + sweep})
    data = timed_report([ms], variants=(CK, SM90))
    typed = checked.parse(data, "test report")
    device = typed.devices[0]
    cells, fixtures = list(device.cells), []
    for n, outcome in enumerate((masked_outcome, *more_outcomes)):
        masked = builders.fixture(MASKED + (f"_{n}" if n else ""), masked_family, masked=True)
        fixtures.append(masked)
        if outcome is not None:
            fields = {"rel_l2": 0.5, "reasons": [builders.reason("accuracy", "relative L2 0.5 > 0.12")]} \
                if outcome == "fail" else {}
            cells.append(builders.cell(CK, masked, outcome, **fields))
    typed = dataclasses.replace(typed, fixtures=[*typed.fixtures, *fixtures],
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
    assert any(
        r.detail.startswith(f"masked calls stay on torch: {CK} on {MASKED}") for r in decision.range_reasons
    )


@pytest.mark.parametrize("outcomes", [("pass", "fail"), ("fail", "pass"), ("pass", "pass", "fail")])
def test_every_masked_fixture_of_the_family_decides_not_only_the_first(outcomes):
    """Issue 54's surviving mutant: only the first masked fixture of an entry decided."""
    decision = decided(CK, outcomes[0], "flux.1", *outcomes[1:])
    assert decision.variant == CK and decision.served.masks is False
    assert any("masked calls stay on torch" in r.detail for r in decision.range_reasons)
    assert decided(CK, "pass", "flux.1", *["pass"] * (len(outcomes) - 1)).served.masks is True


def test_a_masked_call_not_run_serves_no_masked_call():
    decision = decided(CK, None)
    assert decision.variant == CK and decision.served.masks is False
    assert any(
        "masked calls stay on torch" in r.detail and "not run" in r.detail for r in decision.range_reasons
    )


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
