"""The fleet recipes of examples/fleet: the GitHub Actions workflow parses and has the shape its
README promises, the scripts parse, and the merge-and-gate step works on the committed H200 reports
(run 11's two GPUs, compared with run 8's first report), through `python -m sage_qual`."""

import gzip
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from sage_qual.qualification.decide import checked

ROOT = Path(__file__).resolve().parent.parent.parent
FLEET = ROOT / "examples" / "fleet"
RESULTS = ROOT / "docs" / "results"
SCRIPTS = ["certify-one.sh", "merge_and_gate.sh", "certify-model.sbatch"]


def test_the_workflow_parses_and_certifies_per_runner_then_merges_once():
    workflow = yaml.safe_load((FLEET / "github-actions-certify.yml").read_text())
    certify, merge = workflow["jobs"]["certify"], workflow["jobs"]["merge-and-gate"]
    assert certify["runs-on"][0] == "self-hosted" and "${{ matrix.runner }}" in certify["runs-on"]
    assert len(certify["strategy"]["matrix"]["runner"]) >= 2 and certify["strategy"]["fail-fast"] is False
    runs = " ".join(step.get("run", "") for step in certify["steps"])
    assert "examples/fleet/certify-one.sh" in runs
    [upload] = [s for s in certify["steps"] if s.get("uses", "").startswith("actions/upload-artifact")]
    assert "report.json" in upload["with"]["path"]
    assert merge["needs"] == "certify" and merge["if"] == "always()"
    merged = " ".join(step.get("run", "") for step in merge["steps"])
    assert "examples/fleet/merge_and_gate.sh fleet reports baseline" in merged


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_scripts_parse_and_are_executable(script):
    path = FLEET / script
    assert os.access(path, os.X_OK) or script.endswith(".sbatch")
    checked = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr


def test_the_slurm_job_certifies_its_partition_into_a_folder_named_for_it(tmp_path):
    """Issue 27's Slurm gaps: the log folder, one job per GPU model, names stable across releases."""
    script = (FLEET / "certify-model.sbatch").read_text()
    lines = script.splitlines()
    output = next(line.split("=", 1)[1] for line in lines if line.startswith("#SBATCH --output="))
    assert f"mkdir -p {Path(output).parent}" in script  # Slurm creates no folder for --output
    assert "--array" not in script.replace("not one array", "")
    stub = tmp_path / "examples" / "fleet" / "certify-one.sh"
    stub.parent.mkdir(parents=True)
    stub.write_text('#!/usr/bin/env bash\necho "certify-one $1"\n')
    stub.chmod(0o755)
    ran = subprocess.run(["bash", str(FLEET / "certify-model.sbatch")], cwd=tmp_path, capture_output=True,
                         text=True, env={**os.environ, "SLURM_JOB_PARTITION": "h200"}, timeout=30)
    assert (ran.returncode, ran.stdout) == (0, "certify-one fleet/reports/h200\n"), ran.stderr
    env = {k: v for k, v in os.environ.items() if k != "SLURM_JOB_PARTITION"}
    unset = subprocess.run(["bash", str(FLEET / "certify-model.sbatch")], cwd=tmp_path, capture_output=True,
                           text=True, env=env, timeout=30)
    assert unset.returncode != 0 and "submit with sbatch --partition=" in unset.stderr


@pytest.fixture
def fleet(tmp_path):
    """Two hosts (run 11's GPUs) and a baseline for the first (run 8's first report)."""
    run8 = RESULTS / "run8-h200x2-final" / "certify" / "certify-a" / "report.json.gz"
    for host, report in (("h200-a", RESULTS / "run11-h200x2" / "certify-gpu0" / "report.json.gz"),
                         ("h200-b", RESULTS / "run11-h200x2" / "certify-gpu1" / "report.json.gz"),
                         ("../baseline/h200-a", run8)):
        (tmp_path / "reports" / host).mkdir(parents=True)
        shutil.copy(report, tmp_path / "reports" / host / "report.json")
    return tmp_path


