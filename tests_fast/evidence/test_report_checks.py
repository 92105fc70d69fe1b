"""report_model's integrity checks, one edit each to a valid report: every rule that keeps a
damaged, edited or foreign report.json from reaching a verdict names the entry and why, and a
valid report next to each edit still reads (so each rule is tested at its edge, not only far
past it)."""

import copy
import json
from pathlib import Path

import pytest

from sage_qual.qualification.decide import checked
from sage_qual.qualification.evidence import files, report_model
from sage_qual.qualification.evidence.report_model import Outcome, ReportError

SAMPLE = Path(__file__).parent.parent / "data" / "sample_h200_2gpu.json"
SHAPE = {
    "heads": 24,
    "kv_heads": 24,
    "q_tokens": 16896,
    "kv_tokens": 16896,
    "head_dim": 128,
    "dtype": "bfloat16",
    "batch": 1,
}
LONG = {
    "variant": "sm90-fp8-cuda",
    "shape": SHAPE,
    "uses": [{"family": "FLUX.1", "label": "joint"}],
    "layouts": ["contiguous"],
    "outcome": "pass",
    "budget": {"max_rel_l2": 0.1, "max_head_rel_l2": None, "max_batch_rel_l2": None, "max_block_rel_l2": None,
               "min_norm_ratio": None, "max_norm_ratio": None, "min_cosine": 0.99, "max_abs": None},
    "metrics": {"rel_l2": 0.05, "worst_head_cosine": 0.999, "finite": True, "worst_head_rel_l2": None,
                "worst_batch_rel_l2": None, "worst_block_rel_l2": None, "norm_ratio": None,
                "max_abs_error": None},
    "rows": [0, 5632, 11136, 16768],
    "row_block": 128,
}
SPAN = {
    "variant": "sm90-fp8-cuda",
    "layout": "contiguous",
    "side": "below",
    "tokens": 290000,
    "heads": 56,
    "head_dim": 128,
    "kv_tokens": 1024,
    "span": 2078720000,
    "limit": 2147483647,
    "outcome": "pass",
    "rel_l2": 0.05,
}


def valid() -> dict:
    """The H200 sample (version 1) as the current version writes it, with one long check and one span
    probe on cuda:0."""
    data = files.upgrade(json.loads(SAMPLE.read_text()), 1)
    data["devices"][0]["long"] = [copy.deepcopy(LONG)]
    data["devices"][0]["span"] = [copy.deepcopy(SPAN)]
    return data


def refused(change) -> str:
    data = valid()
    change(data)
    with pytest.raises(ReportError) as error:
        files.from_dict(data, "r.json")
    message = str(error.value)
    assert message.startswith("r.json: ") and "\n" not in message
    assert message.endswith(report_model.FIX) or "upgrade sage-qual" in message  # and what to do
    return message.removeprefix("r.json: ").removesuffix("; " + report_model.FIX)


def refused_as_is(data: dict) -> str:
    with pytest.raises(ReportError) as error:
        files.from_dict(data, "r.json")
    return str(error.value).removeprefix("r.json: ").removesuffix("; " + report_model.FIX)


def reads(change) -> report_model.Report:
    data = valid()
    change(data)
    return files.from_dict(data, "r.json")


def cell(data, device=0, n=0) -> dict:
    return data["devices"][device]["cells"][n]


def test_the_valid_report_reads():
    parsed = reads(lambda d: None)
    assert parsed.devices[0].long[0].outcome == Outcome.PASS and parsed.devices[0].span[0].span == 2078720000


# What makes a report --------------------------------------------------------------------------


@pytest.mark.parametrize("data", [[], "report", {"kind": "something-else"}, {"schema_version": 2}])
def test_a_foreign_document_is_not_a_report(data):
    with pytest.raises(
        ReportError,
        match=r'^r.json: kind: not a sage-qual report \(no "kind": '
        r'"sage-qual-report"\); give the report.json',
    ):
        files.from_dict(data, "r.json")


def test_a_newer_schema_says_to_upgrade():
    assert refused(lambda d: d.update(schema_version=6)) == (
        "schema_version: 6 is newer than this sage-qual reads (1, 2, 3, 4, 5); upgrade sage-qual"
    )


