"""Kernel defects measured on real hardware: kept as strict expected failures, never loosened.

Key: (variant, fixture stem). Value: what was measured, where, and why it is the kernel's fault.
An entry that starts passing fails the run (strict xfail), so a fixed kernel is noticed.
"""

KNOWN_DEFECTS: dict[tuple[str, str], str] = {}


def marks(variant: str, fixture: str) -> list:
    import pytest

    reason = KNOWN_DEFECTS.get((variant, fixture))
    return [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
