"""Every reader takes a shipped fixture's fitness bound from the fitness table, never from a report's
copy (issue 63): device run 43's committed report with krea2_b0_outlier_gqa's bounds raised to 0.6 /
0.85 and comfy-kitchen's cell on it set to pass certified ck-int8-cuda for Krea-2 before. Gate, merge,
compare, the profile and the defaults' builder now refuse it, naming the fixture and the bound's
source. And where a fixture file is at hand, gate compares everything a report copies from it."""

import copy
import dataclasses
import gzip
import json
import types

import pytest
import torch

from sage_qual import cli
from sage_qual.errors import ExitCode
from sage_qual.fixtures import fileformat
from sage_qual.fixtures.recorder import AuditFolder
from sage_qual.qualification import selection
from sage_qual.qualification.decide import checked, defaults, gate
from sage_qual.qualification.evidence.report_model import ReportError
from sage_qual.serving.audit_tally import MISS, Finding
from sage_qual.verdicts import fitness, profile

from ..helpers import RESULTS

RUN43 = RESULTS / "run43-h100" / "certify" / "report.json.gz"
EDITED_FIXTURE = "krea2_b0_outlier_gqa"
SAID = (f"fixtures[{{n}}].bounds: class fp16 states {{{{'max_rel_l2': 0.6, 'min_cosine': 0.85}}}}, "
        f"the fitness table {{{{'max_rel_l2': 0.3, 'min_cosine': 0.955}}}} for fixture {EDITED_FIXTURE} "
        "(sage_qual/verdicts/fitness.py, source: rule: about twice the error of the field's good image")


@pytest.fixture(scope="module")
def edited(tmp_path_factory):
    """Run 43's report with the issue's edit: the fixture's bounds raised, ck-int8-cuda's cell passed."""
    data = json.loads(gzip.decompress(RUN43.read_bytes()))
    index = next(n for n, f in enumerate(data["fixtures"]) if f["name"] == EDITED_FIXTURE)
    for bound in data["fixtures"][index]["bounds"].values():
        bound.update(max_rel_l2=0.6, min_cosine=0.85)
    cells = [c for d in data["devices"] for c in d["cells"]
             if c["variant"] == "ck-int8-cuda" and c["fixture"] == EDITED_FIXTURE]
    assert cells and any(c["outcome"] == "fail" for c in cells)  # the committed report fails it
    for cell in cells:
        cell.update(outcome="pass", reasons=[])
    path = tmp_path_factory.mktemp("edited") / "report.json"
    path.write_text(json.dumps(data))
    return path, SAID.format(n=index)


def test_the_report_reader_refuses_the_raised_bound_naming_the_fixture_and_the_source(edited):
    path, said = edited
    with pytest.raises(ReportError) as caught:
        checked.load(path)
    assert said in str(caught.value) and "certify again" in str(caught.value)


def test_the_raised_bound_alone_is_refused_too(edited, tmp_path):
    """Without the cell's edit the stored outcome agrees with the table's bound, not with the copy's."""
    data = json.loads(gzip.decompress(RUN43.read_bytes()))
    for fixture in data["fixtures"]:
        if fixture["name"] == EDITED_FIXTURE:
            fixture["bounds"]["fp8"].update(max_rel_l2=0.31)
    path = tmp_path / "report.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ReportError, match="bounds: class fp8 states"):
        checked.load(path)


@pytest.mark.parametrize("command", [
    ["gate", "--family", "Krea-2", "--report"], ["merge"], ["merge", "--json"], ["compare", str(RUN43)]])
def test_gate_merge_and_compare_refuse_it_with_exit_2(edited, capsys, command):
    path, said = edited
    code = cli.main([*command, str(path)])
    out, err = capsys.readouterr()
    assert code == ExitCode.USAGE
    assert said in out + err


def test_the_profile_and_the_defaults_builder_refuse_it(edited, tmp_path, capsys):
    path, said = edited
    with pytest.raises(profile.ProfileError) as caught:
        defaults.load_run(path)  # the profile a run gives, decided with this code's rules
    assert said in str(caught.value)
    assert defaults.main([str(path), "--out", str(tmp_path / "defaults.json")]) == 2
    assert said in capsys.readouterr().err
    assert not (tmp_path / "defaults.json").exists()


def test_the_committed_report_still_reads_and_certifies_the_same():
    report = checked.load(RUN43)
    stored = {f.name: f.bounds for f in report.fixtures}
    assert all(fitness.table_mismatch(name, bounds) == "" for name, bounds in stored.items())


