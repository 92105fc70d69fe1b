"""`sage-qual gate` and `merge` on fleets: reports holding several GPU models (an H200, an H100 and an
RTX 4090 in one report, and across reports), decided against fixture files on disk through the real
local fixture filter (`selection.family_fixtures`), never a patched one.

The fleet report is built from the hand-made samples in tests_fast/data (certify's format, synthetic
numbers): the H200 sample's cuda:0 stays an H200, its cuda:1 becomes an H100 (so the Qwen-Image
accuracy failure built into cuda:1 is the H100's alone, and the Wan 2.2 crash, timeout and
out-of-memory on cuda:0 the H200's alone), and the RTX 4090 sample's device joins as cuda:2. Each
fixture the report names is written as a real file; the report records those files' checksums
(the builders: tests_fast/fakes.py).
"""

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from sage_qual import cli, records
from sage_qual.fixtures import fileformat
from sage_qual.qualification import families
from sage_qual.qualification.decide import budget_check, checked, verdict
from sage_qual.qualification.decide import gate as gate_module

from ..fakes import (
    CAPABILITY,
    DATA,
    H100,
    H200,
    H200_NVL,
    L40S,
    RTX4090,
    fleet_report,
    gpu_entry,
    load,
    on_machine,
    write_fixture,
    write_fleet,
)


@pytest.fixture
def fleet(tmp_path):
    return write_fleet(tmp_path, fleet_report())


@pytest.fixture
def machine(monkeypatch):
    """Sets the GPUs this machine has (by model name); the rest of its environment is the report's."""
    environment = fleet_report()["environment"]
    # The samples' budgets are hand-made, not derived from these random fixtures: the check that
    # stored budgets match the derived ones is tests_fast/decide/test_gate_budgets.py's.
    monkeypatch.setattr(budget_check, "budget_problem", lambda *args: "")

    def here(*models):
        gpus = [gpu_entry(environment["gpus"][0], i, name) for i, name in enumerate(models)]
        on_machine(monkeypatch, {**environment, "gpus": gpus})
    return here


def gate(capsys, path: Path, fixtures: Path, family: str, *options: str):
    code = cli.main(["gate", "--family", family, "--report", str(path), "--fixtures", str(fixtures),
                     *options])
    out, err = capsys.readouterr()
    return code, out, err


def verdicts(capsys, path, fixtures, family, *options) -> tuple[int, dict]:
    """Exit code and {GPU model: (verdict, variant)} from `gate --json`."""
    code, out, err = gate(capsys, path, fixtures, family, "--json", *options)
    assert err == ""
    decision = json.loads(out)
    return code, {g["gpu"]: (g["verdict"], (g["served"] or {}).get("variant")) for g in decision["gpus"]}


def model(name: str) -> str:
    return "%s (sm_%d%d)" % (name, *CAPABILITY[name])


# One report, several GPU models ---------------------------------------------------------------------
def test_each_model_of_a_mixed_box_gets_its_own_variant(capsys, fleet, machine):
    """The H100 alone failed sm90 on the Qwen-Image outlier fixture: the H200 keeps sm90, the H100
    takes sm89, and two models of one compute capability are not merged."""
    path, fixtures, _ = fleet
    machine(H200, H100)
    code, out, err = gate(capsys, path, fixtures, "Qwen-Image")
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert [line.split(": ")[0] for line in lines] == [f"Qwen-Image on {model(m)}" for m in (H200, H100)]
    assert lines[0].startswith(f"Qwen-Image on {model(H200)}: enable sm90-fp8-cuda from ")
    assert lines[1].startswith(f"Qwen-Image on {model(H100)}: enable sm89-fp8-cuda from ")


