"""README's table of H200 verdicts is what the newest committed certify runs decide (issue 40).

The table sits between `<!-- verdicts: RUN -->` and `<!-- end verdicts -->`; RUN names the folder
of docs/results/ whose certify-*/report.json it states. When a newer run is committed, this test
fails with the table to paste.
"""

import re
from pathlib import Path

from sage_qual.qualification.decide import checked, verdict

from ..helpers import newest_h200_run

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
TABLE = re.search(r"<!-- verdicts: (\S+) -->\n(.*?)<!-- end verdicts -->", README, re.S)


def _tokens(values: list[int | None]) -> str:
    found = sorted({v for v in values if v is not None})
    if not found:
        return "-"
    return f"{found[0]:,}" if len(found) == 1 else f"{found[0]:,}-{found[-1]:,}"


def expected_table(run: Path) -> str:
    decisions = [gpu for path in sorted(run.glob("certify*/report.json")) for gpu in verdict.decide(checked.load(path))]
    lines = ["| family | verdict on the H200 | served from (tokens, over the three runs) | up to | calls kept on torch |",
             "| --- | --- | --- | --- | --- |"]
    for family in [d.family for d in decisions[0].families]:
        each = [gpu.family(family) for gpu in decisions]
        states = {(d.verdict.value, d.variant) for d in each}
        assert len(states) == 1, f"{run.name}: {family} decided {states} across its runs: no one verdict to state"
        state, variant = states.pop()
        kept = {", ".join(b.short().replace("keys >= ", "fewer than ") + (" keys" if b.side == "key" else "")
                          for b in d.bounds) or "-" for d in each}
        lines.append(f"| {family} | {state}{' ' + variant if variant else ''} | "
                     f"{_tokens([d.min_query_tokens for d in each])} | {_tokens([d.max_query_tokens for d in each])} | "
                     f"{' / '.join(sorted(kept))} |")
    return "\n".join(lines) + "\n"


def test_the_table_states_the_newest_h200_run():
    assert TABLE, "README.md lost its <!-- verdicts: RUN --> table"
    assert TABLE.group(1) == newest_h200_run().name, f"a newer run is committed: {newest_h200_run().name}"


def test_the_table_is_what_those_reports_decide():
    run = ROOT / "docs" / "results" / TABLE.group(1)
    expected = expected_table(run)
    assert TABLE.group(2) == expected, "README.md's verdict table differs from the reports; paste:\n" + expected
