"""On the real GPU: `sage-qual env` (in this process), certify's environment task (in a worker
process, as certify and gate collect it), `install()` and the GPU tests' own `runnable` give one
answer to "what can run here", per variant and per GPU."""

import tempfile
from pathlib import Path

import pytest

import sage_qual
from sage_qual.kernels.variants import VARIANTS
from sage_qual.limits import STARTUP_TIMEOUT
from sage_qual.qualification.evidence import tasks
from sage_qual.qualification.run import pool
from sage_qual.serving import environment

pytestmark = [pytest.mark.slow, pytest.mark.gpu]


def test_env_certify_install_and_gpu_tests_agree(sage, gpu0, record):
    here = environment.collect()
    with tempfile.TemporaryDirectory() as logs:
        collected = pool.collect_environment(tasks.EnvTask("env"), Path(logs) / "environment.log",
                                             STARTUP_TIMEOUT)
    sage_qual.uninstall()
    status = sage_qual.install()
    sage_qual.uninstall()
    record(test="assess", kind="agreement", runnable=", ".join(here.gpus[0].runnable_variants),
           kernel=here.gpus[0].kernel)
    worker_gpus = collected.environment.gpus
    assert [g.runnable_variants for g in worker_gpus] == [g.runnable_variants for g in here.gpus]
    assert [g.kernel for g in worker_gpus] == [g.kernel for g in here.gpus]
    for gpu in here.gpus:
        skipped = set(collected.not_supported[str(gpu.index)])
        assert set(gpu.runnable_variants) == set(VARIANTS) - skipped
    assert gpu0.runnable == here.gpus[0].runnable_variants
    assert status.enabled == any(g.kernel for g in here.gpus), status.reason
    if status.enabled:
        assert [d.variant.name if d.variant else "" for d in status.devices] == [g.kernel for g in here.gpus]
