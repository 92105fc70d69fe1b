"""certify end to end on the CPU: real worker processes on the fake CUDA and fake sageattention
(the worker's test hook), with cells made to crash, hang, run out of memory or return bad output.

One run on two fake GPUs (an H200 and an RTX 4090, in parallel) is shared by most tests:
  sm90-fp8-cuda: a-cross aborts its worker (SIGABRT), b-qwen-outlier passes in a fresh worker,
                 c-flux hangs (timeout); after two such endings its speed sweep is skipped.
                 On the RTX 4090 it is not supported: skip cells with the reasons.
  sm89-fp8-cuda: a-cross passes, b-qwen-outlier returns noise (fails accuracy), c-flux raises
                 out of memory; its speed sweep runs.
"""

import ast
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

from sage_qual import records
from sage_qual.cli import UsageError
from sage_qual.fixtures.fileformat import save_fixture
from sage_qual.qualification.decide import checked, verdict
from sage_qual.qualification.evidence import files
from sage_qual.qualification.evidence.report_model import Cell, Outcome
from sage_qual.qualification.measure import judge
from sage_qual.qualification.measure.accuracy import Accuracy
from sage_qual.qualification.run import options as run_options
from sage_qual.qualification.run import pool
from sage_qual.qualification.run.run import Phases, Progress, certify
from sage_qual.qualification.selftest import faults as worker_faults

from .. import builders
from ..fakes import env_result

jsonschema = pytest.importorskip("jsonschema")  # a test dependency; the GPU box lacks it

H200 = {"name": "Fake H200", "capability": [9, 0]}
RTX4090 = {"name": "Fake RTX 4090", "capability": [8, 9]}
FAULTS = {"sm90-fp8-cuda|a-cross": "crash", "sm90-fp8-cuda|c-flux": "hang",
          "sm89-fp8-cuda|b-qwen-outlier": "noise", "sm89-fp8-cuda|c-flux": "oom"}
BOUNDS = {"fp16": {"max_rel_l2": 0.05, "min_cosine": 0.99}, "fp8": {"max_rel_l2": 0.08, "min_cosine": 0.99}}


def write_fixtures(directory: Path) -> Path:
    directory.mkdir()
    g = torch.Generator().manual_seed(0)
    for name, family, tokens in (("a-cross", "cross-attention", 48), ("b-qwen-outlier", "qwen-image", 64),
                                 ("c-flux", "flux.1", 64)):
        q, k, v = (torch.randn(1, 2, tokens, 64, generator=g).to(torch.bfloat16) for _ in range(3))
        save_fixture(directory / f"{name}.safetensors", q, k, v, family=family, kind="replica",
                     source={"test": name}, provenance="random test data", bounds=BOUNDS)
    return directory


