"""Collect what decides SageAttention's behaviour on this machine into a typed record.

Collecting and rendering are separate (as in torch.utils.collect_env): `collect()` builds an
`Environment`, `to_json()` is for machines, `render_text()` for people. Collecting initializes
CUDA and imports sageattention; callers that must keep CUDA out of their process run it in a
worker.
"""

from __future__ import annotations

import importlib.metadata
import json
import platform as host
import subprocess
import sys

import torch

from sage_qual import records
from sage_qual.kernels import sage_package
from sage_qual.kernels.contexts import builtin_safe
from sage_qual.kernels.providers import PROVIDERS, THU_ML
from sage_qual.kernels.variants import VARIANTS, capability_label
from sage_qual.serving import platform
from sage_qual.serving.assess import MachineAssessment, assess_machine
from sage_qual.serving.config import DEFAULT_CONFIG, WrapperConfig
from sage_qual.verdicts.env_record import EnvironmentRecord, GpuInfo, OtherProvider
from sage_qual.version import __version__

# The record (defined once, torch-free, as report.json stores it) under the names this module gives it.
Environment, Gpu = EnvironmentRecord, GpuInfo


def _distribution_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return ""


def _driver_version() -> str:
    try:
        result = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return result.stdout.strip().splitlines()[0] if result.returncode == 0 and result.stdout.strip() else ""


def collect(config: WrapperConfig = DEFAULT_CONFIG,
            machine: MachineAssessment | None = None) -> Environment:
    """This machine's record; `machine` (from `assess.assess_machine(config)`) when the caller has it."""
    cuda = platform.current()
    machine = machine if machine is not None else assess_machine(config)
    package, problem, extensions = machine.package, machine.problem, {}
    if package is not None:
        extensions = {e: "ok" for e in package.extensions}
        extensions.update(package.extension_errors)
    gpus = [Gpu(gpu.index, cuda.device_name(gpu.index), list(gpu.box.capability),
                round(cuda.total_memory(gpu.index) / 2**30, 1),
                gpu.kernel.name if gpu.kernel else "", gpu.no_kernel_reason, gpu.runnable,
                cuda.sm_count(gpu.index))
            for gpu in machine.gpus]
    return Environment(
        sage_qual=__version__,
        python=sys.version.split()[0],
        os=host.platform(),
        torch=torch.__version__,
        torch_cuda=torch.version.cuda or ("ROCm " + torch.version.hip if torch.version.hip else ""),
        cudnn=str(torch.backends.cudnn.version() or "") if torch.backends.cudnn.is_available() else "",
        driver=_driver_version() if cuda.device_count() else "",
        triton=_distribution_version("triton") or _distribution_version("triton-windows"),
        sageattention=package.version if package else _distribution_version("sageattention"),
        sageattention_problem=problem,
        extensions=extensions,
        gpus=gpus,
        sageattention_source=package.source if package else "",
        sageattention_origin=package.origin if package else "",
        other_providers=[_other(name, found) for name, found in machine.packages.items()
                         if name != THU_ML.name],
    )


def _other(name: str, found) -> OtherProvider:
    if isinstance(found, str):
        return OtherProvider(name, "", problem=found)
    return OtherProvider(name, found.version, found.source, found.origin)


def to_json(env: Environment) -> str:
    return json.dumps(records.dump(env))  # one line, as every --json answer (jsonfile.line)


def from_dict(data: dict) -> Environment:
    """`sage-qual env --json`'s output read back; RecordError (one line) when it is not one."""
    return records.parse(Environment, data, "sage-qual env --json",
                         "give the output of `sage-qual env --json`")


def render_text(env: Environment, contexts: bool = False) -> str:
    """The environment as text; `contexts`: also each GPU kernel's built-in execution contexts
    (`sage-qual env`; a report's copy of the environment leaves them to its context checks)."""
    lines = [
        f"sage-qual      {env.sage_qual}",
        f"Python         {env.python} on {env.os}",
        f"torch          {env.torch} (CUDA {env.torch_cuda or 'none'}, cuDNN {env.cudnn or 'none'})",
        f"NVIDIA driver  {env.driver or 'none'}",
        f"triton         {env.triton or 'not installed'}",
        f"sageattention  {env.sageattention or 'not installed'}"
        + (f" (build {env.sageattention_source})" if env.sageattention_source else "")
        + (f" from {env.sageattention_origin}" if env.sageattention_origin else "")
        + (f"  -- cannot serve: {env.sageattention_problem}" if env.sageattention_problem else ""),
    ]
    for name, state in sorted(env.extensions.items()):
        lines.append(f"  {name:<14} {state}")
    for other in env.other_providers:
        # Without a version, "not installed" only where it is not importable: a package that imports
        # but has no metadata, or fails to import, says why (it read "not installed" in device run 41).
        absent = other.problem.startswith(sage_package.absent(PROVIDERS[other.provider])) \
            if other.provider in PROVIDERS else not other.problem
        state = other.version or ("not installed" if absent else "not usable")
        lines.append(f"{other.provider:<14} {state}"
                     + (f" (build {other.source})" if other.source else "")
                     + (f" from {other.origin}" if other.origin else "")
                     + (f"  -- cannot serve: {other.problem}" if other.problem and not absent else ""))
    if not env.gpus:
        lines.append("GPUs           none visible")
    for gpu in env.gpus:
        lines.append("cuda:%d  %s  %s  %.1f GiB"
                     % (gpu.index, gpu.name, capability_label(gpu.capability), gpu.memory_gib))
        lines.append(f"  wrapper kernel   {gpu.kernel or 'none: ' + gpu.no_kernel_reason}")
        if contexts and gpu.kernel in VARIANTS:
            safe = ", ".join(builtin_safe(VARIANTS[gpu.kernel]))
            lines.append(f"  serves, built in default stream, {safe} (a certified profile says otherwise "
                         "where it checked)")
        lines.append(f"  runnable here    {', '.join(gpu.runnable_variants) or 'none'}")
    return "\n".join(lines)
