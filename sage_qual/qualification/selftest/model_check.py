"""The numerics model against the kernels: per (variant, fixture), the model's relative L2 next to the
kernel's, their ratio, and whether both agree on finiteness.

`python -m sage_qual.qualification.selftest.model_check GPU_RESULTS_JSON [FIXTURE_DIR]` prints the markdown
table of docs/numerics.md from a `pytest -m slow` results table (its "accuracy" rows); the GPU test
tests_gpu/test_numerics_vs_kernel.py builds the same table from the kernels it runs.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

from sage_qual import jsonfile
from sage_qual.fixtures.fileformat import list_fixtures, load_fixture, shipped_dir
from sage_qual.kernels.variants import VARIANTS
from sage_qual.qualification.measure import budgets
from sage_qual.qualification.render.report import markdown_table

# Acceptance: the model's relative L2 within 10 % of the kernel's on every cell (issue 9).
TOLERANCE = 0.10


@dataclass(frozen=True)
class Row:
    variant: str
    fixture: str
    kernel_rel_l2: float  # inf where the kernel's output was not finite
    kernel_finite: bool
    model_rel_l2: float  # of the model's finite elements (budgets.expected)
    model_finite: bool
    model_hazard: bool = False  # the model foresees a possibly non-finite output (numerics.hazards)
    # The element-wise criterion (issue 16): max |out - ref| of kernel and model, and the budget's
    # max_abs derived from the model (nan where not measured, as in results tables before it).
    kernel_max_abs: float = math.nan
    model_max_abs: float = math.nan
    max_abs_budget: float = math.nan

    @property
    def ratio(self) -> float:
        if not (self.kernel_finite and self.model_finite) or self.kernel_rel_l2 <= 0:
            return math.nan
        return self.model_rel_l2 / self.kernel_rel_l2

    @property
    def agrees(self) -> bool:
        """Finite on both sides and within TOLERANCE, or non-finite on both sides; a non-finite
        kernel where the model names a hazard was foreseen."""
        if not self.kernel_finite and self.model_hazard:
            return True
        if self.kernel_finite != self.model_finite:
            return False
        return not self.kernel_finite or abs(self.ratio - 1.0) <= TOLERANCE


    @property
    def max_abs_ratio(self) -> float:
        if not (self.kernel_finite and self.model_finite) or not self.model_max_abs > 0:
            return math.nan
        return self.kernel_max_abs / self.model_max_abs

    @property
    def within_max_abs(self) -> bool:
        """The kernel's largest element error within the model's element-wise budget (a cell where
        either side is not finite, or that was not measured, has nothing to compare)."""
        if not (self.kernel_finite and self.model_finite) or math.isnan(self.kernel_max_abs):
            return True
        return self.kernel_max_abs <= self.max_abs_budget


def row(variant: str, fixture, kernel_rel_l2: float, kernel_finite: bool) -> Row:
    found = budgets.expectation(VARIANTS[variant], fixture)
    return Row(variant, fixture.name, kernel_rel_l2, kernel_finite, found.metrics.rel_l2, found.model_finite,
               bool(found.hazards))


def from_results(results_path, fixture_dir) -> list[Row]:
    """Rows for every accuracy cell of a results table whose fixture is in `fixture_dir`."""
    fixtures = {p.name.removesuffix(".safetensors"): p for p in list_fixtures(fixture_dir)}
    rows, loaded = [], {}
    table = jsonfile.read(results_path, ValueError, unreadable="cannot read {path}: {reason}",
                                    not_json="{path} is not JSON: {reason}")
    if not isinstance(table, list) or not all(isinstance(entry, dict) for entry in table):
        raise ValueError("not a list of result rows")
    for entry in table:
        if entry.get("test") != "accuracy" or entry.get("fixture") not in fixtures:
            continue
        name = entry["fixture"]
        if name not in loaded:
            loaded[name] = load_fixture(fixtures[name])
        rel = entry["rel_l2"] if isinstance(entry["rel_l2"], (int, float)) else math.inf
        rows.append(row(entry["variant"], loaded[name], float(rel), bool(entry["finite"])))
    return sorted(rows, key=lambda r: (r.fixture, r.variant))


def markdown(rows: list[Row]) -> str:
    def number(x: float) -> str:
        return "inf" if math.isinf(x) else "-" if math.isnan(x) else f"{x:.5f}"

    cells = []
    for r in rows:
        kernel = number(r.kernel_rel_l2) if r.kernel_finite else "non-finite"
        model = number(r.model_rel_l2) if r.model_finite else "non-finite"
        ratio = "-" if math.isnan(r.ratio) else f"{r.ratio:.3f}"
        both_non_finite = r.agrees and not r.kernel_finite and not r.model_finite
        note = (" (both non-finite)" if both_non_finite else
                " (foreseen: stale-memory hazard)" if r.agrees and not r.kernel_finite else "")
        verdict = ("yes" if r.agrees else "NO") + note
        cells.append([r.fixture, r.variant, kernel, model, ratio, verdict])
    lines = markdown_table(
        ["fixture", "variant", "kernel rel L2", "model rel L2", "model / kernel", "within 10 %"], cells)
    finite = [r for r in rows if not math.isnan(r.ratio)]
    worst = max((abs(r.ratio - 1) for r in finite), default=math.nan)
    lines.append("")
    lines.append(f"{len(rows)} cells, {sum(r.agrees for r in rows)} agree; worst |model / kernel - 1| over "
                 f"the {len(finite)} cells finite on both sides: {worst:.4f}.")
    return "\n".join(lines) + "\n"


def max_abs_markdown(rows: list[Row]) -> str:
    """The element-wise table: kernel and model max |out - ref|, their ratio, and the budget."""
    measured = [r for r in rows if not math.isnan(r.max_abs_ratio)]
    lines = markdown_table(
        ["fixture", "variant", "kernel max abs", "model max abs", "kernel / model", "budget max_abs",
         "within"],
        [[r.fixture, r.variant, f"{r.kernel_max_abs:.5g}", f"{r.model_max_abs:.5g}",
          f"{r.max_abs_ratio:.3f}", f"{r.max_abs_budget:.5g}", "yes" if r.within_max_abs else "NO"]
         for r in measured])
    worst = max((r.max_abs_ratio for r in measured), default=math.nan)
    lines.append("")
    within = sum(r.within_max_abs for r in measured)
    lines.append(f"{len(measured)} cells finite on both sides, {within} within the element-wise budget; "
                 f"largest kernel / model max abs: {worst:.3f} (the budget: 2x the model's plus the output "
                 "rounding).")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or len(argv) > 2:
        print("usage: python -m sage_qual.qualification.selftest.model_check GPU_RESULTS_JSON [FIXTURE_DIR]",
              file=sys.stderr)
        return 2
    directory = argv[1] if len(argv) > 1 else shipped_dir()
    try:
        rows = from_results(argv[0], directory)
    except (OSError, ValueError, KeyError, TypeError) as error:
        print(f"model_check: {argv[0]}: cannot read it as a `pytest -m slow` results table ({error}); give "
              "the gpu_results.json that tests_gpu wrote", file=sys.stderr)
        return 2
    print(markdown(rows), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
