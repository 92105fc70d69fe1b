"""The pytest plugin, as a downstream project uses it: the example project's suite passes (its GPU
tests skip with the reason here), fixtures are parametrized per family, bad options are usage errors,
and the check a test calls serves, judges and explains exactly as certify's cell does."""

import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sage_qual.fixtures import fileformat
from sage_qual.qualification import families as families_mod
from sage_qual.qualification.evidence import report_model
from sage_qual.qualification.evidence.report_model import AccuracyClass, Cell, Outcome
from sage_qual.qualification.integrations import targets
from sage_qual.qualification.integrations.pytest_plugin import check_cell
from sage_qual.qualification.measure.cell import measure_target
from sage_qual.testing import FakeCuda, FakeGpu, FakeSageAttention

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "downstream_app"


@pytest.fixture
def pytest_run(pytester, monkeypatch):
    """Run pytest in this process (pytester: no new interpreter, no second torch import) in `cwd`,
    the sage_qual plugin loaded from its entry point as in any project."""

    def run(cwd: Path, *args: str, require: str | None = None) -> SimpleNamespace:
        monkeypatch.delenv("SAGE_QUAL_REQUIRE_GPU", raising=False)
        if require is not None:
            monkeypatch.setenv("SAGE_QUAL_REQUIRE_GPU", require)
        monkeypatch.chdir(cwd)
        result = pytester.runpytest_inprocess("-p", "no:cacheprovider", *args)
        return SimpleNamespace(returncode=int(result.ret), stdout=str(result.stdout),
                               stderr=str(result.stderr))

    return run


def test_the_example_project_passes_and_says_why_its_gpu_tests_skip(pytest_run):
    result = pytest_run(EXAMPLE, "-rs")
    assert result.returncode == 0, result.stdout + result.stderr
    assert ("sage-qual: target downstream_app.attention:attention (GPU and target are looked at"
            in result.stdout)
    families = [families_mod.find(name) for name in ("FLUX.1", "Qwen-Image", "Wan 2.2")]
    shipped = map(fileformat.load_fixture, fileformat.list_fixtures(fileformat.shipped_dir()))
    owned = [f for f in shipped if any(family.owns(f.family) for family in families)
             or families_mod.normalize(f.family) == "generic"]
    assert len(owned) >= 3  # one per family at least
    assert f"2 passed, {len(owned)} skipped" in result.stdout
    assert "sage-qual: no CUDA GPU visible to torch" in result.stdout


def test_fixtures_are_one_test_each_for_the_marked_families(pytest_run, tmp_path):
    (tmp_path / "test_app.py").write_text(
        "import pytest\n"
        "@pytest.mark.sage_qual(families=['qwen-image'])\n"
        "def test_q(sage_qual_fixture):\n    pass\n"
        "def test_all(sage_qual_fixture):\n    pass\n")
    result = pytest_run(tmp_path, "--collect-only", "-q")
    assert result.returncode == 0, result.stdout + result.stderr
    collected = [line for line in result.stdout.splitlines() if "::" in line]
    qwen = sorted(line.split("[")[1].rstrip("]") for line in collected if "test_q[" in line)
    shipped = fileformat.list_fixtures(fileformat.shipped_dir())
    owned = [fileformat.load_fixture(p) for p in shipped]
    assert qwen == sorted(f.name for f in owned if f.family.lower() in ("qwen-image", "generic"))
    assert qwen and any(name.startswith("qwen_image") for name in qwen)
    assert len([line for line in collected if "test_all[" in line]) == len(shipped)


@pytest.mark.parametrize("how", ["variable", "option"])
def test_a_required_gpu_that_is_missing_is_one_failure_with_the_reason(pytest_run, how):
    """SAGE_QUAL_REQUIRE_GPU=1 or --sage-qual-require-gpu: the GPU tests (one per fixture they read)
    become one failure that counts them; the app's CPU tests still run."""
    result = pytest_run(EXAMPLE, "-rf", *(["--sage-qual-require-gpu"] if how == "option" else []),
                        require="1" if how == "variable" else None)
    assert result.returncode == 1, result.stdout + result.stderr
    deselected = re.search(r"1 failed, 2 passed, (\d+) deselected", result.stdout)
    assert deselected and int(deselected[1]) > 0, result.stdout
    assert ("--sage-qual-require-gpu: sage-qual: no CUDA GPU visible to torch" in result.stdout
            and f"{deselected[1]} GPU test(s) not run" in result.stdout)


def test_a_session_that_asks_nothing_of_the_plugin_imports_no_torch(tmp_path):
    (tmp_path / "conftest.py").write_text(
        "import sys\n"
        "def pytest_sessionfinish(session):\n"
        "    print('TORCH', 'torch' in sys.modules)\n")
    (tmp_path / "test_plain.py").write_text("def test_x():\n    pass\n")
    # A fresh interpreter: this one has torch already.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    result = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-s"], cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "TORCH False" in result.stdout and "sage-qual: target wrapper" in result.stdout


