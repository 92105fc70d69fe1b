"""Small things a first-time user trips over: --help states every default, report.html shows no
Markdown backticks, the downstream example says how to run it, and the fast suite's certify runs
leave no Triton cache folder behind."""

import argparse
import json
from pathlib import Path

import pytest

from sage_qual import cli
from sage_qual.qualification.decide import checked

from .. import builders

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("command", ["certify", "gate", "compare", "merge"])
def test_help_states_every_default(command):
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    for action in sub._actions:
        if action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            continue
        shown = action.help % {"default": action.default} if action.help else ""
        default = f"{action.default:g}" if isinstance(action.default, float) else str(action.default)
        assert default in shown, f"{command} {action.option_strings[0]}: help does not state {default}"


def test_report_html_shows_code_not_backticks(tmp_path):
    data = json.loads((ROOT / "tests_fast" / "data" / "sample_h200_2gpu.json").read_text())
    builders.rendered(checked.parse(data, "r.json"), tmp_path)
    page = (tmp_path / "report.html").read_text()
    assert "`" not in page and f"<code>{data['command']}</code>" in page


def test_the_downstream_example_says_how_to_run_it():
    readme = (ROOT / "examples" / "downstream_app" / "README.md").read_text()
    assert "pytest" in readme and "sage_qual_target" in readme and "skips with the reason" in readme


# Refused before torch is imported (issue 28: 42-71 s to refuse a bad family on a loaded machine) --
REFUSED_EARLY = {
    "a misspelt family": (["--families", "Flux 9"], {}, "unknown family 'Flux 9'"),
    "a misspelt variant": (["--variants", "sm91-fp8"], {}, "unknown variant 'sm91-fp8'"),
    "no GPU visible": ([], {"CUDA_VISIBLE_DEVICES": ""},
                       "no CUDA GPU is visible here (CUDA_VISIBLE_DEVICES is ''"),
}


@pytest.mark.parametrize("case", sorted(REFUSED_EARLY))
def test_certify_refuses_before_importing_torch_or_starting_a_worker(tmp_path, case):
    import os
    import subprocess
    import sys

    argv, env, said = REFUSED_EARLY[case]
    out = tmp_path / "out"
    code = ("import sys\nfrom sage_qual import cli\ncode = cli.main(sys.argv[1:])\n"
            "print('torch imported' if 'torch' in sys.modules else 'no torch')\nsys.exit(code)")
    environ = {k: v for k, v in os.environ.items() if k != "SAGE_QUAL_TEST_WORKER"}
    done = subprocess.run([sys.executable, "-c", code, "certify", "--out", str(out), *argv], text=True,
                          capture_output=True, timeout=60, env={**environ, **env})
    assert done.returncode == 2 and said in done.stderr, done.stderr
    assert done.stdout.strip() == "no torch" and not out.exists()


def test_gate_without_a_gpu_refuses_before_importing_torch_or_starting_a_worker():
    """gate on a CPU machine started a worker (2.9 s here) to learn there is no GPU."""
    import os
    import subprocess
    import sys

    report = Path(__file__).resolve().parents[2] / "docs/results/run25-h200/certify/report.json.gz"
    code = ("import sys\nfrom sage_qual import cli\ncode = cli.main(sys.argv[1:])\n"
            "print('torch imported' if 'torch' in sys.modules else 'no torch')\nsys.exit(code)")
    environ = {k: v for k, v in os.environ.items() if k != "SAGE_QUAL_TEST_WORKER"}
    environ["CUDA_VISIBLE_DEVICES"] = ""
    done = subprocess.run([sys.executable, "-c", code, "gate", "--family", "FLUX.1", "--report", str(report)],
                          text=True, capture_output=True, timeout=60, env=environ)
    assert done.returncode == 2 and done.stdout.strip() == "no torch", done.stderr
    assert ("no CUDA GPU is visible here (CUDA_VISIBLE_DEVICES is ''), so no report can be matched to this "
            "machine") in done.stderr


