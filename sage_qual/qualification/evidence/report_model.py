"""What report.json holds, as typed records: the evidence of a certify run, never its verdicts.

A report stores what was measured (cells: a variant on a fixture; speed: a kernel at a shape, with every
timed repeat) and where; `decide.verdict.decide()` draws every verdict from it. `files.load()` reads a file
strictly: anything missing, mistyped, out of range, truncated or from a newer schema is a `ReportError`
naming the file, the key and the fix. `files.upgrade` reads older schemas: version 1 (up to sage-qual 0.1:
the same evidence plus a stored analysis, `gpus`, dropped unread, and no timing samples) and version 2
(budgets and long-check metrics as open mappings that could lack a key, now `Budget` and `Metrics`).
"""

from __future__ import annotations

import dataclasses
import enum
import math
import statistics
from dataclasses import dataclass, field
from typing import Literal

from sage_qual import limits
from sage_qual.fixtures.audit_misses import WORST_PROVENANCE, RecordedMiss
from sage_qual.kernels.contexts import CHECKS, CONTEXTS
from sage_qual.kernels.variants import VARIANTS
from sage_qual.qualification.evidence import identity
from sage_qual.qualification.evidence.context_runs import ContextRun, safe_contexts  # noqa: F401 (the model's)
from sage_qual.qualification.evidence.numbers import (  # noqa: F401 (the model's)
    COSINE,
    METRIC_NAMES,
    NOT_NEGATIVE,
    Budget,
    Metrics,
    PublishedBound,
)
from sage_qual.qualification.families import FAMILIES

# GpuInfo, ReasonKind: part of the report's model, imported from here
from sage_qual.verdicts.env_record import EnvironmentRecord, GpuIdentity, GpuInfo, Reason, ReasonKind  # noqa: F401

KIND = "sage-qual-report"
SCHEMA_VERSION = 5
FIX = "the file was edited, damaged or written by another tool: run `sage-qual certify` again"


class ReportError(ValueError):
    """A file that is not a readable sage-qual report; the message says why and what to do."""


class Outcome(str, enum.Enum):
    PASS = "pass"
    FAIL = "fail"
    SKIP = "skip"
    OOM = "oom"
    CRASH = "crash"
    TIMEOUT = "timeout"


class DType(str, enum.Enum):
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"


class FixtureKind(str, enum.Enum):
    RECORDED = "recorded"
    REPLICA = "replica"


class AccuracyClass(str, enum.Enum):
    FP16 = "fp16"
    FP8 = "fp8"


@dataclass(frozen=True)
class SmoothK:
    """The same kernel with K smoothing on (outlier fixtures only)."""
    rel_l2: float | None
    worst_head_cosine: float | None
    finite: bool


class _Measured:
    """What a cell and a long check share: an outcome that is measured (pass, fail) or says why not."""

    @property
    def measured(self) -> bool:
        return self.outcome in (Outcome.PASS, Outcome.FAIL)

    def _outcome_problems(self, what: str, needed: tuple[str, ...]) -> list[tuple[str, str]]:
        """A measured one lacking a field in `needed`, or an unmeasured one without its detail."""
        if self.measured:
            missing = [name for name in needed if getattr(self, name) is None]
            if missing:
                return [(missing[0], f"missing for a {what} whose outcome is {self.outcome.value!r}")]
        elif not self.detail:
            return [("detail", f"empty for a {what} whose outcome is {self.outcome.value!r} (it says why)")]
        return []