def test_the_fixtures_hook_is_the_seam_for_what_the_tests_draw_from(pytest_run, tmp_path):
    shipped = fileformat.list_fixtures(fileformat.shipped_dir())
    (tmp_path / "conftest.py").write_text(
        "from pathlib import Path\n"
        "def pytest_sage_qual_fixtures(config):\n"
        f"    return [Path({str(shipped[0])!r})]\n")
    (tmp_path / "test_app.py").write_text("def test_all(sage_qual_fixture):\n    pass\n")
    result = pytest_run(tmp_path, "--collect-only", "-q")
    assert result.returncode == 0, result.stdout + result.stderr
    assert [line for line in result.stdout.splitlines() if "::" in line] == [
        f"test_app.py::test_all[{fileformat.load_fixture(shipped[0]).name}]"]


@pytest.mark.parametrize("damage, message", [
    ("nan", "values are not finite; the reference needs finite inputs"),
    ("twice", "two fixtures named "),
])
def test_the_fixtures_the_plugin_draws_are_checked_as_certify_checks_them(pytest_run, tmp_path, damage,
                                                                          message):
    """A fixture with a non-finite input, or two of one name, is a usage error naming the file, as
    in certify and gate (`selection.load_checked`), not a test that measures on what is left."""
    import torch

    from sage_qual.fixtures.fileformat import save_fixture

    folder = tmp_path / "fixtures"
    folder.mkdir()
    q, k, v = (torch.randn(1, 2, 32, 64).to(torch.bfloat16) for _ in range(3))
    if damage == "nan":
        q[0, 0, 3, 5] = float("nan")
    save_fixture(folder / "a.safetensors", q, k, v, family="FLUX.1", kind="replica", source={"test": 1},
                 provenance="random test data", bounds={cls: {"max_rel_l2": 0.1, "min_cosine": 0.99}
                                                        for cls in ("fp16", "fp8")})
    (tmp_path / "test_app.py").write_text("def test_x(sage_qual_fixture):\n    pass\n")
    if damage == "twice":  # the fixtures hook hands one file twice
        (tmp_path / "conftest.py").write_text(
            "from pathlib import Path\n"
            "def pytest_sage_qual_fixtures(config):\n"
            f"    return [Path({str(folder / 'a.safetensors')!r})] * 2\n")
    result = pytest_run(tmp_path, "--sage-qual-fixtures", str(folder))
    assert result.returncode == 4, result.stdout + result.stderr
    assert message in result.stderr and "a.safetensors" in result.stderr


def test_the_machine_hook_is_the_seam_for_the_gpu_the_tests_run_on(pytest_run, tmp_path):
    (tmp_path / "conftest.py").write_text(
        "from sage_qual.qualification.integrations.pytest_plugin import Machine\n"
        "def pytest_sage_qual_machine(config):\n"
        "    return Machine(problem='the runner lost its GPU')\n")
    (tmp_path / "test_app.py").write_text("def test_t(sage_qual_target):\n    pass\n")
    result = pytest_run(tmp_path, "-rs")
    assert result.returncode == 0 and "sage-qual: the runner lost its GPU; SageAttention" in result.stdout
    result = pytest_run(tmp_path, "-rf", "--sage-qual-require-gpu")
    assert result.returncode == 1 and "1 failed, 1 deselected" in result.stdout
    assert ("--sage-qual-require-gpu: sage-qual: the runner lost its GPU; 1 GPU test(s) not run"
            in result.stdout)


@pytest.mark.parametrize("marker, message", [
    (pytest.mark.sage_qual(families=["FLUX1x"]), "unknown family 'FLUX1x' (known: FLUX.1, "),
    (pytest.mark.sage_qual(family=["FLUX.1"]), "takes only families=[...] (got family)"),
    (pytest.mark.sage_qual("FLUX.1"), "takes only families=[...] (got a positional argument)"),
    (pytest.mark.sage_qual(families="FLUX.1"), "families= takes a list of family names, not 'FLUX.1'"),
])
def test_marker_arguments_are_checked(marker, message):
    from sage_qual.qualification.integrations.pytest_plugin import _marked_families

    with pytest.raises(pytest.UsageError, match=re.escape(message)):
        _marked_families("test_x", marker.mark)
    flux = pytest.mark.sage_qual(families=["flux.1"]).mark
    assert [f.name for f in _marked_families("t", flux)] == ["FLUX.1"]


@pytest.mark.parametrize("args, message", [
    (["-k", "test_x", "--sage-qual-target", "no_such_app_xyz:attention"], "cannot import no_such_app_xyz"),
    (["-k", "test_x", "--sage-qual-fixtures", "/nonexistent/fixtures"], "directory: not found"),
    (["-k", "misspelt"], "test_misspelt: unknown family 'FLUX1x' (known: FLUX.1, "),
])
def test_bad_options_are_usage_errors_with_the_fix(pytest_run, tmp_path, args, message):
    (tmp_path / "test_app.py").write_text(
        "import pytest\n"
        "def test_x(sage_qual_target, sage_qual_fixture):\n    pass\n"
        "@pytest.mark.sage_qual(families=['FLUX1x'])\n"
        "def test_misspelt():\n    pass\n")
    result = pytest_run(tmp_path, *args)
    assert result.returncode == 4, result.stdout + result.stderr  # pytest's usage error
    assert message in result.stderr


