"""pytest plugin (entry point `sage_qual` in `pytest11`): qualify an app's SageAttention integration
in the app's own test suite, on sage-qual's activation fixtures and budgets.

    @pytest.mark.sage_qual(families=["FLUX.1"])
    def test_attention_is_safe(sage_qual_fixture, sage_qual_check):
        sage_qual_check(sage_qual_fixture)      # served on SageAttention and within the budget

- `--sage-qual-target module:function` (or ini `sage_qual_target`): the integration under test, any
  name `sage_qual.qualification.integrations.targets.resolve` takes; default `wrapper` (sage_qual as
  installed).
- `--sage-qual-fixtures DIR`: fixtures to use (default: the ones shipped with sage-qual).
- `sage_qual_fixture`: one test per fixture (of the marker's families, else all), on the GPU;
  `sage_qual_budget`: the budget certify gives that fixture for the kernel the target runs here;
  `sage_qual_target`: the resolved `Target`; `sage_qual_check(fixture)`: runs the target on it as
  certify does, skips or fails with the reasons unless SageAttention served the call within budget,
  and returns the `report_model.Cell` record (`cell.metrics.rel_l2`, `cell.budget`, ...).
- Without a CUDA GPU, or when the target cannot run on this one, these tests skip with the reason;
  with `--sage-qual-require-gpu` (or SAGE_QUAL_REQUIRE_GPU=1) a run without a GPU is one failure
  with the reason instead, so a CI runner that lost its GPU goes red.
- Hooks (`SageQualHooks`): `pytest_sage_qual_machine(config)` says which GPU the tests run on and
  `pytest_sage_qual_fixtures(config)` which fixture files they draw from; a conftest.py may answer either
  (a test suite's fake GPU, a project's own fixtures).

The plugin is loaded in every pytest session where sage-qual is installed, so it costs nothing
until asked: it imports no torch, touches no CUDA and resolves no target until a collected test
uses its fixtures or marker. Bad options and marker arguments are then usage errors.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from sage_qual.kernels.variants import capability_label
from sage_qual.qualification import families as families_mod

if TYPE_CHECKING:  # imported where a check runs: the plugin costs nothing until asked
    from sage_qual.qualification.evidence.report_model import Cell

DEFAULT_TARGET = "wrapper"
REQUIRE_GPU_VARIABLE = "SAGE_QUAL_REQUIRE_GPU"
FIXTURES = ("sage_qual_fixture", "sage_qual_budget", "sage_qual_target", "sage_qual_check")
MARKER_ARGUMENTS = ("families",)


@dataclass(frozen=True)
class Machine:
    """The GPU the sage_qual tests run on (cuda:0), or why there is none."""
    capability: tuple[int, int] | None = None
    label: str = ""  # e.g. "cuda:0 NVIDIA H200 sm_90"
    problem: str = ""  # why no test can run here; empty when one can


class SageQualHooks:
    """Hook specifications of the plugin: the seams a conftest.py answers to change what it runs on."""

    @pytest.hookspec(firstresult=True)
    def pytest_sage_qual_machine(self, config: pytest.Config) -> Machine | None:
        """The GPU the sage_qual tests run on. Default: torch's cuda:0, asked when a test needs it."""

    @pytest.hookspec(firstresult=True)
    def pytest_sage_qual_fixtures(self, config: pytest.Config) -> list[Path] | None:
        """The activation fixture files the sage_qual tests draw from. Default: --sage-qual-fixtures
        DIR, else the ones shipped with sage-qual."""


def pytest_addhooks(pluginmanager):
    pluginmanager.add_hookspecs(SageQualHooks)


def pytest_addoption(parser):
    group = parser.getgroup("sage-qual", "qualify a SageAttention integration on sage-qual's fixtures")
    group.addoption("--sage-qual-target", metavar="NAME", default=None,
                    help="integration under test: module:function, wrapper, wrapper:VARIANT, sageattn or "
                         f"diffusers:BACKEND (default: ini sage_qual_target, else {DEFAULT_TARGET})")
    group.addoption("--sage-qual-fixtures", metavar="DIR", default=None,
                    help="directory of activation fixtures (default: the ones shipped with sage-qual)")
    group.addoption("--sage-qual-require-gpu", action="store_true",
                    help="without a usable CUDA GPU, fail the run once with the reason instead of skipping "
                         f"the sage_qual tests (also: {REQUIRE_GPU_VARIABLE}=1)")
    parser.addini("sage_qual_target", "integration under test (see --sage-qual-target)", default=None)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "sage_qual(families=None): a SageAttention qualification test; with the sage_qual_fixture "
                   "fixture it runs once per activation fixture of these families (default: all)")


def require_gpu(config, option: str = "sage_qual_require_gpu") -> bool:
    """--sage-qual-require-gpu, or SAGE_QUAL_REQUIRE_GPU=1 (anything but 1, 0 or unset: a usage error)."""
    value = os.environ.get(REQUIRE_GPU_VARIABLE, "").strip()
    if value not in ("", "0", "1"):
        raise pytest.UsageError(f"{REQUIRE_GPU_VARIABLE}={value!r}: set it to 1 (require) or 0 / unset")
    return bool(config.getoption(option)) or value == "1"