@dataclass(frozen=True)
class Cell(_Measured):
    """One variant on one fixture: its metrics only when it ran to the end (a number that was not finite
    is null), judged against its budget."""
    IDENTITY = ("variant", "fixture")  # one result per variant and fixture
    variant: str
    fixture: str
    outcome: Outcome
    detail: str = ""
    reasons: list[Reason] = field(default_factory=list)
    accuracy_class: AccuracyClass | None = None
    budget: Budget | None = field(default=None, metadata={
        "description": "the budget the cell was judged against"})
    metrics: Metrics | None = field(default=None, metadata={
        "description": "its output's errors against float32 (null: it did not run to the end)"})
    # Errors and bytes cannot be negative: an edited number that is would pass any limit on its side.
    sdpa_rel_l2: float | None = field(default=None, metadata=NOT_NEGATIVE)
    error_vs_sdpa: float | None = field(default=None, metadata=NOT_NEGATIVE)
    extra_bytes_per_element: float | None = field(default=None, metadata=NOT_NEGATIVE)
    smooth_k_on: SmoothK | None = None
    hazards: list[str] = field(default_factory=list, metadata={
        "description": "a prediction's: what the numerics model says may make the kernel's output "
                       "non-finite here (memory the model cannot see); each fails the cell"})
    seconds: float | None = None
    stderr_tail: str = ""
    traceback: str = ""

    def check(self) -> list[tuple[str, str]]:  # memory is measured on a GPU only: Report.check
        return self._outcome_problems("cell", ("budget", "metrics"))

    def __getattr__(self, name: str):
        """A name schema 4 moved (a test of sage-qual's pytest plugin may still read `cell.rel_l2`):
        an AttributeError that says where it went."""
        moved = f"metrics.{name}" if name in METRIC_NAMES else "budget" if name == "bounds" else ""
        if moved:
            raise AttributeError(f"Cell.{name} is Cell.{moved} since report schema 4")
        raise AttributeError(f"'Cell' object has no attribute {name!r}")


@dataclass(frozen=True)
class Speed:
    """One kernel at one shape: the median of the timed calls (CUDA events, after warm-up), with
    every timed call in `samples_ms`; kernel 'sdpa' is the fastest SDPA backend: `backends` holds
    each backend's median of a short screen, `best_backend` the fastest of them, timed in full."""
    IDENTITY = ("kernel", "shape")  # one timing per kernel and shape
    kernel: str
    shape: str
    outcome: Outcome
    ms: float | None = field(metadata={"description": "median ms; null when it did not run"})
    samples_ms: list[float] = field(default_factory=list, metadata={
        "minimum": 0, "description": "every timed call in ms (empty in schema version 1 reports)"})
    best_backend: str = ""
    backends: dict[str, float] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)
    detail: str = ""
    seconds: float | None = None
    stderr_tail: str = ""
    traceback: str = ""

    def check(self) -> list[tuple[str, str]]:
        if self.ms is not None and self.ms <= 0:
            return [("ms", f"is {self.ms}, expected a positive time")]
        if self.outcome == Outcome.PASS and self.ms is None:
            return [("ms", "null for a timing whose outcome is 'pass'")]
        # The decisions use both the median and the samples: an edit to one shows against the other.
        if self.samples_ms and self.ms is not None:
            median = statistics.median(self.samples_ms)
            if not math.isclose(median, self.ms):
                return [("ms", f"{self.ms:.6g} is not the median of samples_ms ({median:.6g})")]
        if self.best_backend:
            if self.best_backend not in self.backends:
                return [("best_backend", f"{self.best_backend!r} is not in backends")]
            fastest = min(self.backends, key=self.backends.get)
            if not math.isclose(self.backends[fastest], self.backends[self.best_backend]):
                return [("best_backend", f"{self.best_backend!r} is not the fastest of backends "
                                         f"({fastest!r})")]
        return []


@dataclass(frozen=True)
class ShapeSpec:
    heads: int = field(metadata={"minimum": 1})
    kv_heads: int = field(metadata={"minimum": 1})
    q_tokens: int = field(metadata={"minimum": 1})
    kv_tokens: int = field(metadata={"minimum": 1})
    head_dim: int = field(metadata={"minimum": 1})
    dtype: DType
    batch: int = field(metadata={"minimum": 1})


