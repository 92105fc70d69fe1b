"""Imported once by the zygote (`pool.ZYGOTE_PRELOAD`), before it forks any worker: what a
SageAttention kernel's first call imports, so that every worker starts with it.

Its custom ops import torch._dynamo on first use: 3.7 s of each variant's first cell on the H200
host (docs/results/run9-h200x2-startup/worker-phases.txt). Imported in each worker instead, as
until run 30, the 14 workers of certify's follow-up (span probes and context checks, started at
once when the sweep ends) spent 12-16 s on it side by side before their first task
(docs/results/run30-h200/certify/logs.tgz: the sweep's last result at 19:59:15, the context
workers' first log lines at 19:59:27-33). Neither import touches CUDA, so each job's
CUDA_VISIBLE_DEVICES and TRITON_CACHE_DIR still apply (docs/results/run9-h200x2-startup/envcheck.txt).
Skipped with the tests' fake GPUs and without sageattention; an import that fails here fails again,
with its explanation, in the task that loads the package.
"""

import contextlib
import importlib
import importlib.util

from sage_qual.qualification.run import fault_hooks


def preload() -> list[str]:
    """The modules imported (none with a fake GPU or without sageattention)."""
    if "gpus" in fault_hooks.read() or importlib.util.find_spec("sageattention") is None:
        return []
    imported = []
    with contextlib.suppress(Exception):
        for name in ("torch._dynamo", "sageattention"):
            importlib.import_module(name)
            imported.append(name)
    return imported


preload()
