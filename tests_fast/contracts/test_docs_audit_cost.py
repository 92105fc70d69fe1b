"""docs/benchmarks.md's table of the audit's cost states each cited run's measurement, and its prose
range the table's (issue 55: the cost decides that `install()` audits by default)."""

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SECTION = "## The audit: what watching served calls costs a model"


def section() -> str:
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    start = text.index(SECTION)
    return text[start:text.index("\n## ", start + len(SECTION))]


def table() -> dict[int, list[str]]:
    rows = re.findall(r"^\| (\d+) \| (.+) \|$", section(), re.MULTILINE)
    return {int(run): [cell.strip() for cell in cells.split("|")] for run, cells in rows}


def measured(run: int) -> dict:
    """The run's audit-cost row from its gpu_results.json under docs/results/run<N>-*/."""
    found = [row for path in sorted((ROOT / "docs" / "results").glob(f"run{run}-*/**/gpu_results.json"))
             for row in json.loads(path.read_text()) if row.get("test") == "audit-cost"]
    assert len(found) == 1, f"run {run}: {len(found)} audit-cost rows in its gpu_results.json"
    return found[0]


def ratio(row: dict, key: str) -> str:
    return f"{row[key]:.3f} ({row[key + '_min']:.3f}-{row[key + '_max']:.3f})"


def percent(values: list[float]) -> str:
    return f"{min(values) * 100:.1f}-{max(values) * 100:.1f} %"


def test_each_row_is_its_runs_measurement():
    rows = table()
    assert rows, "no table rows found"
    for run, cells in rows.items():
        row = measured(run)
        assert cells == [f"{row['off_ms']:.2f}", ratio(row, "default_over_off"),
                         ratio(row, "every_call_over_off")], run
        assert f"docs/results/run{run}-" in section(), f"run {run} is not cited"


def test_every_run_that_measured_the_cost_is_in_the_table():
    runs = {int(re.match(r"run(\d+)", path.relative_to(ROOT / "docs" / "results").parts[0]).group(1))
            for path in (ROOT / "docs" / "results").glob("run*/**/gpu_results.json")
            if any(row.get("test") == "audit-cost" for row in json.loads(path.read_text()))}
    assert runs == set(table())


def test_the_prose_states_the_tables_range():
    rows = [measured(run) for run in table()]
    costs = [row["every_call_over_off"] - 1 for row in rows]
    per_audit = [(row["every_call_over_off"] - 1) * row["off_ms"] / 4 for row in rows]  # 4 calls a forward
    spreads = [row["default_over_off_max"] - row["default_over_off_min"] for row in rows]
    text = " ".join(section().split())
    assert f"costs {percent(costs)} of a forward" in text
    assert f"({min(per_audit):.2f}-{max(per_audit):.2f} ms per audit)" in text
    assert f"below the {percent(spreads)} spread" in text
    assert max(costs) / 100 < 0.01 / 40, "the stated 40x margin to the 1 % budget"
