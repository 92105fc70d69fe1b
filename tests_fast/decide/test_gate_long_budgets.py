"""gate re-derives a long check's budget as it does a cell's (issue 28): the numerics model on the
check's synthetic inputs drawn again (`long_check.model_budget`), so a long check whose numbers fail,
with its budget loosened and its outcome set to pass, is refused; and so is one that sampled other
rows than certify samples. Each rule here has a test that fails without it.

The checks are sweep calls at 1,024 tokens (24 heads x 128, the smallest generic point FLUX.1 counts),
re-derived on this CPU: about a second each."""

import dataclasses

import pytest
import torch

from sage_qual.kernels.variants import gpu_label
from sage_qual.qualification import families
from sage_qual.qualification.decide import budget_check, gate
from sage_qual.qualification.evidence.report_model import Budget, LongCheck, ShapeUse

from .. import builders

FLUX = families.find("FLUX.1")
HERE = {gpu_label(builders.H200_DEVICE[0], builders.H200_DEVICE[1])}
EXACT = {"min_cosine": 1.0, "min_norm_ratio": 1.0, "max_norm_ratio": 1.0}


@pytest.fixture(scope="module")
def derived():
    """sm90-fp8-cuda's sweep check at 1,024 tokens, with the budget and rows derived on this CPU."""
    check = builders.read(LongCheck, builders.long_check("sm90-fp8-cuda", 24, 1024, [], families.LAYOUTS))
    budget, rows = budget_check.derived_long_budget(check, "cpu")
    return dataclasses.replace(check, budget=budget, rows=rows)


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """gate.decide re-derives the cells' budgets too: their cache goes under tmp_path."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def report_of(*checks: LongCheck):
    return builders.report([builders.device(long=list(checks))], [], variants=["sm90-fp8-cuda"])


def problem(*checks: LongCheck) -> str:
    return budget_check.long_budget_problem("r.json", report_of(*checks), FLUX, HERE, "cpu")


def loosened(check: LongCheck, limit: str, factor: float) -> LongCheck:
    limits = dataclasses.asdict(check.budget)
    exact = EXACT.get(limit, 0.0)
    limits[limit] = exact + (limits[limit] - exact) * factor
    return dataclasses.replace(check, budget=Budget(**limits))


def test_a_check_as_certify_wrote_it_passes(derived):
    assert problem(derived) == ""


@pytest.mark.parametrize("limit", [f.name for f in dataclasses.fields(Budget)])
def test_every_limit_loosened_twice_over_is_refused_naming_it(derived, limit):
    if getattr(derived.budget, limit) is None:
        pytest.skip(f"{limit} is not derived for long checks")
    found = problem(loosened(derived, limit, 2.0))
    assert found.startswith("r.json: devices[0].long[0] (sm90-fp8-cuda at 1,024 tokens): "
                            f"budget.{limit}: "), found
    assert "derived here, its inputs drawn on cpu (long_check.model_budget)" in found
    assert found.endswith("certify again")


def test_a_tighter_budget_is_no_problem(derived):
    """Tighter can only keep a family off."""
    assert problem(loosened(derived, "max_rel_l2", 0.5)) == ""


def test_a_budget_within_the_allowance_passes(derived):
    """Off the GPU the inputs are other draws: half the distance from exact is allowed (module of
    budget_check, measured 0.85-1.18x on run 25)."""
    assert problem(loosened(derived, "max_rel_l2", 1.0 + budget_check.LONG_REL_OTHER_DEVICE * 0.9)) == ""


def test_rows_other_than_certify_samples_are_refused(derived):
    for rows in ([], [0], [0, 128, 256]):
        found = problem(dataclasses.replace(derived, rows=rows))
        assert f"rows: {rows} in the report, but certify samples the query rows {derived.rows}" in found


def test_only_checks_that_bound_the_family_on_the_gpus_here_are_re_derived(derived):
    wan_only = dataclasses.replace(loosened(derived, "max_rel_l2", 10.0), uses=[ShapeUse("Wan 2.2", "w")])
    assert problem(wan_only) == ""  # FLUX.1's range does not read it
    assert budget_check.long_budget_problem("r.json", report_of(loosened(derived, "max_rel_l2", 10.0)),
                                            FLUX, {"NVIDIA H100 (sm_90)"}, "cpu") == ""


def test_without_a_gpu_the_checks_are_re_derived_on_the_cpu(derived, monkeypatch):
    """Issue 54: without a GPU torch can see, a loosened long check was taken as stored."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    problem = budget_check.long_budget_problem("r.json", report_of(loosened(derived, "max_rel_l2", 10.0)),
                                               FLUX, HERE)
    assert "budget.max_rel_l2" in problem and "drawn on cpu" in problem, problem


