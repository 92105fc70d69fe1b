"""Edges of verdict.decide() and of reading a report's evidence that a plausible bug would change
unnoticed: edited cells behind a skipped one, the exact refusal lines, a GPU the kernel table does
not know, the reasons for no fixtures and no variant, the family's own memory bound, the lower
bound in the listed speedups. Reports are the hand-made samples in tests_fast/data."""

import copy
import json
from pathlib import Path

import pytest

from sage_qual.qualification import families
from sage_qual.qualification.decide import checked, verdict
from sage_qual.qualification.evidence.report_model import ReportError
from sage_qual.qualification.families import Family

DATA = Path(__file__).parent.parent / "data"


def sample(name="sample_h200_2gpu.json") -> dict:
    return json.loads((DATA / name).read_text())


def decide(data: dict):
    return verdict.decide(checked.parse(copy.deepcopy(data), "report.json"))


# Reading the evidence ---------------------------------------------------------------------------------
def test_an_edited_cell_after_an_unmeasured_one_is_refused():
    """The RTX 4090 sample lists three skipped sm90 cells; an edit to a measured cell after them is
    still found."""
    data = sample("sample_rtx4090.json")
    device = data["devices"][0]
    assert any(c["outcome"] == "skip" for c in device["cells"])
    device["cells"].sort(key=lambda c: c["outcome"] != "skip")  # the skipped ones first
    edited = device["cells"][-1]
    edited["rel_l2"] = 0.9  # far beyond its bound, still stored as a pass
    n = len(device["cells"]) - 1
    with pytest.raises(ReportError) as refused:
        checked.parse(data, "edited.json")
    message = str(refused.value)
    where = f"edited.json: devices[0].cells[{n}] ({edited['variant']} on {edited['fixture']})"
    assert message.startswith(f"{where}: outcome: 'pass' but its numbers say 'fail' (relative L2 0.9 > ")
    assert message.endswith("; the report was edited: certify again")


def test_a_failed_cell_whose_numbers_pass_is_refused_with_why():
    data = sample()
    device = data["devices"][1]
    n = next(i for i, c in enumerate(device["cells"]) if c["outcome"] == "fail")
    cell = device["cells"][n]
    cell.update(rel_l2=cell["bounds"]["max_rel_l2"] / 2, worst_head_cosine=1.0, finite=True)
    with pytest.raises(ReportError) as refused:
        checked.parse(data, "r.json")
    where = f"r.json: devices[1].cells[{n}] ({cell['variant']} on {cell['fixture']})"
    assert str(refused.value) == (f"{where}: outcome: 'fail' but its numbers say 'pass' (every number within "
                                  "its bound); the report was edited: certify again")


def test_a_cell_of_a_variant_this_version_does_not_know_is_refused():
    data = sample()
    data["options"]["variants"].append("sm91-turbo")
    cell = data["devices"][0]["cells"][0]
    cell["variant"] = "sm91-turbo"
    with pytest.raises(ReportError) as refused:
        checked.parse(data, "r.json")
    # report_model refuses the unknown name in options.variants before any cell is judged
    assert str(refused.value).startswith("r.json: options.variants[3]: 'sm91-turbo' is not a variant this "
                                         "sage-qual knows")


# Deciding ---------------------------------------------------------------------------------------------
def test_a_gpu_the_kernel_table_does_not_know_keeps_the_order_given():
    """A B200 (sm_100) has no default kernel: the selected variants rank in the order given."""
    data = sample()
    for device in data["devices"]:
        device.update(name="NVIDIA B200", capability=[10, 0])
    for gpu in data["environment"]["gpus"]:
        gpu.update(name="NVIDIA B200", capability=[10, 0])
    (gpu,) = decide(data)
    assert gpu.model == "NVIDIA B200 (sm_100)"
    assert [v for v, s in gpu.variants.items() if s.runnable] == data["options"]["variants"]


