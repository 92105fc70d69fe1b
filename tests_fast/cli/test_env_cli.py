"""`sage-qual env`: the environment record, its text and its JSON, on the fake CUDA box."""

import argparse
import contextlib
import dataclasses
import json
import sys

import pytest

from sage_qual import __version__, cli, records
from sage_qual.cli import env as cli_env
from sage_qual.serving import environment
from sage_qual.testing import FakeCuda, FakeGpu, FakeSageAttention

NOT_SM90 = ("_qattn_sm80", "_qattn_sm89", "_fused")


@contextlib.contextmanager
def box(gpus=(((8, 9), "RTX 4090", 24.0), ((8, 7), "Jetson Orin", 32.0)), torch_cuda=(12, 8), **fake_options):
    fake = FakeSageAttention(**fake_options)
    with FakeCuda([FakeGpu(cap, name, memory) for cap, name, memory in gpus], torch_cuda=torch_cuda), \
            fake.installed():
        yield fake


def lines_after(text, start):
    lines = text.splitlines()
    index = next(i for i, line in enumerate(lines) if line.startswith(start))
    return lines[index:]


def test_collect_records_package_extensions_and_each_gpu():
    with box(extensions=NOT_SM90):
        env = environment.collect()
    assert env.sage_qual == __version__
    assert env.python == sys.version.split()[0]
    assert (env.sageattention, env.sageattention_problem) == ("2.2.0", "")
    assert env.extensions["_qattn_sm89"] == "ok" and env.extensions["_fused"] == "ok"
    assert env.extensions["_qattn_sm90"].startswith("ImportError")
    rtx, orin = env.gpus
    assert (rtx.index, rtx.name, rtx.capability, rtx.memory_gib) == (0, "RTX 4090", [8, 9], 24.0)
    assert (rtx.kernel, rtx.no_kernel_reason) == ("sm89-fp8-cuda", "")
    assert "sm89-fp8-cuda" in rtx.runnable_variants and "sm90-fp8-cuda" not in rtx.runnable_variants
    assert (orin.index, orin.capability, orin.kernel) == (1, [8, 7], "")
    assert "sm_87" in orin.no_kernel_reason
    assert "sm89-fp8-cuda" not in orin.runnable_variants and "sm80-fp16-cuda" in orin.runnable_variants


@pytest.mark.parametrize("torch_cuda, kernel", [
    pytest.param((12, 8), "sm89-fp8-cuda", id="cuda12.8"),
    pytest.param((12, 6), "sm89-fp8-cuda-fp32acc", id="cuda12.6"),
])
def test_collect_picks_the_wrapper_kernel(torch_cuda, kernel):
    with box(gpus=(((8, 9), "L40", 48.0),), torch_cuda=torch_cuda):
        [gpu] = environment.collect().gpus
    assert gpu.kernel == kernel


@pytest.mark.parametrize("options, words", [
    pytest.param({"version": "1.0.6"}, ("1.0.6", "SageAttention 1, the release on PyPI"), id="version=1.0.6"),
    pytest.param({"version": "2.1.1"}, ("2.1.1", "older than 2.2.0"), id="version=2.1.1"),
    pytest.param({"triton": False}, ("triton is not installed",), id="triton_missing"),
    pytest.param({"import_error": OSError("DLL load failed while importing _qattn_sm89")},
                 ("OSError", "DLL load failed"), id="import_error"),
])
def test_collect_reports_why_sageattention_cannot_serve(options, words):
    with box(**options):
        env = environment.collect()
    for word in words:
        assert word in env.sageattention_problem
    assert all(gpu.kernel == "" and gpu.runnable_variants == [] for gpu in env.gpus)
    text = environment.render_text(env)
    [line] = [line for line in text.splitlines() if line.startswith("sageattention")]
    assert "cannot serve" in line and words[-1] in line


def test_collect_reports_a_kernel_whose_signature_swallows_smooth_k():
    with box(signature_drops=("smooth_k",)):
        rtx, _ = environment.collect().gpus
    assert rtx.kernel == "" and "smooth_k" in rtx.no_kernel_reason


def test_collect_records_each_gpus_sm_count_and_the_build():
    """Issue 27: what binds a profile entry to its GPU and build."""
    fake = FakeSageAttention()
    with FakeCuda([FakeGpu((9, 0), "H200", 139.8, sm_count=132), FakeGpu((8, 9), "RTX 4090", 24.0)]), \
            fake.installed():
        env = environment.collect()
    assert [gpu.sm_count for gpu in env.gpus] == [132, None]
    assert env.sageattention_source == ""  # the fake package has no files: unknown, never compared


