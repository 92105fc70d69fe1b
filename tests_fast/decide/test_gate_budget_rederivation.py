"""`budget_check.budget_problem` at its edges: which cells it re-derives (the GPU models here; a certify
--target report with the target's variant on each GPU), what it says when a budget cannot be
re-derived, where derived budgets are cached and when that file is written, and a stored limit
exactly at its allowance.

The report is the fleet report of tests_fast/decide/test_gate_fleet.py (cuda:0 an H200, cuda:1 an H100,
cuda:2 an RTX 4090) with its fixtures written as real files; every measured cell on FLUX.1's one
fixture holds the budget `budgets.budget` derives from that file, with numbers inside it.
"""

import dataclasses
import json
import math
import os
import re

import pytest

from sage_qual.kernels.variants import VARIANTS, gpu_label
from sage_qual.qualification import families, selection
from sage_qual.qualification.decide import budget_check, checked
from sage_qual.qualification.integrations import targets
from sage_qual.qualification.measure import budgets

from ..builders import budget_of as only
from ..fakes import CAPABILITY, H100, H200, L40S, RTX4090, fleet_report, write_fleet
from ..fakes import within_budget as _within

FLUX = families.find("FLUX.1")
FIXTURE = "flux1-block5"  # FLUX.1's only fixture in the fleet report
APP = "my_app_not_installed.attention:sage_sdpa"  # a certify --target function not importable here


def derive(cell: dict, variant, fixtures: dict) -> None:
    budget = dataclasses.asdict(budgets.budget(variant, fixtures[cell["fixture"]]))
    cell.update(budget=budget, metrics=_within(budget))


@pytest.fixture
def fleet(tmp_path, monkeypatch):
    """(report dict, FLUX.1's fixture files here, loaded), the cache under tmp_path/cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    _, directory, data = write_fleet(tmp_path, fleet_report())
    fixtures = selection.family_fixtures([str(directory)], FLUX)
    assert list(fixtures) == [FIXTURE]
    for device in data["devices"]:
        for cell in device["cells"]:
            if cell["fixture"] == FIXTURE and cell["outcome"] == "pass":
                derive(cell, VARIANTS[cell["variant"]], fixtures)
    return data, fixtures


def as_target(data: dict, target: str, fixtures: dict) -> dict:
    """The report as certify --target would write it: one cell per GPU on FLUX.1's fixture, the
    target standing where a variant stands, its budget derived from the target's variant there."""
    data.update(target=target)
    data["options"]["variants"] = [target]
    for device in data["devices"]:
        cell = next(c for c in device["cells"] if c["fixture"] == FIXTURE and c["outcome"] == "pass")
        device["cells"] = [{**cell, "variant": target}]
        if target == "wrapper":
            derive(device["cells"][0], targets.resolve(target).variant(device["capability"]), fixtures)
    return data


def problem(data: dict, fixtures: dict, *models: str, family=FLUX) -> str:
    here = {gpu_label(name, CAPABILITY[name]) for name in models}
    return budget_check.budget_problem("report.json", checked.parse(data, "report.json"), family, here,
                                      fixtures)


def first_flux_cell(device: dict) -> tuple[int, dict]:
    return next((m, c) for m, c in enumerate(device["cells"])
                if c["fixture"] == FIXTURE and c["outcome"] == "pass")


def cache_files(tmp_path) -> list:
    return sorted((tmp_path / "cache" / "sage-qual").glob("budgets-*.json"))


# Which cells are re-derived -----------------------------------------------------------------------------
def test_an_untouched_report_has_no_budget_problem(fleet):
    assert problem(*fleet, H200, H100, RTX4090) == ""


def test_a_loosened_budget_on_a_later_gpu_model_here_is_refused(fleet):
    """The H200 comes first in the report: with only the H100 here, the H200's cells are passed
    over and the H100's still checked."""
    data, fixtures = fleet
    index, cell = first_flux_cell(data["devices"][1])
    cell["budget"]["max_rel_l2"] *= 4
    assert problem(data, fixtures, H200) == ""
    assert problem(data, fixtures, H100).startswith(
        f"report.json: devices[1].cells[{index}] ({cell['variant']} on {FIXTURE}): budget.max_rel_l2: ")


@pytest.mark.parametrize("family, here", [
    pytest.param(FLUX, L40S, id="no-gpu-model-of-the-report-here"),
    pytest.param(families.find("Z-Image"), H200, id="no-fixture-of-the-family-in-the-report"),
])
def test_nothing_to_rederive_is_no_problem(fleet, family, here):
    """Loosened budgets that gate does not decide on leave nothing to refuse: the answer is empty."""
    data, fixtures = fleet
    for device in data["devices"]:
        for cell in device["cells"]:
            if cell.get("budget"):
                cell["budget"]["max_rel_l2"] *= 4
    assert problem(data, fixtures, here, family=family) == ""