@pytest.mark.parametrize("version", [0, True, "2", None, 1.5])
def test_an_unreadable_schema_version_is_refused_with_the_fix(version):
    message = refused(lambda d: d.update(schema_version=version))
    assert message == f"schema_version: {version!r} is not a report schema version (1, 2, 3, 4, 5)"


def test_a_version_1_report_drops_its_stored_analysis_and_reads_as_the_current_version():
    data = json.loads(SAMPLE.read_text())
    assert data["schema_version"] == 1 and "gpus" in data
    parsed = files.from_dict(data, "r.json")
    assert parsed.schema_version == report_model.SCHEMA_VERSION == 5
    assert data["schema_version"] == 1 and "gpus" in data  # the caller's dict is not changed
    # Its budgets held two limits: the others read as null, and judge checks no null limit.
    budget = parsed.devices[0].cells[0].budget
    assert (budget.max_rel_l2, budget.min_cosine) == tuple(data["devices"][0]["cells"][0]["bounds"].values())
    assert budget.max_abs is None and budget.max_head_rel_l2 is None


def test_a_version_2_long_check_moves_its_finiteness_into_its_metrics():
    data = valid()
    data["schema_version"] = 2
    long = data["devices"][0]["long"][0]
    long["finite"] = long["metrics"].pop("finite")
    del long["budget"]
    long["bounds"] = {"max_rel_l2": 0.1, "min_cosine": 0.99}  # version 2: a mapping of the limits it had
    long["metrics"] = {"rel_l2": 0.05, "worst_head_cosine": 0.999}
    parsed = files.from_dict(data, "r.json").devices[0].long[0]
    assert parsed.metrics.finite is True and parsed.metrics.rel_l2 == 0.05
    assert parsed.metrics.norm_ratio is None
    assert parsed.budget.max_rel_l2 == 0.1 and parsed.budget.max_abs is None
    long.update(metrics={}, finite=None, outcome="crash", detail="killed by SIGSEGV")
    assert files.from_dict(data, "r.json").devices[0].long[0].metrics is None


def version_3(data: dict) -> dict:
    """A current report as version 3 wrote it: a cell's numbers flat beside its `bounds`, a long
    check's `bounds`."""
    data["schema_version"] = 3
    for device in data["devices"]:
        for record in device["cells"] + device.get("long", []):
            if "budget" in record:
                record["bounds"] = record.pop("budget")
        for c in device["cells"]:
            c.update(c.pop("metrics") or {"finite": None})
    return data


@pytest.mark.parametrize("version", [1, 2, 3])
def test_upgrading_leaves_the_callers_report_as_it_was(version):
    """gate and merge may read one dict twice: the upgrade works on copies, down to each record (a
    crashed cell or long check has no budget to rename, so nothing else copied it)."""
    data = version_3(valid())
    data["schema_version"] = version
    data["devices"][0]["long"][0].update(outcome="crash", detail="killed", finite=None)
    del data["devices"][0]["long"][0]["bounds"]
    before = copy.deepcopy(data)
    files.from_dict(data, "r.json")
    assert data == before


def test_a_version_3_report_reads_as_the_same_evidence():
    """3 -> 4: each cell's numbers move into its metrics (null where it did not run), `bounds` is
    `budget`; the verdicts are the same."""
    current = files.from_dict(valid(), "r.json")
    upgraded = files.from_dict(version_3(valid()), "r.json")
    assert upgraded == current
    assert any(c.metrics is None for c in upgraded.devices[0].cells)  # the crashed cells


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.update(finite=None), "metrics.finite: is null, expected true or false"),
    (lambda c: c.update(budget=c["bounds"]), "bounds: unknown key"),
    (lambda c: c.update(metrics={}), ": unknown key"),  # its first flat number
])
def test_a_version_3_cell_with_numbers_that_do_not_fit_is_refused_not_dropped(edit, message):
    data = version_3(valid())
    measured = next(c for c in data["devices"][0]["cells"] if c["outcome"] == "pass")
    edit(measured)
    index = data["devices"][0]["cells"].index(measured)
    assert refused_as_is(data).startswith(f"devices[0].cells[{index}].") and message in refused_as_is(data)


