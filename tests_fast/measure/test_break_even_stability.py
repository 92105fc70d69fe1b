"""The break-even stays put between runs: steady lower bounds (speed.steady_lower_bounds) fitted
over neighbouring lengths, checked on two real H200 certify runs (tests_fast/data/README.md) and
on simulated noise."""

from __future__ import annotations

import gzip
import json
import math
import random
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from sage_qual.cli import compare
from sage_qual.qualification.decide import checked, verdict
from sage_qual.qualification.evidence import report_model
from sage_qual.qualification.measure import speed

DATA = Path(__file__).resolve().parent.parent / "data"
RUNS = [DATA / "h200_certify_a.json.gz", DATA / "h200_certify_b.json.gz"]
# Device run 11: certify on both H200s of one host at once, the code that screens SDPA backends.
RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"
RUN11 = [RESULTS / "current" / f"certify-gpu{g}" / "report.json" for g in (0, 1)]
VARIANT = "sm90-fp8-cuda"
PROPERTY = settings(max_examples=60, deadline=None, derandomize=True, database=None)


def load(path: Path) -> report_model.Report:
    with gzip.open(path, "rt", encoding="utf-8") as file:
        return checked.parse(json.load(file), str(path))


def decided(path: Path) -> dict[str, verdict.GpuDecision]:
    return {gpu.model: gpu for gpu in verdict.decide(load(path))}


def test_two_h200_runs_give_the_same_verdicts_and_thresholds_within_ten_percent():
    first, second = (decided(path) for path in RUNS)
    lines, found = compare.differences(first, second, compare.DEFAULT_TOLERANCE)
    assert lines and not found, "\n".join(found)
    enabled = [d for gpu in first.values() for d in gpu.families if d.verdict == verdict.Verdict.ENABLE]
    assert enabled, "the runs enable a family: the thresholds compared are numbers, not None"


# SDXL sits at the edge (issue 26: bounded, sm90-fp8-cuda became its candidate): the lower bound of its
# speedup at its largest call (2048² self, 640 ch) was 0.97-1.01x in run 13's four reports, so its
# verdict, and with its head_dim 64 the default entry's, flips between runs. Such flips are set aside
# only while that speedup is this close to 1x in both reports; any other difference fails.
EDGE_SHAPE, EDGE = "2048² self, 640 ch", 0.05


def beyond_sdxls_edge(first, second, found: list[str]) -> list[str]:
    """`found` without the SDXL and default lines when SDXL's largest call is within EDGE of 1x in
    both reports."""
    at_edge = all(abs(gpu.family("SDXL").speedups[EDGE_SHAPE] - 1) <= EDGE
                  for decided in (first, second) for gpu in decided.values())
    edge_lines = ("SDXL:", "default:")
    return [line for line in found if not (at_edge and any(f" {label}" in line for label in edge_lines))]


def run11() -> list[dict[str, verdict.GpuDecision]]:
    return [{gpu.model: gpu for gpu in verdict.decide(checked.load(path))} for path in RUN11]


def test_two_h200s_of_run_11_give_the_same_verdict_and_variant_for_every_family():
    first, second = run11()
    assert first.keys() == second.keys()
    for model, gpu in first.items():
        other = second[model]
        for a, b in zip(gpu.families + [gpu.default], other.families + [other.default], strict=True):
            differ = (a.label, a.verdict, a.variant) != (b.label, b.verdict, b.variant)
            assert not beyond_sdxls_edge(first, second, [f"{model} {a.label}:"] if differ else [])


@pytest.mark.xfail(strict=True, reason="run 11 predates paired timing (docs/certify.md, Break-even): its two "
                   "H200s put sm90-fp8-cuda's head_dim 128 break-even at 9,728 and 16,384 tokens; run 13 "
                   "agrees within 10 % (test_run_13s_...)")
def test_two_h200s_of_run_11_give_thresholds_within_ten_percent():
    first, second = run11()
    lines, found = compare.differences(first, second, compare.DEFAULT_TOLERANCE)
    assert lines and not found, "\n".join(found)


# Device run 13 (code 365e3d2, paired timing near the crossover): three certify runs back to back on
# cuda:0 (b, c, d) and one on cuda:1 at the same time as d (e).
RUN13 = {name: RESULTS / "run13-h200x2" / f"certify-{name}" / "report.json" for name in "bcde"}


@pytest.mark.parametrize("pair", ["bc", "cd", "bd", "de"])
def test_run_13s_back_to_back_and_two_gpu_certify_runs_agree_within_ten_percent(pair):
    first, second = ({gpu.model: gpu for gpu in verdict.decide(checked.load(RUN13[name]))} for name in pair)
    lines, found = compare.differences(first, second, compare.DEFAULT_TOLERANCE)
    left = beyond_sdxls_edge(first, second, found)
    assert lines and not left, "\n".join(left)
    served = [d.min_query_tokens for gpu in first.values() for d in gpu.families if d.min_query_tokens]
    assert served, "no family was enabled: nothing to compare"


def test_sdxls_flip_is_set_aside_only_at_the_edge():
    """The exception above cannot hide a real change: far from 1x, or in another family, it counts."""
    first, second = ({gpu.model: gpu for gpu in verdict.decide(checked.load(RUN13[name]))} for name in "bc")
    found = compare.differences(first, second, compare.DEFAULT_TOLERANCE)[1]
    assert found and not beyond_sdxls_edge(first, second, found)
    assert beyond_sdxls_edge(first, second, ["NVIDIA H200 (sm_90) Qwen-Image: x vs y"])
    [gpu] = second.values()
    gpu.family("SDXL").speedups[EDGE_SHAPE] = 1.2
    assert beyond_sdxls_edge(first, second, found) == found


