"""The records report.json shares with the serving side, defined once: the machine record
`sage-qual env` prints, a GPU's identity, and a verdict's reason (profiles store those too).

Torch-free, so the report model can type them without importing what collects the machine record
(`environment`). Read back strictly with `records.parse`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class ReasonKind(str, enum.Enum):
    ACCURACY = "accuracy"  # off its model: past the budget its numerics model derives (conformance)
    UNFIT = "unfit"  # unfit for the family: past the error the family was shown to tolerate (fitness)
    NON_FINITE = "non_finite"
    MEMORY = "memory"
    SPEED = "speed"
    CRASH = "crash"
    OOM = "oom"
    TIMEOUT = "timeout"
    SKIP = "skip"
    NO_FIXTURES = "no_fixtures"
    INCOMPLETE = "incomplete"
    LAYOUT = "layout"  # a long check's output on a view differs from its output on contiguous copies
    LONG = "long"  # a long check failed or did not run: the verified range stops below its length
    CONTEXT = "context"  # an execution-context check failed or did not run: the variant falls back there
    AUDIT = "audit"  # the wrapper's audit caught the variant over the family's bound in production


@dataclass(frozen=True)
class Reason:  # why a cell failed or a GPU keeps a family off
    kind: ReasonKind
    detail: str


@dataclass(frozen=True)
class GpuIdentity:
    """Which GPU: its index on the machine, model name, compute capability and memory."""
    index: int = field(metadata={"minimum": 0})
    name: str
    capability: list[int] = field(metadata={"length": 2, "minimum": 0})
    memory_gib: float = field(metadata={"minimum": 0})


@dataclass(frozen=True)
class GpuInfo(GpuIdentity):
    kernel: str = ""  # the variant the wrapper would use, or "" when none
    no_kernel_reason: str = ""
    runnable_variants: list[str] = field(default_factory=list)  # every variant that can run here
    sm_count: int | None = field(default=None, metadata={"minimum": 1})  # null: not recorded


@dataclass(frozen=True)
class OtherProvider:
    """A kernel provider beside thu-ml's sageattention (`kernels.providers`), as this machine has it."""
    provider: str
    version: str  # "" when not usable
    source: str = ""  # its build: sage_package.source_digest()
    origin: str = ""  # sage_package.origin()
    problem: str = ""  # why it cannot serve, "" when it can


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
    # The build: sage_package.source_digest() ("" when unusable, or in a report from before it).
    sageattention_source: str = ""
    # Where it was installed from: sage_package.origin() ("" when unknown or from before it).
    sageattention_origin: str = ""
    # The other providers' packages (comfy-kitchen), [] in a report from before them.
    other_providers: list[OtherProvider] = field(default_factory=list)
