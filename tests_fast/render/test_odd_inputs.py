"""Odd text and odd fixtures: host names holding `|`, a newline or a lone surrogate stay inside
their Markdown cell and are written without an encoding error; two reports from one host are
told apart in merge's table; `fixtures show` refuses non-finite q/k/v, prints strict JSON and
takes a shipped fixture's file name as it sits in fixtures/."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sage_qual import cli
from sage_qual.fixtures.fileformat import save_fixture
from sage_qual.qualification.decide import checked

from .. import builders

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "tests_fast" / "data" / "sample_h200_2gpu.json"


def with_host(tmp_path: Path, host: str, name: str = "report.json") -> Path:
    data = json.loads(SAMPLE.read_text())
    data["host"] = host
    path = tmp_path / name
    path.write_text(json.dumps(data))  # json escapes the surrogate: the file itself is valid
    return path


@pytest.mark.parametrize("host", ["rack|7", "rack\n7", "rack\r\n7"])
def test_a_host_name_cannot_split_a_merge_row(tmp_path, capsys, host):
    assert cli.main(["merge", str(with_host(tmp_path, host))]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3  # header, rule, one row
    widths = {len(line.replace("\\|", "").split("|")) for line in lines}
    assert len(widths) == 1  # every row has as many cells as the header
    assert lines[2].startswith("| rack\\|7 |" if "|" in host else "| rack 7 |")


def test_a_lone_surrogate_in_a_host_name_is_printed_as_its_escape(tmp_path):
    """As a real terminal or pipe: UTF-8 stdout, the surrogate from undecodable bytes."""
    path = with_host(tmp_path, "box-\udcff")
    done = subprocess.run([sys.executable, "-m", "sage_qual", "merge", str(path)], cwd=ROOT,
                          capture_output=True, env={"PYTHONIOENCODING": "utf-8", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr.decode()
    assert b"| box-\\udcff |" in done.stdout


def test_report_md_and_html_are_written_with_a_lone_surrogate(tmp_path):
    data = json.loads(SAMPLE.read_text())
    data["host"] = "box-\udcff"
    builders.rendered(checked.parse(data, "r.json"), tmp_path)
    assert "box-\\udcff" in (tmp_path / "report.md").read_text(encoding="utf-8")
    assert "box-\\udcff" in (tmp_path / "report.html").read_text(encoding="utf-8")


def test_two_reports_from_one_host_are_told_apart(tmp_path, capsys):
    first, second = (with_host(tmp_path, "box", name) for name in ("run-a.json", "run-b.json"))
    assert cli.main(["merge", str(first), str(second)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| host | report | GPU |")
    assert lines[2].startswith(f"| box | {first} |") and lines[3].startswith(f"| box | {second} |")
    assert cli.main(["merge", str(first)]) == 0
    assert "report" not in capsys.readouterr().out.splitlines()[0]  # one report per host: no column


BOUNDS = {"fp16": {"max_rel_l2": 0.05, "min_cosine": 0.99}, "fp8": {"max_rel_l2": 0.1, "min_cosine": 0.99}}


@pytest.mark.parametrize("tensor, value", [("q", float("nan")), ("k", float("inf")), ("v", float("-inf"))])
def test_fixtures_show_refuses_non_finite_inputs(tmp_path, capsys, tensor, value):
    q, k, v = (torch.randn(1, 1, 64, 64).to(torch.bfloat16) for _ in range(3))
    dict(q=q, k=k, v=v)[tensor][0, 0, 3, 5] = value
    path = tmp_path / "odd.safetensors"
    save_fixture(path, q, k, v, family="flux.1", kind="replica", source={"t": 1}, provenance="test",
                 bounds=BOUNDS)
    assert cli.main(["fixtures", "show", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and f"tensor {tensor}: 1 of 4096 values are not finite" in err
    assert cli.main(["fixtures", "show", "--json", str(path)]) == 2
    assert "not finite" in json.loads(capsys.readouterr().out)["problem"]


def test_fixtures_show_json_is_strict_json(capsys):
    """The calibration holds a kernel's non-finite result (sm86-fp16-triton on this replica)."""
    assert cli.main(["fixtures", "show", "--json", "qwen_image_b52_value_offset"]) == 0
    out = capsys.readouterr().out

    def refuse(constant):
        raise ValueError(f"non-standard JSON constant {constant}")

    info = json.loads(out, parse_constant=refuse)
    assert info["calibration"]["kernels"]["sm86-fp16-triton"]["rel_l2"] is None


def test_fixtures_show_takes_the_file_name_as_it_sits_in_fixtures(capsys):
    assert cli.main(["fixtures", "show", "z_image_1024.safetensors"]) == 0
    assert capsys.readouterr().out.startswith("z_image_1024  (replica, family z-image)")


def test_a_host_name_with_a_line_break_keeps_report_mds_heading_one_line(tmp_path):
    data = json.loads(SAMPLE.read_text())
    data["host"] = "rack\n# injected"
    builders.rendered(checked.parse(data, "r.json"), tmp_path)
    lines = (tmp_path / "report.md").read_text().splitlines()
    assert lines[0] == "# SageAttention certification, rack # injected"
    assert "# injected" not in lines[1:]