def test_the_current_version_holds_every_limit_and_metric():
    """Version 3 stores each limit of a budget and each number of a long check's metrics: one left out
    is refused (a version 2 mapping could lack any)."""
    assert refused(lambda d: d["devices"][0]["long"][0]["budget"].pop("max_abs")) == (
        "devices[0].long[0].budget.max_abs: missing")
    assert refused(lambda d: d["devices"][0]["long"][0]["metrics"].pop("norm_ratio")) == (
        "devices[0].long[0].metrics.norm_ratio: missing")
    assert refused(lambda d: cell(d)["budget"].update(min_cosine=None)) == (
        "devices[0].cells[0].budget.min_cosine: is null, expected a number")


def test_a_missing_file_says_to_certify(tmp_path):
    with pytest.raises(ReportError) as error:
        files.load(tmp_path / "report.json")
    assert str(error.value) == f"{tmp_path / 'report.json'}: no report there: run `sage-qual certify` first"


def test_a_cut_short_file_says_what_to_do(tmp_path):
    path = tmp_path / "report.json"
    path.write_text(json.dumps(valid())[:-20])
    with pytest.raises(ReportError) as error:
        files.load(path)
    assert str(error.value).startswith(f"{path}: not JSON, or cut short (")
    assert str(error.value).endswith("); " + report_model.FIX)


def test_an_unreadable_path_says_to_give_a_readable_report(tmp_path):
    with pytest.raises(ReportError) as error:
        files.load(tmp_path)  # a directory
    assert str(error.value).startswith(f"{tmp_path}: cannot be read (")
    assert str(error.value).endswith("); give a readable report.json")


def test_a_report_file_reads(tmp_path):
    path = tmp_path / "report.json"
    path.write_text(json.dumps(valid()))
    assert files.load(path).host == valid()["host"]


# The report as a whole ------------------------------------------------------------------------


def test_a_complete_report_has_a_finish_time():
    assert refused(lambda d: d.update(finished=None)) == "finished: null in a report marked complete"
    assert refused(lambda d: d.update(finished="")) == "finished: null in a report marked complete"
    assert reads(lambda d: d.update(complete=False, finished=None)).complete is False


def test_a_measured_cell_of_a_gpu_report_has_its_memory_figure():
    message = refused(lambda d: cell(d, 1, 2).update(extra_bytes_per_element=None))
    assert message == (
        "devices[1].cells[2].extra_bytes_per_element: missing for a measured cell whose outcome is 'pass'"
    )
    # A prediction measures no memory; an unmeasured cell has none either.
    assert reads(lambda d: (cell(d, 1, 2).update(extra_bytes_per_element=None), d.update(predicted=True)))
    crash = next(n for n, c in enumerate(valid()["devices"][0]["cells"]) if c["outcome"] == "crash")
    assert reads(lambda d: cell(d, 0, crash).update(extra_bytes_per_element=None))


def test_two_fixtures_with_one_name_are_refused():
    def twin(d):
        d["fixtures"].append({**d["fixtures"][0], "sha256": "b" * 64})

    assert refused(twin) == "fixtures: two fixtures share a name"


def test_two_entries_for_one_gpu_index_are_refused():
    assert refused(lambda d: d["devices"][1].update(index=0)) == "devices: two entries for one GPU index"


def test_a_cell_names_a_fixture_and_a_variant_of_the_run():
    assert refused(lambda d: cell(d, 1, 3).update(fixture="elsewhere")) == (
        "devices[1].cells[3].fixture: 'elsewhere' is not in `fixtures`"
    )
    assert refused(lambda d: d["options"]["variants"].remove("sm80-fp16-cuda")).startswith(
        "devices[0].cells[10].variant: 'sm80-fp16-cuda' is not in options.variants"
    )


