"""The worker protocol, typed: the tasks certify sends a worker, the messages it answers with, and
each task's result as the report's own record.

A task is one dataclass per kind (`TaskKind`); on the pipe it is `dump_task()`'s object, its
fields plus "kind", and `parse_task()` reads it back strictly. A task's result is the record the
report stores for it (`report_model.Cell`, `Speed`, `LongCheck`, `SpanProbe`; a paired timing
gives two `Speed`s, `Paired`), built by the task's `record()` from the task's own fields (variant,
fixture, shape ...) and what was measured: the one place a worker's answer becomes report
evidence, so the orchestrators only append what `report_entries()` gives. Whatever ends a task
early (a skip, an error in the worker, a crash or timeout the parent sees) is
`task.record(outcome, detail=...)` too.

The worker's messages are `Message`s; the parent reads them with `parse_message()` and each result
with `parse_result()`: a message that does not follow the protocol (an unknown type or key, an
outcome that is no `Outcome`, a result of the wrong shape) is one `records.RecordError` line naming
the key, never a KeyError deep in the parent. This module imports no torch: the parent never does.
"""

from __future__ import annotations

import dataclasses
import enum
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, Union

from sage_qual import records
from sage_qual.qualification.evidence.report_model import (
    METRIC_NAMES,
    AccuracyClass,
    Budget,
    Cell,
    ContextCheck,
    DType,
    LongCheck,
    Metrics,
    Outcome,
    Reason,
    ShapeSpec,
    ShapeUse,
    SpanProbe,
    Speed,
)
from sage_qual.verdicts.env_record import EnvironmentRecord

FIX = "the worker and its parent disagree on the protocol, a sage-qual bug: report it with the worker's log"


class TaskKind(str, enum.Enum):
    ENV = "env"  # the machine's environment (collecting it initializes CUDA, which the parent must not)
    CELL = "cell"  # a variant on a fixture
    SDPA = "sdpa"  # the fastest SDPA backend at a shape
    SPEED = "speed"  # a variant at a shape
    PAIRED = "paired"  # a variant and the fastest SDPA backend at a shape, timed call by call in turn
    LONG = "long"  # a variant at a long call, in the layouts integrations pass (`long_check`)
    SPAN = "span"  # a variant at the 32-bit span boundary (`span_probe`)
    CONTEXT = "context"  # a variant in every execution context (`context_check`)
    COMPILE = "compile"  # a Triton variant's kernels compiled ahead of its sweep job (`Worker.compile`)
    TARGET_MACHINE = "target_machine"  # certify --target: why the integration cannot run on this GPU
    TARGET_CELL = "target_cell"  # certify --target: the integration on a fixture (`cell.measure_target`)


class MessageType(str, enum.Enum):
    READY = "ready"  # the worker has its job
    START = "start"  # it begins task `id`
    RESULT = "result"  # task `id`'s result, after `seconds`
    DONE = "done"  # every task of the job has its result


def shape_spec(shape: dict) -> ShapeSpec:
    """A planned shape (`families.Shape.as_dict()`) as the report's record of it."""
    return records.parse(ShapeSpec, shape, "a planned shape",
                         "families wrote a wrong shape (a sage-qual bug)")


# Results that are no report record --------------------------------------------------------------
@dataclass(frozen=True)
class EnvResult:
    """The environment task's answer: the environment and, per visible GPU index, each variant that
    cannot run on it and why (the parent has no CUDA to ask)."""
    outcome: Outcome
    environment: EnvironmentRecord | None = None
    not_supported: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    detail: str = ""
    seconds: float | None = None
    stderr_tail: str = ""
    traceback: str = ""

    def check(self) -> list[tuple[str, str]]:
        if self.outcome == Outcome.PASS and self.environment is None:
            return [("environment", "missing in a result whose outcome is 'pass'")]
        return []


