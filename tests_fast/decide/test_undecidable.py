"""One refusal of a report that decides nothing (issue 53): gate, compare, merge and the defaults
builder refuse a partial, predicted or --quick report through `checked.undecidable`, in its one
wording (merge lists the report without verdicts and says why)."""

import dataclasses
import json
from pathlib import Path

import pytest

from sage_qual import cli, records
from sage_qual.qualification.decide import checked, gate
from sage_qual.qualification.decide import defaults as building
from sage_qual.qualification.families import find
from sage_qual.verdicts import profile

SAMPLE = Path(__file__).parent.parent / "data" / "sample_h200_2gpu.json"

EDITS = {
    "partial": lambda data: dataclasses.replace(data, complete=False, finished=None, stopped="SIGTERM"),
    "predicted": lambda data: dataclasses.replace(data, predicted=True),
    "quick": lambda data: dataclasses.replace(data, options=dataclasses.replace(data.options, quick=True)),
}


@pytest.mark.parametrize("kind", list(EDITS))
def test_gate_compare_merge_and_the_builder_refuse_in_one_wording(tmp_path, capsys, kind):
    data = EDITS[kind](checked.load(SAMPLE))
    path = tmp_path / "report.json"
    path.write_text(json.dumps(records.dump(data)))
    said = checked.undecidable(checked.load(path), str(path))
    assert said.startswith(f"{path} is a ") and "decides nothing" in said
    assert gate.report_problem(str(path), checked.load(path), find("FLUX.1")) == said
    assert cli.main(["compare", str(SAMPLE), str(path)]) == 2
    assert capsys.readouterr().err == f"sage-qual compare: {said}\n"
    assert cli.main(["merge", "--json", str(path)]) == 0
    (row,) = json.loads(capsys.readouterr().out)["rows"]
    assert (row["undecidable"], row["families"]) == (said, {})
    with pytest.raises(profile.ProfileError) as refused:
        building.load_run(path)
    assert str(refused.value) == said


def test_a_report_that_can_decide_is_not_refused():
    assert checked.undecidable(checked.load(SAMPLE), "r.json") == ""
