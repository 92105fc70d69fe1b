"""The numbers a report stores and every stage passes as records: a kernel output's `Metrics`, the
`Budget` they are judged against, and a fixture's `PublishedBound`. No torch here: the parent
process, the decisions and the renderers read them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from sage_qual import records

NOT_NEGATIVE = {"minimum": 0}
# float32 rounding puts a cosine at 1.0000001 (docs/results/run8-h200x2-final/certify/): 1e-3 of room.
COSINE = {"minimum": -1.001, "maximum": 1.001}
_OLDER = "null: the report predates this limit (schema 1 stored max_rel_l2 and min_cosine only)"


@dataclass(frozen=True)
class Budget:
    """A cell's or long check's limits, derived from the numerics model (`qualification/measure/budgets.py`);
    `judge` checks each against its metric (`judge.LIMITS`). Every limit is a number in what this
    sage-qual writes; a report upgraded from an older schema holds null for a limit it predates."""
    max_rel_l2: float
    max_head_rel_l2: float | None = field(metadata={"description": _OLDER})
    max_batch_rel_l2: float | None = field(metadata={"description": _OLDER})
    max_block_rel_l2: float | None = field(metadata={"description": _OLDER})
    min_norm_ratio: float | None = field(metadata={"description": _OLDER})
    max_norm_ratio: float | None = field(metadata={"description": _OLDER})
    min_cosine: float
    max_abs: float | None = field(metadata={"description": _OLDER})


@dataclass(frozen=True)
class PublishedBound:
    """A fixture's bound for one accuracy class as its file states it (`fixtures/fileformat.py`): the
    fitness bound of every cell of that class on it (`verdicts.fitness.bound_for`)."""
    max_rel_l2: float
    min_cosine: float


@dataclass(frozen=True)
class Metrics:
    """An output's errors against its float32 reference (`measure.accuracy.errors`); null where the number
    is not finite (a report) or was not measured."""
    rel_l2: float | None = field(metadata={**NOT_NEGATIVE, "description": "||out - ref|| / ||ref||"})
    worst_head_cosine: float | None = field(metadata=COSINE)
    finite: bool = field(metadata={"description": "the output is finite wherever the reference is"})
    worst_head_rel_l2: float | None = field(metadata=NOT_NEGATIVE)
    worst_batch_rel_l2: float | None = field(metadata=NOT_NEGATIVE)
    worst_block_rel_l2: float | None = field(metadata=NOT_NEGATIVE)
    norm_ratio: float | None = field(metadata=NOT_NEGATIVE)
    max_abs_error: float | None = field(metadata={**NOT_NEGATIVE, "description": "max |out - ref|"})

    def stored(self) -> "Metrics":
        """The same numbers as a report stores them: a non-finite one is null."""
        return Metrics(**records.finite_or_none(vars(self)))


METRIC_NAMES = tuple(f.name for f in dataclasses.fields(Metrics))  # a cell's and a long check's numbers