def test_a_timing_names_a_shape_and_a_kernel_of_the_run():
    assert refused(lambda d: d["devices"][1]["speed"][4].update(shape="b1 h1 q1 k1 d1 bfloat16")) == (
        "devices[1].speed[4].shape: 'b1 h1 q1 k1 d1 bfloat16' is not in `shapes`"
    )
    assert refused(lambda d: d["devices"][0]["speed"][2].update(kernel="flash")) == (
        "devices[0].speed[2].kernel: 'flash' is neither 'sdpa' nor in options.variants"
    )


def test_a_target_report_may_time_its_integration_under_its_own_name():
    def target(d):
        d["target"] = "wrapper"
        d["options"]["variants"] = ["wrapper"]
        for device in d["devices"]:
            device["cells"] = []
            device["long"] = device["span"] = None
            for timing in device["speed"]:
                if timing["kernel"] != "sdpa":
                    timing["kernel"] = "wrapper"
            seen, kept = set(), []
            for timing in device["speed"]:
                if (timing["kernel"], timing["shape"]) not in seen:
                    seen.add((timing["kernel"], timing["shape"]))
                    kept.append(timing)
            device["speed"] = kept

    assert reads(target).target == "wrapper"


def test_span_probes_and_long_checks_name_a_variant_of_the_run():
    assert refused(lambda d: d["devices"][0]["span"][0].update(variant="sm89-fp8-cuda-fp32acc")) == (
        "devices[0].span[0].variant: 'sm89-fp8-cuda-fp32acc' is not in options.variants"
    )
    assert refused(lambda d: d["devices"][0]["long"][0].update(variant="sm89-fp8-cuda-fp32acc")) == (
        "devices[0].long[0].variant: 'sm89-fp8-cuda-fp32acc' is not in options.variants"
    )


def test_unknown_families_and_variants_are_refused_but_a_targets_variants_are_its_own():
    assert refused(lambda d: d["options"]["families"].append("SD3")).startswith(
        "options.families[8]: 'SD3' is not a family this sage-qual knows (FLUX.1, FLUX.2, Krea-2, LTX-2, "
    )
    assert refused(lambda d: d["options"]["variants"].insert(0, "sm75-int8")) == (
        "options.variants[0]: 'sm75-int8' is not a variant this sage-qual knows (a newer one may)"
    )


# One result per pair ---------------------------------------------------------------------------


def test_a_second_long_check_of_one_variant_and_shape_is_refused():
    message = refused(lambda d: d["devices"][0]["long"].append(copy.deepcopy(LONG)))
    assert message.startswith("devices[0].long[1]: a second result for sm90-fp8-cuda on ")
    assert message.endswith(" (the first is long[0]): one result per variant, shape")
    assert (
        " heads=24 kv_heads=24 kv_tokens=16896 q_tokens=16896 (the first" in message
    )  # the shape, key by key
    # Another shape is another check.
    other = {**copy.deepcopy(LONG), "shape": {**SHAPE, "q_tokens": 4608, "kv_tokens": 4608},
             "rows": [0, 1536, 2944, 4480]}
    assert len(reads(lambda d: d["devices"][0]["long"].append(other)).devices[0].long) == 2


def test_a_second_span_probe_of_one_case_is_refused():
    assert refused(lambda d: d["devices"][0]["span"].append(copy.deepcopy(SPAN))) == (
        "devices[0].span[1]: a second result for sm90-fp8-cuda on contiguous below 2078720000 (the first is "
        "span[0]): one result per variant, layout, side, span"
    )
    above = {
        **SPAN,
        "side": "above",
        "tokens": 299594,
        "span": 2147489792,
        "outcome": "crash",
        "detail": "illegal access",
        "rel_l2": None,
    }
    assert len(reads(lambda d: d["devices"][0]["span"].append(above)).devices[0].span) == 2


def test_the_same_pair_on_two_gpus_is_two_results():
    assert reads(lambda d: d["devices"][1].update(long=[copy.deepcopy(LONG)])).devices[1].long


# Records ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("missing", ["budget", "metrics"])
def test_a_measured_cell_has_its_budget_and_metrics(missing):
    assert refused(lambda d: cell(d, 1, 0).update({missing: None})) == (
        f"devices[1].cells[0].{missing}: missing for a cell whose outcome is 'pass'"
    )