@dataclass(frozen=True)
class MachineResult:
    """certify --target's first task per GPU: why the integration cannot run on it ([]: it can)."""
    outcome: Outcome
    reasons: list[str] = field(default_factory=list)
    detail: str = ""
    seconds: float | None = None
    stderr_tail: str = ""
    traceback: str = ""


@dataclass(frozen=True)
class CompileResult:
    """What a compile-ahead did: the calls it compiled (no evidence: a progress line)."""
    outcome: Outcome
    calls: int = 0
    detail: str = ""
    seconds: float | None = None
    stderr_tail: str = ""
    traceback: str = ""


@dataclass(frozen=True)
class Paired:
    """A paired timing: the variant's, and the fastest SDPA backend's (none when the task ended
    before SDPA was timed)."""
    ours: Speed
    sdpa: Speed | None = None

    @property
    def outcome(self) -> Outcome:
        return self.ours.outcome


Result = Union[
    EnvResult, MachineResult, CompileResult, Cell, Speed, Paired, LongCheck, SpanProbe, ContextCheck
]


# Tasks --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class EnvTask:
    KIND: ClassVar[TaskKind] = TaskKind.ENV
    RESULT: ClassVar[type] = EnvResult
    id: str

    def record(self, outcome: Outcome, **fields) -> EnvResult:
        return EnvResult(outcome, **fields)


@dataclass(frozen=True)
class CellTask:
    KIND: ClassVar[TaskKind] = TaskKind.CELL
    RESULT: ClassVar[type] = Cell
    id: str
    variant: str
    fixture_name: str
    fixture: str = field(metadata={"description": "the fixture file's path"})
    memory_bound: float

    def record(self, outcome: Outcome, **fields) -> Cell:
        return Cell(self.variant, self.fixture_name, outcome, **fields)


@dataclass(frozen=True)
class SdpaTask:
    KIND: ClassVar[TaskKind] = TaskKind.SDPA
    RESULT: ClassVar[type] = Speed
    id: str
    key: str = field(metadata={"description": "the shape's key in the report's shapes"})
    shape: ShapeSpec
    warmup: int
    repeats: int

    def record(self, outcome: Outcome, ms: float | None = None, **fields) -> Speed:
        return Speed("sdpa", self.key, outcome, ms, **fields)


@dataclass(frozen=True)
class SpeedTask:
    KIND: ClassVar[TaskKind] = TaskKind.SPEED
    RESULT: ClassVar[type] = Speed
    id: str
    variant: str
    key: str
    shape: ShapeSpec
    warmup: int
    repeats: int

    def record(self, outcome: Outcome, ms: float | None = None, **fields) -> Speed:
        return Speed(self.variant, self.key, outcome, ms, **fields)


@dataclass(frozen=True)
class PairedTask(SpeedTask):
    """A SpeedTask whose worker also times SDPA at the shape, in turn with the variant."""
    KIND: ClassVar[TaskKind] = TaskKind.PAIRED
    RESULT: ClassVar[type] = Paired

    def record(self, outcome: Outcome, ms: float | None = None, sdpa: Speed | None = None,
               **fields) -> Paired:
        return Paired(Speed(self.variant, self.key, outcome, ms, **fields), sdpa)

    def sdpa_record(self, outcome: Outcome, ms: float | None = None, **fields) -> Speed:
        return Speed("sdpa", self.key, outcome, ms, **fields)


@dataclass(frozen=True)
class LongTask:
    KIND: ClassVar[TaskKind] = TaskKind.LONG
    RESULT: ClassVar[type] = LongCheck
    id: str
    variant: str
    shape: ShapeSpec
    uses: list[ShapeUse]
    layouts: list[str]

    def record(self, outcome: Outcome, **fields) -> LongCheck:
        return LongCheck(self.variant, self.shape, self.uses, self.layouts, outcome, **fields)


