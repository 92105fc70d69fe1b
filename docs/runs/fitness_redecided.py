"""Every committed report decided with the conformance judge alone and with both judges (issue 52):
which family verdicts moved, and which variants the fitness judge finds unfit for which family.

    python docs/runs/fitness_redecided.py > docs/runs/fitness_redecided.txt

Run from the repository root, on the CPU (the decisions read no GPU).
"""

from pathlib import Path
from unittest import mock

from sage_qual.qualification.decide import checked, verdict
from sage_qual.qualification.evidence.report_model import ReasonKind
from sage_qual.qualification.measure import judge


def decisions(path: Path) -> dict:
    found = {}
    for gpu in verdict.decide(checked.load(path)):
        for family in gpu.families + [gpu.default]:
            unfit = sorted(v for v, fs in family.results.findings.items()
                           if any(f.reason.kind == ReasonKind.UNFIT for f in fs))
            found[(gpu.model, family.label)] = (family.verdict.value, family.variant, unfit)
    return found


def main() -> None:
    reports = sorted(Path("docs/results").rglob("report.json.gz"))
    moved = unfit_rows = 0
    lines = []
    for path in reports:
        with mock.patch.object(judge, "fitness_reasons", lambda metrics, fitness: []):
            before = decisions(path)
        after = decisions(path)
        for key, (state, variant, unfit) in after.items():
            old_state, old_variant, _ = before[key]
            if (old_state, old_variant) != (state, variant):
                moved += 1
                lines.append(f"MOVED {path}: {key[0]} {key[1]}: {old_state} {old_variant or ''} -> "
                             f"{state} {variant or ''}")
            if unfit:
                unfit_rows += 1
                lines.append(f"unfit {path}: {key[0]} {key[1]}: {', '.join(unfit)} ({state} {variant or ''})")
    print(f"# {len(reports)} committed reports; {moved} family verdict(s) moved; "
          f"{unfit_rows} (GPU model, family) row(s) with a variant unfit for the family")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
