"""Markers, skips and the report header for the whole suite (registered here, once).

`pytest` runs the fast CPU suite and collects tests_gpu, whose tests skip with the reason;
`pytest -m slow` runs the GPU qualification on a box with a CUDA GPU and SageAttention. With
`--require-gpu` (or SAGE_QUAL_REQUIRE_GPU=1), a GPU test that would skip because this machine has
no CUDA GPU or no usable SageAttention fails instead, so a CI runner that lost its GPU goes red.
"""

import importlib.metadata
import os

import pytest
import torch

REQUIRE_GPU_VARIABLE = "SAGE_QUAL_REQUIRE_GPU"


def pytest_addoption(parser):
    parser.addoption("--require-gpu", action="store_true",
                     help="fail (not skip) GPU tests when no CUDA GPU or no usable SageAttention is found "
                          f"(also: {REQUIRE_GPU_VARIABLE}=1)")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: GPU qualification test; run with `pytest -m slow`")
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")


def _sageattention_version() -> str:
    try:
        return importlib.metadata.version("sageattention")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def require_gpu(config) -> bool:
    value = os.environ.get(REQUIRE_GPU_VARIABLE, "").strip()
    if value not in ("", "0", "1"):
        raise pytest.UsageError(f"{REQUIRE_GPU_VARIABLE}={value!r}: set it to 1 (require) or 0 / unset")
    return config.getoption("--require-gpu") or value == "1"


def missing_gpu() -> str:
    """Why this machine cannot run the GPU tests; empty when it can."""
    if not torch.cuda.is_available():
        return f"no CUDA GPU visible to torch {torch.__version__}"
    from sage_qual.serving import sage_package

    try:
        sage_package.load()
    except sage_package.SageUnavailable as why:
        return f"sageattention unusable: {why}"
    return ""


def pytest_report_header(config):
    if not torch.cuda.is_available():
        return [f"torch {torch.__version__}; no CUDA GPU: tests_gpu will "
                + ("FAIL (--require-gpu)" if require_gpu(config) else "skip")]
    gpus = ", ".join(
        "cuda:%d %s sm_%d%d" % (i, torch.cuda.get_device_name(i), *torch.cuda.get_device_capability(i))
        for i in range(torch.cuda.device_count())
    )
    return [f"torch {torch.__version__} (CUDA {torch.version.cuda}); "
            f"sageattention {_sageattention_version()}",
            f"GPUs: {gpus}"]


def pytest_collection_modifyitems(config, items):
    slow_selected = "slow" in (config.getoption("markexpr") or "")
    has_gpu = torch.cuda.is_available()
    config.stash[_MISSING] = missing_gpu() if require_gpu(config) and slow_selected else ""
    not_selected = pytest.mark.skip(reason="GPU qualification test: run it with `pytest -m slow`")
    no_gpu = pytest.mark.skip(reason="no CUDA GPU visible to torch")
    for item in items:
        # Markers, not keywords: a test parametrized with the id "gpu" is not a GPU test.
        if item.get_closest_marker("slow") and not slow_selected:
            item.add_marker(not_selected)
        elif item.get_closest_marker("gpu") and not has_gpu:
            item.add_marker(no_gpu)


_MISSING = pytest.StashKey[str]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under --require-gpu, a selected GPU test that skipped on a machine without a GPU or without
    SageAttention is a failure, with the reason."""
    outcome = yield
    result = outcome.get_result()
    missing = item.config.stash.get(_MISSING, "")
    selected = item.get_closest_marker("slow") or item.get_closest_marker("gpu")
    if missing and selected and result.skipped and not hasattr(result, "wasxfail"):
        result.outcome = "failed"
        result.longrepr = f"--require-gpu: {missing} (the test would have skipped)"
