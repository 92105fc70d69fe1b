"""One check of a variant in an execution context, as report.json records it inside a context check
(`report_model.ContextCheck`), and what passes: judged from its numbers alone."""

from __future__ import annotations

from dataclasses import dataclass, field

from sage_qual.kernels.contexts import CHECKS, CONTEXTS


@dataclass(frozen=True)
class ContextRun:
    """One check of a variant in an execution context (`contexts.CHECKS`): its outputs against the
    same calls made eagerly on the default stream (`context_check`)."""
    name: str = field(metadata={"description": "side_stream, capture, compile or compile_reduce_overhead"})
    calls: int = field(metadata={"minimum": 0, "description": "calls the wrapper saw (replays not counted)"})
    served: int = field(metadata={"minimum": 0, "description": "of them, those SageAttention served"})
    bit_identical: bool = field(metadata={
        "description": "every output equal, bit for bit, to the eager call's"})
    finite: bool
    max_abs_diff: float | None = field(default=None, metadata={
        "minimum": 0, "description": "largest element difference against the eager call (null: not run)"})
    rel_l2: float | None = field(default=None, metadata={"minimum": 0})
    torch_rel_l2: float | None = field(default=None, metadata={
        "minimum": 0, "description": "largest relative L2 against torch's SDPA on the same values"})
    fallbacks: dict[str, int] = field(default_factory=dict, metadata={"description": "reason -> calls"})
    error: str = ""

    @property
    def context(self) -> str:
        return CHECKS[self.name]

    @property
    def passed(self) -> bool:
        """Every call served and bit-identical to the eager one: judged from the numbers."""
        return (not self.error and self.calls > 0 and self.served == self.calls and self.bit_identical
                and self.finite and self.max_abs_diff == 0)

    def failure(self) -> str:
        """Why it did not pass, from its numbers ("" when it passed)."""
        if self.passed:
            return ""
        if self.error:
            return self.error
        if self.calls == 0:
            return "it made no call, so nothing was checked"
        if self.served < self.calls:
            return f"served {self.served} of {self.calls} calls ({', '.join(self.fallbacks) or 'no reason'})"
        if not self.finite:
            return "output not finite"
        return "not bit-identical to the eager call" + (
            f" (relative L2 {self.rel_l2:.3g})" if self.rel_l2 is not None else "")

    def check(self) -> list[tuple[str, str]]:
        if self.name not in CHECKS:
            return [("name", f"{self.name!r} is not a context check ({', '.join(CHECKS)})")]
        if self.served > self.calls:
            return [("served", f"{self.served} is more than the {self.calls} calls")]
        if self.bit_identical and (self.max_abs_diff != 0 or not self.finite or (self.rel_l2 or 0) != 0):
            return [("bit_identical", "true, but the outputs differ (max_abs_diff, rel_l2 or finite say so)")]
        return []


def safe_contexts(runs: list[ContextRun]) -> list[str]:
    """The contexts (in `contexts.CONTEXTS` order) with at least one check, all of which passed."""
    return [name for name in CONTEXTS if any(r.context == name for r in runs)
            and all(r.passed for r in runs if r.context == name)]
