"""Bounds: the failures a served range excludes, as the calls a profile keeps on torch (issue 26).

A fixture that a family's call site names (`families.CallSite.fixtures`) stands for that site's calls:
the IP-Adapter's image-prompt attention, 4 to 16 keys with the unconditional item's K and V all zero,
where every FP8 and FP16 CUDA kernel gave non-finite output on the H200 (docs/results/run22-h200/).
When the break-even a variant serves from excludes every call of such a site by its key (else query)
tokens, the failure does not veto the variant: it becomes a `Bound`, "calls with fewer than 17 keys stay
on torch", which the profile carries and the wrapper enforces whatever the thresholds. A failure on a
fixture no site names, or a site the range does not exclude, keeps the variant off as before.
"""

from __future__ import annotations

from sage_qual.qualification.families import CallSite, Family, sites_of
from sage_qual.qualification.measure.speed import Thresholds
from sage_qual.serving.config import Bound

_TOKENS = {"key": "kv_tokens", "query": "q_tokens"}


def excluded_bounds(failures, fixtures, family: Family | None,
                    thresholds: Thresholds | None) -> list[Bound] | None:
    """The bounds that keep every failing call on torch, when each failure (`verdict.Finding`) is on a
    fixture of a call site that covers its shape (`fixtures`: the report's fixture records) and that
    `thresholds` exclude; None when one is not, or nothing is served."""
    if thresholds is None:
        return None
    shapes = {f.name: f for f in fixtures}
    found: dict[str, tuple[int, list[str]]] = {}  # side -> (below, the reasons)
    for finding in failures:
        fixture = shapes[finding.fixture]
        sites = [(owner, call) for owner, call in sites_of(finding.fixture, family)
                 if call.covers(fixture.q[2], fixture.k[2], fixture.q[3])]
        excluded = [_excluded(call, thresholds) for _, call in sites]
        if not sites or None in excluded or len({side for side, _ in excluded}) > 1:
            return None
        side, below = excluded[0][0], max(limit for _, limit in excluded)
        calls = " and ".join(f"'{call.label}'" for _, call in sites)
        smallest = min(getattr(call.smallest, _TOKENS[side]) for _, call in sites)
        why = (f"{finding.fixture}: {finding.variant} {finding.reason.detail}; it stands for "
               f"{sites[0][0].name}'s {calls} call{'s' if len(sites) > 1 else ''} "
               f"({smallest:,} to {below - 1:,} {side}s)")
        held, reasons = found.get(side, (0, []))
        found[side] = (max(held, below), reasons + ([why] if why not in reasons else []))
    return [Bound(side, below, "; ".join(reasons)) for side, (below, reasons) in sorted(found.items())]


def _excluded(call: CallSite, thresholds: Thresholds) -> tuple[str, int] | None:
    """(side, below) when every call of the site has fewer key (else query) tokens than `thresholds`
    serve from: calls with fewer than `below` tokens of that side hold all of them; None otherwise."""
    for side in ("key", "query"):
        largest = getattr(call.largest, _TOKENS[side])
        if largest < getattr(thresholds, f"min_{side}_tokens"):
            return side, largest + 1
    return None