def _target_name(config) -> str:
    return config.getoption("sage_qual_target") or config.getini("sage_qual_target") or DEFAULT_TARGET


def pytest_report_header(config):
    return [f"sage-qual: target {_target_name(config)} (GPU and target are looked at when a sage_qual test "
            "runs)"]


# What a test asks for, looked up once per session -------------------------------------------------
_MACHINE = pytest.StashKey[Machine]()
_TARGET = pytest.StashKey[object]()
_FIXTURE_FILES = pytest.StashKey[object]()  # list of paths, or the UsageError their directory gave


@pytest.hookimpl(trylast=True)
def pytest_sage_qual_machine(config) -> Machine:
    import torch

    if not torch.cuda.is_available():
        return Machine(problem=f"no CUDA GPU visible to torch {torch.__version__}")
    capability = tuple(torch.cuda.get_device_capability(0))
    return Machine(capability, f"cuda:0 {torch.cuda.get_device_name(0)} {capability_label(capability)}")


@pytest.hookimpl(trylast=True)
def pytest_sage_qual_fixtures(config) -> list[Path]:
    from sage_qual.fixtures import fileformat

    directory = config.getoption("sage_qual_fixtures") or fileformat.shipped_dir()
    if directory is None:
        raise pytest.UsageError("sage-qual: no fixtures: this sage-qual has no shipped fixtures/; give "
                                "--sage-qual-fixtures DIR")
    try:
        return fileformat.list_fixtures(directory)
    except fileformat.FixtureError as error:
        raise pytest.UsageError(f"sage-qual: --sage-qual-fixtures {error}") from None


def machine(config) -> Machine:
    if _MACHINE not in config.stash:
        config.stash[_MACHINE] = config.hook.pytest_sage_qual_machine(config=config)
    return config.stash[_MACHINE]


def _target(config):
    if _TARGET not in config.stash:
        from sage_qual.qualification.integrations import targets

        try:
            config.stash[_TARGET] = targets.resolve(_target_name(config))
        except targets.TargetError as error:
            raise pytest.UsageError(f"sage-qual: {error}") from None
    return config.stash[_TARGET]


def _marked_families(item_name: str, marker) -> list[families_mod.Family] | None:
    """The marker's families, checked: an unknown argument or family is a usage error naming the known."""
    if marker is None:
        return None
    unknown = sorted(set(marker.kwargs) - set(MARKER_ARGUMENTS))
    if marker.args or unknown:
        raise pytest.UsageError(f"sage-qual: {item_name}: @pytest.mark.sage_qual takes only families=[...] "
                                f"(got {', '.join(unknown) or 'a positional argument'})")
    names = marker.kwargs.get("families")
    if names is None:
        return None
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise pytest.UsageError(f"sage-qual: {item_name}: families= takes a list of family names, "
                                f"not {names!r}")
    try:
        return [families_mod.find(name) for name in names]
    except KeyError as error:
        raise pytest.UsageError(f"sage-qual: {item_name}: {error.args[0]}") from None


def _loaded_fixtures(config):
    """The fixture files, loaded once; a UsageError is kept and raised after collection."""
    if _FIXTURE_FILES not in config.stash:
        from sage_qual.qualification import selection  # certify's and gate's reading and checks

        try:
            paths = config.hook.pytest_sage_qual_fixtures(config=config)
            config.stash[_FIXTURE_FILES] = selection.load_checked(paths)
        except selection.UsageError as error:  # the class selection raises, whatever re-imported errors
            config.stash[_FIXTURE_FILES] = pytest.UsageError(f"sage-qual: {error}")
        except pytest.UsageError as error:
            config.stash[_FIXTURE_FILES] = error
    return config.stash[_FIXTURE_FILES]


def pytest_generate_tests(metafunc):
    if "sage_qual_fixture" not in metafunc.fixturenames:
        return
    loaded = _loaded_fixtures(metafunc.config)
    if isinstance(loaded, pytest.UsageError):
        return  # said once, after collection (an error raised here would be one per test module)
    wanted = _marked_families(metafunc.definition.nodeid, metafunc.definition.get_closest_marker("sage_qual"))
    chosen = [f for f in loaded
              if wanted is None or any(families_mod.counts_for(family, f.family) for family in wanted)]
    metafunc.parametrize("sage_qual_fixture", [f.path for f in chosen], ids=[f.name for f in chosen],
                         indirect=True)


def _uses_plugin(item) -> bool:
    fixtures = set(getattr(item, "fixturenames", ()))
    return bool(fixtures & set(FIXTURES)) or item.get_closest_marker("sage_qual") is not None