def test_memory_and_speedups_of_a_model_come_from_its_devices():
    data = sample()
    data["devices"][1]["memory_gib"] = 80.0
    (gpu,) = decide(data)
    assert gpu.memory_gib == 80.0 and gpu.devices == [0, 1]
    assert gpu.speedups and all(low <= median for low, median in gpu.speedups.values())
    assert {v for v, _ in gpu.speedups} <= set(data["options"]["variants"])


def test_no_fixtures_at_all_names_any_family():
    data = sample()
    for device in data["devices"]:
        device["cells"] = []
    data["fixtures"] = []
    (gpu,) = decide(data)
    assert [(r.kind.value, r.detail) for r in gpu.default.reasons] == [
        ("no_fixtures", "no fixtures of any family in this run: not certified")]
    assert [(r.kind.value, r.detail) for r in gpu.family("FLUX.1").reasons] == [
        ("no_fixtures", "no fixtures of FLUX.1 in this run: not certified")]


def test_no_variant_that_ran_is_a_skip_reason():
    data = sample()
    for device in data["devices"]:
        device["not_supported"] = {v: ["not built (test)"] for v in data["options"]["variants"]}
    (gpu,) = decide(data)
    flux = gpu.family("FLUX.1")
    assert flux.verdict == verdict.Verdict.KEEP_OFF
    assert [(r.kind.value, r.detail) for r in flux.reasons] == [
        ("skip", "no selected variant ran on this GPU")]


def test_a_familys_own_memory_bound_judges_its_cells(monkeypatch):
    """The sample's cells use 1.33-1.67 extra bytes per element; a family bound of 1.0 fails them."""
    data = sample()
    assert decide(data)[0].family("FLUX.1").verdict == verdict.Verdict.ENABLE
    strict = Family("FLUX.1", families.find("FLUX.1").shapes, memory_bound=1.0)
    swapped = tuple(strict if f.name == "FLUX.1" else f for f in families.FAMILIES)
    monkeypatch.setattr(families, "FAMILIES", swapped)
    monkeypatch.setattr(verdict, "FAMILIES", swapped)
    for device in data["devices"]:  # stored outcomes must agree with the stricter judgement
        for cell in device["cells"]:
            if cell["fixture"] == "flux1-block5" and cell["outcome"] == "pass":
                cell["outcome"] = "fail"
    flux = decide(data)[0].family("FLUX.1")
    assert flux.verdict == verdict.Verdict.KEEP_OFF
    assert {r.kind.value for r in flux.reasons} == {"memory"}
    assert all("> 1" in r.detail for r in flux.reasons)


def test_listed_speedups_are_lower_bounds():
    """With timing samples, the speedups a verdict lists are the lower 95 % bounds, below the medians."""
    data = sample()
    data.pop("gpus")
    data["schema_version"] = 2
    for device in data["devices"]:
        for record in device["speed"]:
            if record["ms"]:
                record["samples_ms"] = [record["ms"] * (1 + 0.3 * (i - 9.5) / 9.5) for i in range(20)]
    (gpu,) = decide(data)
    flux = gpu.family("FLUX.1")
    keys = {u["label"]: k for k, s in data["shapes"].items() for u in s["uses"] if u["family"] == "FLUX.1"}
    assert flux.variant and set(flux.speedups) == set(keys)
    for label, listed in flux.speedups.items():
        low, median = gpu.speedups[(flux.variant, keys[label])]
        assert listed == low < median


def test_family_names_compare_without_case_or_punctuation():
    assert [families.normalize(n) for n in ("Qwen-Image", "qwen_image", "Wan 2.2", "FLUX.1")] == \
        ["qwenimage", "qwenimage", "wan22", "flux1"]


def test_a_measured_cell_without_a_number_fails_its_accuracy():
    data = sample()
    cell = next(c for c in data["devices"][0]["cells"] if c["fixture"] == "flux1-block5")
    cell.update(rel_l2=None, outcome="fail", reasons=[])
    flux = decide(data)[0].family("FLUX.1")
    [reason] = flux.results.rejected[cell["variant"]]
    assert reason.kind.value == "accuracy" and "relative L2" in reason.detail


