"""The per-thread scope inside which SDPA calls may go to SageAttention."""

from __future__ import annotations

import collections
import contextlib
import contextvars
import logging
from dataclasses import dataclass, field

from sage_qual.limits import STATUS_LINE_LIMIT, one_line
from sage_qual.serving.audit import AuditTally

log = logging.getLogger("sage_qual")


@dataclass
class ScopeReport:
    """What happened inside one scope; read it after (or during) the block."""

    calls: int = 0
    served: int = 0
    copied: int = 0  # of the served calls, those served from contiguous copies (`copy_past_span`)
    fallbacks: collections.Counter = field(default_factory=collections.Counter)
    details: dict[str, str] = field(default_factory=dict)  # per reason, its first call's detail
    out_of_memory: bool = False  # once set, the rest of the scope runs on PyTorch
    not_installed: str = ""  # why install() left torch's function in place when the scope began
    audit: AuditTally = field(default_factory=AuditTally)  # the sampled audit (serving.audit), read by exit

    def fell_back(self, reason: str, template: str = "", values: tuple = ()) -> None:
        """Count a fallback; its detail (`template % values`) is formatted for a reason's first call."""
        self.calls += 1
        self.fallbacks[reason] += 1
        if reason not in self.details:
            self.details[reason] = template % values

    def summary(self) -> str:
        """One line of at most limits.STATUS_LINE_LIMIT characters: each fallback reason with its
        count, and its first call's detail where they fit (all of them stay in `details`)."""
        if self.not_installed and not self.calls:
            # Not "not installed": a profile that keeps the family off leaves torch's function in place too.
            return one_line("attention calls not counted, all on PyTorch SDPA: the wrapper serves nothing "
                            f"here: {self.not_installed}")
        counted = self.fallbacks.most_common()
        head = f"{self.calls} attention calls, {self.served} on SageAttention; on PyTorch SDPA: "
        audit = self.audit
        tail = f"; {audit.summary()}" if audit.audited or audit.skipped or audit.misses else ""
        detailed = ", ".join(f"{reason}={count} [{self.details.get(reason, '')}]"
                             for reason, count in counted)
        if len(head + detailed + tail) <= STATUS_LINE_LIMIT:
            return head + (detailed or "none") + tail
        return one_line(head + ", ".join(f"{reason}={count}" for reason, count in counted)
                        + " (first call of each: report.details)" + tail)


_active: contextvars.ContextVar[ScopeReport | None] = contextvars.ContextVar("sage_qual_scope", default=None)


def _not_installed() -> str:
    """Why no SDPA call reaches the wrapper ("" when it is installed); the wrapper replaces this."""
    return "install() has not been called"


def report_installs_with(check) -> None:
    """Set the function a new scope asks why the wrapper is not installed (called by the wrapper)."""
    global _not_installed
    _not_installed = check


def _settle_audits() -> None:
    """Judge every audit still on its way to the host (the wrapper replaces this)."""


def settle_audits_with(settle) -> None:
    """Set what a scope calls at exit to read its pending audits (called by the wrapper)."""
    global _settle_audits
    _settle_audits = settle


def active() -> ScopeReport | None:
    return _active.get()


@contextlib.contextmanager
def sage_attention_scope():
    """Let eligible SDPA calls of this thread (and context) run on SageAttention.

    Scopes nest: an inner scope reports its own calls and adds them to the outer one on exit,
    also when its block raises. Other threads are not affected.
    """
    outer = _active.get()
    report = ScopeReport(out_of_memory=outer.out_of_memory if outer else False,
                         not_installed=_not_installed())
    token = _active.set(report)
    try:
        yield report
    finally:
        _active.reset(token)
        _settle_audits()  # the scope's audits are read now, at the latest
        if outer is not None:
            outer.calls += report.calls
            outer.served += report.served
            outer.copied += report.copied
            outer.fallbacks.update(report.fallbacks)
            outer.details = {**report.details, **outer.details}
            outer.out_of_memory |= report.out_of_memory
            outer.audit.add(report.audit)
        log.debug(report.summary())