@dataclass(frozen=True)
class SpanTask:
    """One `span_probe.SpanCase` (its fields) of a variant, at the limit it sits at."""
    KIND: ClassVar[TaskKind] = TaskKind.SPAN
    RESULT: ClassVar[type] = SpanProbe
    id: str
    variant: str
    limit: int
    layout: str
    side: str
    tokens: int
    span: int
    heads: int
    head_dim: int
    kv_tokens: int

    def record(self, outcome: Outcome, **fields) -> SpanProbe:
        return SpanProbe(self.variant, self.layout, self.side, self.tokens, self.heads, self.head_dim,
                         self.kv_tokens, self.span, self.limit, outcome, **fields)


@dataclass(frozen=True)
class ContextTask:
    """A variant in every execution context at one call shape ([B, H, N, D] of `dtype`)."""
    KIND: ClassVar[TaskKind] = TaskKind.CONTEXT
    RESULT: ClassVar[type] = ContextCheck
    # What its torch.compile runs import (inductor, its passes and Triton code generation): most of
    # a context check's 9-11 s on the H200 host, whose image compiles every import from source
    # (docs/results/run30-h200/context_cprofile.txt). A worker started during the sweep imports them
    # while it waits for this task (`pool.Process`, `imports`).
    IMPORTS: ClassVar[tuple[str, ...]] = (
        "torch._inductor.compile_fx", "torch._inductor.fx_passes.post_grad",
        "torch._inductor.fx_passes.joint_graph", "torch._inductor.codegen.triton",
        "torch._inductor.runtime.triton_heuristics", "torch.export")
    id: str
    variant: str
    shape: list[int] = field(metadata={"length": 4, "minimum": 1})
    dtype: str

    def record(self, outcome: Outcome, **fields) -> ContextCheck:
        return ContextCheck(self.variant, list(self.shape), DType(self.dtype), outcome, **fields)


@dataclass(frozen=True)
class KernelCall:
    """One call a sweep job makes of its variant: q, k, v of `shape`, arranged in `layout`
    (`long_check.arrange`)."""
    shape: ShapeSpec
    layout: str


@dataclass(frozen=True)
class CompileTask:
    """A Triton variant's kernels compiled, not launched, for each call its sweep job will make
    (`Worker.compile`), in a worker beside the sweep."""
    KIND: ClassVar[TaskKind] = TaskKind.COMPILE
    RESULT: ClassVar[type] = CompileResult
    id: str
    variant: str
    calls: list[KernelCall]

    def record(self, outcome: Outcome, **fields) -> CompileResult:
        return CompileResult(outcome, **fields)


@dataclass(frozen=True)
class TargetMachineTask:
    KIND: ClassVar[TaskKind] = TaskKind.TARGET_MACHINE
    RESULT: ClassVar[type] = MachineResult
    id: str
    target: str

    def record(self, outcome: Outcome, **fields) -> MachineResult:
        return MachineResult(outcome, **fields)


@dataclass(frozen=True)
class TargetCellTask:
    """The integration on one fixture; it stands where a variant stands in the report's cell."""
    KIND: ClassVar[TaskKind] = TaskKind.TARGET_CELL
    RESULT: ClassVar[type] = Cell
    id: str
    target: str
    fixture_name: str
    fixture: str = field(metadata={"description": "the fixture file's path"})
    capability: list[int] = field(metadata={"length": 2, "minimum": 0})
    memory_bound: float

    def record(self, outcome: Outcome, **fields) -> Cell:
        return Cell(self.target, self.fixture_name, outcome, **fields)


Task = Union[EnvTask, CellTask, SdpaTask, SpeedTask, PairedTask, LongTask, SpanTask, ContextTask,
             CompileTask, TargetMachineTask, TargetCellTask]
TASKS: dict[TaskKind, type] = {cls.KIND: cls for cls in typing.get_args(Task)}


def imports(job: list[Task]) -> tuple[str, ...]:
    """What a job's worker may import before the job arrives: what its tasks declare (`IMPORTS`), in
    order, once each."""
    return tuple(dict.fromkeys(name for task in job for name in getattr(task, "IMPORTS", ())))


def dump_task(task: Task) -> dict:
    """The task's JSON object on the pipe: its fields and its "kind"."""
    return {"kind": task.KIND.value, **records.dump(task)}


