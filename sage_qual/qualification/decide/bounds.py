"""Bounds: the failures a served range excludes, as the calls a profile keeps on torch (issue 26).

A fixture that a family's call site names (`families.CallSite.fixtures`) stands for that site's calls:
the IP-Adapter's image-prompt attention, 4 to 16 keys with the unconditional item's K and V all zero,
where every FP8 and FP16 CUDA kernel gave non-finite output on the H200 (docs/results/run22-h200/).
A failure there does not veto the variant when both hold:
- the break-even it serves from excludes every call of the site by its key (else query) tokens;
- where the failed fixture has several batch items, the variant passed a fixture of the served calls
  with several too (`_batch_covered`).
It becomes a `Bound` instead, "calls with fewer than 17 keys stay on torch", which the profile carries
and the wrapper enforces whatever the thresholds. A failure on a fixture no site names, or on a site
the range does not exclude, keeps the variant off as before.
"""

from __future__ import annotations

from sage_qual.qualification.families import CallSite, Family, sites_of
from sage_qual.qualification.measure.speed import Thresholds
from sage_qual.verdicts.served import SIDE_WORDS, Bound

_TOKENS = {"key": "kv_tokens", "query": "q_tokens"}


def excluded_bounds(failures, passed: list[str], fixtures, family: Family | None,
                    thresholds: Thresholds | None) -> list[Bound] | None:
    """The bounds that keep every failing call on torch, when each failure (`verdict.Finding`) is on a
    fixture of a call site that covers its shape (`fixtures`: the report's fixture records), that
    `thresholds` exclude, and whose batch of several items a fixture of the served calls that the
    variant `passed` has too (`_batch_covered`); None when one is not, or nothing is served."""
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
        if not _batch_covered(fixture, [shapes[name] for name in passed], family):
            return None
        side, below = excluded[0][0], max(limit for _, limit in excluded)
        calls = " and ".join(f"'{call.label}'" for _, call in sites)
        smallest = min(getattr(call.smallest, _TOKENS[side]) for _, call in sites)
        why = (f"{finding.fixture}: {finding.variant} {finding.reason.detail}; it stands for "
               f"{sites[0][0].name}'s {calls} call{'s' if len(sites) > 1 else ''} "
               f"({smallest:,} to {below - 1:,} {SIDE_WORDS[side]})")
        held, reasons = found.get(side, (0, []))
        found[side] = (max(held, below), reasons + ([why] if why not in reasons else []))
    return [Bound(side, below, "; ".join(reasons)) for side, (below, reasons) in sorted(found.items())]


def _batch_covered(failed, passed, family: Family | None) -> bool:
    """Whether the variant passed a fixture of the served calls (one no site names) of more than one
    batch item, where the failed fixture has more than one. A failure is put down to the site's calls
    only then: otherwise a kernel that mixes up batch items (selftest.detection, batch_items_swapped)
    would fail the batch-2 IP-Adapter fixture alone, and its bound would excuse the served calls of
    two items as well. Two items show such a bug: a larger batch adds nothing."""
    return failed.q[0] == 1 or any(not sites_of(p.name, family) and p.q[0] > 1 for p in passed)


def _excluded(call: CallSite, thresholds: Thresholds) -> tuple[str, int] | None:
    """(side, below) when every call of the site has fewer key (else query) tokens than `thresholds`
    serve from: calls with fewer than `below` tokens of that side hold all of them; None otherwise."""
    for side in ("key", "query"):
        largest = getattr(call.largest, _TOKENS[side])
        if largest < getattr(thresholds, f"min_{side}_tokens"):
            return side, largest + 1
    return None
