"""`sage-qual compare` sees everything a verdict serves (issue 27): ranges, head sizes, layouts,
contexts and bounds as well as verdicts and variants, and the speed served within the tolerance
(issue 40; tests_fast/cli/test_compare_runs.py on the H200's runs); what one report has and the
other lacks is a difference; predicted and --quick reports are refused."""

import dataclasses
import json
from pathlib import Path

import pytest

from sage_qual import cli, records
from sage_qual.cli import compare
from sage_qual.qualification.decide import checked
from sage_qual.qualification.decide.verdict import FamilyDecision, GpuDecision, VariantStatus, Verdict
from sage_qual.qualification.evidence.report_model import ShapeSpec
from sage_qual.verdicts.served import Bound, Served

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"
RUN8 = RESULTS / "run8-h200x2-final" / "certify" / "certify-a" / "report.json.gz"  # no long checks
RUN13 = RESULTS / "run13-h200x2" / "certify-e" / "report.json.gz"  # ranges capped, three layouts
SAMPLE = Path(__file__).parent.parent / "data" / "sample_h200_2gpu.json"
ENVIRONMENT = checked.load(SAMPLE).environment


def test_run_8_against_run_13_reports_the_range_and_layout_differences(capsys):
    """One short line per entry; under one that differs, both sides in full; the differences again,
    one short line each (issue 43: compare's lines ran past 300 characters)."""
    assert cli.main(["compare", str(RUN8), str(RUN13)]) == 1
    out = capsys.readouterr().out.splitlines()
    at = out.index("NVIDIA H200 (sm_90) Qwen-Image: DIFFERS: upper bound, layouts")
    assert out[at + 1].startswith("    first:  enable ")
    assert "(no upper bound verified" in out[at + 1]  # run 8: no long checks
    assert out[at + 2].startswith("    second: enable ") and " to 32,768 tokens" in out[at + 2]
    assert "  NVIDIA H200 (sm_90) Qwen-Image: upper bound, layouts" in out[out.index(next(
        line for line in out if "difference(s) beyond 5%:" in line)):]
    entries = [line for line in out if not line.startswith("    ")]
    assert max(map(len, entries)) < 120, max(entries, key=len)


