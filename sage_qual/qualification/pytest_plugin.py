"""pytest plugin (entry point `sage_qual` in `pytest11`): qualify an app's SageAttention integration
in the app's own test suite, on sage-qual's activation fixtures and budgets.

    @pytest.mark.sage_qual(families=["FLUX.1"])
    def test_attention_is_safe(sage_qual_fixture, sage_qual_check):
        sage_qual_check(sage_qual_fixture)      # served on SageAttention and within the budget

- `--sage-qual-target module:function` (or ini `sage_qual_target`): the integration under test, any
  name `sage_qual.qualification.targets.resolve` takes; default `wrapper` (sage_qual as installed).
- `--sage-qual-fixtures DIR`: fixtures to use (default: the ones shipped with sage-qual).
- `sage_qual_fixture`: one test per fixture (of the marker's families, else all), on the GPU;
  `sage_qual_budget`: the budget certify gives that fixture for the kernel the target runs here;
  `sage_qual_target`: the resolved `Target`; `sage_qual_check(fixture)`: runs the target on it as
  certify does and fails with the reasons unless SageAttention served the call within budget.
- Without a CUDA GPU, or when the target cannot run on this one, these tests skip with the reason.
- The report header names the GPU, its capability and sageattention.
"""

from __future__ import annotations

import pytest
import torch

from sage_qual.fixtures import fileformat
from sage_qual.limits import MEMORY_BOUND
from sage_qual.qualification import budgets, target_cells, targets
from sage_qual.qualification import families as families_mod

DEFAULT_TARGET = "wrapper"
NO_GPU = "sage-qual: no CUDA GPU visible to torch; SageAttention integrations are qualified on the GPU"


def pytest_addoption(parser):
    group = parser.getgroup("sage-qual", "qualify a SageAttention integration on sage-qual's fixtures")
    group.addoption("--sage-qual-target", metavar="NAME", default=None,
                    help="integration under test: module:function, wrapper, wrapper:VARIANT, sageattn or "
                         f"diffusers:BACKEND (default: ini sage_qual_target, else {DEFAULT_TARGET})")
    group.addoption("--sage-qual-fixtures", metavar="DIR", default=None,
                    help="directory of activation fixtures (default: the ones shipped with sage-qual)")
    parser.addini("sage_qual_target", "integration under test (see --sage-qual-target)", default=None)


TARGET = pytest.StashKey[targets.Target]()


def pytest_configure(config):
    """Resolve the target and find the fixtures at once: a bad name or directory is a usage error."""
    try:
        config.stash[TARGET] = targets.resolve(_target_name(config))
    except targets.TargetError as error:
        raise pytest.UsageError(f"sage-qual: {error}") from None
    directory = config.getoption("sage_qual_fixtures")
    if directory is not None:
        try:
            fileformat.list_fixtures(directory)
        except fileformat.FixtureError as error:
            raise pytest.UsageError(f"sage-qual: --sage-qual-fixtures {error}") from None
    config.addinivalue_line(
        "markers", "sage_qual(families=None): a SageAttention qualification test; with the sage_qual_fixture "
                   "fixture it runs once per activation fixture of these families (default: all)")


def _target_name(config) -> str:
    return config.getoption("sage_qual_target") or config.getini("sage_qual_target") or DEFAULT_TARGET


def pytest_report_header(config):
    name = _target_name(config)
    if not torch.cuda.is_available():
        return [f"sage-qual: target {name}; no CUDA GPU (torch {torch.__version__}): sage_qual tests skip"]
    try:
        from importlib.metadata import version

        sage = version("sageattention")
    except Exception:  # PackageNotFoundError, or metadata that cannot be read
        sage = "not installed"
    gpus = ", ".join("cuda:%d %s sm_%d%d" % (i, torch.cuda.get_device_name(i),
                                             *torch.cuda.get_device_capability(i))
                     for i in range(torch.cuda.device_count()))
    return [f"sage-qual: target {name}; {gpus}; torch {torch.__version__} (CUDA {torch.version.cuda}); "
            f"sageattention {sage}"]


