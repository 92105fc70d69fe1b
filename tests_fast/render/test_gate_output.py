"""The exact text gate and merge print, from hand-made decisions and rows: a CI log or a fleet
table read by people and scripts must say what the verdicts say, in every branch."""

import json
from pathlib import Path

from sage_qual import records
from sage_qual.qualification.decide import budget_check, checked, fleet, gate, verdict
from sage_qual.qualification.decide.verdict import FamilyDecision, VariantResults, Verdict
from sage_qual.qualification.evidence.report_model import Reason, ReasonKind
from sage_qual.qualification.render import fleet as fleet_render
from sage_qual.qualification.render.gate import lines as gate_lines
from sage_qual.verdicts.served import Bound, Served

from ..builders import budget_of as only

SAMPLE = Path(__file__).parent.parent / "data" / "sample_h200_2gpu.json"


def enabled(variant="sm90-fp8-cuda", head_dims=(64, 128), verified=True, **served):
    """An enabled decision; verified: with the range its long checks verified (a capped one)."""
    upper = dict(max_query_tokens=16384, max_key_tokens=16384, layouts=["contiguous", "transposed"]) \
        if verified else {}
    reasons = [Reason(ReasonKind.LONG, "verified only below 32,768 query tokens")] if verified else []
    return FamilyDecision(
        "FLUX.1",
        Verdict.ENABLE,
        Served(variant, 4608, 512, list(head_dims), **upper, **served),
        range_reasons=reasons,
        results=VariantResults(certified=[variant, "sm80-fp16-cuda"]),
    )


def no_speedup():
    return FamilyDecision("FLUX.1", Verdict.NO_SPEEDUP, None,
                          results=VariantResults(certified=["sm90-fp8-cuda", "sm89-fp8-cuda"]),
                          reasons=[Reason(ReasonKind.SPEED, "sm90-fp8-cuda never measured faster")])


def kept_off():
    return FamilyDecision("FLUX.1", Verdict.KEEP_OFF, reasons=[
        Reason(ReasonKind.CRASH, "sm90-fp8-cuda on flux (cuda:0): killed by SIGSEGV"),
        Reason(ReasonKind.ACCURACY, "sm89-fp8-cuda on flux (cuda:1): relative L2 0.2 > 0.08")])


def test_gate_lines_for_each_verdict():
    decision = gate.GateDecision("FLUX.1", 1, gpus=[("H200 (sm_90)", enabled()),
                                                    ("H100 (sm_90)", no_speedup()),
                                                    ("RTX 4090 (sm_89)", kept_off())])
    assert gate_lines(decision, False) == [
        "FLUX.1 on H200 (sm_90): enable sm90-fp8-cuda from 4,608 to 16,384 query / 512 to 16,384 key tokens, "
        "head_dim 64/128 (layouts: contiguous, transposed)",
        "  - range: verified only below 32,768 query tokens",
        "FLUX.1 on H100 (sm_90): safe, no speedup (passes with sm90-fp8-cuda, sm89-fp8-cuda; a profile "
        "serves no call; --require-speedup would keep it off)",
        "  - speed: sm90-fp8-cuda never measured faster",
        "FLUX.1 on RTX 4090 (sm_89): keep off",
        "  - crash: sm90-fp8-cuda on flux (cuda:0): killed by SIGSEGV",
        "  - accuracy (off its model): sm89-fp8-cuda on flux (cuda:1): relative L2 0.2 > 0.08",
    ]
    assert gate_lines(decision, True)[2] == (
        "FLUX.1 on H100 (sm_90): safe, no speedup (passes with sm90-fp8-cuda, sm89-fp8-cuda; a profile "
        "serves no call)")


def test_gate_line_for_one_head_size_and_a_problem():
    legacy = enabled(head_dims=(128,), verified=False)
    one_size = gate.GateDecision("FLUX.1", 0, gpus=[("H200 (sm_90)", legacy)])
    assert gate_lines(one_size, False) == [  # a report from before long checks: no upper bound, said so
        "FLUX.1 on H200 (sm_90): enable sm90-fp8-cuda from 4,608 query / 512 key tokens, head_dim 128 "
        "(no upper bound verified: a report without long checks)"]
    assert gate_lines(gate.GateDecision("FLUX.1", 2, problem="stale report: torch differs"), True) == [
        "stale report: torch differs"]


def fleet_verdict(verdict_, variant=None, low=(None, None), reasons=(), upper=None, layouts=None, **more):
    kinds = [ReasonKind(kind) for kind in reasons]
    served = (
        Served(
            variant,
            *low,
            more.pop("head_dims", []),
            upper,
            more.pop("max_key_tokens", upper),
            layouts,
            **more,
        )
        if variant
        else None
    )
    return fleet.FleetVerdict(Verdict(verdict_), served, kinds)


