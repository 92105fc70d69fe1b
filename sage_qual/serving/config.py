"""The wrapper's thresholds and kernel table in one typed object.

A per-GPU profile written by `sage-qual certify` replaces these values (`install(config=...)`);
the default numbers, and where each was measured, are in `sage_qual.limits`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from sage_qual import limits
from sage_qual.kernels import contexts, variants
from sage_qual.kernels.variants import (
    KERNEL_HEAD_DIMS,
    LAYOUTS,
    UPSTREAM_PICKS,
    VARIANTS,
    BoxFacts,
    Capability,
    Variant,
)
from sage_qual.verdicts.served import Bound

# Preference order per compute capability; the first variant this box can run wins. The default is
# upstream sageattn()'s own choice, declared once in variants.UPSTREAM_PICKS (with why).
KERNEL_TABLE: Mapping[Capability, tuple[str, ...]] = UPSTREAM_PICKS




@dataclass(frozen=True)
class AuditConfig:
    """every: audit one served call in each block of this many per device, at a seeded random place
    (0: off). rows: query rows per audit. retire: a miss (past the family's fitness bound) moves the
    device to torch for the family, for the rest of the process (False: count and warn only). drift:
    what a kernel off its numerics model does, "retire" as a miss or "warn" and keep serving.
    record: saves a finding, `record(kept, finding) -> path` (None: not saved);
    `fixtures.recorder.AuditFolder(path)` saves it as a recorded fixture. seed: the schedule's."""
    every: int = limits.AUDIT_EVERY
    rows: int = limits.AUDIT_ROWS
    retire: bool = True
    drift: str = "retire"
    record: Callable | None = None
    seed: int = 0

    def __post_init__(self):
        for name, least in (("every", 0), ("rows", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"AuditConfig.{name}={value!r}: give a whole number of at least {least}"
                                 + (" (0 turns the audit off)" if name == "every" else ""))
        if not isinstance(self.retire, bool):
            raise ValueError(f"AuditConfig.retire={self.retire!r}: give True or False")
        if self.drift not in ("retire", "warn"):
            raise ValueError(f"AuditConfig.drift={self.drift!r}: give 'retire' or 'warn'")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"AuditConfig.seed={self.seed!r}: give a whole number")
        if self.record is not None and not callable(self.record):
            raise ValueError(f"AuditConfig.record={self.record!r}: give fixtures.recorder.AuditFolder(path), "
                             "or None to keep misses unrecorded")




@dataclass(frozen=True)
class WrapperConfig:
    min_query_tokens: int = limits.MIN_QUERY_TOKENS
    min_key_tokens: int = limits.MIN_KEY_TOKENS
    head_dims: tuple[int, ...] = KERNEL_HEAD_DIMS
    check_rows: int = limits.CHECK_ROWS  # first-call check: query rows of one sample and K/V group
    cache_error_limit: int = limits.CACHE_ERROR_LIMIT  # Triton cache failures in a row
    kernel_table: Mapping[Capability, tuple[str, ...]] = field(default_factory=lambda: dict(KERNEL_TABLE))
    # Longest calls served, in tokens (None: no upper bound); a profile sets the verified range.
    max_query_tokens: int | None = None
    max_key_tokens: int | None = None
    layouts: tuple[str, ...] | None = None  # verified layouts (names in LAYOUTS); None: any
    # Largest element span and count of one tensor the kernel gets (limits.MAX_SPAN_ELEMENTS).
    max_span_elements: int = limits.MAX_SPAN_ELEMENTS
    # A strided call past the span whose contiguous copies are within it: serve it from copies
    # (True) or leave it to torch with the reason `span` (False). Copies win: on the H200 the fused
    # 100,000 x 56 view ran copy+kernel in 0.68x torch SDPA's time, and at 80,000 x 56 the copies
    # cost 2.4 % over the kernel on the views (docs/results/run12-h200x2/, docs/benchmarks.md).
    copy_past_span: bool = True
    # Execution contexts the served variant is certified safe in (names in contexts.CONTEXTS);
    # None: the variant's built-in rule (`contexts.builtin_safe`). A profile sets what certify verified,
    # so a kernel build that launches on the current stream can be certified capture-safe.
    contexts: tuple[str, ...] | None = None
    # Calls kept on torch whatever the thresholds (a profile's bounds: `Bound`).
    bounds: tuple[Bound, ...] = ()
    # Whether a call with an attn_mask may be served: only where a profile certified the served
    # variant on masked calls (`Served.masks`), and only by a variant that takes a mask.
    masks: bool = False
    # The sampled audit of served calls (serving.audit): on by default; AuditConfig(every=0) turns it off.
    audit: AuditConfig = field(default_factory=AuditConfig)

    def __post_init__(self):
        # A threshold of 0 serves every length (a forced variant's target); the rest count from 1.
        lowest = {"min_query_tokens": 0, "min_key_tokens": 0, "check_rows": 1, "cache_error_limit": 1}
        for name, least in lowest.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"WrapperConfig.{name}={value!r}: give a whole number of at least {least}")
        dims = self.head_dims
        if isinstance(dims, (str, int)) or not dims or any(d not in KERNEL_HEAD_DIMS for d in dims):
            raise ValueError(f"WrapperConfig.head_dims={dims!r}: give a tuple of head sizes the kernels take "
                             f"({', '.join(map(str, KERNEL_HEAD_DIMS))})")
        for name in ("masks", "copy_past_span"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"WrapperConfig.{name}={getattr(self, name)!r}: give True or False")
        for name in ("max_query_tokens", "max_key_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"WrapperConfig.{name}={value!r}: give a token count of at least 1, "
                                 "or None for no upper bound")
        span = self.max_span_elements
        # At most 2^31 - 1, as the profile reader caps it: past it the kernels' 32-bit offsets
        # overflow (limits.MAX_SPAN_ELEMENTS), and a view spanning more would reach them as it is.
        if isinstance(span, bool) or not isinstance(span, int) or not 1 <= span <= limits.MAX_SPAN_ELEMENTS:
            raise ValueError(
                f"WrapperConfig.max_span_elements={span!r}: give an element count from 1 to "
                f"{limits.MAX_SPAN_ELEMENTS} (2^31 - 1, the default: past it the kernels' 32-bit "
                "offsets overflow)"
            )
        if self.layouts is not None:
            unknown = [name for name in self.layouts if name not in LAYOUTS]
            if isinstance(self.layouts, str) or unknown:
                raise ValueError(f"WrapperConfig.layouts={self.layouts!r}: give a tuple of layout names "
                                 f"from {', '.join(LAYOUTS)}, or None for any layout")
        if not isinstance(self.audit, AuditConfig):
            raise ValueError(f"WrapperConfig.audit={self.audit!r}: give a serving.audit.AuditConfig")
        if self.contexts is not None:
            contexts.check_names(self.contexts, "WrapperConfig.contexts")
        if isinstance(self.bounds, (str, Bound)) or not all(isinstance(b, Bound) for b in self.bounds):
            raise ValueError(f"WrapperConfig.bounds={self.bounds!r}: give a tuple of config.Bound")
        for bound in self.bounds:
            for key, problem in bound.check():
                raise ValueError(f"WrapperConfig.bounds: {key} {problem}")

    def safe_contexts(self, variant: Variant) -> tuple[str, ...]:
        """The execution contexts `variant` may serve in under this config."""
        return contexts.builtin_safe(variant) if self.contexts is None else tuple(self.contexts)

    def choose(self, capability: Capability,
               reasons: Mapping[str, Sequence[str]]) -> tuple[Variant | None, str]:
        """The first variant of this capability's table without `reasons` not to run, or None with
        why there is none (`assess` gives the reasons of a GPU and its installed package)."""
        candidates = self.kernel_table.get(capability)
        if not candidates:
            known = ", ".join(map(variants.capability_label, sorted(self.kernel_table)))
            label = variants.capability_label(capability)
            return None, f"{label} has no SageAttention kernel (kernels for: {known})"
        unknown = ("not a registered variant",)
        for name in candidates:
            if not reasons.get(name, unknown):
                return VARIANTS[name], ""
        return None, " | ".join(f"{name}: {'; '.join(reasons.get(name, unknown))}" for name in candidates)

    def kernel_for(self, box: BoxFacts) -> tuple[Variant | None, str]:
        """The variant serving a GPU judged by its facts alone, or None with why it gets none."""
        reasons = {name: v.not_supported_reasons(box) for name, v in VARIANTS.items()}
        return self.choose(box.capability, reasons)


DEFAULT_CONFIG = WrapperConfig()
