"""The machine record `sage-qual env` prints and report.json stores, defined once.

Torch-free, so the report model can type it without importing what collects it
(`environment`). Read back strictly with `records.parse`.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class GpuInfo:
    index: int = field(metadata={"minimum": 0})
    name: str
    capability: list[int] = field(metadata={"length": 2, "minimum": 0})
    memory_gib: float = field(metadata={"minimum": 0})
    kernel: str = ""  # the variant the wrapper would use, or "" when none
    no_kernel_reason: str = ""
    runnable_variants: list[str] = field(default_factory=list)  # every variant that can run here


@dataclass(frozen=True)
class EnvironmentRecord:
    """sage_qual.serving.environment.Environment, collected in a worker."""
    sage_qual: str
    python: str
    os: str
    torch: str
    torch_cuda: str
    cudnn: str
    driver: str
    triton: str
    sageattention: str  # version, or "" when unusable
    sageattention_problem: str  # why it cannot serve, "" when it can
    extensions: dict[str, str]  # extension -> "ok" or its import error
    gpus: list[GpuInfo]
