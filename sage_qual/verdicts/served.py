"""What a profile serves for one family on one GPU model, as one frozen, torch-free record.

`Served` is decided once (`qualification.decide.verdict`) and carried unchanged into gate's answer,
merge's table, report.md, profile.json, the built-in defaults and the wrapper (`config()`), so
every reader states one range in one phrasing (`text()`, or `short()` in the fleet table).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from sage_qual import records
from sage_qual.kernels.contexts import CONTEXTS
from sage_qual.kernels.variants import KERNEL_HEAD_DIMS, LAYOUTS, VARIANTS

SIDE_WORDS = {"key": "keys", "query": "query tokens"}


@dataclass(frozen=True)
class Bound:
    """Calls with fewer than `below` query or key tokens stay on torch, whatever the thresholds: a
    certified failure there (`reason`: which fixture, which call site) that the served range excludes
    (qualification.decide.verdict, "Bounds"). A profile carries it, so lowering a threshold cannot
    hand the kernel the calls it failed."""
    side: Literal["query", "key"]
    below: int = field(metadata={"minimum": 2})
    reason: str = field(metadata={"minLength": 1})

    def check(self) -> list[tuple[str, str]]:
        """(field, problem) for what makes the bound unusable; empty when nothing does."""
        if self.side not in ("query", "key"):
            return [("side", f"is {self.side!r}: give 'query' or 'key'")]
        if isinstance(self.below, bool) or not isinstance(self.below, int) or self.below < 2:
            return [("below", f"is {self.below!r}: give a token count of at least 2 (below 1 token bounds "
                              "nothing)")]
        if not isinstance(self.reason, str) or not self.reason.strip():
            return [("reason", "is empty: say which fixture and call the bound keeps on torch")]
        return []

    @property
    def tokens(self) -> str:
        """What it counts, in words: "keys" or "query tokens"."""
        return SIDE_WORDS[self.side]

    def text(self) -> str:
        """"calls with fewer than 17 keys stay on torch (sdxl_ip_adapter_zero_uncond: ...)"."""
        return f"calls with fewer than {self.below:,} {self.tokens} stay on torch ({self.reason})"

    def short(self) -> str:
        """"keys >= 17": what a served call needs, as tables and notes give it."""
        return f"{self.tokens} >= {self.below:,}"


@dataclass(frozen=True)
class Served:
    """A variant from its break-even (`min_*`) up to its verified range (`max_*`), in the verified
    layouts and execution contexts, with the calls its bounds keep on torch."""
    variant: str
    min_query_tokens: int
    min_key_tokens: int
    head_dims: tuple[int, ...]
    # The verified range and layouts (null: no upper bound, any layout: a report without long checks).
    max_query_tokens: int | None = None
    max_key_tokens: int | None = None
    layouts: tuple[str, ...] | None = None
    # The execution contexts certify verified (names in contexts.CONTEXTS; null: none were checked,
    # the variant's built-in rule, `contexts.builtin_safe`).
    contexts: tuple[str, ...] | None = None
    # Calls kept on torch whatever the thresholds.
    bounds: tuple[Bound, ...] = ()
    # Whether masked calls (an attn_mask) are served: the variant takes a mask and passed every masked
    # fixture of the family (false: masked calls stay on torch).
    masks: bool = False

    def __post_init__(self):
        records.tuples(self)

    def check(self) -> list[tuple[str, str]]:
        """(field, problem) for what makes it unusable; empty when nothing does."""
        if self.variant not in VARIANTS:
            return [("variant", f"{self.variant!r} is not a SageAttention variant sage-qual knows "
                                f"({', '.join(VARIANTS)})")]
        for name in ("min_query_tokens", "min_key_tokens"):
            value = getattr(self, name)
            if value < 1:
                return [(name, f"is {value!r}, expected a token count of at least 1")]
        if not self.head_dims:
            return [("head_dims", "empty: name the head sizes served")]
        wrong = [d for d in self.head_dims if d not in KERNEL_HEAD_DIMS]
        if wrong:
            return [("head_dims", f"{wrong[0]} is not a head size the kernels take "
                                  f"({', '.join(map(str, KERNEL_HEAD_DIMS))})")]
        for name, lowest in (("max_query_tokens", self.min_query_tokens),
                             ("max_key_tokens", self.min_key_tokens)):
            value = getattr(self, name)
            if value is not None and value < lowest:
                return [(name, f"is {value}, below min_{name[4:]} {lowest}: the verified range is empty")]
        if self.layouts is not None:
            if not self.layouts:
                return [("layouts", "empty: name the verified layouts, or null for any")]
            unknown = [name for name in self.layouts if name not in LAYOUTS]
            if unknown:
                return [("layouts", f"{unknown[0]!r} is not a layout sage-qual knows ({', '.join(LAYOUTS)})")]
        if self.masks and not VARIANTS[self.variant].takes_mask:
            return [("masks", f"is true, but {self.variant} takes no attn_mask: set it false")]
        if self.contexts is not None:
            unknown = [name for name in self.contexts if name not in CONTEXTS]
            if unknown or len(set(self.contexts)) != len(self.contexts):
                what = f"{unknown[0]!r} is not" if unknown else "names a context twice, not"
                return [("contexts", f"{what} a list of execution contexts sage-qual knows "
                                     f"({', '.join(CONTEXTS)}); [] for none, null for the built-in rule")]
        return []

    @property
    def range_verified(self) -> bool:
        return self.max_query_tokens is not None

    def start(self) -> str:
        """"9,728 query / 9,728 key tokens, head_dim 128": where it starts serving."""
        return (f"{self.min_query_tokens:,} query / {self.min_key_tokens:,} key tokens, "
                f"head_dim {'/'.join(map(str, self.head_dims))}")

    def text(self) -> str:
        """The one phrasing of what it serves, as gate, merge's notes, report.md, the terminal and
        install_status() give it: "from 9,728 to 75,600 tokens, head_dim 128 (layouts: contiguous,
        transposed; contexts: side_stream, compile); calls with fewer than 17 keys stay on torch (...)"."""
        bounds = "".join(f"; {bound.text()}" for bound in self.bounds)
        masks = "; masked calls too" if self.masks else ""
        if not self.range_verified:
            return (
                f"from {self.start()} (no upper bound verified: a report without long checks{masks}){bounds}"
            )
        dims = "/".join(map(str, self.head_dims))
        contexts = "" if self.contexts is None else f"; contexts: {', '.join(self.contexts) or 'none'}"
        layouts = "any" if self.layouts is None else ", ".join(self.layouts)
        return f"{self._tokens()}, head_dim {dims} (layouts: {layouts}{contexts}{masks}){bounds}"

    def _tokens(self) -> str:
        """"from 9,728 to 75,600 tokens", "at 16,384 tokens" (a range of one length), or the query and
        key ranges apart when they differ ("from 4,096 to 8,192 query / 512 key tokens")."""
        words = self._lengths()
        one_length = self.min_query_tokens == self.max_query_tokens == self.min_key_tokens == self._max_key()
        return ("at " if one_length else "from ") + words

    def _max_key(self) -> int | None:
        return self.max_key_tokens if self.max_key_tokens is not None else self.max_query_tokens

    def _lengths(self) -> str:
        """"9,728 to 75,600 tokens", "16,384 tokens", or "4,096 to 8,192 query / 512 key tokens"."""
        def span(low: int, high: int) -> str:
            return f"{low:,}" if low == high else f"{low:,} to {high:,}"

        query, key = (self.min_query_tokens, self.max_query_tokens), (self.min_key_tokens, self._max_key())
        return f"{span(*query)} tokens" if query == key else f"{span(*query)} query / {span(*key)} key tokens"

    def short(self) -> str:
        """The short form, for the fleet table's cells and install_status()'s one-line notes:
        "sm90-fp8-cuda 9,728 to 75,600 tokens, head_dim 128 (contiguous, transposed; contexts:
        side_stream, compile; keys >= 17)"."""
        dims = f", head_dim {'/'.join(map(str, self.head_dims))}"
        bounds = "".join(f"; {b.short()}" for b in self.bounds)
        masks = "; masks" if self.masks else ""
        if not self.range_verified:
            notes = (masks + bounds)[2:]
            return f"{self.variant} >= {self.min_query_tokens}/{self.min_key_tokens}{dims}" + (
                f" ({notes})" if notes else "")
        tokens = self._lengths()
        contexts = "" if self.contexts is None else f"; contexts: {', '.join(self.contexts) or 'none'}"
        layouts = "any layout" if self.layouts is None else ", ".join(self.layouts)
        return f"{self.variant} {tokens}{dims} ({layouts}{contexts}{masks}{bounds})"
