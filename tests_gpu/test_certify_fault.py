"""A CUDA fault that poisons the context, inside a certify worker: that cell is a crash with its
stderr tail, every other cell keeps the verdict it has in a run without the fault, and the parent
(a child of this test) survives. Two short certify runs on two variants and two fixtures."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.gpu]

VARIANTS = ["sm90-fp8-cuda", "sm80-fp16-cuda"]
FAMILIES = ["FLUX.1", "Qwen-Image"]
FAULTY_VARIANT = "sm90-fp8-cuda"


def certify(out, faults=None):
    env = dict(os.environ)
    if faults:
        env["SAGE_QUAL_TEST_WORKER"] = json.dumps({"faults": faults})
    command = [sys.executable, "-m", "sage_qual", "certify", "--quick", "--devices", "0", "--out", str(out),
               "--variants", *VARIANTS, "--families", *FAMILIES]
    result = subprocess.run(command, capture_output=True, text=True, timeout=400, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["complete"] is True
    return {f"{c['variant']}|{c['fixture']}": c for c in report["devices"][0]["cells"]}


def test_poisoned_context_costs_only_its_cell(tmp_path):
    clean = certify(tmp_path / "clean")
    # --quick takes each family's smallest fixture, whichever that is: fault the variant's first cell.
    faulty_cell = next(key for key in sorted(clean) if key.startswith(FAULTY_VARIANT + "|"))
    faulty = certify(tmp_path / "faulty", {faulty_cell: "cuda-fault"})
    assert clean[faulty_cell]["outcome"] in ("pass", "fail")
    assert faulty[faulty_cell]["outcome"] == "crash"
    assert "device-side assert" in json.dumps(faulty[faulty_cell])
    others = {key: cell["outcome"] for key, cell in clean.items() if key != faulty_cell}
    assert others and others == {key: faulty[key]["outcome"] for key in others}