def test_an_entry_that_is_the_same_is_one_short_line_with_its_served_speed(capsys):
    assert cli.main(["compare", str(SAMPLE), str(SAMPLE)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "NVIDIA H200 (sm_90) FLUX.1: no difference, served speedup x1.000" in out
    assert not any(line.startswith("    ") for line in out)


SERVED_FIELDS = {f.name for f in dataclasses.fields(Served)}


def decision(**fields) -> FamilyDecision:
    """An enabled FLUX.1 decision; `fields` change it or what it serves."""
    served = dict(variant="sm90-fp8-cuda", min_query_tokens=9728, min_key_tokens=9728, head_dims=[128],
                  max_query_tokens=32768, max_key_tokens=32768, layouts=["contiguous", "transposed"],
                  contexts=["side_stream", "compile"])
    served.update({k: v for k, v in fields.items() if k in SERVED_FIELDS})
    rest = {k: v for k, v in fields.items() if k not in SERVED_FIELDS}
    return FamilyDecision(
        **{"family": "FLUX.1", "verdict": Verdict.ENABLE, "served": Served(**served), **rest}
    )


SHAPES = {f"self {n}": ShapeSpec(24, 24, n, n, 128, "bfloat16", 1) for n in (8192, 16384, 32768)}


def gpu(*families: FamilyDecision, ran=("sm90-fp8-cuda",), speedup=1.2, extra=()) -> compare.Decided:
    status = {name: VariantStatus(True, True, [], None) for name in ran}
    speedups = {(name, key): (speedup * 0.95, speedup) for name in ran for key in SHAPES}
    model = GpuDecision("NVIDIA H200", (9, 0), 139.8, [0], status, list(families), decision(family=None),
                        speedups)
    return compare.Decided({model.model: model, **{m.model: m for m in extra}}, SHAPES, ENVIRONMENT)


@pytest.mark.parametrize("change", [
    dict(max_query_tokens=16384), dict(max_key_tokens=16384),
    dict(layouts=["contiguous"]), dict(head_dims=[64, 128]), dict(contexts=["compile"]),
    dict(contexts=None), dict(max_query_tokens=None, max_key_tokens=None, layouts=None),
    dict(variant="sm80-fp16-cuda"), dict(bounds=[Bound("key", 17, "ip-adapter")]),
], ids=lambda change: ",".join(change))
def test_every_part_of_what_is_served_is_compared(change):
    _, found = compare.verdict_differences(gpu(decision()), gpu(decision(**change)), 0.10)
    assert [line.split(":")[0] for line in found] == ["NVIDIA H200 (sm_90) FLUX.1"]


def test_a_bound_is_compared_by_its_side_and_tokens_not_its_words():
    first = decision(bounds=[Bound("key", 17, "flux1_ip_adapter_zero_uncond: NaN")])
    reworded = decision(bounds=[Bound("key", 17, "flux1_ip_adapter_zero_uncond: output not finite")])
    assert compare.verdict_differences(gpu(first), gpu(reworded), 0.10)[1] == []
    _, found = compare.verdict_differences(gpu(first), gpu(decision(bounds=[Bound("key", 18, "x")])), 0.10)
    assert (
        len(found) == 1
        and "; calls with fewer than 17 keys stay on torch (flux1_ip_adapter_zero_uncond: NaN) vs "
        in found[0]
    )
    assert found[0].endswith("; calls with fewer than 18 keys stay on torch (x) (served speedup x1.000)")
    other_side = decision(bounds=[Bound("query", 17, "x")])
    assert compare.verdict_differences(gpu(first), gpu(other_side), 0.10)[1] != []


def test_served_speed_is_judged_not_the_length_served_from():
    """The served-from length moved one refinement step between identical H200 runs (run 29): alone
    it is no difference. The speedup over the shapes either entry serves is, beyond the tolerance."""
    later = decision(min_query_tokens=11_648, min_key_tokens=11_648)
    assert compare.verdict_differences(gpu(decision()), gpu(later), 0.05)[1] == []
    assert compare.verdict_differences(gpu(decision()), gpu(decision(), speedup=1.2 * 1.04), 0.05)[1] == []
    _, found = compare.verdict_differences(gpu(decision()), gpu(decision(), speedup=1.2 / 1.10), 0.05)
    assert [line.split(":")[0] for line in found] == [
        "NVIDIA H200 (sm_90) FLUX.1",
        "NVIDIA H200 (sm_90) default",
    ]
    assert all(line.endswith("(served speedup x0.909)") for line in found)
    assert compare.verdict_differences(gpu(decision()), gpu(decision(), speedup=1.2 / 1.10), 0.12)[1] == []


def test_a_shape_no_entry_serves_does_not_count():
    narrow = decision(min_query_tokens=20_000, min_key_tokens=20_000)
    slower = gpu(narrow, speedup=1.2)
    slower.gpus["NVIDIA H200 (sm_90)"].speedups[("sm90-fp8-cuda", "self 8192")] = (0.4, 0.5)
    assert compare.verdict_differences(gpu(narrow), slower, 0.05)[1] == []
    slower.gpus["NVIDIA H200 (sm_90)"].speedups[("sm90-fp8-cuda", "self 32768")] = (0.4, 0.5)
    assert compare.verdict_differences(gpu(narrow), slower, 0.05)[1] != []


def test_what_one_report_lacks_is_a_difference():
    wan = decision(family="Wan 2.2")
    both = gpu(decision(), wan, ran=("sm90-fp8-cuda", "sm86-fp16-triton"))
    _, found = compare.verdict_differences(gpu(decision()), both, 0.10)
    assert sorted(found) == ["NVIDIA H200 (sm_90) Wan 2.2: in only one report",
                             "NVIDIA H200 (sm_90): variant sm86-fp16-triton ran in only one report"]


@pytest.mark.parametrize("field, words", [("predicted", "is a predicted report (certify --emulate"),
                                          ("quick", "is a --quick report: it ran the smallest fixture")])
def test_predicted_and_quick_reports_are_refused(tmp_path, capsys, field, words):
    data = checked.load(SAMPLE)
    edited = (dataclasses.replace(data, predicted=True) if field == "predicted" else
              dataclasses.replace(data, options=dataclasses.replace(data.options, quick=True)))
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(records.dump(edited)))
    assert cli.main(["compare", str(SAMPLE), str(path)]) == 2
    assert words in capsys.readouterr().err


def test_the_same_report_is_the_same(capsys):
    assert cli.main(["compare", str(SAMPLE), str(SAMPLE)]) == 0
    out = capsys.readouterr().out
    assert out.strip().endswith("served speedups within 5%") and "other software" not in out


@pytest.mark.parametrize("field, said", [
    ("sageattention_source", "sageattention build sha256:aaaa vs sha256:bbbb"),
    ("torch", "torch sha256:aaaa vs sha256:bbbb"),
    ("other_providers", "comfy-kitchen build sha256:aaaa vs sha256:bbbb")])
def test_another_build_or_torch_under_the_same_verdicts_is_said_not_counted(tmp_path, capsys, field, said):
    """Another sageattention build under the same version went unsaid (issue 43); a rebuild of one
    source gets another fingerprint (runs 31 and 33), so it is not a difference by itself."""
    paths = []
    for name, value in (("a", "sha256:aaaa"), ("b", "sha256:bbbb")):
        data = json.loads(SAMPLE.read_text())
        if field == "other_providers":  # comfy-kitchen's build beside sageattention's
            value = [{"provider": "comfy-kitchen", "version": "0.2.40", "source": value}]
        data["environment"][field] = value
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(data))
    assert cli.main(["compare", *map(str, paths)]) == 0
    assert capsys.readouterr().out.startswith(f"ran on other software: {said}\n")
    assert cli.main(["compare", "--json", *map(str, paths)]) == 0
    assert json.loads(capsys.readouterr().out)["software"] == [said]


