"""The committed H200 certify reports as known failures per shipped fixture (`sage_qual.fixtures.known`).

`python -m sage_qual.qualification.selftest.known_failures [REPORT ...]` rewrites
sage_qual/fixtures/known_failures.json from the given reports (default: every report.json.gz under
docs/results/). A report counts for a fixture when it holds a cell on that very file (the same
sha256 as the shipped one); a GPU-less prediction (certify --emulate) and an integration's report
(certify --target) say nothing of the kernels and are left out.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from sage_qual.fixtures import known
from sage_qual.fixtures.fileformat import list_fixtures, load_fixture, shipped_dir
from sage_qual.qualification.decide import checked
from sage_qual.qualification.evidence.report_model import Outcome

RESULTS = Path("docs/results")
# What a failed cell says, in the words `fixtures show` prints.
HOW = {"non_finite": "not finite", "accuracy": "over its budget", "unfit": "past its fitness bound",
       "memory": "over the memory bound"}


def committed_reports(root: Path = RESULTS) -> list[Path]:
    return sorted(root.rglob("report.json.gz"))


def tables(reports: list[Path], shipped: dict[str, str]) -> dict:
    """known_failures.json's content from `reports`, for the shipped fixtures (name -> sha256)."""
    fixtures: dict[str, dict] = {}
    counted = []
    for path in reports:
        data = checked.load(path)
        if data.predicted or data.target:
            continue
        counted.append(str(path))
        same = {f.name for f in data.fixtures if shipped.get(f.name) == f.sha256}
        by_fixture: dict[str, list] = {}
        for cell in (c for d in data.devices for c in d.cells if c.fixture in same):
            by_fixture.setdefault(cell.fixture, []).append(cell)
        for name, cells in sorted(by_fixture.items()):
            entry = fixtures.setdefault(name, {"sha256": shipped[name], "reports": 0, "variants": {}})
            entry["reports"] += 1
            failed: dict[str, set[str]] = {}
            ran: set[str] = set()
            for cell in cells:
                if cell.outcome == Outcome.SKIP:
                    continue
                ran.add(cell.variant)
                if cell.outcome == Outcome.FAIL:
                    failed.setdefault(cell.variant, set()).update(HOW.get(r.kind.value, r.kind.value)
                                                                  for r in cell.reasons)
                elif cell.outcome != Outcome.PASS:  # crash, oom, timeout
                    failed.setdefault(cell.variant, set()).add(cell.outcome.value)
            for variant in sorted(ran):
                seen = entry["variants"].setdefault(variant, {"ran": 0, "failed": 0, "how": []})
                seen["ran"] += 1
                if variant in failed:
                    seen["failed"] += 1
                    seen["how"] = sorted(set(seen["how"]) | failed[variant])
    for entry in fixtures.values():
        entry["failures"] = {v: seen for v, seen in entry.pop("variants").items() if seen["failed"]}
    return {"measured_on": "the H200 certify reports under docs/results/ (docs/results/README.md: each run)",
            "reports": counted, "fixtures": dict(sorted(fixtures.items()))}


def shipped_fixtures() -> dict[str, str]:
    return {(f := load_fixture(path)).name: f.sha256 for path in list_fixtures(shipped_dir())}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    reports = [Path(a) for a in args] or committed_reports()
    known.FILE.write_text(json.dumps(tables(reports, shipped_fixtures()), indent=1) + "\n")
    print(f"{known.FILE}: {len(reports)} report(s) read")
    return 0


if __name__ == "__main__":
    sys.exit(main())
