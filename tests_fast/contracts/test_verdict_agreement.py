"""gate, report.md, merge and certify's summary say the same verdict for every (GPU model, family).

Reports are generated from a seeded random model of a certify run: GPU models with one or two
devices, variants that pass, fail (with numbers beyond the fixture's bounds), crash, run out of
memory, time out or never ran, fixtures of real, generic and unknown families, and timings
around the break-even with repeat samples. Each output is read back the way its user reads it
(the Markdown table, the merge rows, gate's JSON, the summary's lines), not from the decision
objects.
"""

import copy
import gzip
import io
import json
import random
import re
import statistics
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from sage_qual import records
from sage_qual.kernels.variants import VARIANTS
from sage_qual.qualification.decide import checked, fleet, gate, verdict
from sage_qual.qualification.evidence.report_model import (
    AccuracyClass,
    Cell,
    FixtureRecord,
    PublishedBound,
    Speed,
)
from sage_qual.qualification.families import FAMILIES, find
from sage_qual.qualification.measure import judge
from sage_qual.qualification.render import plots
from sage_qual.qualification.run import plan

from .. import builders

MODELS = [  # name, capability, memory_gib
    ("NVIDIA H200", [9, 0], 139.8),
    ("NVIDIA H100 80GB HBM3", [9, 0], 79.6),
    ("NVIDIA GeForce RTX 4090", [8, 9], 23.6),
    ("NVIDIA A100-SXM4-80GB", [8, 0], 79.3),
]
FIXTURE_FAMILIES = ["flux.1", "qwen-image", "sdxl", "wan-2.2", "z-image", "generic", "cross-attention"]
BOUNDS = {AccuracyClass.FP16: PublishedBound(max_rel_l2=0.05, min_cosine=0.99),
          AccuracyClass.FP8: PublishedBound(max_rel_l2=0.12, min_cosine=0.98)}
REPORTS = 30


def _cell(rng: random.Random, variant: str, fixture: FixtureRecord) -> Cell | None:
    roll = rng.random()
    if roll < 0.04:
        return None  # never recorded: the variant is incomplete on this device
    if roll < 0.12:
        return builders.cell(variant, fixture, rng.choice(["crash", "oom", "timeout", "skip"]))
    published = fixture.bounds[AccuracyClass(VARIANTS[variant].accuracy_class)]
    budget = builders.budget(published.max_rel_l2, published.min_cosine)
    failing = roll < 0.25
    rel_l2 = budget.max_rel_l2 * (rng.uniform(1.1, 4) if failing else rng.uniform(0.2, 0.95))
    numbers = {"rel_l2": rel_l2, "worst_head_cosine": rng.uniform(max(budget.min_cosine, 0.9), 1.0)}
    extra = rng.uniform(1.2, 1.8)
    reasons = judge.cell_reasons(
        builders.metrics(**numbers), extra, budget, 2.5, 0.002, fitness=builders.CONFORMANCE_ONLY
    )
    return builders.cell(variant, fixture, "fail" if reasons else "pass", reasons=reasons, budget=budget,
                         extra_bytes_per_element=extra, finite=True, sdpa_rel_l2=0.002,
                         error_vs_sdpa=rel_l2 / 0.002, **numbers)


def _timing(rng: random.Random, kernel: str, key: str, ms: float) -> Speed:
    samples = [ms * rng.uniform(0.97, 1.03) for _ in range(rng.choice([5, 10, 20]))]
    return builders.timing(kernel, key, statistics.median(samples), samples_ms=samples)


def make_report(seed: int) -> dict:
    rng = random.Random(seed)
    models = [rng.choice(MODELS) for _ in range(rng.randint(1, 2))]
    devices_models = [m for m in models for _ in range(rng.randint(1, 2))]
    variants = rng.sample(
        ["sm90-fp8-cuda", "sm89-fp8-cuda", "sm80-fp16-cuda", "sm89-fp8-cuda-fp32acc"], rng.randint(1, 3)
    )
    chosen = rng.sample(FAMILIES, rng.randint(1, len(FAMILIES)))
    fixtures = [builders.fixture(f"fx{n}", rng.choice(FIXTURE_FAMILIES), sha256=f"{n:064x}", bounds=BOUNDS,
                                 provenance="generated for the agreement test")
                for n in range(rng.randint(1, 5))]
    shapes = plan.speed_shapes(chosen, quick=rng.random() < 0.3)
    # Each variant pays from its own crossover, scaled per GPU model: some pay nowhere.
    crossover = {(v, m[0]): rng.choice([1e9, 1e10, 3e10, 1e11, 1e12, 1e14]) for v in variants for m in models}
    devices = []
    for index, gpu in enumerate(devices_models):
        cells = [c for v in variants for f in fixtures if (c := _cell(rng, v, f)) is not None]
        speed = []
        for key, entry in shapes.items():
            s = entry.shape
            flops = 4.0 * s.batch * s.heads * s.head_dim * s.q_tokens * s.kv_tokens
            sdpa_ms = flops / 4.5e11 + 0.02
            speed.append(_timing(rng, "sdpa", key, sdpa_ms))
            for v in variants:
                if rng.random() < 0.03:
                    speed.append(builders.timing(v, key, None, "oom", detail="test oom"))
                    continue
                factor = 1.6 if flops > crossover[(v, gpu[0])] else 0.7
                speed.append(_timing(rng, v, key, sdpa_ms / factor))
        devices.append(builders.device(cells, speed, index, gpu))
    return records.dump(builders.report(devices, fixtures, shapes, variants, [f.name for f in chosen],
                                        host=f"generated-{seed}", command="generated for the agreement test"))