def test_a_target_report_is_rederived_with_the_targets_variant_on_each_gpu(fleet):
    """certify --target wrapper ran sm90 on the H200 and sm89 on the RTX 4090: each cell's budget
    is re-derived from its own GPU's variant."""
    data, fixtures = fleet
    wrapper = targets.resolve("wrapper")
    assert wrapper.variant(CAPABILITY[H200]) != wrapper.variant(CAPABILITY[RTX4090])
    data = as_target(data, "wrapper", fixtures)
    assert problem(data, fixtures, H200, RTX4090) == ""
    bounds = data["devices"][2]["cells"][0]["budget"]
    derived = bounds["max_rel_l2"]
    bounds["max_rel_l2"] = derived * 4
    assert problem(data, fixtures, H200, RTX4090) == (
        f"report.json: devices[2].cells[0] (wrapper on {FIXTURE}): budget.max_rel_l2: {derived * 4} in the "
        f"report is looser than {derived} derived from the fixture here (budgets.budget); the budget was "
        "edited or comes from another sage-qual: certify again")


@pytest.mark.parametrize("case, why", [
    pytest.param("fixture-file-missing", "no fixture file here", id="fixture-file-missing"),
    pytest.param("target-not-importable", "no known variant", id="target-not-importable"),
])
def test_a_budget_that_cannot_be_rederived_is_refused_saying_why(fleet, case, why):
    data, fixtures = fleet
    if case == "fixture-file-missing":
        fixtures = {}
    else:
        data = as_target(data, APP, fixtures)
    index, cell = first_flux_cell(data["devices"][0])
    assert problem(data, fixtures, H200) == (
        f"report.json: devices[0].cells[{index}] ({cell['variant']} on {FIXTURE}): budget: cannot be "
        f"re-derived ({why}); certify again on this machine")


# The cache of derived budgets ---------------------------------------------------------------------------
@pytest.mark.parametrize("xdg, root", [
    pytest.param(None, "home/.cache", id="XDG_CACHE_HOME-unset"),
    pytest.param("", "home/.cache", id="XDG_CACHE_HOME-empty"),
    pytest.param("xdg", "xdg", id="XDG_CACHE_HOME-set"),
])
def test_derived_budgets_are_cached_under_the_users_cache_directory(fleet, tmp_path, monkeypatch, xdg, root):
    """$XDG_CACHE_HOME/sage-qual, else ~/.cache/sage-qual; one file per model code, named by a
    16-digit digest of it."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    if xdg is None:
        monkeypatch.delenv("XDG_CACHE_HOME")
    else:
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / xdg) if xdg else "")
    assert problem(*fleet, H200) == ""
    cached, = (tmp_path / root / "sage-qual").iterdir()
    assert re.fullmatch(r"budgets-[0-9a-f]{16}\.json", cached.name)
    assert len(json.loads(cached.read_text())["entries"]) == 3  # H200: three variants on FLUX.1's fixture


@pytest.mark.parametrize("content", [
    pytest.param("[]", id="list"), pytest.param("null", id="null"), pytest.param('"budgets"', id="string"),
    pytest.param("{not json", id="not-json"),
])
def test_a_cache_file_that_is_not_a_json_object_is_replaced(fleet, tmp_path, content):
    """A damaged cache costs time only: the budgets are derived again and the file rewritten."""
    assert problem(*fleet, H200) == ""
    cached, = cache_files(tmp_path)
    cached.write_text(content)
    assert problem(*fleet, H200) == ""
    assert len(json.loads(cached.read_text())["entries"]) == 3


def test_a_gate_that_derives_nothing_new_leaves_the_cache_file_alone(fleet, tmp_path):
    assert problem(*fleet, H200) == ""
    cached, = cache_files(tmp_path)
    os.utime(cached, (0, 0))
    assert problem(*fleet, H200) == ""
    assert cached.stat().st_mtime == 0


def test_new_budgets_are_cached_beside_an_older_sage_quals_cache(fleet, tmp_path):
    """The cache directory exists already (a cache of other model code): the new file is written."""
    older = tmp_path / "cache" / "sage-qual" / "budgets-0123456789abcdef.json"
    older.parent.mkdir(parents=True)
    older.write_text("{}")
    assert problem(*fleet, H200) == ""
    assert len(cache_files(tmp_path)) == 2
    assert older.read_text() == "{}"


# A stored limit at its allowance ------------------------------------------------------------------------
def test_a_limit_exactly_at_its_allowance_is_accepted_and_one_step_past_it_refused():
    derived = 0.104  # one whose derived + allowance is exact in floats
    allowed = budget_check.BUDGET_ABS + budget_check.BUDGET_REL * derived
    stored = derived + allowed
    assert stored - derived == allowed
    assert budget_check._looser("w", only(max_rel_l2=stored), only(max_rel_l2=derived)) == ""
    past = math.nextafter(stored, 1.0)
    assert budget_check._looser("w", only(max_rel_l2=past), only(max_rel_l2=derived)).startswith(
        f"w: budget.max_rel_l2: {past} in the report is looser than {derived}")


@pytest.mark.parametrize("entry, budget", [
    ({"max_rel_l2": 0.1, "min_cosine": 0.99}, only(max_rel_l2=0.1, min_cosine=0.99)),
    ({"max_rel_l2": 0.1, "tolerance": 0.5}, None),  # a limit no budget has: another sage-qual's entry
    ({"max_rel_l2": float("nan")}, None), ({"max_rel_l2": 1}, None), ({}, None), ([0.1], None)])
def test_a_cache_entry_is_read_as_a_budget_only_when_it_is_one(entry, budget):
    assert budget_check._cached(entry) == budget
