"""Small things a first-time user trips over: --help states every default, report.html shows no
Markdown backticks, the downstream example says how to run it, and the fast suite's certify runs
leave no Triton cache folder behind."""

import argparse
import json
from pathlib import Path

import pytest

from sage_qual import cli
from sage_qual.qualification.decide import checked

from .. import builders

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("command", ["certify", "gate", "compare", "merge"])
def test_help_states_every_default(command):
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    for action in sub._actions:
        if action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            continue
        shown = action.help % {"default": action.default} if action.help else ""
        default = f"{action.default:g}" if isinstance(action.default, float) else str(action.default)
        assert default in shown, f"{command} {action.option_strings[0]}: help does not state {default}"


def test_report_html_shows_code_not_backticks(tmp_path):
    data = json.loads((ROOT / "tests_fast" / "data" / "sample_h200_2gpu.json").read_text())
    builders.rendered(checked.parse(data, "r.json"), tmp_path)
    page = (tmp_path / "report.html").read_text()
    assert "`" not in page and f"<code>{data['command']}</code>" in page


def test_the_downstream_example_says_how_to_run_it():
    readme = (ROOT / "examples" / "downstream_app" / "README.md").read_text()
    assert "pytest" in readme and "sage_qual_target" in readme and "skips with the reason" in readme
