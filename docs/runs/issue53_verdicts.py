"""Every committed report's decisions, one line per (report, GPU model, family): the verdict and
everything it serves (`Served` as its JSON), so two revisions' outputs can be compared with `diff`
(issue 53: "every committed report decides the same verdicts before and after").

    python docs/runs/issue53_verdicts.py > /tmp/after.txt
    git worktree add /tmp/before 2fa7bc8
    (cd /tmp/before && PYTHONPATH=. python $OLDPWD/docs/runs/issue53_verdicts.py $OLDPWD) > /tmp/before.txt

Run from the repository root, on the CPU (the decisions read no GPU). A report the code refuses is
one line naming the refusal.
"""

import json
import sys
from pathlib import Path

from sage_qual import records
from sage_qual.qualification.decide import checked, verdict


def lines(root: Path) -> list[str]:
    found = []
    for path in sorted(root.glob("docs/results/**/report.json.gz")):
        name = path.relative_to(root)
        try:
            decided = verdict.decide(checked.load(path))
        except Exception as error:  # a refusal is part of what is compared
            found.append(f"{name}: refused: {type(error).__name__}")
            continue
        for gpu in decided:
            for family in gpu.families + [gpu.default]:
                served = json.dumps(records.dump(family.served), sort_keys=True) if family.served else "-"
                found.append(f"{name}: {gpu.model} {family.label}: {family.verdict.value} {served}")
    return found


if __name__ == "__main__":
    print("\n".join(lines(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("."))))
