"""README's table of H200 verdicts is what the newest committed certify runs decide (issue 40).

The table sits between `<!-- verdicts: RUN... -->` and `<!-- end verdicts -->`; RUN names the folders
of docs/results/ whose certify*/report.json it states, the newest among them. When a newer run is
committed, this test fails until it is named, and then with the table to paste.
"""

import json
import re
from pathlib import Path

from sage_qual.qualification.decide import checked, verdict
from sage_qual.qualification.evidence.report_model import ReasonKind

from ..helpers import flat, newest_h200_run

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
TABLE = re.search(r"<!-- verdicts: ([^>]+?) -->\n(.*?)<!-- end verdicts -->", README, re.S)


def _tokens(values: list[int | None]) -> str:
    found = sorted({v for v in values if v is not None})
    if not found:
        return "-"
    return f"{found[0]:,}" if len(found) == 1 else f"{found[0]:,}-{found[-1]:,}"


def unfit(decision: verdict.FamilyDecision) -> set[str]:
    """The variants the fitness judge found unfit for the family (issue 52)."""
    return {variant for variant, found in decision.results.findings.items()
            if any(f.reason.kind == ReasonKind.UNFIT for f in found)}


def expected_table(runs: list[Path]) -> str:
    decisions = [gpu for run in runs for path in sorted(run.glob("certify*/report.json.gz"))
                 for gpu in verdict.decide(checked.load(path))]
    lines = [
        "| family | verdict on the H200 | served from (tokens, over the runs) | up to | calls kept on torch "
        "| unfit for the family |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for family in [d.family for d in decisions[0].families]:
        each = [gpu.family(family) for gpu in decisions]
        states = {(d.verdict.value, d.variant) for d in each}
        assert len(states) == 1, f"{family} decided {states} across the runs: no one verdict to state"
        state, variant = states.pop()
        kept = {", ".join(b.short().replace("keys >= ", "fewer than ") + (" keys" if b.side == "key" else "")
                          for b in (d.served.bounds if d.served else [])) or "-" for d in each}
        lines.append(
            f"| {family} | {state}{' ' + variant if variant else ''} | "
            f"{_tokens([d.served and d.served.min_query_tokens for d in each])} | "
            f"{_tokens([d.served and d.served.max_query_tokens for d in each])} | "
            f"{' / '.join(sorted(kept))} | {', '.join(sorted(set().union(*map(unfit, each)))) or '-'} |"
        )
    return "\n".join(lines) + "\n"


def test_the_table_states_the_newest_h200_run():
    assert TABLE, "README.md lost its <!-- verdicts: RUN... --> table"
    assert newest_h200_run().name in TABLE.group(1).split(), (
        f"a newer run is committed: {newest_h200_run().name}"
    )


def test_the_table_is_what_those_reports_decide():
    runs = [ROOT / "docs" / "results" / name for name in TABLE.group(1).split()]
    assert all(run.is_dir() for run in runs), TABLE.group(1)
    expected = expected_table(runs)
    assert TABLE.group(2) == expected, (
        "README.md's verdict table differs from the reports; paste:\n" + expected
    )


def test_the_defaults_sentence_names_the_runs_the_defaults_were_built_from():
    sentence = re.search(r"\*\*Built-in defaults\.\*\*(.*?)decided with", README, re.S).group(1)
    said = {int(n) for n in re.findall(r"\b\d+\b", sentence.split("(runs", 1)[1])}  # not H200's 200
    built = json.loads((ROOT / "sage_qual" / "serving" / "default_profile.json").read_text())
    sources = {int(re.match(r"docs/results/run(\d+)-", source["file"]).group(1))
               for source in built["sources"]}
    assert said == sources, f"README names runs {sorted(said)}; the defaults come from {sorted(sources)}"


def test_the_h100_sentence_is_what_its_runs_decide():
    """"an H100 80GB HBM3 gets the same verdicts from N tokens (runs M and L)": each run decides each
    family as the H200 table states, and N is the most conservative start any of them serves from
    (what the built-in defaults keep)."""
    said = re.search(
        r"an H100 80GB HBM3 gets the same verdicts from ([\d,]+) tokens \(runs? ([\d, and]+)\)", flat(README)
    )
    assert said, "README.md lost its sentence on the H100"
    tokens, runs = int(said.group(1).replace(",", "")), re.findall(r"\d+", said.group(2))
    decisions = [gpu for run in runs for folder in (ROOT / "docs" / "results").glob(f"run{run}-h100*")
                 for path in sorted(folder.glob("certify*/report.json.gz"))
                 for gpu in verdict.decide(checked.load(path))]
    assert len({gpu.model for gpu in decisions}) == 1 and decisions[0].model.startswith("NVIDIA H100")
    rows = {
        row.split(" | ")[0].strip("| "): row.strip("| ").split(" | ")
        for row in TABLE.group(2).splitlines()[2:]
    }
    starts = {d.served.min_query_tokens for gpu in decisions for d in gpu.families if d.served}
    assert max(starts) == tokens, f"the runs serve from {sorted(starts)}; README says {tokens}"
    for gpu in decisions:
        for d in gpu.families:
            assert f"{d.verdict.value}{' ' + d.variant if d.variant else ''}" == rows[d.family][1], d.family
            assert (", ".join(sorted(unfit(d))) or "-") == rows[d.family][5], d.family  # unfit there as here