@pytest.mark.parametrize("models, code", [
    ((H200,), 1), ((H100,), 0), ((H200, H100), 1), ((H100, H200), 1), ((H100, RTX4090), 0),
    ((H200, H100, RTX4090), 1),
])
def test_one_model_that_keeps_a_family_off_keeps_the_machine_off(capsys, fleet, machine, models, code):
    """Wan 2.2 crashed, timed out and ran out of memory on the H200 only."""
    path, fixtures, _ = fleet
    machine(*models)
    found_code, found = verdicts(capsys, path, fixtures, "Wan 2.2")
    assert found_code == code
    assert set(found) == {model(m) for m in models}
    if H200 in models:
        assert found[model(H200)] == ("keep off", None)
    assert all(verdict != "keep off" for m, (verdict, _) in found.items() if m != model(H200))


def test_keep_off_names_the_model_and_every_reason(capsys, fleet, machine):
    path, fixtures, _ = fleet
    machine(H100, H200)
    code, out, _ = gate(capsys, path, fixtures, "Wan 2.2")
    assert code == 1
    lines = out.splitlines()
    start = lines.index(f"Wan 2.2 on {model(H200)}: keep off")
    reasons = lines[start + 1:start + 4]
    assert [line.split(":")[0].strip() for line in reasons] == ["- crash", "- timeout", "- oom"]
    assert all("(cuda:0)" in line for line in reasons)
    assert not any(line.startswith(f"Wan 2.2 on {model(H100)}: keep off") for line in lines)


def test_only_the_models_here_are_decided(capsys, fleet, machine):
    path, fixtures, _ = fleet
    machine(RTX4090)
    code, found = verdicts(capsys, path, fixtures, "FLUX.1")
    assert (code, list(found)) == (0, [model(RTX4090)])
    assert found[model(RTX4090)][1] in {"sm89-fp8-cuda", "sm86-fp16-triton"}  # never the H200's sm90


def test_the_rtx_4090_never_gets_a_kernel_it_cannot_run(capsys, fleet, machine):
    path, fixtures, _ = fleet
    machine(H200, H100, RTX4090)
    for family in ("FLUX.1", "Qwen-Image", "SDXL", "Wan 2.2"):
        _, found = verdicts(capsys, path, fixtures, family)
        assert found[model(RTX4090)][1] != "sm90-fp8-cuda"
        assert found[model(H200)][1] in {None, "sm90-fp8-cuda", "sm89-fp8-cuda", "sm80-fp16-cuda"}


@pytest.mark.parametrize("models, missing", [
    ((H200, L40S), L40S), ((L40S,), L40S), ((H200_NVL,), H200_NVL),
])
def test_a_model_here_that_the_report_lacks_cannot_be_decided(capsys, fleet, machine, models, missing):
    path, fixtures, _ = fleet
    machine(*models)
    code, out, err = gate(capsys, path, fixtures, "FLUX.1")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert f"{model(missing)} here is not in the report" in err


def test_require_speedup_applies_to_each_model(capsys, fleet, machine):
    """SDXL (head_dim 64) measured slower than SDPA on the H200 sample: safe, no speedup there."""
    path, fixtures, _ = fleet
    machine(H200, H100)
    code, found = verdicts(capsys, path, fixtures, "SDXL")
    assert code == 0 and {v for v, _ in found.values()} == {"safe, no speedup"}
    code, found = verdicts(capsys, path, fixtures, "SDXL", "--require-speedup")
    assert code == 1 and {v for v, _ in found.values()} == {"safe, no speedup"}


# The local fixture filter, on real files -------------------------------------------------------------
def test_matching_fixture_files_decide(capsys, fleet, machine):
    path, fixtures, _ = fleet
    machine(H200)
    assert gate(capsys, path, fixtures, "FLUX.1")[0] == 0


