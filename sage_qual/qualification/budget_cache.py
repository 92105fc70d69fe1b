"""gate's cache of derived budgets: where it lives, and checking it before it is trusted.

Deriving a budget runs the numerics model, about a second per variant and fixture on a CPU, so
gate keeps what it derived in `$XDG_CACHE_HOME/sage-qual/` (default `~/.cache`), one file per
model code. Where neither is known (HOME and XDG_CACHE_HOME unset and no passwd entry, as for an
arbitrary uid in a container) it uses `.sage-qual-cache/` in the run's own folder, next to the
report.

A cache restored from elsewhere (a CI cache) may hold loosened entries, and a loosened entry that
matches a loosened report would let it through. So the file carries a digest over its entries and
the model code (an entry edited by hand or cut short fails it, and the whole file is dropped), and
every run derives one of the entries it used again, chosen at random; when that one disagrees, the
cache is dropped and every budget derived afresh. A deliberate forgery that recomputes the digest
is caught with probability at least 1/n per run for n entries used (each run picks anew).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
from pathlib import Path

FOLDER = "sage-qual"
RUN_FOLDER_FALLBACK = ".sage-qual-cache"


def directory(run_folder: Path) -> Path:
    """`$XDG_CACHE_HOME/sage-qual`, `~/.cache/sage-qual`, or the run folder's .sage-qual-cache."""
    root = os.environ.get("XDG_CACHE_HOME")
    if root:
        return Path(root) / FOLDER
    try:
        return Path.home() / ".cache" / FOLDER
    except (RuntimeError, KeyError):  # no HOME and no passwd entry for this uid
        return Path(run_folder) / RUN_FOLDER_FALLBACK


def _digest(model: str, entries: dict) -> str:
    text = json.dumps(entries, sort_keys=True, allow_nan=False)
    return hashlib.sha256(f"{model}\n{text}".encode()).hexdigest()


def _valid_entry(entry) -> bool:
    return (isinstance(entry, dict) and bool(entry)
            and all(isinstance(x, float) and math.isfinite(x) for x in entry.values()))


def load(path: Path, model: str) -> dict:
    """The entries of the cache file made with this model code; {} when there is none, it cannot be
    read, or its digest does not match its entries."""
    try:
        stored = json.loads(Path(path).read_text())
        entries, digest = stored["entries"], stored["digest"]
        if not isinstance(entries, dict) or digest != _digest(model, entries):
            return {}
    except (OSError, ValueError, TypeError, KeyError):
        return {}
    return {key: entry for key, entry in entries.items() if _valid_entry(entry)}


def save(path: Path, model: str, entries: dict) -> None:
    """Written atomically; a cache that cannot be written costs time only."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps({"digest": _digest(model, entries), "entries": entries}))
        temporary.replace(path)
    except (OSError, ValueError):
        pass


def agrees(found: dict, derived: dict, tolerance: float) -> bool:
    """A cached entry against the same budget derived again here: the same limits, each within
    `tolerance` (the model moves by about 1e-5 between machines)."""
    return set(found) == set(derived) and all(abs(found[k] - derived[k]) <= tolerance for k in found)


class Entries(dict):
    """The cache's entries, remembering which of them were read (`hits`): the ones a run trusted."""

    def __init__(self, entries: dict):
        super().__init__(entries)
        self.hits: set[str] = set()

    def get(self, key, default=None):
        if key in self:
            self.hits.add(key)
        return super().get(key, default)


_CHOOSER = random.SystemRandom()  # not predictable from the cache file or the report


def spot_check(cache: dict, used: list[str], derive, tolerance: float) -> bool:
    """Derive one of the `used` cached entries again (`derive(key)`); False when it disagrees."""
    if not used:
        return True
    key = _CHOOSER.choice(sorted(used))
    return agrees(cache[key], derive(key), tolerance)
