"""`sage-qual` in a child process whose stdout a test controls (a pipe closed early), on the
machine of tests_fast/data/sample_h200_2gpu.json: this machine's environment is the sample's, the
local fixtures are the checksums it recorded, and its hand-made budgets count as derived (as in
tests_fast/decide/test_gate_merge.py's `machine` and `fixture_dir`).

    python -m tests_fast.cli_child gate --family FLUX.1 --report tests_fast/data/sample_h200_2gpu.json
"""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

from sage_qual import cli, records
from sage_qual.qualification import families
from sage_qual.qualification.decide import budget_check, gate
from sage_qual.qualification.evidence.report_model import EnvironmentRecord

SAMPLE = json.loads((Path(__file__).parent / "data" / "sample_h200_2gpu.json").read_text())
# Built here, not with tests_fast.fakes.env_result: that module imports torch, which a child of the
# gate, compare or merge command does not need (1.0 of its 1.6 s start on CI's cores, measured here).
_MACHINE = records.parse(EnvironmentRecord, SAMPLE["environment"], "sample_h200_2gpu.json", "fix the sample")


def _local_fixture_files(directories, family):
    """The sample's fixtures that count for the family, as loaded fixtures stand in for the gate: only
    their checksums are read."""
    return {f["name"]: SimpleNamespace(name=f["name"], sha256=f["sha256"])
            for f in SAMPLE["fixtures"] if families.counts_for(family, f["family"])}


_real_gate = gate.gate
# gate's machine is the sample's, not a worker's: run.worker_executor imports torch through the plan.
gate.gate = lambda report, family, _machine, *rest: _real_gate(report, family, lambda: _MACHINE, *rest)
gate.family_fixtures = _local_fixture_files
budget_check.budget_problem = lambda *args: ""

if __name__ == "__main__":
    sys.exit(cli.main(sys.argv[1:]))