def test_a_changed_fixture_of_the_family_cannot_decide(capsys, fleet, machine):
    path, fixtures, data = fleet
    machine(H200, H100)
    qwen = next(f for f in data["fixtures"] if f["name"].startswith("qwen"))
    changed = write_fixture(fixtures, qwen["name"], qwen["family"], qwen["bounds"], seed=99)
    code, out, err = gate(capsys, path, fixtures, "Qwen-Image")
    assert code == 2 and out == "" and err.count("\n") == 1
    recorded = qwen["sha256"][:12]
    assert f"fixture {qwen['name']} changed (sha256 {changed[:12]} here, {recorded} in the report)" in err
    assert gate(capsys, path, fixtures, "FLUX.1")[0] == 0  # another family's fixture changed


def test_a_missing_fixture_file_of_the_family_cannot_decide(capsys, fleet, machine):
    path, fixtures, data = fleet
    machine(H100)
    flux = next(f for f in data["fixtures"] if f["family"] == "flux.1")
    (fixtures / f"{flux['name']}{fileformat.SUFFIX}").unlink()
    code, _, err = gate(capsys, path, fixtures, "FLUX.1")
    assert code == 2 and f"fixture {flux['name']} is in the report but not here" in err
    assert gate(capsys, path, fixtures, "Qwen-Image")[0] == 0


@pytest.mark.parametrize("family, spelled", [("SDXL", "sdxl"), ("Qwen-Image", "Qwen_Image"),
                                             ("Wan 2.2", "WAN-2.2")])
def test_a_new_fixture_counts_for_its_family_however_spelled(capsys, fleet, machine, family, spelled):
    path, fixtures, data = fleet
    machine(H100)
    write_fixture(fixtures, "new-fixture", spelled, data["fixtures"][0]["bounds"], seed=7)
    code, _, err = gate(capsys, path, fixtures, family)
    assert code == 2 and "fixture new-fixture is here but not in the report" in err
    assert gate(capsys, path, fixtures, "FLUX.1")[0] == 0  # not FLUX.1's


def test_a_new_generic_fixture_counts_for_every_family(capsys, fleet, machine):
    path, fixtures, data = fleet
    machine(H100)
    write_fixture(fixtures, "stress-generic", "generic", data["fixtures"][0]["bounds"], seed=8)
    for family in ("FLUX.1", "Qwen-Image", "SDXL"):
        code, _, err = gate(capsys, path, fixtures, family)
        assert code == 2 and "fixture stress-generic is here but not in the report" in err


def test_a_generic_fixture_in_the_report_judges_every_family(capsys, tmp_path, machine):
    """The Qwen-Image outlier fixture made generic: the H100's sm90 failure on it now also moves
    FLUX.1 on the H100 off sm90, and not on the H200."""
    data = fleet_report()
    next(f for f in data["fixtures"] if f["name"].startswith("qwen"))["family"] = "generic"
    path, fixtures, _ = write_fleet(tmp_path, data)
    machine(H200, H100)
    code, found = verdicts(capsys, path, fixtures, "FLUX.1")
    assert code == 0
    assert found[model(H200)] == ("enable", "sm90-fp8-cuda")
    assert found[model(H100)][1] != "sm90-fp8-cuda"


def test_a_damaged_fixture_file_is_one_line_naming_it(capsys, fleet, machine):
    path, fixtures, _ = fleet
    machine(H200)
    damaged = fixtures / f"zz-damaged{fileformat.SUFFIX}"
    damaged.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    code, out, err = gate(capsys, path, fixtures, "FLUX.1")
    assert code == 2 and out == "" and err.count("\n") == 1 and str(damaged) in err