def test_gate_refuses_a_loosened_long_check(derived, monkeypatch):
    """gate.decide runs the re-derivation after the cells'; refused with exit 2 and the line."""
    monkeypatch.setattr(budget_check, "long_device", lambda: "cpu")
    data = report_of(loosened(derived, "max_rel_l2", 10.0))
    decision = gate.decide(data, FLUX, data.environment, {}, require_speedup=False, source="r.json")
    assert decision.code == 2 and "budget.max_rel_l2" in decision.problem, decision.problem
    clean = report_of(derived)
    assert gate.decide(clean, FLUX, clean.environment, {}, require_speedup=False).code != 2


def test_every_counting_check_on_every_gpu_here_is_read(derived):
    """A check that does not count, or a GPU model not here, is passed over, not the end of the scan."""
    bad = loosened(derived, "max_rel_l2", 10.0)
    wan_only = dataclasses.replace(derived, uses=[ShapeUse("Wan 2.2", "w")])
    assert problem(wan_only, bad).startswith("r.json: devices[0].long[1] ")
    h100 = builders.device(long=[bad], index=0, gpu=("NVIDIA H100", [9, 0], 79.6))
    data = builders.report([h100, builders.device(long=[bad], index=1)], [], variants=["sm90-fp8-cuda"])
    found = budget_check.long_budget_problem("r.json", data, FLUX, HERE, "cpu")
    assert found.startswith("r.json: devices[1].long[0] "), found


@pytest.mark.parametrize("ran", [dict(ran_tokens=1024, ran_heads=24), dict(ran_heads=1),
                                 dict(ran_tokens=512, ran_kv_tokens=512)],
                         ids=["planned-call", "fewer-heads", "fewer-tokens"])
def test_no_field_exempts_a_check_from_re_derivation(derived, ran):
    """Issue 43: "the planned call ran" (ran_tokens, ran_heads) once exempted a loosened check. Now a
    check is derived at the call it ran, cut down or not: refused for its budget, or for rows that are
    not that call's."""
    found = problem(dataclasses.replace(loosened(derived, "max_rel_l2", 10.0), **ran))
    assert found.startswith("r.json: devices[0].long[0] ") and found.endswith("certify again"), found


def test_a_cut_down_check_is_derived_at_the_call_it_ran(derived):
    """The test hook's fake GPUs run fewer heads and tokens: derived there, such a check as certify
    wrote it passes, and its rows are that call's."""
    cut = dataclasses.replace(derived, ran_heads=1, ran_tokens=512, ran_kv_tokens=512)
    budget, rows = budget_check.derived_long_budget(cut, "cpu")
    assert rows != derived.rows
    assert problem(dataclasses.replace(cut, budget=budget, rows=rows)) == ""
    assert "rows:" in problem(dataclasses.replace(cut, budget=budget))


def test_a_cut_down_check_whose_key_tokens_are_unknown_is_refused(derived):
    cross = dataclasses.replace(derived, shape=dataclasses.replace(derived.shape, kv_tokens=512),
                                ran_tokens=256)
    assert problem(cross).endswith("budget: cannot be re-derived (the key tokens it ran are not recorded); "
                                   "certify again on this machine")


def test_on_the_gpu_the_allowance_is_a_cells(derived, monkeypatch):
    """The inputs drawn on the GPU are certify's own: a stored limit may then be only as loose as a
    cell's (BUDGET_REL); the device asked is the one the inputs are drawn on."""
    asked = []

    def on(check, device, variant=None):
        asked.append(device)
        return derived.budget, derived.rows

    monkeypatch.setattr(budget_check, "derived_long_budget", on)
    somewhat = loosened(derived, "max_rel_l2", 1.3)
    assert "budget.max_rel_l2" in budget_check.long_budget_problem("r.json", report_of(somewhat), FLUX, HERE,
                                                                   "cuda")
    assert budget_check.long_budget_problem("r.json", report_of(somewhat), FLUX, HERE, "cpu") == ""
    assert asked == ["cuda", "cpu"]


@pytest.mark.parametrize("available, device", [(True, "cuda"), (False, "cpu")])
def test_the_inputs_are_drawn_on_the_gpu_when_there_is_one(monkeypatch, available, device):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    assert budget_check.long_device() == device
