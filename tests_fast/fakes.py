"""Fakes shared by the fast suite's test modules (test modules import this, never each other).

A fleet of GPUs in one certify report: built from the hand-made samples in tests_fast/data
(certify's format, synthetic numbers), the H200 sample's cuda:0 stays an H200, its cuda:1 becomes an
H100, and the RTX 4090 sample's device joins as cuda:2; `write_fleet` writes every fixture the report
names as a small real file and records its checksum. `within_budget` gives numbers inside a budget.
"""

import json
from dataclasses import replace
from pathlib import Path

import torch

from sage_qual import records
from sage_qual.fixtures import fileformat
from sage_qual.qualification import selection
from sage_qual.qualification.evidence import files, report_model, tasks
from sage_qual.qualification.evidence.report_model import Outcome

from . import builders

DATA = Path(__file__).parent / "data"
H200, H100, RTX4090 = "NVIDIA H200", "NVIDIA H100 80GB HBM3", "NVIDIA GeForce RTX 4090"
L40S, H200_NVL = "NVIDIA L40S", "NVIDIA H200 NVL"  # not in the fleet report
CAPABILITY = {H200: [9, 0], H100: [9, 0], RTX4090: [8, 9], L40S: [8, 9], H200_NVL: [9, 0]}
MEMORY_GIB = {RTX4090: 24.0}  # the fleet report's; its H200 and H100 keep the sample's 139.8


def load(name: str) -> dict:
    return json.loads((DATA / name).read_text())


def random_fixture(directory: Path, name: str, family: str, bounds: dict, seed: int = 0, tokens: int = 32,
                   dtype: torch.dtype = torch.bfloat16, zero_v_channel: int | None = None) -> Path:
    """A small valid fixture file of random q, k, v (1 batch, 2 heads, `tokens`, head_dim 64).
    `zero_v_channel`: that V channel is zero in every token, where FP8 kernels, which scale V per
    channel by its maximum, return NaN (README, Known limits)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 2, tokens, 64, generator=g).to(dtype) for _ in range(3))
    if zero_v_channel is not None:
        v[..., zero_v_channel] = 0.0
    return fileformat.save_fixture(directory / f"{name}{fileformat.SUFFIX}", q, k, v, family=family,
                                   kind="replica", source={"test": name},
                                   provenance="tests_fast/fakes.py: random data", bounds=bounds)


def write_fixture(directory: Path, name: str, family: str, bounds: dict, seed: int = 0) -> str:
    """A small valid fixture file; returns its sha256 as gate reads it."""
    return fileformat.load_fixture(random_fixture(directory, name, family, bounds, seed)).sha256


def gpu_entry(template: dict, index: int, name: str) -> dict:
    """`template` (a report's GPU entry) as GPU `index` of model `name`, with that model's memory as the
    fleet report records it (a GPU of another memory is another part: verdicts.machine.RULES)."""
    return {**template, "index": index, "name": name, "capability": CAPABILITY[name],
            "memory_gib": MEMORY_GIB.get(name, template["memory_gib"])}


def env_result(environment: dict | report_model.EnvironmentRecord,
               not_supported: dict | None = None) -> tasks.EnvResult:
    """What `pool.collect_environment` gives on a machine with `environment` (a report's
    environment JSON or record): the environment task's passed result."""
    if isinstance(environment, dict):
        environment = builders.read(report_model.EnvironmentRecord, environment)
    return tasks.EnvResult(tasks.Outcome.PASS, environment, not_supported or {})


def on_machine(monkeypatch, environment) -> None:
    """This process runs on a machine with `environment` (env_result's, or a function giving it when
    the worker is asked): its worker collects that environment, and the device-node check that refuses
    a machine without a GPU before any worker (`options.gpu_absent`) finds one."""
    from sage_qual.qualification.run import options, pool

    monkeypatch.setattr(pool, "collect_environment", lambda *args, **kwargs: env_result(
        environment() if callable(environment) else environment))
    monkeypatch.setattr(options, "gpu_absent", lambda: "")


def fleet_report() -> dict:
    """One complete report: cuda:0 H200, cuda:1 H100, cuda:2 RTX 4090."""
    data, rtx = (files.from_dict(load(name), name) for name in ("sample_h200_2gpu.json",
                                                                        "sample_rtx4090.json"))
    h200, h100 = data.devices
    device = replace(rtx.devices[0], index=2)
    skip = next(c for c in device.cells if c.outcome == Outcome.SKIP)
    added = []
    for fixture in data.fixtures:  # the RTX sample ran three of the five fixtures
        if not any(c.fixture == fixture.name for c in device.cells):
            added += [builders.cell(v, fixture) for v in ("sm89-fp8-cuda", "sm86-fp16-triton")]
            added.append(replace(skip, fixture=fixture.name))
    devices = [h200, replace(h100, name=H100), replace(device, cells=device.cells + added)]
    gpus = [replace(data.environment.gpus[0], index=n, name=name, capability=CAPABILITY[name])
            for n, name in enumerate((H200, H100))] + [replace(rtx.environment.gpus[0], index=2)]
    variants = data.options.variants + [v for v in rtx.options.variants if v not in data.options.variants]
    return records.dump(replace(data, host="fleet-box", devices=devices,
                                options=replace(data.options, devices=[0, 1, 2], variants=variants),
                                environment=replace(data.environment, gpus=gpus)))


def write_fleet(directory: Path, data: dict) -> tuple[Path, Path, dict]:
    """(report path, fixture directory, report) with every fixture of the report written to disk."""
    fixtures = directory / "fixtures"
    fixtures.mkdir()
    for seed, f in enumerate(data["fixtures"]):
        f["sha256"] = write_fixture(fixtures, f["name"], f["family"], f["bounds"], seed)
        written = fileformat.load_fixture(fixtures / f"{f['name']}{fileformat.SUFFIX}")
        # What a report copies from a file is the file's (gate compares the two).
        f.update({key: value for key, value in records.dump(selection.fixture_record(written)).items()
                  if key in ("q", "k", "dtype", "provenance", "masked", "kind")})
    path = directory / "report.json"
    path.write_text(json.dumps(data))
    return path, fixtures, data


def within_budget(budget: dict) -> dict:
    """Metrics (as a report stores them) halfway inside every limit of `budget`."""
    return {"rel_l2": budget["max_rel_l2"] / 2, "worst_head_rel_l2": budget["max_head_rel_l2"] / 2,
            "worst_batch_rel_l2": budget["max_batch_rel_l2"] / 2,
            "worst_block_rel_l2": budget["max_block_rel_l2"] / 2,
            "worst_head_cosine": (1 + budget["min_cosine"]) / 2, "norm_ratio": 1.0, "finite": True,
            "max_abs_error": budget["max_abs"] / 2}
