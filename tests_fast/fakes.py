"""Fakes shared by the fast suite's test modules (test modules import this, never each other).

A fleet of GPUs in one certify report: built from the hand-made samples in tests_fast/data
(certify's format, synthetic numbers), the H200 sample's cuda:0 stays an H200, its cuda:1 becomes an
H100, and the RTX 4090 sample's device joins as cuda:2; `write_fleet` writes every fixture the report
names as a small real file and records its checksum. `within_budget` gives numbers inside a budget.
"""

import copy
import json
from pathlib import Path

import torch

from sage_qual.fixtures import fileformat
from sage_qual.serving.variants import VARIANTS

DATA = Path(__file__).parent / "data"
H200, H100, RTX4090 = "NVIDIA H200", "NVIDIA H100 80GB HBM3", "NVIDIA GeForce RTX 4090"
L40S, H200_NVL = "NVIDIA L40S", "NVIDIA H200 NVL"  # not in the fleet report
CAPABILITY = {H200: [9, 0], H100: [9, 0], RTX4090: [8, 9], L40S: [8, 9], H200_NVL: [9, 0]}


def load(name: str) -> dict:
    return json.loads((DATA / name).read_text())


def write_fixture(directory: Path, name: str, family: str, bounds: dict, seed: int = 0) -> str:
    """A small valid fixture file; returns its sha256 as gate reads it."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 2, 32, 64, generator=g).to(torch.bfloat16) for _ in range(3))
    path = fileformat.save_fixture(directory / f"{name}{fileformat.SUFFIX}", q, k, v, family=family,
                                   kind="replica", source={"test": name},
                                   provenance="tests_fast/fakes.py: random data", bounds=bounds)
    return fileformat.load_fixture(path).sha256


def passing_cell(template: dict, fixture: dict, variant: str) -> dict:
    bounds = fixture["bounds"][VARIANTS[variant].accuracy_class]
    return {**template, "variant": variant, "fixture": fixture["name"], "outcome": "pass", "reasons": [],
            "accuracy_class": VARIANTS[variant].accuracy_class, "bounds": bounds, "finite": True,
            "rel_l2": bounds["max_rel_l2"] / 2, "worst_head_cosine": (1 + bounds["min_cosine"]) / 2,
            "extra_bytes_per_element": 1.5}


def gpu_entry(template: dict, index: int, name: str) -> dict:
    return {**template, "index": index, "name": name, "capability": CAPABILITY[name]}


def fleet_report() -> dict:
    """One complete report: cuda:0 H200, cuda:1 H100, cuda:2 RTX 4090."""
    data, rtx = load("sample_h200_2gpu.json"), load("sample_rtx4090.json")
    data.pop("gpus", None)  # the stored analysis of version 1: verdicts come from the evidence
    data["host"] = "fleet-box"
    selected = data["options"]["variants"]
    selected += [v for v in rtx["options"]["variants"] if v not in selected]
    data["options"]["devices"] = [0, 1, 2]
    h200, h100 = data["devices"]
    h100["name"] = H100
    device = copy.deepcopy(rtx["devices"][0])
    device["index"] = 2
    template = next(c for c in device["cells"] if c["outcome"] == "pass")
    skip = next(c for c in device["cells"] if c["outcome"] == "skip")
    for fixture in data["fixtures"]:  # the RTX sample ran three of the five fixtures
        if not any(c["fixture"] == fixture["name"] for c in device["cells"]):
            device["cells"] += [passing_cell(template, fixture, v)
                                for v in ("sm89-fp8-cuda", "sm86-fp16-triton")]
            device["cells"].append({**skip, "fixture": fixture["name"]})
    data["devices"].append(device)
    gpu = data["environment"]["gpus"][0]
    data["environment"]["gpus"] = [gpu_entry(gpu, 0, H200), gpu_entry(gpu, 1, H100),
                                   {**rtx["environment"]["gpus"][0], "index": 2}]
    return data


def write_fleet(directory: Path, data: dict) -> tuple[Path, Path, dict]:
    """(report path, fixture directory, report) with every fixture of the report written to disk."""
    fixtures = directory / "fixtures"
    fixtures.mkdir()
    for seed, f in enumerate(data["fixtures"]):
        f["sha256"] = write_fixture(fixtures, f["name"], f["family"], f["bounds"], seed)
    path = directory / "report.json"
    path.write_text(json.dumps(data))
    return path, fixtures, data


def within_budget(budget: dict) -> dict:
    """Numbers halfway inside every limit of `budget`."""
    return {"rel_l2": budget["max_rel_l2"] / 2, "worst_head_rel_l2": budget["max_head_rel_l2"] / 2,
            "worst_batch_rel_l2": budget["max_batch_rel_l2"] / 2,
            "worst_block_rel_l2": budget["max_block_rel_l2"] / 2,
            "worst_head_cosine": (1 + budget["min_cosine"]) / 2, "norm_ratio": 1.0, "finite": True,
            "max_abs_error": budget["max_abs"] / 2}
