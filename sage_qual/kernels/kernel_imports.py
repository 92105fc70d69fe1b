"""Imported once by certify's zygote (`qualification.run.pool.ZYGOTE_PRELOAD`), before it forks any
worker: what a SageAttention kernel's first call imports, so that every worker starts with it.

Its custom ops import torch._dynamo on first use: 3.7 s of each variant's first cell on the H200
host (docs/results/run9-h200x2-startup/worker-phases.txt). Imported in each worker instead, as
until run 30, the 14 workers of certify's follow-up (span probes and context checks, started at
once when the sweep ends) started 2-8 s later than run 31's, which import nothing after the fork
(docs/results/README.md, runs 30 and 31). Neither import touches CUDA, so each job's
CUDA_VISIBLE_DEVICES and TRITON_CACHE_DIR still apply (docs/results/run9-h200x2-startup/envcheck.txt).
Nothing without sageattention; an import that fails here fails again, with its explanation, in the
task that loads the package.
"""

import contextlib
import importlib
import importlib.util


def preload() -> list[str]:
    """The modules imported (none without sageattention)."""
    if importlib.util.find_spec("sageattention") is None:
        return []
    imported = []
    with contextlib.suppress(Exception):
        for name in ("torch._dynamo", "sageattention"):
            importlib.import_module(name)
            imported.append(name)
    return imported


preload()