FLUX = fleet_verdict("enable", "sm90-fp8-cuda", (4608, 512), head_dims=[128])


def row(**changes):
    base = dict(host="box-a", report="box-a/report.json", complete=True, predicted=False, target="",
                driver="580.1", torch="2.11.0", sageattention="2.2.0", sageattention_source="",
                gpu="NVIDIA H200", capability=[9, 0],
                devices=[0, 1], families={"FLUX.1": FLUX,
                                          "SDXL": fleet_verdict("safe, no speedup", reasons=["speed"]),
                                          "Wan 2.2": fleet_verdict("keep off", reasons=["crash", "oom"])})
    return fleet.FleetRow(**{**base, **changes})


def test_merge_table_for_every_kind_of_row():
    rows = [row(),
            row(host="box-b", gpu="NVIDIA GeForce RTX 4090", capability=[8, 9], devices=[0], driver="",
                sageattention="", families={"FLUX.1": FLUX}),
            row(host="box-c", complete=False, families={}, undecidable="c.json is a partial report (...)"),
            row(host="box-d", predicted=True, families={}, undecidable="d.json is a predicted report (...)")]
    assert fleet_render.merge_markdown(rows).splitlines() == [
        "| host | GPU | sm | GPUs | driver | torch | sageattention | FLUX.1 | SDXL | Wan 2.2 |",
        "|---|---|---|---|---|---|---|---|---|---|",
        "| box-a | NVIDIA H200 | 90 | 2 | 580.1 | 2.11.0 | 2.2.0 | enable: sm90-fp8-cuda >= 4608/512, "
        "head_dim 128 | "
        "safe, no speedup: speed | keep off: crash, oom |",
        "| box-b | NVIDIA GeForce RTX 4090 | 89 | 1 | - | 2.11.0 | - | enable: sm90-fp8-cuda >= 4608/512, "
        "head_dim 128 | "
        "not run | not run |",
        "| box-c | NVIDIA H200 | 90 | 2 | 580.1 | 2.11.0 | 2.2.0 | decides nothing (below) | "
        "decides nothing (below) | decides nothing (below) |",
        "| box-d | NVIDIA H200 | 90 | 2 | 580.1 | 2.11.0 | 2.2.0 | decides nothing (below) | "
        "decides nothing (below) | decides nothing (below) |",
        "",
        "- c.json is a partial report (...)",
        "- d.json is a predicted report (...)",
    ]


def test_merge_table_tells_two_builds_of_one_version_apart():
    rows = [row(families={}, sageattention_source="sha256:9b1e6a18984cab51"),
            row(host="box-b", families={}, sageattention_source="sha256:6bccd0c119a473ff")]
    table = fleet_render.merge_markdown(rows).splitlines()[2:]
    assert [line.split(" | ")[6].rstrip(" |") for line in table] == [
        "2.2.0 (sha256:9b1e6a18984cab51)", "2.2.0 (sha256:6bccd0c119a473ff)"]


def test_merge_rows_of_a_report_as_it_is_decided():
    """A complete report gives a row per GPU model with each family's verdict, its build and the kinds of
    reason once each, sorted; one that decides nothing (partial, predicted, --quick) a row per GPU
    model, no verdict, and gate's refusal (`checked.undecidable`) in its words."""
    data = json.loads(SAMPLE.read_text())
    data["environment"]["sageattention_source"] = "sha256:feedface"
    data["environment"]["other_providers"] = [
        {"provider": "comfy-kitchen", "version": "0.2.40", "source": "sha256:65f98cf1050cc674"},
        {"provider": "fourth", "version": "1.0"}, {"provider": "broken", "version": "", "problem": "no GPU"}]
    typed = checked.parse(data, "r.json")
    (model,) = fleet.merge_rows([(Path("r.json"), typed)])
    assert model.devices == tuple(d.index for d in typed.devices)
    assert model.sageattention_source == "sha256:feedface"
    # the providers that could serve, each with its build where the report has one
    assert model.other_providers == ("comfy-kitchen 0.2.40 (sha256:65f98cf1050cc674)", "fourth 1.0")
    (decided,) = verdict.decide(typed)
    for decision in decided.families:
        kinds = model.families[decision.family].reasons
        assert list(kinds) == sorted({r.kind for r in decision.reasons}, key=lambda kind: kind.value)
        assert model.families[decision.family].served == decision.served
    assert model.undecidable == ""
    for edit in ({"complete": False, "finished": None}, {"predicted": True},
                 {"options": {**data["options"], "quick": True}}):
        refused = checked.parse({**data, **edit}, "r.json")
        rows = fleet.merge_rows([(Path("r.json"), refused)])
        assert [(r.gpu, r.devices, r.families) for r in rows] == [(model.gpu, model.devices, {})]
        assert rows[0].undecidable == checked.undecidable(refused, "r.json") != ""