def test_a_cell_that_did_not_run_says_why():
    crash = next(n for n, c in enumerate(valid()["devices"][0]["cells"]) if c["outcome"] == "crash")
    assert refused(lambda d: cell(d, 0, crash).update(detail="")) == (
        f"devices[0].cells[{crash}].detail: empty for a cell whose outcome is 'crash' (it says why)"
    )
    assert reads(lambda d: cell(d, 0, crash).update(budget=None, metrics=None))


def timing(data, n=1) -> dict:
    return (
        next(t for t in data["devices"][0]["speed"] if t["kernel"] != "sdpa")
        if n == 1
        else data["devices"][0]["speed"][n]
    )


def speed_index(data, kernel_is_sdpa):
    return next(
        n for n, t in enumerate(data["devices"][0]["speed"]) if (t["kernel"] == "sdpa") == kernel_is_sdpa
    )


@pytest.mark.parametrize("ms", [0.0, -1.0])
def test_a_timing_is_positive(ms):
    n = speed_index(valid(), False)
    assert refused(lambda d: d["devices"][0]["speed"][n].update(ms=ms)) == (
        f"devices[0].speed[{n}].ms: is {ms}, expected a positive time"
    )


def test_a_passed_timing_has_its_median():
    n = speed_index(valid(), False)
    assert refused(lambda d: d["devices"][0]["speed"][n].update(ms=None)) == (
        f"devices[0].speed[{n}].ms: null for a timing whose outcome is 'pass'"
    )
    assert reads(lambda d: d["devices"][0]["speed"][n].update(ms=None, outcome="oom", detail="out of memory"))


def test_the_median_is_the_median_of_the_samples():
    n = speed_index(valid(), False)
    assert refused(lambda d: d["devices"][0]["speed"][n].update(ms=2.0, samples_ms=[1.0, 2.5, 3.0])) == (
        f"devices[0].speed[{n}].ms: 2 is not the median of samples_ms (2.5)"
    )
    assert reads(lambda d: d["devices"][0]["speed"][n].update(ms=2.5, samples_ms=[1.0, 2.5, 3.0]))
    assert reads(lambda d: d["devices"][0]["speed"][n].update(ms=2.5, samples_ms=[3.0, 1.0, 2.0, 4.0]))


def test_the_best_backend_is_a_screened_one_and_the_fastest():
    n = speed_index(valid(), True)
    backends = {"cudnn": 0.2, "flash": 0.3}
    assert refused(lambda d: d["devices"][0]["speed"][n].update(best_backend="math", backends=backends)) == (
        f"devices[0].speed[{n}].best_backend: 'math' is not in backends"
    )
    assert refused(lambda d: d["devices"][0]["speed"][n].update(best_backend="flash", backends=backends)) == (
        f"devices[0].speed[{n}].best_backend: 'flash' is not the fastest of backends ('cudnn')"
    )
    assert reads(lambda d: d["devices"][0]["speed"][n].update(best_backend="cudnn", backends=backends))
    # A tie is not an edit.
    tie = {"cudnn": 0.2, "flash": 0.2}
    assert reads(lambda d: d["devices"][0]["speed"][n].update(best_backend="flash", backends=tie))


def test_a_timed_shape_stands_for_a_call():
    key = next(iter(valid()["shapes"]))
    assert refused(lambda d: d["shapes"][key].update(uses=[])) == (
        f"shapes.{key}.uses: empty: a timed shape stands for at least one call"
    )


@pytest.mark.parametrize(
    "name, value, low, high",
    [
        ("rel_l2", -0.01, 0, "inf"),
        ("worst_head_cosine", 1.002, -1.001, 1.001),
        ("worst_head_cosine", -1.002, -1.001, 1.001),
    ],
)
def test_a_long_checks_metric_stays_in_its_range(name, value, low, high):
    bound = f"at least {low}" if value < low else f"at most {high}"
    assert refused(lambda d: d["devices"][0]["long"][0]["metrics"].update({name: value})) == (
        f"devices[0].long[0].metrics.{name}: is {value}, expected {bound}"
    )


