"""Every committed report's decisions, as one JSON (issue 41: the `Served` refactor must decide the same).

`python docs/runs/run31_served_verdicts.py OUT.json` writes, per report.json under docs/results/ and per GPU
model and family: the verdict, what it serves, its reasons and each variant's results. Run before and
after a change to the decisions and diff the two files (docs/runs/run31_served_verdicts.txt).
"""
import json, sys
from pathlib import Path
from sage_qual.qualification.decide import checked, verdict
from sage_qual.qualification.evidence.report_model import ReportError

def row(d):
    s = d.served
    return {"family": d.label, "verdict": d.verdict.value, "variant": d.variant,
            "min_q": s and s.min_query_tokens, "min_k": s and s.min_key_tokens, "head_dims": s and s.head_dims,
            "max_q": s and s.max_query_tokens, "max_k": s and s.max_key_tokens,
            "layouts": s and s.layouts, "contexts": s and s.contexts,
            "bounds": [[b.side, b.below, b.reason] for b in (s.bounds if s else [])],
            "reasons": [[r.kind.value, r.detail] for r in d.reasons],
            "range_reasons": [[r.kind.value, r.detail] for r in d.range_reasons],
            "certified": d.results.certified, "bounded": {k: [[b.side, b.below] for b in v] for k, v in d.results.bounded.items()},
            "rejected": sorted(d.results.findings)}
out = {}
for path in sorted(Path("docs/results").rglob("report.json")):
    try:
        report = checked.load(path)
    except ReportError as e:
        out[str(path)] = "refused: " + str(e)
        continue
    out[str(path)] = [{"gpu": g.model, "families": [row(d) for d in g.families + [g.default]]} for g in verdict.decide(report)]
Path(sys.argv[1]).write_text(json.dumps(out, indent=1, sort_keys=True))
print(len(out), sum(isinstance(v, str) for v in out.values()))
