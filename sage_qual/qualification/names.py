"""The families and variants a run names, checked against the registries without importing torch:
`certify` refuses a misspelt name in about 0.2 s, before torch (1.7 s to import here) or a worker
starts (issue 28)."""

from __future__ import annotations

from sage_qual.errors import UsageError
from sage_qual.kernels.variants import VARIANTS
from sage_qual.qualification import families as families_mod


def select_variants(names: list[str] | None) -> list[str]:
    for name in names or ():
        if name not in VARIANTS:
            raise UsageError(f"unknown variant {name!r} (known: {', '.join(VARIANTS)})")
    return list(dict.fromkeys(names)) if names else list(VARIANTS)


def select_families(names: list[str] | None) -> list[families_mod.Family]:
    if not names:
        return list(families_mod.FAMILIES)
    try:
        return list(dict.fromkeys(families_mod.find(n) for n in names))
    except KeyError as error:
        raise UsageError(error.args[0]) from None