def parse_task(data: Any, where: str = "a task from the parent") -> Task:
    """`dump_task()`'s object as its task; a RecordError naming the key when it is not one."""
    if not isinstance(data, dict):
        raise records.RecordError(where, "", "is not an object", FIX)
    known = [kind.value for kind in TaskKind]
    if "kind" not in data:
        raise records.RecordError(where, "kind", "missing", FIX)
    if data["kind"] not in known:
        raise records.RecordError(where, "kind", f"is {data['kind']!r}, expected one of "
                                                 f"{', '.join(map(repr, known))}", FIX)
    fields = {k: v for k, v in data.items() if k != "kind"}
    return records.parse(TASKS[TaskKind(data["kind"])], fields, where, FIX)


@dataclass(frozen=True)
class Job:
    """The one line a worker reads: its tasks (`dump_task()`'s objects) and the environment to set
    before anything touches CUDA or Triton (its GPU, its Triton cache)."""
    tasks: list[dict[str, Any]]
    env: dict[str, str] = field(default_factory=dict)


# Messages -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Message:
    """One line a worker sends its parent."""
    type: MessageType
    id: str = ""
    seconds: float | None = None
    result: dict[str, Any] | None = field(default=None, metadata={
        "description": "the result record of task `id` (its type follows the task's kind)"})

    def check(self) -> list[tuple[str, str]]:
        if self.type in (MessageType.START, MessageType.RESULT) and not self.id:
            return [("id", f"missing in a {self.type.value!r} message")]
        if self.type == MessageType.RESULT and self.result is None:
            return [("result", "missing in a 'result' message")]
        return []


def result_message(task: Task, seconds: float, result: Result) -> Message:
    return Message(MessageType.RESULT, task.id, seconds, records.dump(result))


def parse_message(data: Any, where: str) -> Message:
    return records.parse(Message, data, where, FIX)


def parse_result(task: Task, message: Message, where: str) -> Result:
    """The result record of `message` for `task`, with the seconds the worker spent on it."""
    result = records.parse(task.RESULT, message.result, f"{where}: the result of {task.id}", FIX)
    return timed(result, message.seconds)


def timed(result: Result, seconds: float | None) -> Result:
    """The result with the task's time (a paired timing's goes to the variant's record)."""
    if isinstance(result, Paired):
        return dataclasses.replace(result, ours=dataclasses.replace(result.ours, seconds=seconds))
    return dataclasses.replace(result, seconds=seconds)


# Into the report ----------------------------------------------------------------------------------
def report_entries(result: Result) -> list[tuple[str, Any]]:
    """(the device's list it goes in: cells, speed, long, span or contexts; the record) for each report record
    of a task's result, in the order they are appended (a paired timing: SDPA's, then the variant's)."""
    if isinstance(result, Paired):
        return [("speed", speed) for speed in (result.sdpa, result.ours) if speed is not None]
    lists = {Cell: "cells", Speed: "speed", LongCheck: "long", SpanProbe: "span", ContextCheck: "contexts"}
    return [(lists[type(result)], result)]


def judged_cell(variant: str, fixture: str, accuracy: Metrics, budget: Budget, reasons: list[Reason],
                accuracy_class: str, extra_bytes_per_element: float | None, **more) -> Cell:
    """A measured (or predicted) cell: its accuracy numbers (`measure.Accuracy`, or a prediction's
    `Metrics`; non-finite ones stored as null), the budget it was judged against and the reasons it
    fails ([]: it passes)."""
    numbers = records.finite_or_none(vars(accuracy))
    metrics = Metrics(**{name: numbers.pop(name) for name in METRIC_NAMES})
    return Cell(variant, fixture, Outcome.FAIL if reasons else Outcome.PASS, reasons=reasons,
                accuracy_class=AccuracyClass(accuracy_class), budget=budget, metrics=metrics, **numbers,
                extra_bytes_per_element=extra_bytes_per_element, **more)