class RequiredGpuMissing(pytest.Item):
    """The one failure that stands for every GPU test of a run that requires a GPU and has none."""

    def __init__(self, *, reason: str, count: int, option: str, **kwargs):
        super().__init__(**kwargs)
        self.reason, self.count, self.option = reason, count, option

    def runtest(self):
        pytest.fail(f"{self.option}: {self.reason}; {self.count} GPU test(s) not run", pytrace=False)

    def reportinfo(self):
        return self.path, None, self.name


def collapse_to_one_failure(config, items: list, chosen: list, reason: str, option: str) -> None:
    """Replace the `chosen` items by one failing item that gives `reason` (deselecting them)."""
    if not chosen:
        return
    config.hook.pytest_deselected(items=chosen)
    first = items.index(chosen[0])
    kept = [item for item in items if item not in set(chosen)]
    failure = RequiredGpuMissing.from_parent(chosen[0].parent, name="required_gpu_missing", reason=reason,
                                             count=len(chosen), option=option)
    items[:] = kept[:first] + [failure] + kept[first:]


@pytest.hookimpl(trylast=True)  # after -m and -k: only the tests this run selected count
def pytest_collection_modifyitems(config, items):
    used = [item for item in items if _uses_plugin(item)]
    if not used:
        return  # nothing asked for the plugin: no torch, no CUDA, no target
    for item in used:
        _marked_families(item.nodeid, item.get_closest_marker("sage_qual"))
    loaded = config.stash.get(_FIXTURE_FILES, None)  # read by pytest_generate_tests, if a test asked
    if isinstance(loaded, pytest.UsageError):
        raise loaded
    targeted = {"sage_qual_target", "sage_qual_budget", "sage_qual_check"}
    if any(targeted & set(item.fixturenames) for item in used):
        _target(config)  # a misspelt target is a usage error before anything runs
    if require_gpu(config) and machine(config).problem:
        collapse_to_one_failure(config, items, used, f"sage-qual: {machine(config).problem}",
                                "--sage-qual-require-gpu")


# Fixtures -----------------------------------------------------------------------------------------
def _capability(config) -> tuple[int, int]:
    here = machine(config)
    if here.problem:
        pytest.skip(f"sage-qual: {here.problem}; SageAttention integrations are qualified on the GPU")
    return here.capability


@pytest.fixture(scope="session")
def sage_qual_target(pytestconfig):
    """The integration under test (a `targets.Target`); skips when it cannot run on this GPU."""
    from sage_qual.qualification.integrations import targets

    target = _target(pytestconfig)
    _capability(pytestconfig)
    reasons = target.machine_reasons(targets.box_facts())
    if reasons:
        pytest.skip(f"sage-qual: {target.name} cannot run on this GPU: {'; '.join(reasons)}")
    return target


@pytest.fixture
def sage_qual_fixture(request):
    """One activation fixture (see the marker), its tensors on cuda:0."""
    from sage_qual.fixtures import fileformat

    _capability(request.config)
    return fileformat.load_fixture(request.param, device="cuda")


@pytest.fixture
def sage_qual_budget(request, sage_qual_fixture, sage_qual_target):
    """The budget certify gives this fixture for the kernel the target runs here, a
    `report_model.Budget` (`budgets.budget`: max_rel_l2, min_cosine, per-head/item/block,
    norm-ratio and element-wise limits)."""
    from sage_qual.qualification.measure import budgets

    variant = sage_qual_target.variant(_capability(request.config))
    if variant is None:
        pytest.skip(f"sage-qual: {sage_qual_target.name} has no kernel for this GPU")
    return budgets.budget(variant, sage_qual_fixture)


class _CudaBench:
    device = "cuda"

    def extra_peak_bytes(self, fn):
        from sage_qual.qualification.measure import accuracy

        return accuracy.extra_peak_bytes(fn, 0)


def check_cell(target, fixture, capability: tuple[int, int], bench) -> Cell:
    """The target on one fixture, measured and judged as certify's cell (`cell.measure_target`),
    as a test takes it: skipped unless the target served the call, failed with every reason unless
    within budget, else the `report_model.Cell` that certify --target would store (variant: the
    target's name)."""
    from sage_qual.qualification.evidence import report_model
    from sage_qual.qualification.measure.cell import measure_target

    cell = measure_target(target, fixture, capability, bench, families_mod.memory_bound(fixture.family))
    if cell.outcome == report_model.Outcome.SKIP:
        pytest.skip(f"sage-qual: {cell.detail}")
    if cell.outcome != report_model.Outcome.PASS:
        reasons = "; ".join(r.detail for r in cell.reasons) or cell.detail
        pytest.fail(f"sage-qual: {target.name} on {fixture.name}: {reasons}", pytrace=False)
    return cell


@pytest.fixture
def sage_qual_check(request, sage_qual_target):
    """check(fixture) -> its `report_model.Cell` (metrics, budget, ...); skips or
    fails the test with every reason unless the target served the call within budget."""
    return lambda fixture: check_cell(sage_qual_target, fixture, _capability(request.config), _CudaBench())
