"""Every module `tox -e mutate` is set to mutate exists (issue 54: docs/mutation.md named modules two
layouts old), and the modules issue 54 put under it are there."""

from pathlib import Path

import tomllib

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
