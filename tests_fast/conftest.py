"""Shared fixtures of the fast suite: a fake CUDA box running the fake sageattention."""

import logging

import pytest

import sage_qual
from sage_qual.testing import FakeCuda, FakeGpu, FakeSageAttention


@pytest.fixture(autouse=True)
def _uninstalled():
    """Every test starts and ends with torch's own SDPA."""
    sage_qual.uninstall()
    yield
    sage_qual.uninstall()


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