def test_an_edited_cell_names_every_failing_number():
    data = sample()
    cell = next(c for c in data["devices"][0]["cells"] if c["outcome"] == "pass")
    cell.update(rel_l2=0.9, worst_head_cosine=0.1)
    with pytest.raises(ReportError) as refused:
        checked.parse(data, "r.json")
    message = str(refused.value)
    assert f"relative L2 0.9 > {cell['bounds']['max_rel_l2']:g} (SDPA in the input precision: " in message
    assert f"); worst head cosine 0.1 < {cell['bounds']['min_cosine']:g}); the report was edited" in message


def predicted(extra):
    data = sample()
    data["predicted"] = True
    for device in data["devices"]:
        for cell in device["cells"]:
            if cell["outcome"] in ("pass", "fail"):
                cell["extra_bytes_per_element"] = extra
    return data


def test_a_predicted_cell_is_judged_on_accuracy_alone_when_it_has_no_memory_number():
    (gpu,) = decide(predicted(None))
    assert gpu.family("FLUX.1").verdict == verdict.Verdict.ENABLE


def test_a_predicted_cell_with_a_memory_number_is_judged_on_it():
    data = predicted(3.0)
    for device in data["devices"]:
        for cell in device["cells"]:
            if cell["outcome"] == "pass":
                cell["outcome"] = "fail"
    (gpu,) = decide(data)
    flux = gpu.family("FLUX.1")
    assert flux.verdict == verdict.Verdict.KEEP_OFF and {r.kind.value for r in flux.reasons} == {"memory"}


def test_a_variant_a_gpu_cannot_run_keeps_each_devices_reasons():
    data = sample()
    data["devices"][0]["not_supported"] = {"sm80-fp16-cuda": ["b (test)", "a (test)"]}
    data["devices"][1]["not_supported"] = {"sm80-fp16-cuda": ["c (test)", "a (test)"]}
    (gpu,) = decide(data)
    assert gpu.variants["sm80-fp16-cuda"].reasons == ["a (test)", "b (test)", "c (test)"]
    assert gpu.variants["sm90-fp8-cuda"].reasons == []


def test_the_speed_reasons_in_words():
    data = sample()
    for device in data["devices"]:  # every variant slower than SDPA everywhere
        for record in device["speed"]:
            if record["kernel"] != "sdpa" and record["ms"]:
                record["ms"] = 1000.0
    (gpu,) = decide(data)
    flux = gpu.family("FLUX.1")
    assert [r.detail for r in flux.reasons] == [
        "sm90-fp8-cuda never measured faster than 1.05x the fastest SDPA backend (lower 95 % bound)"]
    quick = sample()
    own = [k for k, s in quick["shapes"].items() if any(u["family"] == "FLUX.1" for u in s["uses"])]
    for device in quick["devices"]:  # a --quick run times the sweep, not the family's shapes
        device["speed"] = [r for r in device["speed"] if r["shape"] not in own]
    (gpu,) = decide(quick)
    assert [r.detail for r in gpu.family("FLUX.1").reasons] == [
        "FLUX.1's own shapes were not timed (a --quick run): speedup unknown"]


def test_the_default_verdict_needs_only_a_plain_speedup():
    """On the RTX 4090 sample, sm89 1.5x faster than SDPA everywhere (sm86 slower): the default
    verdict enables sm89 from the smallest shape; a 2x bar would serve nothing."""
    data = sample("sample_rtx4090.json")
    for device in data["devices"]:
        sdpa = {r["shape"]: r["ms"] for r in device["speed"] if r["kernel"] == "sdpa"}
        for record in device["speed"]:
            if record["kernel"] != "sdpa" and record["ms"]:
                record["ms"] = sdpa[record["shape"]] / (1.5 if record["kernel"] == "sm89-fp8-cuda" else 0.5)
    default = decide(data)[0].default
    assert default.variant == "sm89-fp8-cuda"
    assert default.served.min_query_tokens == min(s["shape"]["q_tokens"] for s in data["shapes"].values())