def test_no_gpu_is_known_from_the_device_nodes_and_the_hook(monkeypatch):
    import fnmatch

    from sage_qual.qualification.run import options

    monkeypatch.delenv("SAGE_QUAL_TEST_WORKER", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(options.sys, "platform", "linux")
    nodes: list[str] = []
    monkeypatch.setattr(options.glob, "glob", lambda pattern: fnmatch.filter(nodes, pattern))
    assert options.gpu_absent().startswith("no GPU device in /dev: none of /dev/nvidia[0-9]*")
    for node in ("/dev/nvidia0", "/dev/dxg", "/dev/kfd"):
        nodes[:] = [node]
        assert options.gpu_absent() == "", node
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    assert options.gpu_absent() == "CUDA_VISIBLE_DEVICES is '-1'"
    monkeypatch.setenv("SAGE_QUAL_TEST_WORKER", '{"gpus": []}')  # the test hook's fake GPUs decide
    assert options.gpu_absent() == ""
    monkeypatch.setattr(options.sys, "platform", "win32")
    monkeypatch.delenv("SAGE_QUAL_TEST_WORKER")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    nodes[:] = []
    assert options.gpu_absent() == ""  # no device nodes to read: the worker asks torch


@pytest.mark.parametrize("value, said", [("{garbage", "is not JSON"), ("[1]", "holds a list")])
@pytest.mark.parametrize("command", [["gate", "--family", "FLUX.1", "--report", "absent.json"],
                                     ["certify", "--emulate", "--quick"]])
def test_a_garbled_test_hook_is_named_with_the_fix(monkeypatch, capsys, tmp_path, command, value, said):
    """issue 28: SAGE_QUAL_TEST_WORKER set to garbage killed a worker with a JSONDecodeError that named
    no variable; every command now refuses it first, naming it and how to clear it."""
    from sage_qual import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SAGE_QUAL_TEST_WORKER", value)
    assert cli.main(command) == 2
    message = capsys.readouterr().err
    assert f"SAGE_QUAL_TEST_WORKER {said}" in message and "unset SAGE_QUAL_TEST_WORKER" in message
    assert not (tmp_path / "sage-qual-report").exists()


# --out holds only what a run writes ----------------------------------------------------------------
def _report_folder(out: Path) -> str:
    (out / "report.json").mkdir(parents=True)
    return f"{out / 'report.json'} is a folder, not what certify writes there"


def _linked_profile(out: Path) -> str:
    out.mkdir()
    (out.parent / "elsewhere.json").write_text("kept")
    (out / "profile.json").symlink_to(out.parent / "elsewhere.json")
    return f"{out / 'profile.json'} is a symbolic link: certify writes only inside --out"


@pytest.mark.parametrize("prepare", [_report_folder, _linked_profile])
@pytest.mark.parametrize("force", [[], ["--force"]], ids=["plain", "force"])
def test_certify_refuses_an_out_whose_run_files_are_not_its_own(tmp_path, capsys, prepare, force):
    """A report.json that is a folder gave "internal error" after the run began; --force wrote
    profile.json through a link to a file outside --out."""
    out = tmp_path / "out"
    said = prepare(out)
    assert cli.main(["certify", "--emulate", "--quick", "--out", str(out), *force]) == 2
    assert said in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) in (["report.json"], ["profile.json"])
    assert not (tmp_path / "elsewhere.json").exists() or (tmp_path / "elsewhere.json").read_text() == "kept"


def test_certify_refuses_an_empty_out(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exited:
        cli.main(["certify", "--emulate", "--quick", "--out", ""])
    assert exited.value.code == 2 and "argument --out: is empty" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("make, said", [
    (lambda t: (t / "a_file").write_text("kept"), "is a file: give a folder"),
    (lambda t: (t / "a_file").symlink_to(t / "nowhere"), "is a symbolic link to nothing"),
    (lambda t: (t / "file").write_text("kept") and t / "file" / "sub", "is under "),
])
def test_certify_refuses_an_out_that_cannot_be_a_folder_before_any_work(tmp_path, capsys, make, said):
    """Issue 54: an --out that was a file or a dangling link ran 30 s, then said "File exists"."""
    made = make(tmp_path)
    out = made if isinstance(made, Path) else tmp_path / "a_file"
    before = sorted(tmp_path.rglob("*"))
    assert cli.main(["certify", "--emulate", "--out", str(out)]) == 2
    err = capsys.readouterr()
    assert said in err.err and f"--out {out}" in err.err and err.out == ""  # nothing ran
    assert sorted(tmp_path.rglob("*")) == before


def test_force_removes_what_the_previous_run_wrote_and_nothing_else(tmp_path):
    from sage_qual.qualification.run import options, run

    out = tmp_path / "out"
    (out / "logs").mkdir(parents=True)
    previous = [
        "report.json",
        "report.md",
        "report.html",
        "profile.json",
        "accuracy-cuda1.png",
        "speedup-3.png",
        "logs/worker-1.log",
    ]
    for name in previous + ["notes.txt", "speedup.txt"]:
        (out / name).write_text("previous")
    request = options.RunRequest(out=out, executor=options.InProcess(), force=True)
    request.check()
    with run.output_directory(out, replacing=request.previous_run()):
        pass
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "speedup.txt"]


def test_the_readme_test_command_runs_the_benchmarks_once_without_a_warning():
    """Every run of the README's test command (xdist) warned that it disables the benchmarks."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadfile", "-p",
                           "no:cacheprovider", "tests_fast/serving/test_overhead_benchmarks.py"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:]
    assert "passed" in done.stdout and "Benchmark" not in done.stdout + done.stderr, done.stdout[-2000:]


@pytest.mark.parametrize("timeout", ["0", "30"])
def test_emulate_refuses_a_timeout_it_would_not_read(tmp_path, capsys, timeout):
    """`certify --emulate --timeout 0` was accepted (issue 64): the emulation starts no worker."""
    out = str(tmp_path / "p")
    assert cli.main(["certify", "--emulate", "--quick", "--timeout", timeout, "--out", out]) == 2
    assert f"--timeout {timeout} with --emulate: it starts no worker to time out" in capsys.readouterr().err
    assert not (tmp_path / "p").exists()