# A fixture file at hand: the report's copy is compared with it -------------------------------------

@pytest.fixture
def own_fixture(tmp_path):
    """A fixture of the user's (a name the table does not hold), with its own bounds."""
    q = torch.randn(1, 2, 64, 64).half()
    k, v = torch.randn(1, 2, 32, 64).half(), torch.randn(1, 2, 32, 64).half()
    bound = {"max_rel_l2": 0.2, "min_cosine": 0.98}
    path = fileformat.save_fixture(tmp_path / "my_call.safetensors", q, k, v, family="krea-2",
                                   kind="recorded", source={"model": "mine"},
                                   provenance="recorded from my model", bounds={"fp16": bound, "fp8": bound})
    return fileformat.load_fixture(path)


def stored_as(fixture, **changes):
    return types.SimpleNamespace(fixtures=[dataclasses.replace(selection.fixture_record(fixture), **changes)])


def test_a_report_copy_equal_to_the_file_at_hand_passes(own_fixture):
    assert gate.copies_problem("r.json", stored_as(own_fixture), {own_fixture.name: own_fixture}) == ""


@pytest.mark.parametrize("field, value", [("bounds", "raised"), ("family", "flux.1"), ("kind", "replica"),
                                          ("provenance", "edited"), ("masked", True)])
def test_a_report_copy_that_differs_from_the_file_at_hand_is_refused_with_both_values(own_fixture, field,
                                                                                      value):
    record = selection.fixture_record(own_fixture)
    if value == "raised":
        raised = copy.deepcopy(record.bounds)
        value = {cls: dataclasses.replace(bound, max_rel_l2=0.9) for cls, bound in raised.items()}
    if field == "kind":
        value = type(record.kind)(value)
    at_hand = {own_fixture.name: own_fixture}
    said = gate.copies_problem("r.json", stored_as(own_fixture, **{field: value}), at_hand)
    assert said.startswith(f"r.json: fixtures: 'my_call'.{field}")
    assert f"in {own_fixture.path} (the same file, sha256 {own_fixture.sha256[:12]})" in said
    assert said.endswith("the report's copy was edited; certify again")


def test_a_changed_file_is_left_to_the_staleness_check(own_fixture):
    other = dataclasses.replace(own_fixture, sha256="0" * 64)
    raised = stored_as(own_fixture, provenance="edited")
    assert gate.copies_problem("r.json", raised, {own_fixture.name: other}) == ""


def test_a_recorded_miss_removed_or_moved_in_the_report_is_refused_where_its_file_is_at_hand(tmp_path):
    """Gate read the miss from the report's copy, so a copy with the miss removed (or moved to another
    variant) enabled the variant while the unchanged file sat in --fixtures (issue 64)."""
    finding = Finding(MISS, "Krea-2", "cuda:0 (NVIDIA H100, sm_90)", "NVIDIA H100", (9, 0), "sm90-fp8-cuda",
                      "thu-ml 2.2.0", 0.5, 0.3, 0.03, "q/k/v [1, 1, 64, 64] float16", "sample 0, rows 0-63")
    kept = {"q": torch.randn(1, 1, 64, 64).half(), "k": torch.randn(1, 1, 32, 64).half(),
            "v": torch.randn(1, 1, 32, 64).half(), "mask": None, "channels": torch.ones(3, 64),
            "shapes": {"q": [1, 1, 64, 64], "k": [1, 1, 32, 64], "v": [1, 1, 32, 64]}}
    recorded = fileformat.load_fixture(AuditFolder(str(tmp_path))(kept, finding))
    record = selection.fixture_record(recorded)
    assert record.audit is not None and record.audit.variant == "sm90-fp8-cuda"
    at_hand = {recorded.name: recorded}
    assert gate.copies_problem("r.json", stored_as(recorded), at_hand) == ""
    removed = gate.copies_problem("r.json", stored_as(recorded, audit=None), at_hand)
    assert f"'{recorded.name}'.audit is null in the report but {{" in removed
    moved = stored_as(recorded, audit=dataclasses.replace(record.audit, variant="ck-int8-cuda"))
    assert (f"'{recorded.name}'.audit.variant is \"ck-int8-cuda\" in the report but \"sm90-fp8-cuda\""
            in gate.copies_problem("r.json", moved, at_hand))