def _fixture_paths(config, families: list[str] | None) -> list:
    directory = config.getoption("sage_qual_fixtures") or fileformat.shipped_dir()
    if directory is None:
        raise pytest.UsageError("sage-qual: no fixtures: this sage-qual has no shipped fixtures/; give "
                                "--sage-qual-fixtures DIR")
    try:
        paths = fileformat.list_fixtures(directory)
        fixtures = [fileformat.load_fixture(p) for p in paths]
    except fileformat.FixtureError as error:
        raise pytest.UsageError(f"sage-qual: {error}") from None
    if families is None:
        return fixtures
    try:
        wanted = [families_mod.find(name) for name in families]
    except KeyError as error:
        raise pytest.UsageError(f"sage-qual: {error.args[0]}") from None
    return [f for f in fixtures if any(family.owns(f.family) for family in wanted)
            or families_mod.normalize(f.family) == "generic"]


def pytest_generate_tests(metafunc):
    if "sage_qual_fixture" not in metafunc.fixturenames:
        return
    marker = metafunc.definition.get_closest_marker("sage_qual")
    families = marker.kwargs.get("families") if marker else None
    fixtures = _fixture_paths(metafunc.config, families)
    metafunc.parametrize("sage_qual_fixture", [f.path for f in fixtures], ids=[f.name for f in fixtures],
                         indirect=True)


def _capability() -> tuple[int, int]:
    if not torch.cuda.is_available():
        pytest.skip(NO_GPU)
    return tuple(torch.cuda.get_device_capability(0))


@pytest.fixture(scope="session")
def sage_qual_target(pytestconfig) -> targets.Target:
    """The integration under test; skips when it cannot run on this GPU."""
    target = pytestconfig.stash[TARGET]
    _capability()
    reasons = target.machine_reasons(targets.box_facts())
    if reasons:
        pytest.skip(f"sage-qual: {target.name} cannot run on this GPU: {'; '.join(reasons)}")
    return target


@pytest.fixture
def sage_qual_fixture(request) -> fileformat.Fixture:
    """One activation fixture (see the marker), its tensors on cuda:0."""
    _capability()
    return fileformat.load_fixture(request.param, device="cuda")


@pytest.fixture
def sage_qual_budget(sage_qual_fixture, sage_qual_target) -> dict:
    """The budget certify gives this fixture for the kernel the target runs here (`budgets.budget`:
    max_rel_l2, min_cosine, per-head/item/block and norm-ratio limits)."""
    variant = sage_qual_target.variant(_capability())
    if variant is None:
        pytest.skip(f"sage-qual: {sage_qual_target.name} has no kernel for this GPU")
    return budgets.budget(variant, sage_qual_fixture)


class _CudaBench:
    device = "cuda"

    def extra_peak_bytes(self, fn):
        from sage_qual.qualification import measure

        return measure.extra_peak_bytes(fn, 0)


@pytest.fixture
def sage_qual_check(sage_qual_target):
    """check(fixture) -> the cell record; fails the test with every reason unless served in budget."""

    def check(fixture: fileformat.Fixture) -> dict:
        owner = families_mod.family_of(fixture.family)
        cell = target_cells.measure_cell(sage_qual_target, fixture, _capability(), _CudaBench(),
                                         owner.memory_bound if owner else MEMORY_BOUND)
        if cell["outcome"] == "skip":
            pytest.skip(f"sage-qual: {cell['detail']}")
        if cell["outcome"] != "pass":
            reasons = "; ".join(r["detail"] for r in cell.get("reasons", [])) or cell.get("detail", "")
            pytest.fail(f"sage-qual: {sage_qual_target.name} on {fixture.name}: {reasons}", pytrace=False)
        return cell

    return check
