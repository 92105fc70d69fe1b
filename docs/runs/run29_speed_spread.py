"""How far a certify run's speed verdicts move between runs of one H200 and one build.

Reads the three back-to-back full certifies of docs/results/run29-h200/ and runs 27 and 28. Prints,
per self-attention length of sm90-fp8-cuda from 8,192 tokens, the median speedups and their largest
over smallest (the run-to-run spread), then each run's head_dim-128 and head_dim-64 break-even for
a range of margins on the 1x bar. Run from the repository root:
`python docs/runs/run29_speed_spread.py > docs/runs/run29_speed_spread.txt`.
"""

import statistics
from pathlib import Path

from sage_qual.qualification.decide import verdict
from sage_qual.qualification.evidence import files
from sage_qual.qualification.measure import speed

RESULTS = Path("docs/results")
RUNS = [RESULTS / f"run29-h200/certify-{n}/report.json" for n in (1, 2, 3)] + [
    RESULTS / "run28-h200/certify/report.json", RESULTS / "run27-h200/certify/report.json"]
VARIANT = "sm90-fp8-cuda"


def curves(path: Path) -> dict[tuple[int, int], tuple[float, float]]:
    """(head_dim, tokens) -> (steady lower bound, median speedup) of the self-attention sweep."""
    report = files.load(path)
    shapes = {key: entry.shape for key, entry in report.shapes.items()}
    found = {}
    for (variant, key), (low, median) in verdict._speedups(report.devices, shapes).items():
        shape = shapes[key]
        if variant == VARIANT and shape.q_tokens == shape.kv_tokens and median > 0 and all(u.family is None for u in report.shapes[key].uses):
            found[(shape.head_dim, shape.q_tokens)] = (low, median)
    return found


def main() -> None:
    runs = [curves(path) for path in RUNS]
    common = sorted(set.intersection(*map(set, runs)))
    print("runs:", ", ".join(str(p) for p in RUNS))
    spreads = {64: [], 128: []}
    print("head_dim tokens | median speedup per run | largest/smallest")
    for head_dim, tokens in common:
        if tokens < 8192:
            continue
        medians = [run[(head_dim, tokens)][1] for run in runs]
        spread = max(medians) / min(medians)
        spreads[head_dim].append(spread)
        print(f"{head_dim:>3} {tokens:>6} | {' '.join(f'{m:.3f}' for m in medians)} | {spread:.3f}")
    for head_dim, values in spreads.items():
        print(f"head_dim {head_dim}: {len(values)} lengths, spread median {statistics.median(values):.3f}, "
              f"largest {max(values):.3f}")
    print("break-even (tokens) per run, by the bar the steady lower bound must clear:")
    for bar in (1.0, 1.02, 1.05, 1.08):
        cells = []
        for head_dim in (128, 64):
            found = []
            for run in runs:
                points = [(t, t, d, low) for (d, t), (low, _) in run.items() if d == head_dim]
                even = speed.break_even(points, bar)
                found.append(even.min_query_tokens if even else None)
            cells.append(f"head_dim {head_dim}: {found}")
        print(f"  {bar:.2f}x  " + "; ".join(cells))


if __name__ == "__main__":
    main()
