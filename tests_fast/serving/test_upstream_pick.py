"""Upstream sageattn()'s kernel per capability is declared once (variants.UPSTREAM_PICKS): the
wrapper's default table, `Variant.native_on` and the fake `sageattn()` all read it."""

import pytest

from sage_qual.kernels.variants import VARIANTS, upstream_pick
from sage_qual.serving.config import KERNEL_TABLE


@pytest.mark.parametrize("capability", sorted(KERNEL_TABLE))
def test_one_declared_pick_per_capability(capability):
    pick = upstream_pick(capability)
    assert pick.name == KERNEL_TABLE[capability][0]
    assert capability in pick.native_on
    # Every variant claiming this GPU is one of its table's choices, never a second pick by dict order.
    assert {v.name for v in VARIANTS.values() if capability in v.native_on} == set(KERNEL_TABLE[capability])


@pytest.mark.parametrize("capability", [(8, 7), (10, 0), (7, 5)])
def test_no_pick_where_upstream_has_none(capability):
    assert upstream_pick(capability) is None
    assert not any(capability in v.native_on for v in VARIANTS.values())