def test_merge_table_gives_the_verified_range_and_layouts():
    wan = fleet_verdict("enable", "sm90-fp8-cuda", (9728, 9728), upper=75600,
                        layouts=["contiguous", "transposed", "fused_qkv"], head_dims=[128])
    table = fleet_render.merge_markdown([row(families={"Wan 2.2": wan})]).splitlines()
    assert table[2] == ("| box-a | NVIDIA H200 | 90 | 2 | 580.1 | 2.11.0 | 2.2.0 | enable: sm90-fp8-cuda "
                        "9,728 to 75,600 tokens, head_dim 128 (contiguous, transposed, fused_qkv) |")


def test_merge_table_names_the_target_only_when_a_report_has_one():
    rows = [row(families={}), row(host="box-t", target="diffusers:sage_hub", families={})]
    assert fleet_render.merge_markdown(rows).splitlines() == [
        "| host | GPU | sm | GPUs | driver | torch | sageattention | target |",
        "|---|---|---|---|---|---|---|---|",
        "| box-a | NVIDIA H200 | 90 | 2 | 580.1 | 2.11.0 | 2.2.0 | (variants) |",
        "| box-t | NVIDIA H200 | 90 | 2 | 580.1 | 2.11.0 | 2.2.0 | diffusers:sage_hub |",
    ]
    assert "target" not in fleet_render.merge_markdown([row(families={})]).splitlines()[0]


# A stored budget against the one derived here ------------------------------------------------------------
AGAIN = "the budget was edited or comes from another sage-qual: certify again"


def test_a_limit_on_one_side_only_is_named():
    assert budget_check._looser("w", only(max_rel_l2=0.1), only(max_rel_l2=0.1, min_cosine=0.99)) == (
        f"w: budget.min_cosine: missing in the report, 0.99 derived from the fixture here; {AGAIN}")
    assert budget_check._looser("w", only(max_rel_l2=0.1, min_cosine=0.99), only(max_rel_l2=0.1)) == (
        f"w: budget.min_cosine: 0.99 in the report, none derived from the fixture here; {AGAIN}")


def test_a_maximum_may_exceed_the_derived_one_by_its_allowance_only():
    derived = 0.5
    allowed = budget_check.BUDGET_ABS + budget_check.BUDGET_REL * derived
    assert budget_check._looser("w", only(max_rel_l2=derived + allowed / 2), only(max_rel_l2=derived)) == ""
    stored = derived + 2 * allowed
    assert budget_check._looser("w", only(max_rel_l2=stored), only(max_rel_l2=derived)) == (
        f"w: budget.max_rel_l2: {stored} in the report is looser than {derived} derived from the fixture "
        f"here (budgets.budget); {AGAIN}")
    looser = budget_check._looser("w", only(max_rel_l2=1.5), only(max_rel_l2=1.2))
    assert looser.startswith("w: budget.max_rel_l2: 1.5")


def test_a_minimum_may_fall_below_the_derived_one_by_its_allowance_only():
    derived = 0.9
    allowed = budget_check.BUDGET_ABS_COSINE + budget_check.BUDGET_REL * (1.0 - derived)
    assert budget_check._looser("w", only(min_cosine=derived - allowed / 2), only(min_cosine=derived)) == ""
    assert budget_check._looser("w", only(min_cosine=0.95), only(min_cosine=derived)) == ""  # stricter
    stored = derived - 2 * allowed
    assert budget_check._looser("w", only(min_cosine=stored), only(min_cosine=derived)).startswith(
        f"w: budget.min_cosine: {stored} in the report is looser than {derived}")


def test_a_cosine_over_one_is_compared_as_one():
    """5e-5 under a derived cosine of 1.0005 is within the cosine's absolute allowance (1e-4) once
    both sides are capped at 1, and far outside it if they were not."""
    assert budget_check.BUDGET_ABS < 5e-5 < budget_check.BUDGET_ABS_COSINE
    assert budget_check._looser("w", only(min_cosine=0.99995), only(min_cosine=1.0005)) == ""


def test_a_maximums_absolute_allowance_is_the_smaller_one():
    """8e-5 over a derived relative L2 of 0.001 is beyond 3e-5 + 3 % (the maxima's allowance), though
    within the cosine's absolute 1e-4."""
    derived = 0.001
    assert budget_check.BUDGET_ABS + budget_check.BUDGET_REL * derived < 8e-5 < budget_check.BUDGET_ABS_COSINE
    assert budget_check._looser("w", only(max_rel_l2=derived + 8e-5), only(max_rel_l2=derived)) != ""