# Across reports: merge --------------------------------------------------------------------------------
def test_merge_gives_one_row_per_model_and_report(capsys, fleet):
    path, _, _ = fleet
    reports = [path, DATA / "sample_partial.json", DATA / "sample_rtx4090.json"]
    code = cli.main(["merge", "--json", *map(str, reports)])
    out, err = capsys.readouterr()
    assert (code, err) == (0, "")
    rows = json.loads(out)["rows"]
    assert [(r["host"], r["gpu"], r["devices"], r["report"]) for r in rows[:3] + rows[4:]] == [
        ("fleet-box", H200, [0], str(path)), ("fleet-box", H100, [1], str(path)),
        ("fleet-box", RTX4090, [2], str(path)), ("sample-ws-4090", RTX4090, [0], str(reports[2]))]
    partial = rows[3]  # one row per GPU model of the partial run, no verdicts
    assert (partial["devices"], partial["complete"], partial["families"], partial["report"]) == (
        [0, 1], False, {}, str(reports[1]))
    assert partial["undecidable"].startswith(f"{reports[1]} is a partial report")
    rows = rows[:3] + rows[4:]
    qwen = {
        (r["host"], r["gpu"]): (
            r["families"]["Qwen-Image"]["verdict"],
            (r["families"]["Qwen-Image"]["served"] or {}).get("variant"),
        )
        for r in rows[:4]
    }
    assert qwen[("fleet-box", H200)] == ("enable", "sm90-fp8-cuda")
    assert qwen[("fleet-box", H100)] == ("enable", "sm89-fp8-cuda")
    wan = {r["gpu"]: r["families"]["Wan 2.2"] for r in rows[:3]}
    assert wan[H200]["verdict"] == "keep off" and wan[H200]["reasons"] == ["crash", "oom", "timeout"]
    assert wan[H100]["verdict"] != "keep off" and wan[RTX4090]["verdict"] != "keep off"


def test_merge_markdown_has_a_line_per_model(capsys, fleet):
    path, _, _ = fleet
    assert cli.main(["merge", str(path), str(DATA / "sample_rtx4090.json")]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = {tuple(c.strip() for c in line.strip("|").split("|")[:4]): line for line in lines[2:]}
    assert set(rows) == {("fleet-box", H200, "90", "1"), ("fleet-box", H100, "90", "1"),
                         ("fleet-box", RTX4090, "89", "1"), ("sample-ws-4090", RTX4090, "89", "1")}
    qwen = header.index("Qwen-Image")
    cell = {key: [c.strip() for c in line.strip("|").split("|")][qwen] for key, line in rows.items()}
    assert cell[("fleet-box", H200, "90", "1")].startswith("enable: sm90-fp8-cuda >= ")
    assert cell[("fleet-box", H100, "90", "1")].startswith("enable: sm89-fp8-cuda >= ")


def test_a_fixture_file_with_non_finite_values_is_one_line_naming_it(capsys, fleet, machine):
    path, fixtures, data = fleet
    machine(H200)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 32, 64, generator=g).to(torch.bfloat16) for _ in range(3))
    q[0, 0, 0, 0] = float("inf")
    bad = fixtures / f"zz-inf{fileformat.SUFFIX}"
    fileformat.save_fixture(bad, q, k, v, family="flux.1", kind="replica", source={"test": "inf"},
                            provenance="tests_fast/decide/test_gate_fleet.py: one inf",
                            bounds=data["fixtures"][0]["bounds"])
    code, out, err = gate(capsys, path, fixtures, "FLUX.1")
    assert code == 2 and out == "" and err.count("\n") == 1 and str(bad) in err


# What gate says it cannot decide, and its JSON --------------------------------------------------------
def test_gate_refuses_a_predicted_report(capsys, tmp_path, machine):
    data = fleet_report()
    data["predicted"] = True
    path, fixtures, _ = write_fleet(tmp_path, data)
    machine(H200)
    code, out, err = gate(capsys, path, fixtures, "FLUX.1")
    assert code == 2 and out == "" and err.count("\n") == 1 and "predicted" in err
    typed = checked.parse(data, "report.json")
    decision = gate_module.decide(typed, families.find("FLUX.1"), typed.environment, {}, False)
    assert (decision.family, decision.code, decision.problem, decision.gpus) == (
        "FLUX.1", 2, "report.json is a predicted report (certify --emulate: the CPU numerics model, no GPU "
                     "ran): it decides nothing; run `sage-qual certify` on the GPU", [])
    assert records.dump(decision.answer()) == {
        "family": "FLUX.1",
        "exit_code": 2,
        "problem": decision.problem,
        "gpus": [],
        "version": 2,
        "differences": [],
    }


