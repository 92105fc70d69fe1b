"""Every module `tox -e mutate` is set to mutate exists (issue 54: docs/mutation.md named modules two
layouts old), and the modules issue 54 put under it are there."""

import gzip
from pathlib import Path

import tomllib

from ..helpers import table_rows

ROOT = Path(__file__).resolve().parents[2]
MUTMUT = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mutmut"]
MUTATE = MUTMUT["only_mutate"]


def test_every_module_to_mutate_exists():
    assert MUTATE and [path for path in MUTATE if not (ROOT / path).is_file()] == []


def test_every_test_file_the_mutants_run_against_exists():
    selection = MUTMUT["pytest_add_cli_args_test_selection"]
    assert selection and [path for path in selection if not (ROOT / path).is_file()] == []


def test_the_fleet_rows_and_gate_and_the_built_in_defaults_are_mutated():
    assert {"sage_qual/qualification/decide/fleet.py", "sage_qual/qualification/decide/defaults.py",
            "sage_qual/serving/defaults.py"} <= set(MUTATE)


RUNS = ROOT / "docs" / "runs" / "mutation-2026-12-07"


def _counts(results: Path, module: str) -> tuple[int, int, int]:
    """(mutants, killed, survived) of one module in a saved `mutmut results --all true`."""
    lines = gzip.decompress(results.read_bytes()).decode().splitlines()
    outcomes = [line.rsplit(": ", 1)[1] for line in lines if line.startswith(f"sage_qual.{module}.x")]
    return len(outcomes), outcomes.count("killed"), outcomes.count("survived")


def test_the_issue_54_mutation_table_is_its_saved_results():
    """docs/mutation.md's 2026-12-07 table: each row's counts as the saved results of its run give them."""
    text = (ROOT / "docs" / "mutation.md").read_text()
    rows = table_rows(text[text.index("## 2026-12-07: the built-in defaults' builder"):], "| module |")
    assert len(rows) >= 8
    for cells in rows:
        module = cells[0].split("`")[1].removesuffix(".py").replace("/", ".")
        module = module if module.startswith("serving") else f"qualification.{module}"
        commit = cells[2].split()[0]
        [results] = RUNS.glob(f"*-{commit}.txt.gz")
        mutants, killed, survived = _counts(results, module)
        assert (int(cells[3]), int(cells[4]), int(cells[5])) == (mutants, killed, survived), cells
        assert cells[6] == f"{100 * killed / mutants:.1f}", cells
