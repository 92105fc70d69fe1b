"""`pytest -m slow --require-gpu` (or SAGE_QUAL_REQUIRE_GPU=1) fails where the GPU tests would skip
for want of a GPU or of SageAttention: a CI runner that lost its GPU goes red, not green.

Runs the repository's root conftest.py on a two-test project in this process (pytester; this CPU
machine has neither a GPU nor SageAttention).
"""

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
PROJECT_TEST = '''
import pytest
import torch


@pytest.mark.slow
def test_needs_the_gpu():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")


@pytest.mark.slow
@pytest.mark.xfail(reason="a known defect", strict=False)
def test_known_defect():
    raise AssertionError("expected")
'''


@pytest.fixture
def project(pytester):
    shutil.copy(ROOT / "conftest.py", pytester.path / "conftest.py")
    (pytester.path / "test_gpu.py").write_text(PROJECT_TEST)
    return pytester


def run(project, *args: str, require: str | None = None) -> SimpleNamespace:
    """pytest in this process (pytester), on the two-test project with the repository's conftest."""
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("SAGE_QUAL_REQUIRE_GPU", raising=False)
        if require is not None:
            patch.setenv("SAGE_QUAL_REQUIRE_GPU", require)
        result = project.runpytest_inprocess("-p", "no:cacheprovider", "-q", "-rA", *args)
    return SimpleNamespace(returncode=int(result.ret), stdout=str(result.stdout))


def test_without_the_option_gpu_tests_skip(project):
    result = run(project, "-m", "slow")
    assert result.returncode == 0, result.stdout
    assert "1 skipped, 1 xfailed" in result.stdout


def test_a_plain_run_deselects_the_gpu_tests_with_one_line(project):
    result = run(project, "-rs")
    assert result.returncode == 5, result.stdout  # nothing left to run in this project
    assert "2 deselected" in result.stdout and "SKIPPED" not in result.stdout
    assert "tests_gpu: 2 GPU qualification tests deselected; run them on a GPU box" in result.stdout


@pytest.mark.parametrize("how", ["option", "variable"])
def test_required_gpu_tests_fail_once_with_the_reason(project, how):
    result = run(project, "-m", "slow", *(["--require-gpu"] if how == "option" else []),
                 require="1" if how == "variable" else None)
    assert result.returncode == 1, result.stdout
    assert "--require-gpu: no CUDA GPU visible to torch" in result.stdout
    assert "2 GPU test(s) not run" in result.stdout
    assert "1 failed, 2 deselected" in result.stdout  # one failure for the run, not one per test