def test_gate_decides_nothing_from_a_partial_report():
    partial = load("sample_partial.json")
    partial["stopped"] = "SIGTERM"
    data = checked.parse(partial, "sample_partial.json")
    here = checked.parse(load("sample_h200_2gpu.json"), "sample_h200_2gpu.json").environment
    decision = gate_module.decide(data, families.find("FLUX.1"), here, {}, False)
    status = checked.status_line(False, data.started, data.finished, data.stopped)
    assert (decision.family, decision.code, decision.problem, decision.gpus) == (
        "FLUX.1", 2,
        f"report.json is a partial report ({status}): it decides nothing; run certify to the end", [])


def test_gate_json_holds_each_models_decision(capsys, fleet, machine):
    """--json renders verdict.decide()'s decision for each model here, every field of it."""
    path, fixtures, data = fleet
    machine(H200, H100)
    code, out, _ = gate(capsys, path, fixtures, "Wan 2.2", "--json")
    printed = json.loads(out)
    assert (code, printed["family"], printed["exit_code"], printed["problem"]) == (1, "Wan 2.2", 1, "")
    decided = {g.model: g.family("Wan 2.2") for g in verdict.decide(checked.parse(data, "report.json"))}
    assert [g["gpu"] for g in printed["gpus"]] == [model(H200), model(H100)]
    for entry in printed["gpus"]:
        d = decided[entry["gpu"]]
        assert entry == {"gpu": entry["gpu"], "verdict": d.verdict.value,
                         "served": None if d.served is None else records.dump(d.served),
                         "certified": d.results.certified,
                         "reasons": [{"kind": r.kind.value, "detail": r.detail} for r in d.reasons],
                         "provider": "" if d.served is None else "thu-ml"}
    h200, h100 = printed["gpus"]
    assert h200["verdict"] == "keep off"
    assert [r["kind"] for r in h200["reasons"]] == ["crash", "timeout", "oom"]
    assert h100["verdict"] == "enable" and h100["served"]["head_dims"] and h100["certified"]


def test_a_component_missing_on_one_side_is_named_none(capsys, tmp_path, machine, monkeypatch):
    data = fleet_report()
    recorded = data["environment"]["sageattention"]
    data["environment"]["sageattention"] = ""  # not installed where certify ran
    path, fixtures, _ = write_fleet(tmp_path, data)
    machine(H200)
    code, _, err = gate(capsys, path, fixtures, "FLUX.1")
    assert code == 2 and f"sageattention none measured, {recorded} here" in err


def test_a_family_the_report_did_not_certify_names_what_it_ran():
    fleet = fleet_report()
    fleet["options"]["families"] = ["SDXL", "Wan 2.2"]
    typed = checked.parse(fleet, "report.json")
    decision = gate_module.decide(typed, families.find("FLUX.1"), typed.environment, {}, False)
    assert (decision.family, decision.code, decision.problem) == (
        "FLUX.1", 2, "the report did not certify FLUX.1 (it ran: SDXL, Wan 2.2)")


def test_every_difference_of_a_stale_report_is_listed():
    data = fleet_report()
    typed = checked.parse(data, "report.json")
    here = dataclasses.replace(typed.environment, sageattention="2.2.1", torch="2.12.0")
    decision = gate_module.decide(typed, families.find("FLUX.1"), here, {}, False)
    assert (decision.family, decision.code) == ("FLUX.1", 2)
    made = data["environment"]
    assert decision.problem.startswith(f"stale report: sageattention {made['sageattention']} measured, 2.2.1 "
                                       f"here; torch {made['torch']} measured, 2.12.0 here; fixture ")
    assert decision.problem.endswith(". Run `sage-qual certify` on this machine again")