def merge_and_gate(fleet: Path, *, baseline=True, **env) -> subprocess.CompletedProcess:
    command = ["bash", str(FLEET / "merge_and_gate.sh"), str(fleet / "out"), str(fleet / "reports")]
    return subprocess.run(command + ([str(fleet / "baseline")] if baseline else []), capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHON": sys.executable, **env})


def gates(fleet: Path) -> dict[str, str]:
    lines = (fleet / "out" / "fleet-gates.txt").read_text().splitlines()
    return dict(line.split(": ", 1) for line in lines)


def test_merge_and_gate_on_the_committed_h200_reports(fleet):
    done = merge_and_gate(fleet, REQUIRED_FAMILIES="Wan 2.2,Z-Image")
    assert done.returncode == 0, done.stderr
    table = (fleet / "out" / "fleet.md").read_text()
    assert table.count("| NVIDIA H200 |") == 2 and "enable: sm90-fp8-cuda >= 16384/16384" in table
    rows = json.loads((fleet / "out" / "fleet.json").read_text())["rows"]
    assert [row["gpu"] for row in rows] == ["NVIDIA H200"] * 2
    decided = gates(fleet)
    # run 11's two GPUs, 9,728 and 16,384 tokens, predate long checks: the fleet serves from the higher
    assert decided["Wan 2.2"] == decided["Z-Image"] == (
        "enable (sm90-fp8-cuda on NVIDIA H200; every host: from 16,384 query / 16,384 key tokens, head_dim "
        "128, no upper bound verified (a report without long checks))")
    assert decided["FLUX.1"] == decided["SDXL"] == "safe, no speedup"
    assert decided["FLUX.2"].startswith("keep off (vm NVIDIA H200 (h200-a): keep off;")
    # run 8 against run 11's first GPU: the same served speed; the second has no baseline
    assert "h200-a: same as the last release" in done.stdout
    assert "h200-b: no report of the last release" in done.stdout
    compared = (fleet / "out" / "compare-h200-a.txt").read_text()
    assert "Wan 2.2: no difference, served speedup x0.982" in compared  # run 11 against run 8, not back
    assert compared.endswith("same verdicts, variants, ranges, layouts and contexts; served speedups "
                             "within 5%\n")


def test_the_fleet_gate_names_the_variant_and_the_range_every_host_verified(tmp_path):
    """Issue 27: the fleet's enable line named neither. Runs 21 and 22 (one H200 each) with long checks."""
    for host, run in (("h200-a", "run21-h200"), ("h200-b", "run22-h200")):
        (tmp_path / "reports" / host).mkdir(parents=True)
        shutil.copy(RESULTS / run / "certify" / "report.json.gz", tmp_path / "reports" / host / "report.json")
    done = merge_and_gate(tmp_path, baseline=False, REQUIRED_FAMILIES="Wan 2.2")
    assert done.returncode == 0, done.stderr
    decided = gates(tmp_path)
    assert decided["Wan 2.2"] == ("enable (sm90-fp8-cuda on NVIDIA H200; every host: from 10,624 to 75,600 "
                                  "tokens, head_dim 128 (layouts: contiguous, transposed, nhd, fused_qkv; "
                                  "contexts: side_stream, compile))")
    assert decided["Z-Image"].endswith("from 10,624 to 32,768 tokens, head_dim 128 (layouts: contiguous, "
                                       "transposed, nhd; contexts: side_stream, compile))")
    # run 21 had no FLUX.2 fixture; run 22 enables it
    assert decided["FLUX.2"].startswith("keep off (vm NVIDIA H200 (h200-a): keep off")


def test_the_fleet_gate_states_the_hosts_bounds(tmp_path):
    """Issue 26: run 25 bounds FLUX.1 (its IP-Adapter calls, 4 to 16 keys, stay on torch); two hosts of it."""
    for host in ("h200-a", "h200-b"):
        (tmp_path / "reports" / host).mkdir(parents=True)
        run25 = RESULTS / "run25-h200" / "certify" / "report.json.gz"
        shutil.copy(run25, tmp_path / "reports" / host / "report.json")
    done = merge_and_gate(tmp_path, baseline=False, REQUIRED_FAMILIES="FLUX.1")
    assert done.returncode == 0, done.stderr
    assert gates(tmp_path)["FLUX.1"] == (
        "enable (sm90-fp8-cuda on NVIDIA H200; every host: from 12,672 to 32,768 tokens, head_dim 128 "
        "(layouts: contiguous, transposed, nhd, fused_qkv; contexts: side_stream, compile); calls with fewer "
        "than 17 keys stay on torch)")
    assert "keys >= 17" in (tmp_path / "out" / "fleet.md").read_text()


def test_a_required_family_kept_off_fails_the_step(fleet):
    assert merge_and_gate(fleet, baseline=False, REQUIRED_FAMILIES="FLUX.2").returncode == 1
    strict = merge_and_gate(fleet, baseline=False, REQUIRED_FAMILIES="SDXL", REQUIRE_SPEEDUP="1")
    assert strict.returncode == 1
    assert gates(fleet)["SDXL"].startswith("keep off (vm NVIDIA H200 (h200-a): safe, no speedup")
    assert merge_and_gate(fleet, baseline=False, REQUIRED_FAMILIES="Flux 9").returncode == 2


def test_a_hosts_own_gate_that_did_not_enable_keeps_the_family_off(fleet):
    answers = [{"family": "Wan 2.2", "exit_code": 1}, {"family": "Z-Image", "exit_code": 0}]
    lines = "".join(json.dumps(answer) + "\n\n" for answer in answers)  # as certify-one.sh writes them
    (fleet / "reports" / "h200-b" / "gates.jsonl").write_text(lines)
    done = merge_and_gate(fleet, baseline=False, REQUIRED_FAMILIES="Z-Image")
    assert done.returncode == 0, done.stderr
    decided = gates(fleet)
    assert decided["Wan 2.2"] == "keep off (vm NVIDIA H200 (h200-b): gate exit 1)"
    assert decided["Z-Image"].startswith("enable (sm90-fp8-cuda on NVIDIA H200; ")
    assert decided["Krea-2"] == "keep off (vm NVIDIA H200 (h200-b): gate exit missing)"  # not decided there


def test_no_reports_is_an_error(tmp_path):
    (tmp_path / "reports").mkdir()
    done = merge_and_gate(tmp_path, baseline=False)
    assert done.returncode == 2 and "no report.json under" in done.stderr


def test_a_report_merge_refuses_stops_the_step_as_bad_input_naming_it(fleet):
    broken = fleet / "reports" / "h200-b" / "report.json"
    broken.write_bytes(broken.read_bytes()[:1000])  # cut short, as a failed copy leaves it
    done = merge_and_gate(fleet, baseline=False, REQUIRED_FAMILIES="Wan 2.2")
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"sage-qual merge: {broken}: cannot be read" in done.stderr
    assert done.stderr.count("sage-qual merge:") == 1  # stopped at the first refusal, not after the second
    assert "give a readable report.json" in done.stderr
    assert not (fleet / "out" / "fleet-gates.txt").exists()


def test_certify_one_sh_that_cannot_certify_never_gates_an_older_report(tmp_path):
    """The folder holds last release's report; certify refuses here (no GPU): no gate may read that
    report as this run's."""
    out = tmp_path / "host"
    out.mkdir()
    shutil.copy(RESULTS / "run11-h200x2" / "certify-gpu0" / "report.json.gz", out / "report.json")
    done = subprocess.run(["bash", str(FLEET / "certify-one.sh"), str(out)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHON": sys.executable})
    assert done.returncode == 2, done.stdout + done.stderr
    assert "no CUDA GPU is visible here" in done.stderr and "certify wrote no report (exit 2)" in done.stderr
    assert not (out / "gates.jsonl").exists()


def test_gate_answers_appended_as_certify_one_sh_appends_them_read_back_one_object_per_line(tmp_path):
    """certify-one.sh's gate loop, run for real on a committed report: every `--json` answer is one
    line, so the file holds one object per line (issue 27: indented answers broke merge_and_gate.sh)."""
    script = (FLEET / "certify-one.sh").read_text()
    loop = script[script.index(": > \"$out/gates.jsonl\""):script.index("exit \"$certified\"")]
    out = tmp_path / "host"
    out.mkdir()
    shutil.copy(RESULTS / "run11-h200x2" / "certify-gpu0" / "report.json.gz", out / "report.json")
    families = 'families=("FLUX.1" "Wan 2.2" "Flux 9")\n'  # the last one is refused: exit 2, one line too
    done = subprocess.run(["bash", "-c", f"out={out}; python={sys.executable}\n{families}{loop}"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr  # the loop ends with the last gate's exit: "Flux 9" refused
    answers = [json.loads(line) for line in (out / "gates.jsonl").read_text().splitlines()]
    assert len(answers) == 3 and all(set(a) >= {"exit_code", "problem"} for a in answers)
    assert answers[2]["exit_code"] == 2 and "Flux 9" in answers[2]["problem"]


def test_the_real_scripts_certify_gate_and_merge_one_object_per_line(tmp_path):
    """Issue 27's done-when: certify-one.sh and merge_and_gate.sh as they are, on a host of fake H200s
    (the test hook), a --quick run of one family and one variant to keep it short: every `gate --json`
    answer appended to gates.jsonl reads back as one object per line, and the merge step reads them
    (its own gate keeps FLUX.1 off: a pre-flight cannot enable a family)."""
    fake = {"name": "NVIDIA H200", "capability": [9, 0]}
    env = {**os.environ, "PYTHON": sys.executable, "SAGE_QUAL_TEST_WORKER": json.dumps({"gpus": [fake]}),
           "CERTIFY_ARGS": "--quick --families FLUX.1 --variants sm90-fp8-cuda"}
    host = tmp_path / "reports" / "host-a"
    done = subprocess.run(["bash", str(FLEET / "certify-one.sh"), str(host)], capture_output=True, text=True,
                          timeout=600, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    answers = [json.loads(line) for line in (host / "gates.jsonl").read_text().splitlines()]
    assert [a["family"] for a in answers] == ["FLUX.1", "FLUX.2", "Z-Image", "Qwen-Image", "Krea-2", "SDXL",
                                              "LTX-2", "Wan 2.2"]
    assert all(a["exit_code"] == 2 for a in answers), answers
    assert all("is a --quick report: it ran the smallest fixture" in a["problem"] for a in answers)
    merged = subprocess.run(["bash", str(FLEET / "merge_and_gate.sh"), str(tmp_path / "fleet"),
                             str(tmp_path / "reports")], capture_output=True, text=True, timeout=300,
                            env={**env, "REQUIRED_FAMILIES": "FLUX.1"}, cwd=ROOT)
    assert merged.returncode == 1, merged.stderr  # FLUX.1 required and kept off: the step fails
    gates = (tmp_path / "fleet" / "fleet-gates.txt").read_text()
    assert gates.startswith("FLUX.1: keep off") and "gate exit 2" in gates, gates
    assert "Traceback" not in merged.stderr


# Each kind of bad gates line, each duplicate and each REQUIRE_SPEEDUP spelling is tested in process
# (tests_fast/decide/test_fleet_gate.py); one case of each here shows the script passes it through.
@pytest.mark.parametrize("line, problem", [('{"family": "Wan 2.2", "exit_co', "not JSON")], ids=["torn"])
def test_a_bad_gates_line_is_bad_input_named_with_its_file_and_line(fleet, line, problem):
    """Issue 43: a torn line crashed the step with a traceback and exit 1 ("a required family is kept
    off"). Now: exit 2, the file and line named, no traceback."""
    answers = (fleet / "reports" / "h200-b" / "gates.jsonl")
    answers.write_text(json.dumps({"family": "Z-Image", "exit_code": 0}) + "\n\n" + line + "\n")
    done = merge_and_gate(fleet, baseline=False)
    assert done.returncode == 2, done.stderr
    assert f"{answers} line 3: {problem}" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("codes", [(1, 0)])
def test_a_family_answered_twice_in_one_gates_file_is_bad_input_naming_both_lines(fleet, codes):
    """Issue 54: keep off, then enable, for one family: the last line won and the step exited 0."""
    answers = (fleet / "reports" / "h200-b" / "gates.jsonl")
    lines = [json.dumps({"family": family, "exit_code": code})
             for family, code in (("Z-Image", codes[0]), ("SDXL", 0), ("Z-Image", codes[1]))]
    answers.write_text("\n".join(lines) + "\n")
    done = merge_and_gate(fleet, baseline=False)
    assert done.returncode == 2, done.stderr
    assert f"{answers} lines 1 and 3: both answer Z-Image" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("value, strict", [("YES", True), ("false", False)])
def test_require_speedup_reads_the_usual_spellings(fleet, value, strict):
    done = merge_and_gate(fleet, baseline=False, REQUIRED_FAMILIES="SDXL", REQUIRE_SPEEDUP=value)
    assert done.returncode == (1 if strict else 0), done.stderr


def test_an_unknown_require_speedup_value_is_bad_input(fleet):
    done = merge_and_gate(fleet, baseline=False, REQUIRE_SPEEDUP="maybe")
    assert done.returncode == 2 and "REQUIRE_SPEEDUP='maybe'" in done.stderr


def test_the_fleet_line_carries_the_contexts_every_host_certified(tmp_path):
    """As gate's line does: run 30's H200 certified sm90-fp8-cuda in side_stream and compile."""
    run30 = RESULTS / "run30-h200" / "certify" / "report.json.gz"
    for host in ("h200-a", "h200-b"):
        (tmp_path / "reports" / host).mkdir(parents=True)
        shutil.copy(run30, tmp_path / "reports" / host / "report.json")
    done = merge_and_gate(tmp_path, baseline=False, REQUIRED_FAMILIES="Wan 2.2")
    assert done.returncode == 0, done.stderr
    assert gates(tmp_path)["Wan 2.2"].endswith("(layouts: contiguous, transposed, nhd, fused_qkv; contexts: "
                                               "side_stream, compile))")


def test_one_required_family_kept_off_among_several_fails_the_step(fleet):
    """Issue 54's surviving mutant: only a single required family was tried."""
    done = merge_and_gate(fleet, baseline=False, REQUIRED_FAMILIES="Wan 2.2,FLUX.2,Z-Image")
    assert done.returncode == 1, done.stderr
    decided = gates(fleet)
    assert decided["Wan 2.2"].startswith("enable") and decided["FLUX.2"].startswith("keep off")


def test_a_quick_report_without_gate_answers_enables_nothing(tmp_path):
    """A --quick pre-flight merged with no gates.jsonl beside it: its stored "enable" is not a
    family's, so a required family is kept off (exit 1) in gate's words, never enabled."""
    run21 = json.loads(gzip.decompress((RESULTS / "run21-h200" / "certify" / "report.json.gz").read_bytes()))
    report = tmp_path / "reports" / "h200-a" / "report.json"
    report.parent.mkdir(parents=True)
    report.write_text(json.dumps({**run21, "options": {**run21["options"], "quick": True}}))
    done = merge_and_gate(tmp_path, baseline=False, REQUIRED_FAMILIES="Wan 2.2")
    assert done.returncode == 1, done.stdout + done.stderr
    why = checked.undecidable(checked.load(report), str(report))
    assert "--quick report" in why
    assert gates(tmp_path) == {"Wan 2.2": f"keep off (no report that decides ran it; {why})"}


def test_a_predicted_report_keeps_every_family_off_for_the_fleet(tmp_path):
    """A host's `certify --emulate` report beside a measured one: no GPU ran there, so nothing is on."""
    run21 = RESULTS / "run21-h200" / "certify" / "report.json.gz"
    measured = json.loads(gzip.decompress(run21.read_bytes()))
    for host, predicted in (("h200-a", False), ("h200-b", True)):
        (tmp_path / "reports" / host).mkdir(parents=True)
        report = {**measured, "predicted": predicted}
        (tmp_path / "reports" / host / "report.json").write_text(json.dumps(report))
    done = merge_and_gate(tmp_path, baseline=False, REQUIRED_FAMILIES="Wan 2.2")
    assert done.returncode == 1, done.stderr
    refused = tmp_path / "reports" / "h200-b" / "report.json"
    why = checked.undecidable(checked.load(refused), str(refused))  # gate's refusal, in its words
    assert gates(tmp_path)["Wan 2.2"] == f"keep off (vm NVIDIA H200 (h200-b): {why})"  # run 21's host: "vm"