@pytest.mark.parametrize(
    "name, value",
    [
        ("rel_l2", 0.0),
        ("rel_l2", 1e9),
        ("worst_head_cosine", 1.001),
        ("worst_head_cosine", -1.001),
        ("max_abs_error", None),
    ],
)
def test_a_long_checks_metric_at_its_range_edge_reads(name, value):
    assert reads(lambda d: d["devices"][0]["long"][0]["metrics"].update({name: value}))


@pytest.mark.parametrize("missing", ["budget", "metrics"])
def test_a_measured_long_check_has_its_budget_and_metrics(missing):
    assert refused(lambda d: d["devices"][0]["long"][0].update({missing: None})) == (
        f"devices[0].long[0].{missing}: missing for a long check whose outcome is 'pass'"
    )


def test_a_long_check_that_did_not_run_says_why():
    assert refused(lambda d: d["devices"][0]["long"][0].update(outcome="timeout", budget=None)) == (
        "devices[0].long[0].detail: empty for a long check whose outcome is 'timeout' (it says why)"
    )
    assert reads(
        lambda d: d["devices"][0]["long"][0].update(
            outcome="timeout", budget=None, metrics=None, detail="ran past 90 s"
        )
    )
    failed = reads(lambda d: d["devices"][0]["long"][0].update(outcome="fail"))
    assert failed.devices[0].long[0].measured


@pytest.mark.parametrize("change, says", [
    ({"limit": 2**40}, "limit: 1099511627776 is past the 2147483647 elements a kernel indexes with 32-bit "
                       "offsets"),
    ({"span": 2**40, "side": "above"}, "span: 1099511627776 is not above its limit 2147483647 (a probe "
                                       "sits within 2x of it)"),
    ({"span": 2147483648}, "span: 2147483648 is not below its limit 2147483647 (a probe sits within 2x of "
                           "it)"),
    ({"layout": "nhd"}, "layout: is the string 'nhd', expected 'contiguous' or 'fused_qkv'"),
    ({"side": "middle"}, "side: is the string 'middle', expected 'below' or 'above'"),
])
def test_a_span_probe_sits_at_its_limit_in_a_known_layout(change, says):
    """Issue 28: probes claiming 2^40, or unknown layouts or sides, were read."""
    assert refused(lambda d: d["devices"][0]["span"][0].update(change)) == f"devices[0].span[0].{says}"


@pytest.mark.parametrize("change, planned", [
    ({"tokens": 5}, "35840 elements of a contiguous query of 5 tokens x 56 heads x 128"),
    ({"heads": 24}, "890880000 elements of a contiguous query of 290000 tokens x 24 heads x 128"),
    ({"span": 2078720001}, "2078720000 elements of a contiguous query of 290000 tokens x 56 heads x 128"),
    ({"layout": "fused_qkv"}, "6236145664 elements of a fused_qkv query of 290000 tokens x 56 heads x 128"),
])
def test_a_span_probe_spans_what_its_shape_does(change, planned):
    """A probe's shape edited apart from its span (tokens cut to 5 beside a span of 2.08e9 was read)."""
    span = change.get("span", SPAN["span"])
    assert refused(lambda d: d["devices"][0]["span"][0].update(change)) == (
        f"devices[0].span[0].span: {span} is not the {planned}")


def test_a_passed_span_probe_has_its_error_and_any_other_says_why():
    assert refused(lambda d: d["devices"][0]["span"][0].update(rel_l2=None)) == (
        "devices[0].span[0].rel_l2: missing for a span probe whose outcome is 'pass'"
    )
    assert refused(lambda d: d["devices"][0]["span"][0].update(outcome="crash")) == (
        "devices[0].span[0].detail: empty for a span probe whose outcome is 'crash' (it says why)"
    )
    assert refused(lambda d: d["devices"][0]["span"][0].update(outcome="fail")).startswith(
        "devices[0].span[0].detail: empty for a span probe whose outcome is 'fail'"
    )
    assert reads(lambda d: d["devices"][0]["span"][0].update(outcome="fail", detail="wrong rows"))