def test_the_largest_element_error_has_its_own_wider_allowance():
    """Run 13's H200 budget for sm80-fp16-cuda-fp16acc on krea2_gqa_partial_tiles (0.093545) against
    the one this CPU derives (0.082421) passes; 20 % over the derived one, or the same excess on
    another limit, does not."""
    assert budget_check._looser("w", only(max_abs=0.093545), only(max_abs=0.082421)) == ""
    loosened = only(max_abs=0.082421 * 1.2)
    assert budget_check._looser("w", loosened, only(max_abs=0.082421)).startswith("w: budget.max_abs:")
    assert budget_check._looser("w", only(max_rel_l2=0.093545), only(max_rel_l2=0.082421)).startswith(
        "w: budget.max_rel_l2:")


def test_gate_json_carries_the_served_record_unchanged():
    answer = records.dump(gate.GateDecision("FLUX.1", 0, gpus=[("H200 (sm_90)", enabled())]).answer())
    assert answer["version"] == gate.ANSWER_VERSION == 2
    assert answer["gpus"] == [{
        "gpu": "H200 (sm_90)", "verdict": "enable",
        "served": {"variant": "sm90-fp8-cuda", "min_query_tokens": 4608, "min_key_tokens": 512,
                   "head_dims": [64, 128], "max_query_tokens": 16384, "max_key_tokens": 16384,
                   "layouts": ["contiguous", "transposed"], "contexts": None, "bounds": [], "masks": False},
        "certified": ["sm90-fp8-cuda", "sm80-fp16-cuda"], "reasons": [], "provider": "thu-ml"}]
    assert records.dump(enabled().served) == answer["gpus"][0]["served"]


def test_gate_names_each_bound_and_its_json_carries_it():
    bound = Bound("key", 17, "flux1_ip_adapter_zero_uncond: sm90-fp8-cuda output not finite")
    decided = gate.GateDecision("FLUX.1", 0, gpus=[("H200 (sm_90)", enabled(bounds=[bound]))])
    line = gate_lines(decided, False)[0]
    assert line.endswith("; calls with fewer than 17 keys stay on torch (flux1_ip_adapter_zero_uncond: "
                         "sm90-fp8-cuda output not finite)")
    assert records.dump(decided.answer())["gpus"][0]["served"]["bounds"] == [
        {"side": "key", "below": 17, "reason": bound.reason}]
    cell = fleet_verdict("enable", "sm90-fp8-cuda", (9728, 9728), upper=32768, layouts=["contiguous"],
                         head_dims=[128], bounds=[bound])
    assert (
        fleet_render.cell(cell)
        == "enable: sm90-fp8-cuda 9,728 to 32,768 tokens, head_dim 128 (contiguous; keys >= 17)"
    )


def test_a_fleet_cell_names_the_contexts_certified_when_there_are_checks():
    ranged = dict(verdict_="enable", variant="sm90-fp8-cuda", low=(9728, 9728), upper=32768,
                  layouts=["contiguous", "transposed"], head_dims=[128])
    assert fleet_render.cell(fleet_verdict(**ranged, contexts=["side_stream", "compile"])) == (
        "enable: sm90-fp8-cuda 9,728 to 32,768 tokens, head_dim 128 (contiguous, transposed; "
        "contexts: side_stream, compile)")
    assert fleet_render.cell(fleet_verdict(**ranged)) == ("enable: sm90-fp8-cuda 9,728 to 32,768 tokens, "
                                                          "head_dim 128 (contiguous, transposed)")
    assert fleet_render.cell(fleet_verdict(**ranged, contexts=[])).endswith("; contexts: none)")


def test_a_fleet_cell_names_the_head_sizes_and_a_key_range_of_its_own():
    served = fleet_verdict("enable", "sm90-fp8-cuda", (9728, 512), upper=16896, layouts=["contiguous"],
                           max_key_tokens=4096, head_dims=[64, 128])
    assert fleet_render.cell(served) == (
        "enable: sm90-fp8-cuda 9,728 to 16,896 query / 512 to 4,096 key tokens, head_dim 64/128 (contiguous)"
    )
    unbounded = fleet_verdict("enable", "sm90-fp8-cuda", (4608, 512), head_dims=[128])
    assert fleet_render.cell(unbounded) == "enable: sm90-fp8-cuda >= 4608/512, head_dim 128"
    assert fleet_render.cell(fleet_verdict("keep off", reasons=["crash", "oom"])) == "keep off: crash, oom"
