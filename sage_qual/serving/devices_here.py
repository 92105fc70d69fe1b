"""The visible devices as a profile entry must match them (`profile_matching.LocalDevice`): what torch and
the installed packages say of this machine. Apart from `profile` and `profile_matching`, which read
and match profiles without torch (gate and the defaults builder read them)."""

from __future__ import annotations

from typing import Mapping

import torch

from sage_qual.kernels import sage_package
from sage_qual.kernels.providers import THU_ML
from sage_qual.serving import platform
from sage_qual.serving.profile_matching import LocalDevice


def this_machine() -> list[LocalDevice]:
    """Every visible device as a profile entry must match it. Raises SageUnavailable without a
    usable sageattention (its version is part of the match)."""
    packages = sage_package.load_all()
    package = packages[THU_ML.name]
    if isinstance(package, str):
        raise sage_package.SageUnavailable(package)
    return machines(platform.current(), package.version, package.source,
                    sage_package.other_builds(packages, package))


def machines(cuda: platform.CudaPlatform, sageattention: str, source: str = "",
             other_sources: Mapping[str, str] | None = None) -> list[LocalDevice]:
    """Every device of `cuda` as a profile entry must match it, with this sageattention version and
    build (`source`), and the other providers' builds (`other_sources`: provider -> source digest)."""
    cuda_version = cuda.torch_cuda()
    torch_cuda = "%d.%d" % cuda_version if cuda_version else ""
    return [LocalDevice(cuda.device_name(i), cuda.capability(i), round(cuda.total_memory(i) / 2**30, 1),
                    torch.__version__, torch_cuda, sageattention, source, cuda.sm_count(i),
                    dict(other_sources or {}))
            for i in range(cuda.device_count())]