def raw_thresholds(path: Path) -> set[int]:
    """Each head size's break-even from every shape's own lower bound (no fitting)."""
    data = load(path)
    (device,) = data.devices
    sdpa = {r.shape: r for r in device.speed if r.kernel == "sdpa" and r.ms}
    found = set()
    for head_dim in (64, 128):
        points = []
        for r in device.speed:
            shape = data.shapes[r.shape].shape
            if r.kernel == VARIANT and r.ms and r.shape in sdpa and shape.head_dim == head_dim:
                base = sdpa[r.shape]
                low = speed.speedup_bounds(base.ms, base.samples_ms, r.ms, r.samples_ms)[0]
                points.append((shape.q_tokens, shape.kv_tokens, shape.head_dim, low))
        thresholds = speed.break_even(points)
        found.add(thresholds.min_query_tokens if thresholds else None)
    return found


def test_the_same_runs_without_the_fit_are_thirty_percent_apart():
    """The comparison above can fail: each shape's own lower bound puts head_dim 128's break-even
    at 8,960 tokens in one run and 11,648 in the other."""
    first, second = (raw_thresholds(path) for path in RUNS)
    assert 8960 in first and 11648 in second


# Simulated runs -------------------------------------------------------------------------------
# The refinement grid of a full run: 2**(1/8) steps rounded to 128 tokens, 4096 to 32768.
GRID = sorted({round(4096 * 2 ** (i / 8) / 128) * 128 for i in range(25)})
# Slope of log(speedup) per octave near 1x in docs/results/run8-h200x2-final/certify/certify-a
# (8192 tokens 0.99x, 16384 tokens 1.23x at head_dim 128) and the spread seen there: a shape's
# median moves by up to about 3 % between runs and its 95 % interval spans about ±3 %.
SLOPE, JITTER, HALF_WIDTH = math.log(1.23 / 0.99), 0.015, 0.03


def simulated_run(crossing: float, rng: random.Random) -> dict:
    shapes = {}
    for tokens in GRID:
        median = math.exp(SLOPE * (math.log2(tokens) - math.log2(crossing)) + rng.gauss(0, JITTER))
        half = HALF_WIDTH * rng.uniform(0.5, 1.5)
        shapes[f"self-{tokens}"] = (tokens, median * math.exp(-half), median, median * math.exp(half))
    return shapes


def steady_threshold(shapes: dict) -> int | None:
    steady = speed.steady_lower_bounds(shapes)
    points = [(tokens, tokens, 128, steady[key]) for key, (tokens, *_) in shapes.items()]
    thresholds = speed.break_even(points)
    return thresholds.min_query_tokens if thresholds else None


@PROPERTY
@given(st.sampled_from([7000, 9000, 11000, 14000]), st.integers(0, 2 ** 32 - 1), st.integers(0, 2 ** 32 - 1))
def test_two_noisy_runs_of_one_curve_break_even_within_ten_percent(crossing, seed_a, seed_b):
    a = steady_threshold(simulated_run(crossing, random.Random(seed_a)))
    b = steady_threshold(simulated_run(crossing, random.Random(seed_b)))
    assert a is not None and b is not None
    assert abs(a - b) <= 0.10 * max(a, b), (a, b)
    # Honest: never below where the true curve is at 1x.
    assert min(a, b) >= crossing * 0.97


SHAPE = st.tuples(st.sampled_from(GRID), st.floats(0.05, 3.0), st.floats(0.0, 0.3), st.floats(0.0, 0.3))


def as_bounds(rows):
    return {f"s{i}": (tokens, median * math.exp(-low), median, median * math.exp(high))
            for i, (tokens, median, low, high) in enumerate(rows)}


@PROPERTY
@given(st.lists(SHAPE, max_size=12))
@example([(8192, 0.95, 0.01, 0.02), (8960, 1.5, 0.01, 0.01), (9728, 1.5, 0.01, 0.01)])
def test_a_steady_bound_never_exceeds_the_shapes_own_upper_bound(rows):
    """A shape measured slower with confidence (upper bound below the bar) stays below it however
    fast its neighbours are."""
    shapes = as_bounds(rows)
    steady = speed.steady_lower_bounds(shapes)
    assert set(steady) == set(shapes)
    for key, (_, _, _, high) in shapes.items():
        assert steady[key] <= high


@PROPERTY
@given(st.lists(SHAPE, max_size=12), st.randoms(use_true_random=False))
def test_steady_bounds_do_not_depend_on_the_order_of_shapes(rows, rng):
    shuffled = list(rows)
    rng.shuffle(shuffled)
    keyed = as_bounds(rows)
    by_content = {v: k for k, v in keyed.items()}
    again = speed.steady_lower_bounds(as_bounds(shuffled))
    first = speed.steady_lower_bounds(keyed)
    for key, value in as_bounds(shuffled).items():
        assert math.isclose(again[key], first[by_content[value]], rel_tol=1e-9)


def test_fewer_than_three_neighbours_keep_their_own_bound():
    shapes = {"a": (1024, 0.5, 0.6, 0.7), "b": (8192, 0.9, 1.0, 1.1)}
    assert speed.steady_lower_bounds(shapes) == {"a": 0.5, "b": 0.9}
