"""Conformance: how far a kernel's output may sit from its numerics model's, the first judge.

Certify derives a cell's budget from the model's error times (1 + MARGIN)
(`qualification/measure/budgets.py`); the wrapper's online check holds a served slice to the same
margin (`slice_bound`). One home for the margin, below both.

Kernel against model on every shipped fixture where both are finite: at most 1.5 % apart in relative
L2 (H200, docs/results/run6-h200x2-pytest-slow/gpu_results.json.gz; table and method in
docs/numerics.md); run to run 0 % (runs 5 and 6 equal to 4 significant digits); their worst 64-row
block within 3.5 % (docs/results/run8-h200x2-final/suite/numerics_vs_kernel.json.gz). One margin for
the suite: about 7x the worst measured spread, for slice errors (maxima over heads, items and row
blocks, which move more than the whole-tensor error), and well under the 0.25 allowed.
"""

from __future__ import annotations

MEASURED_SPREAD = 0.015
MARGIN = 0.10

# Unit roundoff of an output dtype: the rounding of one output element, relative to its value.
UNIT_ROUNDOFF = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8, "float32": 2.0 ** -24}


def slice_bound(model_rel_l2: float, dtype: str) -> float:
    """The largest relative L2 against torch a kernel's output may show on a slice where its numerics
    model shows `model_rel_l2` against the same reference: the model's error with certify's margin,
    plus one unit of rounding in the output dtype (kernel and model may round an element to
    neighbouring values, and torch's reference is in that dtype too)."""
    return model_rel_l2 * (1.0 + MARGIN) + UNIT_ROUNDOFF.get(dtype, UNIT_ROUNDOFF["bfloat16"])
