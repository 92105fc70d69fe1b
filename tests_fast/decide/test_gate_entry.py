"""`gate.gate()`, the library's whole gate: what it reads (the report, this machine, the fixtures),
in which order, and the answer of each entry point when one of them fails."""

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from sage_qual import limits
from sage_qual.errors import ExitCode, UsageError
from sage_qual.qualification import families, selection
from sage_qual.qualification.decide import budget_check, checked, gate
from sage_qual.qualification.run import pool, worker_executor

from ..fakes import DATA, env_result, load

SAMPLE = DATA / "sample_h200_2gpu.json"  # SDXL there: safe, no speedup on the H200
PARTIAL = DATA / "sample_partial.json"


def sample_machine():
    return checked.load(SAMPLE).environment


@pytest.fixture
def sample_fixtures(monkeypatch):
    """This machine holds the sample's fixtures (their checksums), and its budgets count as derived."""
    recorded = load(SAMPLE.name)["fixtures"]

    def local(directories, family):
        return {f["name"]: SimpleNamespace(name=f["name"], sha256=f["sha256"]) for f in recorded
                if gate.counts_for(family, f["family"])}

    monkeypatch.setattr(selection, "family_fixtures", local)
    monkeypatch.setattr(budget_check, "budget_problem", lambda *args: "")


def test_this_machine_is_the_environment_a_worker_collected_into_a_temporary_log(monkeypatch):
    asked = []

    def collect(task, log_path, timeout):
        asked.append((log_path, timeout, log_path.parent.is_dir()))
        return env_result(load(SAMPLE.name)["environment"])

    monkeypatch.setattr(pool, "collect_environment", collect)
    assert worker_executor.this_machine() == sample_machine()
    ((log_path, timeout, folder_existed),) = asked
    assert (log_path.name, timeout, folder_existed) == ("environment.log", limits.STARTUP_TIMEOUT, True)
    assert log_path.parent.name.startswith("sage-qual-gate-") and not log_path.parent.exists()


@pytest.mark.usefixtures("sample_fixtures")
def test_gate_needs_a_speedup_only_when_asked():
    assert gate.gate(SAMPLE, "SDXL", machine=sample_machine).code == ExitCode.ENABLE
    assert gate.gate(SAMPLE, "SDXL", require_speedup=True, machine=sample_machine).code == ExitCode.KEEP_OFF


def test_a_report_that_cannot_decide_is_refused_before_this_machine_is_asked(tmp_path):
    predicted = tmp_path / "predicted.json"
    predicted.write_text(json.dumps({**load(SAMPLE.name), "predicted": True}))

    def machine():
        raise AssertionError("gate started a worker for a report that cannot decide")

    decision = gate.gate(predicted, "FLUX.1", machine=machine)
    assert decision.code == ExitCode.USAGE
    assert decision.problem.startswith(f"{predicted} is a predicted report")


@pytest.mark.usefixtures("sample_fixtures")
def test_a_machine_that_cannot_be_collected_answers_for_the_family():
    def machine():
        raise UsageError("collecting this machine's environment failed: crash: killed by SIGSEGV")

    assert gate.gate(SAMPLE, "flux.1", machine=machine) == gate.GateDecision(
        "FLUX.1", ExitCode.USAGE, "collecting this machine's environment failed: crash: killed by SIGSEGV")


def test_a_worker_that_cannot_collect_the_machine_is_a_usage_error(monkeypatch):
    def collect(task, log_path, timeout):
        raise pool.WorkerError("collecting this machine's environment failed: crash: killed by SIGSEGV")

    monkeypatch.setattr(pool, "collect_environment", collect)
    with pytest.raises(UsageError, match="killed by SIGSEGV"):
        worker_executor.this_machine()


def test_machine_problems_name_the_machine():
    here = sample_machine()
    assert gate.machine_problem(here) == ""
    assert gate.machine_problem(dataclasses.replace(here, gpus=[])) == (
        "no CUDA GPU is visible here, so no report can be matched to this machine; `sage-qual merge REPORT` "
        "gives a report's verdicts on any machine")
    assert gate.machine_problem(dataclasses.replace(here, sageattention_problem="not installed")) == (
        "sageattention cannot run here: not installed")


def test_each_entry_point_names_its_source():
    partial, flux = checked.load(PARTIAL), families.find("FLUX.1")
    here = sample_machine()
    assert gate.decide_stored(partial, flux, here, {}, False).problem.startswith("report.json is a partial")
    decided = gate.decide(partial, flux, here, {}, False, source=str(Path("runs") / "a.json"))
    assert decided.problem.startswith(f"{Path('runs') / 'a.json'} is a partial report")