# Each output, read back as its user reads it ----------------------------------------------------
SERVED = re.compile(r"(from|at) ([\d,]+)(?: to ([\d,]+))?(?: query / ([\d,]+)(?: to [\d,]+)? key)? tokens")


def served_text(text: str) -> str:
    """ "from 9,728 to 75,600 tokens, ...", "at 16,384 tokens" or "from 4,608 query / 512 key tokens,
    ..." as "MIN_Q / MIN_K to MAX_Q" (MAX_Q None without a verified upper bound)."""
    word, low_q, high_q, low_k = SERVED.match(text).groups()
    high_q = low_q if word == "at" else high_q
    number = lambda x: x.replace(",", "")  # noqa: E731
    return f"{number(low_q)} / {number(low_k or low_q)} to {number(high_q) if high_q else None}"


def served_numbers(entry: dict) -> str | None:
    served = entry["served"]
    if served is None:
        return None
    return f"{served['min_query_tokens']} / {served['min_key_tokens']} to {served.get('max_query_tokens')}"


def variant_of(entry: dict) -> str | None:
    return entry["served"]["variant"] if entry["served"] else None


def from_markdown(data: dict, tmp_path: Path, monkeypatch) -> dict:
    monkeypatch.setattr(plots, "plots", lambda *args: {})  # the tables are what is compared
    builders.rendered(checked.parse(data, "r.json"), tmp_path)
    found, model, in_verdicts = {}, None, False
    for line in (tmp_path / "report.md").read_text().splitlines():
        if line.startswith("## "):
            model = line[3:].split(", cuda:")[0]
        elif line.startswith("### "):
            in_verdicts = line == "### Verdicts"
        elif in_verdicts and line.startswith("| ") and not line.startswith("| family"):
            family, word, variant, served = [c.strip() for c in line.strip("|").split(" | ")][:4]
            if family != "(default: all fixtures)":
                found[(model, family)] = (
                    word,
                    variant if variant != "-" else None,
                    served_text(served) if served != "-" else None,
                )
    return found


def from_merge(data: dict) -> dict:
    rows = fleet.merge_rows([(Path("r.json"), checked.parse(copy.deepcopy(data), "r.json"))])
    found = {}
    for row in json.loads(json.dumps([records.dump(row) for row in rows])):  # as merge --json prints
        model = "%s (sm_%d%d)" % (row["gpu"], *row["capability"])
        for family, v in row["families"].items():
            found[(model, family)] = (v["verdict"], variant_of(v), served_numbers(v))
    return found


def from_gate(data: dict) -> dict:
    found = {}
    typed = checked.parse(copy.deepcopy(data), "r.json")
    for family_name in data["options"]["families"]:
        family = find(family_name)
        local = {f["name"]: f["sha256"] for f in data["fixtures"] if gate.counts_for(family, f["family"])}
        answer = records.dump(gate.decide_stored(typed, family, typed.environment, local, False).answer())
        assert answer["exit_code"] in (0, 1), answer["problem"]
        for g in json.loads(json.dumps(answer))["gpus"]:
            found[(g["gpu"], family.name)] = (g["verdict"], variant_of(g), served_numbers(g))
    return found


SUMMARY_LINE = re.compile(
    r"^  (?P<model>.+ \(sm_\d+\))  (?P<family>\S.*?)\s+(?P<state>enable .+|keep off .+|"
    r"safe, no speedup .+)$"
)


def from_summary(data: dict, tmp_path: Path) -> dict:
    with redirect_stdout(io.StringIO()) as text:
        print(builders.summarized(checked.parse(data, "report.json"), tmp_path))
    found = {}
    for line in text.getvalue().splitlines()[1:]:
        match = SUMMARY_LINE.match(line)
        assert match, line
        if match["family"] == "default":
            continue
        state = match["state"]
        if state.startswith("enable "):
            variant, served = re.match(r"enable (\S+) ((?:from|at) .*)", state).groups()
            found[(match["model"], match["family"])] = ("enable", variant, served_text(served))
        else:
            found[(match["model"], match["family"])] = (state.split(" (")[0], None, None)
    return found


@pytest.mark.parametrize("seed", range(REPORTS))
def test_gate_report_merge_and_summary_agree(seed, tmp_path, monkeypatch):
    data = make_report(seed)
    markdown = from_markdown(data, tmp_path, monkeypatch)
    merged, gated, summed = from_merge(data), from_gate(data), from_summary(data, tmp_path)
    assert markdown, "no verdicts rendered"
    assert merged == markdown
    assert summed == markdown
    # gate answers for the GPU models of this machine: here, all of the report's
    assert gated == markdown


def test_the_generated_reports_cover_every_verdict():
    """The generator is only a test if it produces every verdict (and several variants win)."""
    words, variants = set(), set()
    for seed in range(REPORTS):
        for gpu in verdict.decide(checked.parse(make_report(seed), "r.json")):
            words |= {d.verdict.value for d in gpu.families}
            variants |= {d.variant for d in gpu.families if d.variant}
    assert words == {v.value for v in verdict.Verdict}
    assert len(variants) >= 2


RESULTS = Path(__file__).resolve().parent.parent.parent / "docs" / "results"
CURRENT = sorted((RESULTS / "run11-h200x2").rglob("report.json.gz"))


@pytest.mark.parametrize("path", CURRENT, ids=lambda p: str(p.parent.name))
def test_the_committed_current_reports_agree(path, tmp_path, monkeypatch):
    """The final GPU run's reports (docs/results/run11-h200x2/): the same four outputs, same verdicts."""
    data = json.loads(gzip.decompress(path.read_bytes()))
    markdown = from_markdown(data, tmp_path, monkeypatch)
    assert markdown and from_merge(data) == markdown and from_summary(data, tmp_path) == markdown
    assert from_gate(data) == markdown
