"""Markers, skips and the report header for the whole suite (registered here, once).

`pytest` runs the fast CPU suite and collects tests_gpu, whose tests skip with the reason;
`pytest -m slow` runs the GPU qualification on a box with a CUDA GPU and SageAttention.
"""

import importlib.metadata

import pytest
import torch


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: GPU qualification test; run with `pytest -m slow`")
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")


def _sageattention_version() -> str:
    try:
        return importlib.metadata.version("sageattention")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def pytest_report_header(config):
    if not torch.cuda.is_available():
        return [f"torch {torch.__version__}; no CUDA GPU: tests_gpu will skip"]
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
    not_selected = pytest.mark.skip(reason="GPU qualification test: run it with `pytest -m slow`")
    no_gpu = pytest.mark.skip(reason="no CUDA GPU visible to torch")
    for item in items:
        if "slow" in item.keywords and not slow_selected:
            item.add_marker(not_selected)
        elif "gpu" in item.keywords and not has_gpu:
            item.add_marker(no_gpu)
