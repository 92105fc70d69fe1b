"""Shared fixtures of the fast suite: a fake CUDA box running the fake sageattention."""

import logging

import pytest
import torch.nn.functional as F

import sage_qual
from sage_qual.serving import audit
from sage_qual.testing import FakeCuda, FakeGpu, FakeSageAttention

from .helpers import TORCH_SDPA


@pytest.fixture(autouse=True)
def _uninstalled():
    """Every test starts and ends with torch's own SDPA, as a fresh process (no audit's findings)."""
    sage_qual.uninstall()
    audit.reset_process()
    yield
    sage_qual.uninstall()
    audit.reset_process()


@pytest.fixture
def log_everything(caplog):
    """Every sage_qual record in caplog; modules use it with pytest.mark.usefixtures."""
    caplog.set_level(logging.DEBUG, logger="sage_qual")


@pytest.fixture
def torch_spy():
    """torch's SDPA behind a recorder of (args, kwargs, current device), in place before install so the
    wrapper takes it as torch's."""
    calls = []

    def spy(*args, **kwargs):
        cuda = sage_qual.serving.platform.current()
        calls.append((args, kwargs, getattr(cuda, "current_device", None)))
        return TORCH_SDPA(*args, **kwargs)

    F.scaled_dot_product_attention = spy
    try:
        yield calls
    finally:
        sage_qual.uninstall()
        F.scaled_dot_product_attention = TORCH_SDPA


@pytest.fixture
def fake_sage():
    return FakeSageAttention()


@pytest.fixture
def box(fake_sage, caplog):
    """An installed wrapper on one fake sm_90 GPU; yields (fake cuda, fake sageattention)."""
    caplog.set_level(logging.DEBUG, logger="sage_qual")
    with FakeCuda([FakeGpu((9, 0), "Fake H200")]) as cuda, fake_sage.installed():
        status = sage_qual.install()
        assert status.enabled, status.reason
        yield cuda, fake_sage
