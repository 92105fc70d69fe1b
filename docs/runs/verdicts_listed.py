"""Every committed certify report's verdicts, one line per GPU model and family (run from a checkout)."""
import sys
from pathlib import Path
from sage_qual.qualification.decide import checked, verdict
root = Path(sys.argv[1])
for path in sorted(root.glob("docs/results/**/report.json.gz")):
    try:
        report = checked.load(path)
    except Exception as error:
        print(path.relative_to(root), "unreadable:", type(error).__name__); continue
    for gpu in verdict.decide(report):
        for d in [*gpu.families, gpu.default]:
            print(path.relative_to(root), gpu.model, d.label, d.verdict.value, d.served.text() if d.served else "-")
