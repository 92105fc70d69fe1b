"""report.md says a long reason that many rows share once, under its table (issue 43: a predicted report
repeated one 95-character sentence in 96 rows)."""

from sage_qual.qualification.render import report

LONG = "predicted by the CPU numerics model (sage_qual.kernels.numerics), not measured on a GPU"


def test_a_long_reason_of_many_rows_is_a_note_and_the_rest_stay_as_they_are():
    rows = [["a", LONG], ["b", LONG], ["c", "short, shared"], ["d", LONG], ["e", "short, shared"],
            ["f", "short, shared"], ["g", "its own long reason that only one row of the table gives"]]
    table, *notes = report._folded(["row", "reasons"], rows)
    assert [row[-1] for row in table.rows] == ["note 1", "note 1", "short, shared", "note 1", "short, shared",
                                               "short, shared", rows[-1][-1]]
    assert [note.text for note in notes] == [f"note 1 (3 rows): {LONG}"]


def test_a_long_reason_of_two_rows_stays_in_them():
    rows = [["a", LONG], ["b", LONG]]
    table, *notes = report._folded(["row", "reasons"], rows)
    assert table.rows == rows and notes == []