@dataclass(frozen=True)
class ShapeUse:
    family: str | None = field(metadata={"description": "null: a point of the generic sweep"})
    label: str


@dataclass(frozen=True)
class ShapeEntry:
    """A timed shape and which sweep points or family calls it stands for."""
    shape: ShapeSpec
    uses: list[ShapeUse]

    def check(self) -> list[tuple[str, str]]:
        return [] if self.uses else [("uses", "empty: a timed shape stands for at least one call")]


@dataclass(frozen=True)
class LongCheck(_Measured):
    """A variant at one long call (`measure.long_check`): accuracy on sampled query rows of synthetic
    tensors against the numerics model's budget for those rows, whether every row's output is the same
    wherever its block sits, and whether each declared layout gave the contiguous call's output."""
    IDENTITY = ("variant", "shape")  # one check per variant and call
    variant: str
    shape: ShapeSpec = field(metadata={"description": "the call checked (the planned size)"})
    uses: list[ShapeUse] = field(metadata={"description": "the family calls and sweep points it stands for"})
    layouts: list[str] = field(metadata={"description": "layouts checked (families.LAYOUTS)"})
    outcome: Outcome
    detail: str = ""
    reasons: list[Reason] = field(default_factory=list)
    budget: Budget | None = None
    metrics: Metrics | None = field(default=None, metadata={
        "description": "the sampled rows' errors against float32 (null: not measured)"})
    model_finite: bool | None = None
    identical: dict[str, bool] = field(default_factory=dict, metadata={
        "description": "layout -> the output on that view equals the contiguous call's, bit for bit"})
    rows: list[int] = field(default_factory=list, metadata={
        "minimum": 0, "description": "first query row of each sampled block (the numerics model's rows)"})
    row_block: int | None = field(default=None, metadata={"minimum": 1})
    rows_identical: bool | None = field(default=None, metadata={
        "description": "every row: the output of each whole 128-row block, computed with the blocks in "
                       "reverse order, equals its output in place, bit for bit (null: not compared: "
                       "emulation, fewer than two whole blocks, or an older report)"})
    ran_tokens: int | None = field(default=None, metadata={
        "minimum": 1, "description": "tokens actually run when not the planned ones (test fakes, emulation)"})
    ran_heads: int | None = field(default=None, metadata={
        "minimum": 1, "description": "query heads actually run when not the planned ones (emulation)"})
    ran_kv_tokens: int | None = field(default=None, metadata={
        "minimum": 1, "description": "key tokens actually run when not the planned ones (test fakes)"})
    inputs: str = field(default="", metadata={"description": "what the tensors were (synthetic, seeded)"})
    seconds: float | None = None
    stderr_tail: str = ""
    traceback: str = ""

    def ran_shape(self) -> ShapeSpec | None:
        """The call it ran: the planned shape, cut down where it ran cut down (None: a cut-down cross
        call whose key tokens were not recorded, as before ran_kv_tokens)."""
        shape = self.shape
        kv_tokens = self.ran_kv_tokens
        if kv_tokens is None:
            if self.ran_tokens is not None and shape.q_tokens != shape.kv_tokens:
                return None
            kv_tokens = self.ran_tokens or shape.kv_tokens
        heads = self.ran_heads or shape.heads
        return dataclasses.replace(shape, heads=heads, kv_heads=max(1, heads * shape.kv_heads // shape.heads),
                                   q_tokens=self.ran_tokens or shape.q_tokens, kv_tokens=kv_tokens)

    def check(self) -> list[tuple[str, str]]:
        # A comparison of a layout the check did not declare would enable that layout (issue 28).
        undeclared = sorted(set(self.identical) - set(self.layouts))
        if undeclared:
            return [("identical", f"{undeclared[0]!r} is not among the layouts checked "
                                  f"({', '.join(self.layouts)})")]
        return self._outcome_problems("long check", ("budget", "metrics"))


@dataclass(frozen=True)
class SpanProbe:
    """A variant called directly on one long query near the 32-bit element limit (`measure.span_probe`):
    pass (right on sampled rows), fail (wrong), or what ended its worker (crash, with the stderr tail)."""
    IDENTITY = ("variant", "layout", "side", "span")  # one probe per variant and case
    variant: str
    layout: Literal["contiguous", "fused_qkv"] = field(metadata={
        "description": "contiguous, or fused_qkv (views into one fused QKV)"})
    side: Literal["below", "above"] = field(metadata={
        "description": "below: within the probed limit; above: past it"})
    tokens: int = field(metadata={"minimum": 1})
    heads: int = field(metadata={"minimum": 1})
    head_dim: int = field(metadata={"minimum": 1})
    kv_tokens: int = field(metadata={"minimum": 1})
    span: int = field(metadata={"minimum": 1, "description": "the query's elements from its data pointer"})
    limit: int = field(metadata={"minimum": 1, "description": "the element limit the case sits at"})
    outcome: Outcome
    detail: str = ""
    rel_l2: float | None = field(default=None, metadata=NOT_NEGATIVE)
    worst_row: float | None = field(default=None, metadata=NOT_NEGATIVE)
    ran_tokens: int | None = field(default=None, metadata={
        "minimum": 1, "description": "tokens actually run when not the planned ones (test fakes)"})
    ran_heads: int | None = field(default=None, metadata={"minimum": 1})
    ran_span: int | None = field(default=None, metadata={"minimum": 1})
    seconds: float | None = None
    stderr_tail: str = ""
    traceback: str = ""

    def check(self) -> list[tuple[str, str]]:
        # A probe sits just below or above the 32-bit element boundary or its rung (issue 28: 2^40).
        if self.limit > limits.MAX_SPAN_ELEMENTS:
            return [("limit", f"{self.limit} is past the {limits.MAX_SPAN_ELEMENTS} elements a kernel "
                              "indexes with 32-bit offsets")]
        if (self.side == "below") != (self.span <= self.limit) or self.span > 2 * self.limit:
            return [("span", f"{self.span} is not {self.side} its limit {self.limit} (a probe sits within "
                             "2x of it)")]
        if self.span != (planned := limits.query_span(self.layout, self.tokens, self.heads, self.head_dim)):
            return [("span", f"{self.span} is not the {planned} elements of a {self.layout} query of "
                             f"{self.tokens} tokens x {self.heads} heads x {self.head_dim}")]
        if self.outcome == Outcome.PASS and self.rel_l2 is None:
            return [("rel_l2", "missing for a span probe whose outcome is 'pass'")]
        if self.outcome != Outcome.PASS and not self.detail:
            return [("detail", f"empty for a span probe whose outcome is {self.outcome.value!r} "
                               "(it says why)")]
        return []


@dataclass(frozen=True)
class FixtureRecord:
    name: str
    family: str
    kind: FixtureKind
    dtype: DType
    q: list[int] = field(metadata={"length": 4, "minimum": 1})
    k: list[int] = field(metadata={"length": 4, "minimum": 1})
    sha256: str = field(metadata={"pattern": "[0-9a-f]{64}"})
    bounds: dict[AccuracyClass, PublishedBound] = field(metadata={"description": "accuracy class -> bound"})
    provenance: str
    masked: bool = field(default=False, metadata={
        "description": "the call has an attn_mask: only variants that take a mask run it"})
    audit: RecordedMiss | None = field(default=None, metadata={
        "description": "recorded by the wrapper's audit: the miss it caught, which keeps that variant off "
                       "the family on that GPU model"})

    def check(self) -> list[tuple[str, str]]:
        # Each bound is the fitness bound of the cells of its class (verdicts.fitness): none may be missing.
        missing = [c.value for c in AccuracyClass if c not in self.bounds]
        if missing:
            return [("bounds", f"no bound for class {', '.join(missing)} (every cell's fitness bound is its "
                               "fixture's bound for its class)")]
        return []


@dataclass(frozen=True)
class ContextCheck(_Measured):
    """A variant in every execution context (`context_check`): pass when every check passed, fail when
    one did not (it then serves only in the contexts that passed), or what ended its worker."""
    IDENTITY = ("variant",)  # one check per variant: a second would leave its contexts to order
    variant: str
    shape: list[int] = field(metadata={"length": 4, "minimum": 1, "description": "[B, H, N, D] of each call"})
    dtype: DType
    outcome: Outcome
    runs: list[ContextRun] = field(default_factory=list)
    detail: str = ""
    ran_shape: list[int] | None = field(default=None, metadata={
        "length": 4, "minimum": 1, "description": "the shape run when not the planned one (test fakes)"})
    seconds: float | None = None
    stderr_tail: str = ""
    traceback: str = ""

    @property
    def safe_contexts(self) -> list[str]:
        return safe_contexts(self.runs) if self.measured else []

    def decided(self) -> str:
        """What it decides, in words ("safe in side_stream, compile; falls back under capture"), or how
        it ended when nothing was measured (crash, timeout, skip)."""
        if not self.measured:
            return self.outcome.value
        safe, unsafe = self.safe_contexts, [name for name in CONTEXTS if name not in self.safe_contexts]
        return f"safe in {', '.join(safe) or 'no context'}" + (
            f"; falls back under {', '.join(unsafe)}" if unsafe else "")

    def check(self) -> list[tuple[str, str]]:
        if not self.measured:
            return self._outcome_problems("context check", ())
        missing = [name for name in CHECKS if name not in {r.name for r in self.runs}]
        if missing:
            return [("runs", f"no {missing[0]} check in a context check that {self.outcome.value}ed")]
        passed = all(r.passed for r in self.runs)
        if (self.outcome == Outcome.PASS) != passed:
            return [("outcome", f"{self.outcome.value!r}, but its runs say {'pass' if passed else 'fail'}")]
        return []


@dataclass(frozen=True)
class Options:
    devices: list[int] = field(metadata={"minimum": 0})
    variants: list[str]
    families: list[str]
    fixture_dirs: list[str]
    quick: bool
    timeout_s: float = field(metadata={"minimum": 0})


@dataclass(frozen=True)
class Device(GpuIdentity):
    not_supported: dict[str, list[str]] = field(metadata={"description": "variant -> why it cannot run here"})
    cells: list[Cell]
    speed: list[Speed]
    long: list[LongCheck] | None = field(default=None, metadata={
        "description": "long checks (null: a report written before sage-qual checked long calls)"})
    span: list[SpanProbe] | None = field(default=None, metadata={
        "description": "span probes (null: none ran: --quick, or a report from before them)"})
    contexts: list[ContextCheck] | None = field(default=None, metadata={
        "description": "execution-context checks (null: none ran: --quick, emulation, or a report from "
                       "before them; each variant then keeps the built-in rule)"})
    sm_count: int | None = field(default=None, metadata={"minimum": 1, "description": "null: not recorded"})

    @property
    def model(self) -> tuple[str, tuple[int, int]]:
        return self.name, (self.capability[0], self.capability[1])


@dataclass(frozen=True)
class Report:
    """Written by `sage-qual certify` as report.json: rewritten after every result with
    complete=false, and with complete=true when the run finished. Holds evidence only: every
    verdict is computed from it when it is read."""
    kind: Literal["sage-qual-report"]
    schema_version: Literal[5]
    complete: bool
    stopped: str = field(metadata={"description": "why the run stopped before the end ('' when it did not)"})
    started: str
    finished: str | None
    host: str
    command: str
    options: Options
    environment: EnvironmentRecord
    fixtures: list[FixtureRecord]
    shapes: dict[str, ShapeEntry]
    devices: list[Device]
    predicted: bool = field(default=False, metadata={
        "description": "true: cells predicted by the CPU numerics model (certify --emulate), nothing "
                       "measured on a GPU; gate refuses such a report"})
    target: str = field(default="", metadata={
        "description": "certify --target: the integration qualified instead of the variants (wrapper, "
                       "sageattn, diffusers:BACKEND, module:function); it stands where a variant stands "
                       "(options.variants, cells' variant) and each cell stores its kernel class"})
    fitness_judged: bool = field(default=False, metadata={
        "description": "true: every outcome was judged for fitness as well as conformance (schema 5); "
                       "false in an older report, whose outcomes the reader judges for fitness again"})

    def recorded_misses(self) -> set[str]:
        """The names of the fixtures that the wrapper's audit recorded as misses."""
        return {f.name for f in self.fixtures if f.audit is not None}

    def audit_recordings(self) -> set[str]:
        """The names of every fixture the wrapper's audit recorded: its misses and drifts, and the worst
        call of each site it kept (`fixtures.recorder.AuditFolder.worst`)."""
        kept = {f.name for f in self.fixtures if f.provenance.startswith(WORST_PROVENANCE)}
        return self.recorded_misses() | kept

    def check(self) -> list[tuple[str, str]]:
        if self.complete and not self.finished:
            return [("finished", "null in a report marked complete")]
        if not self.predicted:
            for n, device in enumerate(self.devices):
                for m, cell in enumerate(device.cells):
                    if cell.measured and cell.extra_bytes_per_element is None:
                        return [(f"devices[{n}].cells[{m}].extra_bytes_per_element",
                                 f"missing for a measured cell whose outcome is {cell.outcome.value!r}")]
        names = [f.name for f in self.fixtures]
        if len(set(names)) != len(names):
            return [("fixtures", "two fixtures share a name")]
        indices = [d.index for d in self.devices]
        if len(set(indices)) != len(indices):
            return [("devices", "two entries for one GPU index")]
        known = self._unknown_names()
        if known:
            return known
        for n, device in enumerate(self.devices):
            duplicate = identity.duplicate(device)
            if duplicate:
                return [(f"devices[{n}].{duplicate[0]}", duplicate[1])]
            for kind, records_ in identity.evidence_lists(device):
                for m, record in enumerate(records_):
                    if getattr(record, "variant", None) not in (None, *self.options.variants):
                        return [(f"devices[{n}].{kind}[{m}].variant",
                                 f"{record.variant!r} is not in options.variants")]
            for m, cell in enumerate(device.cells):
                if cell.fixture not in names:
                    return [(f"devices[{n}].cells[{m}].fixture", f"{cell.fixture!r} is not in `fixtures`")]
            for m, timing in enumerate(device.speed):
                if timing.shape not in self.shapes:
                    return [(f"devices[{n}].speed[{m}].shape", f"{timing.shape!r} is not in `shapes`")]
                if not self.target and timing.kernel not in ("sdpa", *self.options.variants):
                    return [(f"devices[{n}].speed[{m}].kernel",
                             f"{timing.kernel!r} is neither 'sdpa' nor in options.variants")]
        return []

    def _unknown_names(self) -> list[tuple[str, str]]:
        """A family or variant this sage-qual does not know: its verdicts would be drawn from rules
        it lacks (a target report's variants are its integration, not registry names)."""
        families = {f.name for f in FAMILIES}
        for n, name in enumerate(self.options.families):
            if name not in families:
                return [(f"options.families[{n}]", f"{name!r} is not a family this sage-qual knows "
                                                   f"({', '.join(sorted(families))}; a newer sage-qual may)")]
        for n, name in enumerate(self.options.variants):
            if not self.target and name not in VARIANTS:
                return [(f"options.variants[{n}]",
                         f"{name!r} is not a variant this sage-qual knows (a newer one may)")]
        return []
