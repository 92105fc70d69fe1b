"""Markers, GPU-test selection and the report header for the whole suite (registered here, once).

`pytest` runs the fast CPU suite; the GPU qualification in tests_gpu (marker `slow`) is collected
and deselected with one summary line. `pytest -m slow` selects it explicitly (a `-m` expression
that the slow marker satisfies, never a substring of it) for a box with a CUDA GPU and
SageAttention. With `--require-gpu` (or SAGE_QUAL_REQUIRE_GPU=1), a run that selected the GPU tests
on a machine with no CUDA GPU or no usable SageAttention is one failure with the reason (not one
per test), so a CI runner that lost its GPU goes red.

The README runs the fast suite in pytest-xdist workers, one test file per worker (`-n auto --dist
loadfile`: a module's shared certify run is made once). Each worker computes with one CPU thread:
two workers of torch's two threads each took 352 s on CI's two cores against 366 s in one process,
one thread each 166 s (docs/fast-suite.md, 2026-12-02).
"""

import importlib.metadata
import os

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):  # before anything imports torch, in this worker and its children
    os.environ.setdefault("OMP_NUM_THREADS", "1")

from sage_qual.qualification.integrations.pytest_plugin import collapse_to_one_failure, require_gpu

pytest_plugins = ["pytester"]  # tests_fast runs pytest sessions in-process (test_plugin, test_require_gpu)

_DESELECTED = pytest.StashKey[int]()


def pytest_addoption(parser):
    parser.addoption("--require-gpu", action="store_true",
                     help="fail (not skip) GPU tests when no CUDA GPU or no usable SageAttention is found "
                          "(also: SAGE_QUAL_REQUIRE_GPU=1)")


@pytest.hookimpl(tryfirst=True)  # before pytest-benchmark reads its options
def pytest_configure(config):
    config.addinivalue_line("markers", "slow: GPU qualification test; run with `pytest -m slow`")
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")
    # Under xdist (the README's test command) a benchmark cannot time reliably, so each runs once, as
    # pytest-benchmark would do after warning on every run; `-p no:xdist` times them (docs/benchmarks.md).
    xdist = config.getoption("dist", "no") != "no" or "PYTEST_XDIST_WORKER" in os.environ
    if hasattr(config.option, "benchmark_disable") and xdist:
        config.option.benchmark_disable = True


def _sageattention_version() -> str:
    try:
        return importlib.metadata.version("sageattention")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def missing_gpu() -> str:
    """Why this machine cannot run the GPU tests; empty when it can."""
    import torch

    if not torch.cuda.is_available():
        return f"no CUDA GPU visible to torch {torch.__version__}"
    from sage_qual.kernels import sage_package

    try:
        sage_package.load()
    except sage_package.SageUnavailable as why:
        return f"sageattention unusable: {why}"
    return ""


def pytest_report_header(config):
    import torch

    if not torch.cuda.is_available():
        return [f"torch {torch.__version__}; no CUDA GPU: tests_gpu will "
                + ("FAIL (--require-gpu)" if require_gpu(config, "require_gpu") else "skip")]
    gpus = ", ".join(
        "cuda:%d %s sm_%d%d" % (i, torch.cuda.get_device_name(i), *torch.cuda.get_device_capability(i))
        for i in range(torch.cuda.device_count())
    )
    return [f"torch {torch.__version__} (CUDA {torch.version.cuda}); "
            f"sageattention {_sageattention_version()}",
            f"GPUs: {gpus}"]


@pytest.hookimpl(trylast=True)  # after pytest's own -m/-k deselection
def pytest_collection_modifyitems(config, items):
    # Markers, not keywords: a test parametrized with the id "gpu" is not a GPU test. A slow test
    # still here after -m was selected by it; without -m, slow tests are deselected.
    slow = [item for item in items if item.get_closest_marker("slow")]
    if slow and not config.getoption("markexpr"):
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not item.get_closest_marker("slow")]
        config.stash[_DESELECTED] = len(slow)
        if hasattr(config, "workeroutput"):  # an xdist worker: the controller prints the line
            config.workeroutput["gpu_tests_deselected"] = len(slow)
        slow = []
    gpu_tests = [item for item in items if item.get_closest_marker("slow") or item.get_closest_marker("gpu")]
    if not gpu_tests:
        return
    missing = missing_gpu() if require_gpu(config, "require_gpu") else ""
    if missing:
        collapse_to_one_failure(config, items, gpu_tests, missing, "--require-gpu")
        return
    import torch

    if not torch.cuda.is_available():  # slow tests skip through their fixtures, with the reason
        no_gpu = pytest.mark.skip(reason="no CUDA GPU visible to torch")
        for item in gpu_tests:
            if item.get_closest_marker("gpu"):
                item.add_marker(no_gpu)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """`-n auto`: one worker per CPU this process may use, at most 8 (each imports torch and collects
    the whole suite)."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(usable, 8))


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """Each xdist worker collected the whole suite: any one's count of deselected GPU tests is it."""
    count = getattr(node, "workeroutput", {}).get("gpu_tests_deselected")
    if count:
        node.config.stash[_DESELECTED] = count


def pytest_terminal_summary(terminalreporter, config):
    count = config.stash.get(_DESELECTED, 0)
    if count:
        terminalreporter.write_line(f"tests_gpu: {count} GPU qualification tests deselected; run them on a "
                                    "GPU box with `pytest -m slow` (docs/guide.md, GPU qualification)")
