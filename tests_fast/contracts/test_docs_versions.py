"""The file versions docs/certify.md states are the code's (issue 54: it gave report.json as
schema 4 and profile.json as schema 2 after both moved on)."""

import re
from pathlib import Path

from sage_qual.qualification.evidence import report_model
from sage_qual.verdicts import profile

CERTIFY = " ".join((Path(__file__).resolve().parents[2] / "docs" / "certify.md").read_text().split())


def test_the_report_schema_version_is_the_models():
    stated = re.search(r"`DIR/report\.json` follows .*?`schema_version` (\d+)\)", CERTIFY)
    assert stated and int(stated.group(1)) == report_model.SCHEMA_VERSION


def test_the_profile_schema_version_is_the_readers():
    stated = re.search(r"A profile \(`sage_qual/verdicts/profile\.py`, schema version (\d+)", CERTIFY)
    assert stated and int(stated.group(1)) == profile.SCHEMA_VERSION
