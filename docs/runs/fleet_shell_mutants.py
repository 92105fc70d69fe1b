"""Hand-made mutants of examples/fleet/merge_and_gate.sh's shell lines, each run against the fleet
recipes' tests (issue 54: mutmut mutates Python only; the step's gate is Python in
sage_qual/qualification/decide/fleet.py and under `tox -e mutate`, the shell around it is not).

    python docs/runs/fleet_shell_mutants.py > docs/runs/fleet_shell_mutants.txt

Run from the repository root of a clean checkout: each mutant edits the script in place, runs
`pytest -x tests_fast/cli/test_fleet_recipes.py`, and puts the script back. One line per mutant:
killed (a test failed) or SURVIVED.
"""

import subprocess
import sys
from pathlib import Path

SCRIPT = Path("examples/fleet/merge_and_gate.sh")
TESTS = ["tests_fast/cli/test_fleet_recipes.py"]

# (what a plausible slip would do, the line as written, the slip)
MUTANTS = [
    ("no reports passes the check", "-eq 0 ]", "-gt 0 ]"),
    ("nullglob dropped", "shopt -s nullglob\n", "\n"),
    ("a report merge refuses goes on", 'fleet.md" || exit 2', 'fleet.md"'),
    ("merge --json refusing goes on", 'fleet.json" || exit 2', 'fleet.json"'),
    ("the host named by the file", 'host=$(basename "$(dirname "$current")")', 'host=$(basename "$current")'),
    ("the baseline looked up without the host", 'previous="$baseline/$host/report.json"',
     'previous="$baseline/report.json"'),
    ("a missing baseline compared anyway", '[ -n "$baseline" ] && [ -f "$previous" ]', '[ -n "$baseline" ]'),
    ("compare's order swapped", 'compare "$previous" "$current"', 'compare "$current" "$previous"'),
    ("compare's 'same' and 'differs' swapped", '0) echo "$host: same', '1) echo "$host: same'),
    ("the gate's exit code lost", '"${found[@]}"\n', '"${found[@]}" || true\n'),
    ("the gate given the first report only", '"$out/fleet-gates.txt" "${found[@]}"',
     '"$out/fleet-gates.txt" "${found[0]}"'),
    ("the gate reads the Markdown table", '-m sage_qual.qualification.decide.fleet "$out/fleet.json"',
     '-m sage_qual.qualification.decide.fleet "$out/fleet.md"'),
]


def main() -> int:
    original = SCRIPT.read_text()
    survived = 0
    for what, line, slip in MUTANTS:
        if original.count(line) != 1:
            print(f"{what}: the line {line!r} is not in the script once: update this list")
            return 2
        SCRIPT.write_text(original.replace(line, slip))
        try:
            command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *TESTS]
            ran = subprocess.run(command, capture_output=True, text=True)
        finally:
            SCRIPT.write_text(original)
        failed = [ln.split(" ")[1] for ln in ran.stdout.splitlines() if ln.startswith("FAILED ")]
        survived += ran.returncode == 0
        killer = failed[0] if failed else f"exit {ran.returncode}"
        print(f"{what}: " + ("SURVIVED" if ran.returncode == 0 else f"killed by {killer}"))
    print(f"{len(MUTANTS) - survived} of {len(MUTANTS)} killed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