def test_collect_without_gpus():
    with box(gpus=()):
        env = environment.collect()
    assert env.gpus == [] and env.driver == ""
    assert "GPUs           none visible" in environment.render_text(env)


def test_render_text():
    with box(extensions=NOT_SM90):
        text = environment.render_text(environment.collect(), contexts=True)
    assert text.splitlines()[0] == f"sage-qual      {__version__}"
    assert "sageattention  2.2.0" in text and "cannot serve" not in text
    assert lines_after(text, "  _qattn_sm90")[0].split()[1] == "ImportError:"
    rtx = lines_after(text, "cuda:0")
    assert rtx[0] == "cuda:0  RTX 4090  sm_89  24.0 GiB"
    assert rtx[1].split() == ["wrapper", "kernel", "sm89-fp8-cuda"]
    # a legacy-stream CUDA kernel: bridged on side streams, an opaque operator under compile, never captured
    assert rtx[2].startswith("  serves, built in default stream, side_stream, compile (")
    assert rtx[3].startswith("  runnable here") and "sm89-fp8-cuda-fp32acc" in rtx[3]
    orin = lines_after(text, "cuda:1")
    assert orin[0] == "cuda:1  Jetson Orin  sm_87  32.0 GiB"
    assert orin[1].split()[:3] == ["wrapper", "kernel", "none:"] and "sm_87" in orin[1]
    assert orin[2].startswith("  runnable here")  # no kernel: no contexts line


@pytest.mark.parametrize(
    "problem, line",
    [
        (
            'comfy-kitchen is not installed: pip install "sage-qual[comfy-kitchen]"',
            "comfy-kitchen  not installed",
        ),
        (
            "comfy-kitchen imports but has no package metadata, so its version is unknown",
            "comfy-kitchen  not usable  -- cannot serve: comfy-kitchen imports but has no package "
            "metadata, so its "
            "version is unknown",
        ),
        (
            "importing comfy-kitchen 0.2.40 failed: OSError: libcudart.so.13",
            "comfy-kitchen  not usable  -- cannot serve: importing comfy-kitchen 0.2.40 failed: OSError: "
            "libcudart.so.13",
        ),
    ],
)
def test_another_provider_reads_not_installed_only_where_it_is_absent(problem, line):
    """A provider that imports but cannot be used says why (device run 41 unpacked comfy-kitchen
    without its metadata, and `env` called it "not installed")."""
    with box():
        env = environment.collect()
    env = dataclasses.replace(
        env, other_providers=[environment.OtherProvider("comfy-kitchen", "", problem=problem)]
    )
    assert line in environment.render_text(env).splitlines()


def test_json_round_trips():
    with box():
        env = environment.collect()
    data = json.loads(environment.to_json(env))
    assert data["sageattention"] == "2.2.0"
    assert [g["capability"] for g in data["gpus"]] == [[8, 9], [8, 7]]
    assert [g["kernel"] for g in data["gpus"]] == ["sm89-fp8-cuda", ""]
    assert environment.from_dict(data) == env


@pytest.mark.parametrize("change, key", [({"driver": 580}, "driver"), ({"uptime": "3 days"}, "uptime"),
                                         ({"gpus": [{"index": 0}]}, "gpus[0].name")])
def test_json_that_is_not_an_environment_is_one_line_naming_the_key(change, key):
    with box():
        data = json.loads(environment.to_json(environment.collect()))
    with pytest.raises(records.RecordError) as refused:
        environment.from_dict({**data, **change})
    assert refused.value.key == key and "\n" not in str(refused.value)


# The command ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("as_json", [pytest.param(False, id="text"), pytest.param(True, id="json")])
def test_env_command_prints_the_record(capsys, as_json):
    with box():
        code = cli_env._env(argparse.Namespace(json=as_json))
        expected = environment.collect()
    out = capsys.readouterr().out
    assert code == 0
    if as_json:
        assert environment.from_dict(json.loads(out)) == expected
    else:
        assert out.rstrip("\n") == environment.render_text(expected, contexts=True)


@pytest.mark.parametrize("argv", [
    pytest.param(["env"], id="env"),
    pytest.param(["env", "--json"], id="env_--json"),
    pytest.param(["doctor", "--json"], id="doctor_alias"),
])
def test_cli_main_env(capsys, argv):
    with box():
        code = cli.main(argv)
        expected = environment.collect()
    out = capsys.readouterr().out
    assert code == 0
    if "--json" in argv:
        assert environment.from_dict(json.loads(out)) == expected
    else:
        assert out.rstrip("\n") == environment.render_text(expected, contexts=True)


def test_cli_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"sage-qual {__version__}"
