"""Detection power on a real kernel: the kernel the wrapper picks for this GPU, wrapped with each
defect of `sage_qual.qualification.selftest.detection`, judged as certify judges (the numerics model's
budgets, `judge.cell_reasons`) on every shipped fixture; each defect must keep off exactly the
families it reaches (a family the clean kernel already keeps off stays off).

Writes the detection matrix (defect x family: caught / MISSED / FALSE ALARM / off already) to
$SAGE_QUAL_RESULTS_DIR/detection_matrix.md, and the fixtures that caught each defect to
detection_matrix.json.
"""

import json
import os
from pathlib import Path

import pytest
import torch

from sage_qual.fixtures.fileformat import load_fixture
from sage_qual.qualification.measure import accuracy, budgets
from sage_qual.qualification.selftest import detection

from .conftest import FIXTURE_PATHS

pytestmark = [pytest.mark.slow, pytest.mark.gpu]

_newly: dict[str, frozenset[str]] = {}
_caught: dict[str, list[str]] = {}


@pytest.fixture(scope="module")
def kernel(sage, gpu0):
    """The wrapper's kernel for this GPU, its clean output on every fixture, the references."""
    if gpu0.kernel is None:
        pytest.skip(f"no kernel for this GPU: {gpu0.no_kernel_reason}")
    variant = gpu0.kernel
    fixtures = [load_fixture(p, device="cuda") for p in FIXTURE_PATHS]
    clean = {f.name: accuracy.call_kernel(sage, variant, f.q, f.k, f.v) for f in fixtures}
    references = {f.name: accuracy.reference(f.q, f.k, f.v) for f in fixtures}
    failing = detection.failing(variant, fixtures, clean, references)
    baseline = frozenset().union(*(detection.owners(f) for f in fixtures if f.name in failing))
    return variant, fixtures, clean, references, failing, baseline


def _write(variant_name: str, baseline: frozenset[str], failing: frozenset[str]) -> None:
    directory = os.environ.get("SAGE_QUAL_RESULTS_DIR")
    if not directory:
        return
    Path(directory).mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name(0)
    title = f"{variant_name} on {gpu} (real kernel, defects injected into its output)"
    text = detection.matrix_markdown(_newly, baseline, title)
    text += f"\nClean kernel fails: {', '.join(sorted(failing)) or 'nothing'}.\n"
    Path(directory, "detection_matrix.md").write_text(text)
    defects = {name: {"kept_off": sorted(_newly[name]), "caught_by": _caught[name]} for name in _newly}
    Path(directory, "detection_matrix.json").write_text(json.dumps(
        {"variant": variant_name, "gpu": gpu, "clean_failing": sorted(failing),
         "baseline_off": sorted(baseline), "defects": defects}, indent=1))


@pytest.mark.parametrize("defect", detection.DEFECTS, ids=lambda d: d.name)
def test_defect_keeps_off_exactly_the_families_it_reaches(kernel, defect, record):
    variant, fixtures, clean, references, failing, baseline = kernel
    newly, caught = detection.kept_off(variant, fixtures, clean, references, defect, failing)
    _newly[defect.name], _caught[defect.name] = newly, sorted(caught)
    _write(variant.name, baseline, failing)
    record(test="detection", variant=variant.name, defect=defect.name, reaches=sorted(defect.reaches),
           kept_off=sorted(newly), already_off=sorted(baseline), caught_by=sorted(caught))
    assert defect.reaches - baseline <= newly <= defect.reaches, f"caught on {sorted(caught)}"


def test_the_unmodified_kernel_keeps_off_only_what_the_model_predicts(kernel):
    variant, fixtures, clean, references, failing, _ = kernel
    expected = {f.name: budgets.expectation(variant, f) for f in fixtures}
    predicted = {name for name, e in expected.items() if not e.model_finite}
    foreseen = {name for name, e in expected.items() if e.hazards}
    assert predicted <= failing <= predicted | foreseen, (
        "the clean kernel fails other fixtures than the numerics model predicts")


# A few wrong elements on the real kernel: the element-wise limit (max |out - ref| within 2x the
# model's plus the output rounding) must fail every fixture the clean kernel passes, as on the CPU.
@pytest.mark.parametrize("defect", [detection.few_elements_wrong(1, 3.0),
                                    detection.few_elements_wrong(3, 2.5, seed=7)], ids=lambda d: d.name)
def test_a_few_wrong_elements_fail_every_fixture_the_clean_kernel_passes(kernel, defect, record):
    variant, fixtures, clean, references, failing, _ = kernel
    _, caught = detection.kept_off(variant, fixtures, clean, references, defect, failing)
    passing = {f.name for f in fixtures} - failing
    record(test="detection_few_elements", variant=variant.name, defect=defect.name,
           missed=sorted(passing - set(caught)))
    assert set(caught) == passing, f"not caught on {sorted(passing - set(caught))}"


@pytest.mark.parametrize("defect", detection.CALL_SPACE_DEFECTS, ids=lambda d: d.name)
def test_a_defect_past_the_fixtures_fires_on_no_fixture(kernel, defect):
    # Only certify's call-space checks (long calls, views, spans) can catch these.
    variant, fixtures, clean, _, _, _ = kernel
    for f in fixtures:
        out = defect.apply(detection.Call(f.q, f.k, f.v, clean[f.name], f.q.shape[-1] ** -0.5))
        assert torch.equal(out, clean[f.name]), f.name


CONTEXT_SCRIPT = """
import json
from sage_qual.qualification.measure import context_check
from sage_qual.qualification.selftest import detection
from sage_qual.qualification.evidence.report_model import safe_contexts
from sage_qual.kernels.variants import VARIANTS
variant = VARIANTS[{variant!r}]
found = {{"clean": safe_contexts(context_check.check_variant(variant))}}
for defect in detection.CONTEXT_DEFECTS:
    with detection.injected(defect):
        found[defect.name] = safe_contexts(context_check.check_variant(variant))
print(json.dumps(found))
"""


def test_a_context_defect_takes_exactly_its_contexts_from_the_real_kernel(gpu0, record):
    """The GPU's own kernel with each context defect injected into its served output, checked as
    certify checks it (`context_check`, every context trusted), in a child process: each must take
    exactly the contexts it reaches and leave the others certified as they are without it."""
    from .child import run_child

    if gpu0.kernel is None:
        pytest.skip(f"no kernel for this GPU: {gpu0.no_kernel_reason}")
    found = run_child(CONTEXT_SCRIPT.format(variant=gpu0.kernel.name), timeout=420)
    clean = found["clean"]
    for defect in detection.CONTEXT_DEFECTS:
        record(test="context-defect", variant=gpu0.kernel.name, fixture=defect.name, kind="random",
               certified=",".join(found[defect.name]) or "none", clean=",".join(clean))
        assert found[defect.name] == [c for c in clean if c not in defect.reaches], defect.name