# Outcomes and the quick pre-flight ------------------------------------------------------------------


@pytest.mark.parametrize(
    "outcome, measured",
    [("pass", True), ("fail", True), ("skip", False), ("oom", False), ("crash", False), ("timeout", False)],
)
def test_only_a_cell_that_ran_to_the_end_is_measured(outcome, measured):
    assert report_model.Cell("v", "f", Outcome(outcome), detail="x").measured is measured


def test_a_quick_report_decides_nothing():
    assert checked.undecidable(reads(lambda d: None), "r.json") == ""
    problem = checked.undecidable(reads(lambda d: d["options"].update(quick=True)), "r.json")
    assert problem == (
        "r.json is a --quick report: it ran the smallest fixture of each family and those with a known "
        "failure, left the others out (report.md lists them) and timed no family's shapes, so it decides "
        "nothing; run `sage-qual certify` without --quick"
    )


def test_a_devices_model_is_its_name_and_capability():
    assert reads(lambda d: None).devices[0].model == ("NVIDIA H200", (9, 0))


def test_the_json_schema_names_this_version():
    schema = files.json_schema()
    assert schema["$id"] == "https://sage-qual.invalid/report/5"
    assert "schema version 5" in schema["title"]


@pytest.mark.parametrize("rows, said", [
    ([], "rows: empty for a measured long check"),
    ([5632, 0, 11136, 16768], "are not distinct 128-row block starts in order below the 16896 query tokens"),
    ([0, 0, 11136, 16768], "are not distinct 128-row block starts in order"),
    ([0, 5632, 11136, 16896], "in order below the 16896 query tokens"),
    ([0, 5633, 11136, 16768], "are not distinct 128-row block starts"),
])
def test_a_measured_long_check_judged_rows_inside_its_call(rows, said):
    """issue 28: a long check that sampled no rows was taken as checked."""
    data = valid()
    data["devices"][0]["long"][0].update(rows=rows)
    with pytest.raises(ReportError) as error:
        checked.parse(data, "r.json")
    message = str(error.value)
    assert message.startswith("r.json: devices[0].long[0] (sm90-fp8-cuda at 16896 tokens): rows: ")
    assert said in message and message.endswith("certify again"), message
    crashed = valid()
    crashed["devices"][0]["long"][0].update(outcome="crash", detail="killed", budget=None, metrics=None,
                                            rows=[])
    assert checked.parse(crashed, "r.json").devices[0].long[0].rows == []
    assert checked.parse(valid(), "r.json").devices[0].long[0].rows == [0, 5632, 11136, 16768]


@pytest.mark.parametrize("dropped", ["fp16", "fp8"])
def test_a_fixture_without_a_bound_for_a_class_is_refused_by_its_path(dropped):
    """Every cell's fitness bound is its fixture's bound for the cell's class (issue 52): a report
    missing one was an internal KeyError in gate."""
    message = refused(lambda d: d["fixtures"][0]["bounds"].pop(dropped))
    assert message == (f"fixtures[0].bounds: no bound for class {dropped} (every cell's fitness bound is its "
                       "fixture's bound for its class)")


def test_a_target_cell_without_its_class_is_refused_by_its_path():
    """A certify --target cell names an integration, not a variant: its stored class is the only way to
    its fitness bound (a null one was an internal KeyError in gate). Run 8's report of the wrapper."""
    import gzip
    from pathlib import Path

    from sage_qual.qualification.decide import checked

    path = (Path(__file__).resolve().parents[2] / "docs/results/run8-h200x2-final/targets/wrapper"
            / "report.json.gz")
    data = json.loads(gzip.decompress(path.read_bytes()))
    checked.parse(data, "r.json")  # as committed, it reads
    first = next(n for n, c in enumerate(data["devices"][0]["cells"]) if c["outcome"] in ("pass", "fail"))
    data["devices"][0]["cells"][first]["accuracy_class"] = None
    with pytest.raises(ReportError) as error:
        checked.parse(data, "r.json")
    assert f"devices[0].cells[{first}] (wrapper on " in str(error.value)
    assert "accuracy_class: null, and no variant of that name gives it" in str(error.value)
