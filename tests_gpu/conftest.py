"""GPU qualification fixtures: the installed SageAttention, the box, forced variants, results.

Collection needs no GPU: parameters come from the variant registry and the fixture files.
Each run appends its measurements to a results table, rewritten after every row (so a run cut
short keeps what it measured) in $SAGE_QUAL_RESULTS_DIR (default: no file) as gpu_results.json
and gpu_results.md.
"""

import contextlib
import json
import os
from pathlib import Path

import pytest
import torch

import sage_qual
from sage_qual.fixtures.fileformat import load_fixture
from sage_qual.kernels import sage_package
from sage_qual.kernels.variants import VARIANTS, BoxFacts
from sage_qual.serving import platform
from sage_qual.serving.assess import GpuAssessment, assess, box_facts
from sage_qual.serving.config import WrapperConfig

FIXTURE_DIR = Path(__file__).resolve().parent.parent / "fixtures"
# Masked calls (a fixture holding an attn_mask) run only on the variants that take a mask
# (`MASK_CASES`), as certify plans them (`plan.runs`); every variant runs the others.
MASKED_PATHS = sorted(p for p in FIXTURE_DIR.glob("*.safetensors") if load_fixture(p).mask is not None)
FIXTURE_PATHS = sorted(p for p in FIXTURE_DIR.glob("*.safetensors") if p not in MASKED_PATHS)
VARIANT_NAMES = list(VARIANTS)
MASK_CASES = [(name, path) for path in MASKED_PATHS for name in VARIANT_NAMES if VARIANTS[name].takes_mask]
_results: list[dict] = []


@pytest.fixture(autouse=True)
def _fresh_process_audit():
    """Each GPU test starts as a fresh process would: no earlier test's retirement or finding holds."""
    from sage_qual.serving import audit

    audit.reset_process()
    yield
    audit.reset_process()


@pytest.fixture(scope="session")
def sage():
    try:
        return sage_package.load()
    except sage_package.SageUnavailable as why:
        pytest.skip(f"sageattention unusable: {why}")


def assess_device(packages, index: int = 0) -> GpuAssessment:
    """What cuda:`index` can run: the one `assess()` that install(), `sage-qual env` and certify use."""
    return assess(index, box_facts(platform.current(), index, packages), packages)


@pytest.fixture(scope="session")
def packages():
    """Every provider's package, or why it is not usable (`sage_package.load_all`); a box with
    comfy-kitchen alone still runs that provider's tests."""
    return sage_package.load_all()


@pytest.fixture(scope="session")
def kernels(packages):
    """The package of a variant's provider (its kernels); the test is skipped where it does not load."""
    def of(variant):
        package = packages[variant.provider]
        if isinstance(package, str):
            pytest.skip(package)
        return package
    return of


@pytest.fixture(scope="session")
def gpu0(packages) -> GpuAssessment:
    return assess_device(packages, 0)


@pytest.fixture(scope="session")
def box(gpu0) -> BoxFacts:
    return gpu0.box


@pytest.fixture
def runnable(gpu0):
    """Look up a variant by name; skip with its reasons when this box cannot run it."""

    def get(name):
        reasons = gpu0.reasons[name]
        if reasons:
            pytest.skip(f"{name} cannot run here: {'; '.join(reasons)}")
        return VARIANTS[name]

    return get


@pytest.fixture
def wrapper_serving(box):
    """install() with the kernel table forced to one variant and no size thresholds."""

    @contextlib.contextmanager
    def serving(variant, **overrides):
        sage_qual.uninstall()
        config = WrapperConfig(min_query_tokens=1, min_key_tokens=1,
                               kernel_table={box.capability: (variant.name,)}, **overrides)
        status = sage_qual.install(config=config)
        assert status.enabled, status.reason
        try:
            yield status
        finally:
            sage_qual.uninstall()

    return serving


@pytest.fixture
def record():
    """Add one row to the session's results table."""
    gpu = f"{torch.cuda.get_device_name(0)} sm_%d%d" % torch.cuda.get_device_capability(0)

    def add(**row):
        _results.append({"gpu": gpu, **row})
        _write(_results)

    return add


_FIRST = ["test", "variant", "fixture", "kind", "gpu"]


def _markdown(rows: list[dict]) -> str:
    seen = {key for row in rows for key in row}
    columns = [c for c in _FIRST if c in seen] + sorted(seen - set(_FIRST))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = [f"{row[c]:.4g}" if isinstance(row.get(c), float) else str(row.get(c, "")) for c in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _write(rows: list[dict]) -> None:
    directory = os.environ.get("SAGE_QUAL_RESULTS_DIR")
    if not directory:
        return
    Path(directory).mkdir(parents=True, exist_ok=True)
    Path(directory, "gpu_results.json").write_text(json.dumps(rows, indent=1))
    Path(directory, "gpu_results.md").write_text(_markdown(rows))