@pytest.fixture
def fake_h200():
    fake = FakeSageAttention()
    with FakeCuda([FakeGpu((9, 0), "Fake H200")]), fake.installed():
        yield fake


def test_the_check_a_test_calls_returns_the_cell_record(fake_h200):
    target, fixture = targets.resolve("wrapper:sm90-fp8-cuda"), _fixture("sdxl_1024_level1")
    cell = check_cell(target, fixture, (9, 0), _CpuBench())
    assert isinstance(cell, report_model.Cell)
    assert (cell.variant, cell.fixture, cell.outcome) == ("wrapper:sm90-fp8-cuda", "sdxl_1024_level1",
                                                          report_model.Outcome.PASS)
    assert cell.accuracy_class == report_model.AccuracyClass.FP8
    assert cell.metrics.finite is True and cell.reasons == []
    assert 0 < cell.metrics.rel_l2 <= cell.budget.max_rel_l2 and cell.extra_bytes_per_element == 0


def first_rows_wrong(exact):
    """Wrong in the first 256 query rows only: the first-call check, which judges the call's last rows
    by both judges, passes it and the wrapper serves the call."""
    out = exact.clone()
    out[:, :, :256] *= 3
    return out


def test_the_check_fails_the_test_with_every_reason(fake_h200):
    fake_h200.return_value(first_rows_wrong)
    with pytest.raises(pytest.fail.Exception,
                       match=r"^sage-qual: wrapper:sm90-fp8-cuda on flux1_1024: relative L2 .*; "):
        check_cell(targets.resolve("wrapper:sm90-fp8-cuda"), _fixture("flux1_1024"), (9, 0), _CpuBench())


def test_the_check_skips_a_call_the_target_leaves_to_torch(fake_h200):
    fixture = _fixture("krea2_b0_outlier_gqa")
    small = fileformat.Fixture(**{**fixture.__dict__, "q": fixture.q[:, :, :64], "k": fixture.k[:, :, :32],
                                  "v": fixture.v[:, :, :32]})
    with pytest.raises(pytest.skip.Exception,
                       match=r"^sage-qual: wrapper does not take this call: short: tokens=64/32"):
        check_cell(targets.resolve("wrapper"), small, (9, 0), _CpuBench())


class _CpuBench:
    device = "cpu"

    def extra_peak_bytes(self, fn):
        return fn(), 0


def _fixture(name: str) -> fileformat.Fixture:
    return fileformat.load_fixture(fileformat.shipped_dir() / f"{name}.safetensors")


def test_a_served_call_within_budget_passes(fake_h200):
    cell = measure_target(targets.resolve("wrapper:sm90-fp8-cuda"), _fixture("sdxl_1024_level1"),
                                     (9, 0), _CpuBench())
    assert cell.outcome == Outcome.PASS and cell.accuracy_class == AccuracyClass.FP8
    assert (cell.variant, cell.fixture) == ("wrapper:sm90-fp8-cuda", "sdxl_1024_level1")
    assert fake_h200.calls and fake_h200.calls[0].function == "sageattn_qk_int8_pv_fp8_cuda_sm90"


def test_a_result_out_of_budget_fails_with_the_numbers(fake_h200):
    fake_h200.return_value(first_rows_wrong)  # past flux1_1024's budget, served
    cell = measure_target(targets.resolve("wrapper:sm90-fp8-cuda"), _fixture("flux1_1024"),
                                     (9, 0), _CpuBench())
    assert cell.outcome == Outcome.FAIL
    assert any(r.detail.startswith("relative L2 ") for r in cell.reasons), cell.reasons


def test_a_call_the_integration_leaves_to_torch_is_not_evidence(fake_h200):
    # The wrapper as installed leaves calls under 1536/512 tokens to torch: no verdict from them.
    fixture = _fixture("krea2_b0_outlier_gqa")
    small = fileformat.Fixture(**{**fixture.__dict__, "q": fixture.q[:, :, :64], "k": fixture.k[:, :, :32],
                                  "v": fixture.v[:, :, :32]})
    cell = measure_target(targets.resolve("wrapper"), small, (9, 0), _CpuBench())
    assert cell == Cell("wrapper", fixture.name, Outcome.SKIP,
                        "wrapper does not take this call: short: tokens=64/32 (needs >= 1536/512)")
    assert fake_h200.calls == []


def test_a_function_that_claims_everything_but_runs_torch_is_a_skip_with_why(fake_h200, monkeypatch):
    import types

    app = types.ModuleType("plain_app_xyz")
    app.attention = lambda q, k, v, **kw: torch.nn.functional.scaled_dot_product_attention(q, k, v, **kw)
    monkeypatch.setitem(sys.modules, "plain_app_xyz", app)
    cell = measure_target(targets.resolve("plain_app_xyz:attention"), _fixture("flux1_1024"),
                                     (9, 0), _CpuBench())
    assert cell.outcome == Outcome.SKIP
    assert "did not run SageAttention on this call: no SageAttention function was called" in cell.detail