def validate(data: dict) -> list[str]:
    return [e.message for e in jsonschema.Draft202012Validator(files.schema()).iter_errors(data)]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The shared two-GPU run, with the parent's CUDA entry points made to fail loudly."""
    base = tmp_path_factory.mktemp("certify")
    fixtures = write_fixtures(base / "fixtures")
    out = base / "out"
    snapshots = []
    done = threading.Event()

    def watch():  # what a kill at this moment would leave behind
        while not done.is_set():
            try:
                data = json.loads((out / "report.json").read_text())
            except (OSError, ValueError):
                data = None
            if data and any(d["cells"] for d in data["devices"]) and not snapshots:
                snapshots.append(data)
            time.sleep(0.05)

    def no_cuda(*args, **kwargs):
        raise AssertionError("the certify parent touched CUDA")

    watcher = threading.Thread(target=watch, daemon=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(worker_faults.TEST_HOOK, json.dumps({"gpus": [H200, RTX4090], "faults": FAULTS}))
        for name in ("init", "_lazy_init", "is_available", "device_count", "get_device_capability",
                     "get_device_name", "set_device", "synchronize"):
            mp.setattr(torch.cuda, name, no_cuda)
        watcher.start()
        start = time.monotonic()
        data = records.dump(certify(builders.gpu_request(
            out, devices="0,1", variants=["sm90-fp8-cuda", "sm89-fp8-cuda"], fixture_dirs=[str(fixtures)],
            quick=True, timeout=3.0)))
        seconds = time.monotonic() - start
        done.set()
    return {"data": data, "out": out, "snapshot": snapshots[0] if snapshots else None, "seconds": seconds}


def cells(data, device):
    return {(c["variant"], c["fixture"]): c for c in data["devices"][device]["cells"]}


def test_the_run_completes_with_a_valid_report(run):
    data = run["data"]
    assert data["complete"] and data["stopped"] == ""
    assert validate(data) == []
    assert json.loads((run["out"] / "report.json").read_text()) == data
    assert {p.name for p in run["out"].iterdir()} >= {
        "report.json", "report.md", "report.html", "accuracy-cuda0.png", "accuracy-cuda1.png", "logs",
        "profile.json"}


def test_a_crash_costs_its_cell_only(run):
    h200 = cells(run["data"], 0)
    crashed = h200[("sm90-fp8-cuda", "a-cross")]
    assert crashed["outcome"] == "crash"
    assert crashed["detail"] == "the worker ran this task when it died (killed by SIGABRT)"
    assert "test fault: aborting the worker" in crashed["stderr_tail"]
    passed = h200[("sm90-fp8-cuda", "b-qwen-outlier")]  # in a fresh worker
    numbers = passed["metrics"]
    assert passed["outcome"] == "pass" and numbers["rel_l2"] < 0.01 and numbers["worst_head_cosine"] > 0.999
    assert passed["smooth_k_on"]["finite"] and h200[("sm89-fp8-cuda", "a-cross")]["smooth_k_on"] is None


def test_a_hang_times_out_and_two_endings_skip_the_rest_of_the_variant(run):
    h200 = cells(run["data"], 0)
    hung = h200[("sm90-fp8-cuda", "c-flux")]
    assert hung["outcome"] == "timeout"
    assert hung["detail"] == "the worker ran this task when it sent nothing for 3 s and was killed"
    speed = [r for r in run["data"]["devices"][0]["speed"] if r["kernel"] == "sm90-fp8-cuda"]
    assert len(speed) == 5 and {r["outcome"] for r in speed} == {"skip"}
    assert speed[0]["detail"] == "not run: workers of this job crashed or hung 2 times"


@pytest.mark.parametrize("device", [0, 1])
def test_fail_and_oom_are_reported_with_their_numbers_and_the_variant_goes_on(run, device):
    got = cells(run["data"], device)
    assert got[("sm89-fp8-cuda", "a-cross")]["outcome"] == "pass"
    noisy = got[("sm89-fp8-cuda", "b-qwen-outlier")]
    # The budget is derived from the numerics model (qualification/measure/budgets.py), not a fixed bound.
    limit = noisy["budget"]["max_rel_l2"]
    assert noisy["outcome"] == "fail" and noisy["metrics"]["rel_l2"] > limit
    # Noise of the output's own size: off its model and unfit for the family (the fixture's bound) alike.
    assert {r["kind"] for r in noisy["reasons"]} == {"accuracy", "unfit"}
    assert noisy["reasons"][0]["detail"].startswith(
        f"relative L2 {noisy['metrics']['rel_l2']:.4g} > {limit:.4g}"
    )
    oom = got[("sm89-fp8-cuda", "c-flux")]
    assert oom["outcome"] == "oom" and "OutOfMemoryError: CUDA out of memory" in oom["detail"]
    speed = [r for r in run["data"]["devices"][device]["speed"] if r["kernel"] == "sm89-fp8-cuda"]
    assert len(speed) == 5 and all(r["outcome"] == "pass" and r["ms"] > 0 for r in speed)


def test_unsupported_variant_is_skipped_with_its_reasons(run):
    rtx = run["data"]["devices"][1]
    assert rtx["not_supported"] == {"sm90-fp8-cuda": ["capability=(8, 9) (needs >= (9, 0))"]}
    skipped = [c for c in rtx["cells"] if c["variant"] == "sm90-fp8-cuda"]
    assert len(skipped) == 3 and {c["outcome"] for c in skipped} == {"skip"}
    assert skipped[0]["detail"] == "capability=(8, 9) (needs >= (9, 0))"
    assert not [r for r in rtx["speed"] if r["kernel"] == "sm90-fp8-cuda"]


def test_sdpa_backends_that_refuse_are_skipped(run):
    sdpa = [r for r in run["data"]["devices"][0]["speed"] if r["kernel"] == "sdpa"]
    assert len(sdpa) == 5
    for record in sdpa:  # on the CPU, cuDNN and the memory-efficient kernel refuse
        assert record["outcome"] == "pass" and record["ms"] == statistics.median(record["samples_ms"])
        assert set(record["refused"]) == {"cudnn", "efficient"}
        assert record["best_backend"] == "flash" and set(record["backends"]) == {"flash"}


def test_verdicts_name_every_reason(run):
    h200, rtx = verdict.decide(checked.parse(run["data"], "report.json"))
    flux = h200.family("FLUX.1")
    assert [r.kind.value for r in flux.reasons] == ["timeout", "oom"]
    qwen = h200.family("Qwen-Image")
    assert qwen.results.certified == ["sm90-fp8-cuda"] and list(qwen.results.rejected) == ["sm89-fp8-cuda"]
    qwen_rtx = rtx.family("Qwen-Image")
    assert qwen_rtx.verdict.value == "keep off" and {r.kind.value for r in qwen_rtx.reasons} == {
        "accuracy",
        "unfit",
    }
    assert rtx.variants["sm90-fp8-cuda"].runnable is False


def test_results_were_on_disk_as_they_arrived(run):
    snapshot = run["snapshot"]
    assert snapshot is not None and snapshot["complete"] is False and "gpus" not in snapshot
    assert validate(snapshot) == []


def test_the_environment_was_collected_in_a_worker(run):
    env = run["data"]["environment"]
    assert [g["name"] for g in env["gpus"]] == ["Fake H200", "Fake RTX 4090"]
    assert env["torch"] == torch.__version__ and env["sageattention"] == "2.2.0"


def test_each_gpu_has_its_workers_and_its_own_triton_cache(run):
    jobs = [line for log in (run["out"] / "logs").glob("worker-*.log")
            for line in log.read_text().splitlines() if line.startswith("sage-qual worker ")]
    envs = {}
    for line in jobs:  # "... env {'CUDA_VISIBLE_DEVICES': '1', 'TRITON_CACHE_DIR': '...'}"
        env = ast.literal_eval(line.split(" env ", 1)[1])
        envs.setdefault(env["CUDA_VISIBLE_DEVICES"], set()).add(env["TRITON_CACHE_DIR"])
    assert set(envs) == {"0", "1"} and all(len(caches) == 1 for caches in envs.values())
    assert envs["0"] != envs["1"]
    assert not any(Path(cache).exists() for caches in envs.values() for cache in caches)  # removed after
    assert len(jobs) == 6  # cuda:0: sdpa, sm90 twice (the crash), sm89; cuda:1: sdpa, sm89


def measured(rel_l2: float, cosine: float, finite: bool = True) -> Accuracy:
    """A worker's accuracy of `rel_l2` and `cosine`, its slices unmeasured (the budget has no limit
    on them)."""
    return Accuracy(**vars(builders.metrics(finite, rel_l2=rel_l2, worst_head_cosine=cosine)),
                    sdpa_rel_l2=0.002, error_vs_sdpa=rel_l2 / 0.002)


@pytest.mark.parametrize("acc, per_element, kinds", [
    (measured(0.04, 0.999), 1.67, []),
    (measured(0.04, 0.999), 2.6, ["memory"]),
    (measured(0.09, 0.999), 1.0, ["accuracy"]),
    (measured(0.04, 0.98), 1.0, ["accuracy"]),
    # inf is a number over its limit; the NaN cosine is not measured, which non_finite already says.
    (measured(float("inf"), float("nan"), False), 1.0, ["non_finite", "accuracy"]),
])
def test_cell_reasons(acc, per_element, kinds):
    published = BOUNDS["fp8"]
    reasons = judge.cell_reasons(
        acc, per_element, builders.budget(**published), 2.5, fitness=builders.CONFORMANCE_ONLY
    )
    assert [r.kind.value for r in reasons] == kinds


PASSED = Cell(variant="sm90-fp8-cuda", fixture="f", outcome=Outcome.PASS,
              metrics=builders.metrics(rel_l2=0.01, worst_head_cosine=0.999))
CRASHED = Cell(variant="sm90-fp8-cuda", fixture="g", outcome=Outcome.CRASH,
               detail="the worker died (SIGSEGV)")


def test_progress_is_plain_lines_in_a_log_with_the_seconds_since_the_start(capsys):
    readings = iter([100.0, 101.25, 163.0])
    progress = Progress(2, clock=lambda: next(readings))
    progress.tick("cuda:0", PASSED)
    progress.tick("cuda:1", CRASHED)
    progress.close()
    out, err = capsys.readouterr()
    assert out.splitlines() == [
        "[1/2, 1.2 s] cuda:0 sm90-fp8-cuda x f: pass (rel L2 0.01, worst cos 0.999)",
        "[2/2, 63.0 s] cuda:1 sm90-fp8-cuda x g: crash -- the worker died (SIGSEGV)"]
    assert err == ""


def test_progress_is_a_bar_on_a_terminal_with_problems_printed(capsys, monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    progress = Progress(2)
    progress.tick("cuda:0", PASSED)
    progress.tick("cuda:1", CRASHED)
    progress.close()
    out, err = capsys.readouterr()
    assert out.splitlines() == ["cuda:1 sm90-fp8-cuda x g: crash -- the worker died (SIGSEGV)"]
    assert "2/2" in err and "[1/2]" not in out


# Bad input -------------------------------------------------------------------------------------
@pytest.fixture
def machine(monkeypatch):
    """This machine as the environment worker reports it: the `devices` and environment `fields` a
    test sets (one Fake H200 at cuda:0)."""
    here = {"devices": [builders.device(gpu=(H200["name"], H200["capability"], 24.0))], "fields": {}}
    monkeypatch.setattr(run_options, "gpu_absent", lambda: "")  # nor do its /dev nodes say otherwise
    monkeypatch.setattr(pool, "collect_environment", lambda *args, **kwargs: env_result(
        builders.environment(here["devices"], **here["fields"]), {"0": {}}))
    return here


@pytest.mark.parametrize("options, message", [
    ({"variants": ["sm91-nope"]}, "unknown variant 'sm91-nope'"),
    ({"families": ["Nope"]}, "unknown family 'Nope'"),
    ({"devices": "2"}, "there is no cuda:2: this machine shows 1 GPU(s)"),
    ({"devices": "x"}, "--devices takes GPU indices"),
    ({"fixture_dirs": ["/nonexistent"]}, "/nonexistent: directory: not found"),
])
def test_bad_input(tmp_path, machine, options, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        certify(builders.gpu_request(tmp_path / "out", **options))


@pytest.mark.parametrize("change, message", [
    ({"devices": []}, "no CUDA GPU is visible here .* run `sage-qual certify --emulate`"),
    ({"fields": {"sageattention_problem": "triton is not installed"}},
     "sageattention cannot run here: triton is not installed"),
])
def test_no_gpu_or_no_sageattention(tmp_path, machine, change, message):
    machine.update(change)
    with pytest.raises(UsageError, match=message):
        certify(builders.gpu_request(tmp_path / "out"))


# A killed run ----------------------------------------------------------------------------------
def worker_pids(marker: str) -> set[int]:
    """Processes whose environment carries this test's marker."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "environ").read_bytes():
                    found.add(int(entry.name))
            except OSError:
                continue
    return found


def test_a_killed_run_leaves_a_partial_report_and_no_workers(tmp_path):
    """SIGKILL the certify process while its worker hangs in the second SDPA timing."""
    fixtures = write_fixtures(tmp_path / "fixtures")
    out = tmp_path / "out"
    marker = f"kill-test-{uuid.uuid4()}"  # in every worker's environment, to find them
    # TMPDIR: the SIGKILLed parent cannot remove its Triton cache folder; it is left in tmp_path.
    env = {**os.environ, "TMPDIR": str(tmp_path), worker_faults.TEST_HOOK: json.dumps(
        {"gpus": [H200], "faults": {"sdpa@b1 h24 q4096 k4096 d128 bfloat16": "hang", marker: "none"}})}
    parent = subprocess.Popen([sys.executable, "-m", "sage_qual", "certify", "--out", str(out), "--quick",
                               "--variants", "sm90-fp8-cuda", "--fixtures", str(fixtures), "--timeout", "60"],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # until the first result is on disk
        try:
            data = json.loads((out / "report.json").read_text())
            if data["devices"][0]["speed"]:
                break
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    assert worker_pids(marker), "no worker running"
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    data = checked.load(out / "report.json")
    assert data.complete is False and data.finished is None
    assert [(r.kernel, r.shape) for r in data.devices[0].speed] == \
        [("sdpa", "b1 h24 q1024 k1024 d128 bfloat16")]
    assert validate(json.loads((out / "report.json").read_text())) == []
    assert "PARTIAL REPORT" in checked.status_line(data.complete, data.started, data.finished, data.stopped)
    # Orphaned workers see their stdin end and exit, the hung one included.
    deadline = time.monotonic() + 10
    while worker_pids(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not worker_pids(marker)
    assert [p.name[:22] for p in tmp_path.glob("sage-qual-triton-*")] == ["sage-qual-triton-cuda0"]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """A --quick run on two fake GPUs without --variants, writing JUnit XML too."""
    base = tmp_path_factory.mktemp("quick")
    fixtures = write_fixtures(base / "fixtures")
    junit = base / "certify.xml"
    workers = {"started": 0, "given a job": 0}
    start_process, give_job, collect = pool.Process.__init__, pool.Process.start, pool.collect_environment

    def started(process, *args, **kwargs):
        workers["started"] += 1
        start_process(process, *args, **kwargs)

    def given_job(process, *args, **kwargs):
        workers["given a job"] += 1
        give_job(process, *args, **kwargs)

    def collect_environment(*args, **kwargs):
        workers["started before the environment"] = workers["started"]
        return collect(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(worker_faults.TEST_HOOK, json.dumps({"gpus": [H200, RTX4090], "faults": {}}))
        mp.setattr(pool.Process, "__init__", started)
        mp.setattr(pool.Process, "start", given_job)
        mp.setattr(pool, "collect_environment", collect_environment)
        data = records.dump(certify(builders.gpu_request(
            base / "out", devices="0,1", families=["FLUX.1", "SDXL"], fixture_dirs=[str(fixtures)],
            quick=True, timeout=30.0, junit_xml=junit)))
    return data, junit, workers


def test_quick_without_variants_runs_each_gpus_own_kernel(quick_run):
    """--quick is a pre-flight: only the kernel the wrapper would use on each GPU runs."""
    data, _, _ = quick_run
    ran = [{c["variant"] for c in device["cells"] if c["outcome"] != "skip"} for device in data["devices"]]
    assert ran == [{"sm90-fp8-cuda"}, {"sm89-fp8-cuda"}]
    assert validate(data) == []


def test_a_quick_run_starts_no_worker_it_does_not_use(quick_run):
    """Its jobs are known up front (per GPU the SDPA timing and one kernel): every worker started
    ahead gets one (before, two per GPU were killed unused, each after a torch import)."""
    _, _, workers = quick_run
    # the environment, then two jobs per GPU; the first GPU's two started while it was collected
    assert workers == {"started": 5, "given a job": 5, "started before the environment": 2}


def test_junit_xml_has_a_case_per_gpu_model_and_family(quick_run):
    data, junit, _ = quick_run
    assert data["complete"]
    cases = ET.parse(junit).getroot().findall("testsuite/testcase")
    assert [(c.get("classname"), c.get("name")) for c in cases] == [
        ("Fake H200 (sm_90)", "FLUX.1"), ("Fake H200 (sm_90)", "SDXL"),
        ("Fake RTX 4090 (sm_89)", "FLUX.1"), ("Fake RTX 4090 (sm_89)", "SDXL")]
    for sdxl in (cases[1], cases[3]):
        failure = sdxl.find("failure")
        assert failure is not None and failure.get("message") == "keep off"
        assert "no fixtures of SDXL" in failure.text


@pytest.mark.parametrize("installed, preloaded", [(True, ["sageattention", "torch._dynamo"]), (False, [])],
                         ids=["with-sageattention", "without"])
def test_the_zygote_preloads_what_a_kernels_first_call_imports(tmp_path, installed, preloaded):
    """`kernels.kernel_imports`, in the zygote's preload, imports sageattention and torch._dynamo
    before any worker is forked (3.7 s of every variant's first cell on the H200, run 9); nothing
    where sageattention is not installed."""
    assert "sage_qual.kernels.kernel_imports" in pool.ZYGOTE_PRELOAD
    if installed:
        (tmp_path / "sageattention").mkdir()
        (tmp_path / "sageattention" / "__init__.py").write_text("")
    env = pool.worker_env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])
    code = ("import sys; from sage_qual.kernels import kernel_imports; "
            "print([m for m in ('sageattention', 'torch._dynamo') if m in sys.modules])")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(preloaded)


def test_each_variant_ran_its_long_checks_in_its_worker(run):
    """The long checks (task kind 'long') of a --quick run: the sweep lengths past the 64-token
    fixtures and the longest family call (Wan 2.2, 75,600 tokens; the fake GPU cuts tokens 256-fold
    and runs one K/V group of heads)."""
    for device in (0, 1):
        checks = [c for c in run["data"]["devices"][device]["long"] if c["variant"] == "sm89-fp8-cuda"]
        assert sorted(c["shape"]["q_tokens"] for c in checks) == [1024, 4096, 16384, 75600]
        short = [c for c in checks if c["shape"]["q_tokens"] == 1024][0]
        assert short["outcome"] == "pass" and short["inputs"].startswith("synthetic")
        assert (short["ran_tokens"], short["ran_heads"]) == (16, 1)
        assert short["identical"] == {"transposed": True, "fused_qkv": True, "nhd": True}
    skipped = [c for c in run["data"]["devices"][0]["long"] if c["variant"] == "sm90-fp8-cuda"]
    assert len(skipped) == 4 and {c["detail"] for c in skipped} == {
        "not run: workers of this job crashed or hung 2 times"}


def test_the_phases_line_says_where_the_time_went():
    readings = iter([10.0, 19.5, 147.0, 157.25, 160.0])
    phases = Phases(clock=lambda: next(readings))
    for phase in ("discovery", "sweep", "follow-up", "conclusion"):
        phases.end(phase)
    assert str(phases) == "150.0 s (discovery 9.5 s, sweep 127.5 s, follow-up 10.2 s, conclusion 2.8 s)"