def test_a_gpu_model_in_one_report_only_is_a_difference_and_the_others_still_compared():
    """issue 28's survivors: the models are the union of both reports', each missing one said, and
    the other models' differences kept (not replaced) after it."""
    h100 = GpuDecision("NVIDIA H100", (9, 0), 79.6, [1], {}, [], decision(family=None))
    first = gpu(decision(), extra=[h100])
    second = gpu(decision(), ran=("sm90-fp8-cuda", "sm86-fp16-triton"))
    lines, found = compare.verdict_differences(first, second, 0.10)
    assert found == ["NVIDIA H100 (sm_90): in only one report",
                     "NVIDIA H200 (sm_90): variant sm86-fp16-triton ran in only one report"]
    assert [c.where for c in lines] == ["NVIDIA H200 (sm_90) FLUX.1", "NVIDIA H200 (sm_90) default"]
    assert compare.verdict_differences(second, first, 0.10)[1][0] == "NVIDIA H100 (sm_90): in only one report"


@pytest.mark.parametrize("tolerance, code", [("0", 0), ("0.5", 0), ("1", 2), ("-0.1", 2), ("1.5", 2)])
def test_the_tolerance_is_a_fraction_from_0_to_below_1(capsys, tolerance, code):
    assert cli.main(["compare", "--tolerance", tolerance, str(SAMPLE), str(SAMPLE)]) == code
    err = capsys.readouterr().err
    assert (code == 2) == ("--tolerance" in err), err


# A value of each field of Served other than the first decision's (issue 53: compare ignored `masks`).
OTHER_VALUES = {"variant": "sm89-fp8-cuda", "min_query_tokens": 4096, "min_key_tokens": 4096,
                "head_dims": [64], "max_query_tokens": 16384, "max_key_tokens": 16384,
                "layouts": ["contiguous"], "contexts": ["side_stream"],
                "bounds": [Bound("key", 17, "a test")], "masks": True}


@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(Served)])
def test_every_field_of_what_is_served_is_compared(name):
    """A field of Served that compare does not judge fails here: each is exact, judged by the served
    speedups (the thresholds) or by what it keeps on torch (the bounds)."""
    assert set(OTHER_VALUES) == {f.name for f in dataclasses.fields(Served)}
    first = decision()
    second = decision(**{name: OTHER_VALUES[name]})
    found = compare.changed(first, second, None, 0.05)
    if name in compare.BY_SPEED:  # judged by the served speedups, which are equal here
        assert found == []
    else:
        assert found, name
