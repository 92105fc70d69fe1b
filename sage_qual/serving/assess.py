"""What each GPU of this machine can run: every variant, runnable or with its reasons, and the
kernel the wrapper would give it.

This is the one answer to "what can run here": `install()`, `sage-qual env`, certify's workers
and the GPU tests all read it, so none of them can list a variant another one skips.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from sage_qual.kernels import sage_package
from sage_qual.kernels.providers import THU_ML
from sage_qual.kernels.variants import VARIANTS, BoxFacts, Variant
from sage_qual.serving import platform
from sage_qual.serving.config import DEFAULT_CONFIG, WrapperConfig

UNUSABLE_PACKAGE = "sageattention unusable (see above)"
# Every provider's package, or why it cannot serve (`sage_package.load_all`).
Packages = Mapping[str, "sage_package.SagePackage | str"]


@dataclass(frozen=True)
class GpuAssessment:
    index: int
    box: BoxFacts
    reasons: Mapping[str, tuple[str, ...]]  # every registered variant -> why not here; () when runnable
    kernel: Variant | None  # the wrapper's kernel for this GPU under the config, None when none
    no_kernel_reason: str  # why there is none; "" when there is one

    @property
    def runnable(self) -> list[str]:
        return [name for name, why in self.reasons.items() if not why]

    def not_supported(self) -> dict[str, list[str]]:
        return {name: list(why) for name, why in self.reasons.items() if why}


@dataclass(frozen=True)
class MachineAssessment:
    packages: Packages  # every provider's, or why not
    gpus: list[GpuAssessment] = field(default_factory=list)

    @property
    def package(self) -> sage_package.SagePackage | None:
        """thu-ml's sageattention, None when it cannot serve."""
        found = self.packages[THU_ML.name]
        return None if isinstance(found, str) else found

    @property
    def problem(self) -> str:
        """Why sageattention cannot serve at all; "" when it loads."""
        found = self.packages[THU_ML.name]
        return found if isinstance(found, str) else ""


def loaded(packages: Packages) -> list[sage_package.SagePackage]:
    return [p for p in packages.values() if not isinstance(p, str)]


def box_facts(cuda: platform.CudaPlatform, index: int, packages: Packages) -> BoxFacts:
    extensions = frozenset().union(*(p.extensions for p in loaded(packages)))
    return BoxFacts(cuda.capability(index), cuda.torch_cuda(), extensions, sage_package.has_triton())


def assess(index: int, box: BoxFacts, packages: Packages,
           config: WrapperConfig = DEFAULT_CONFIG) -> GpuAssessment:
    """One GPU: each variant's reasons (its provider's package, its box facts, then the installed
    function's signature) and the first variant of the config's table for this capability that has none."""
    reasons = {}
    for name, variant in VARIANTS.items():
        package = packages.get(variant.provider, f"{variant.provider}: not looked for")
        if isinstance(package, str):
            reasons[name] = (package,)
            continue
        why = variant.not_supported_reasons(box)
        kernel_problem = None if why else sage_package.kernel_problem(package, variant)
        reasons[name] = tuple(why) if why else ((kernel_problem,) if kernel_problem else ())
    if not loaded(packages):
        return GpuAssessment(index, box, reasons, None, UNUSABLE_PACKAGE)
    kernel, why_none = config.choose(box.capability, reasons)
    return GpuAssessment(index, box, reasons, kernel, why_none)


def assess_machine(config: WrapperConfig = DEFAULT_CONFIG) -> MachineAssessment:
    """Every visible GPU (through `platform`), with every provider's package or why it is unusable."""
    cuda = platform.current()
    packages = sage_package.load_all()
    gpus = [assess(index, box_facts(cuda, index, packages), packages, config)
            for index in range(cuda.device_count())]
    return MachineAssessment(packages, gpus)
