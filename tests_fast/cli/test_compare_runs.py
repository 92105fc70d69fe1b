"""Two certify runs of one H200 and one build compare equal, and a real slowdown does not (issue 40).

docs/results/run29-h200/: three full certifies back to back on one warm H200 (same build and code).
Before the bar carried the run-to-run spread and compare judged served speed, pairs of such runs
differed in six entries (break-even 9,728 against 11,648 tokens) and SDXL flipped."""

import dataclasses
import itertools
from pathlib import Path

import pytest

from sage_qual.cli import compare
from sage_qual.qualification.decide import checked, verdict

RUN29 = [Path(__file__).resolve().parents[2] / "docs" / "results" / "run29-h200" / f"certify-{n}"
         / "report.json.gz"
         for n in (1, 2, 3)]
SLOWER = 1.10


@pytest.fixture(scope="module")
def reports():
    return [checked.load(path) for path in RUN29]


@pytest.mark.parametrize(
    "pair", list(itertools.combinations(range(3), 2)), ids=lambda p: f"{p[0] + 1}-{p[1] + 1}"
)
def test_back_to_back_runs_compare_equal(reports, pair):
    first, second = (compare.decided(reports[n]) for n in pair)
    lines, found = compare.verdict_differences(first, second, compare.DEFAULT_TOLERANCE)
    assert len(lines) == 9 and not found, "\n".join(found)


def test_back_to_back_runs_give_the_same_verdict_and_variant_for_every_family(reports):
    answers = []
    for report in reports:
        [gpu] = verdict.decide(report)
        answers.append([(d.label, d.verdict, d.variant) + ((d.served.max_query_tokens, d.served.layouts,
                         d.served.contexts, [(b.side, b.below) for b in d.served.bounds]) if d.served else ())
                        for d in gpu.families + [gpu.default]])
    assert answers[0] == answers[1] == answers[2]
    enabled = [label for label, state, *_ in answers[0] if state == verdict.Verdict.ENABLE]
    assert enabled == ["FLUX.1", "FLUX.2", "Z-Image", "Qwen-Image", "Krea-2", "Wan 2.2"]


def slowed(report, variant: str, factor: float):
    """The report with every timing of `variant` `factor` times longer."""
    def scaled(record):
        if record.kernel != variant or not record.ms:
            return record
        return dataclasses.replace(record, ms=record.ms * factor,
                                   samples_ms=[t * factor for t in record.samples_ms or []])
    devices = [dataclasses.replace(d, speed=[scaled(r) for r in d.speed]) for d in report.devices]
    return dataclasses.replace(report, devices=devices)


def test_the_sm90_kernel_ten_percent_slower_is_flagged(reports):
    first = compare.decided(reports[0])
    second = compare.decided(slowed(reports[0], "sm90-fp8-cuda", SLOWER))
    _, found = compare.verdict_differences(first, second, compare.DEFAULT_TOLERANCE)
    flagged = {line.split(") ")[1].split(":")[0] for line in found}
    assert {"FLUX.1", "FLUX.2", "Z-Image", "Qwen-Image", "Krea-2", "Wan 2.2"} <= flagged, "\n".join(found)
    assert all("served speedup x0.9" in line or "vs safe, no speedup" in line for line in found), found
