"""The worker protocol, typed (qualification/evidence/tasks.py): every task and result survives the pipe
unchanged, a message that breaks the protocol ends the run with one line naming the key (never a
KeyError deep in the parent), and whatever ends a task early becomes that task's own report record."""

import json
import queue
from pathlib import Path

import pytest

from sage_qual import records
from sage_qual.qualification import families
from sage_qual.qualification.evidence import tasks
from sage_qual.qualification.evidence.report_model import (
    AccuracyClass,
    Cell,
    ContextCheck,
    ContextRun,
    LongCheck,
    Outcome,
    Reason,
    ReasonKind,
    ShapeUse,
    SmoothK,
    SpanProbe,
    Speed,
)
from sage_qual.qualification.run import pool
from sage_qual.verdicts.env_record import EnvironmentRecord
from tests_fast import builders

SHAPE = tasks.shape_spec(families.self_attention(24, 8192, 128).as_dict())
FIXTURE = "/f/flux1_1024.safetensors"
CELL = tasks.CellTask("sm90-fp8-cuda|flux1_1024", "sm90-fp8-cuda", "flux1_1024", FIXTURE, 2.5)
SPEED = tasks.SpeedTask("sm90-fp8-cuda@k", "sm90-fp8-cuda", "k", SHAPE, 3, 20)
PAIRED = tasks.PairedTask("sm90-fp8-cuda+sdpa@k", "sm90-fp8-cuda", "k", SHAPE, 3, 20)
LONG = tasks.LongTask("sm90-fp8-cuda~k", "sm90-fp8-cuda", SHAPE, [ShapeUse(None, "self 8192")],
                      ["contiguous", "transposed"])
SPAN = tasks.SpanTask("sm90-fp8-cuda^span", "sm90-fp8-cuda", 2**31 - 1, "fused_qkv", "above", 99_866,
                      2_147_504_128, 56, 128, 1024)
CONTEXT = tasks.ContextTask("sm90-fp8-cuda#contexts", "sm90-fp8-cuda", [1, 24, 16384, 128], "bfloat16")
COMPILE = tasks.CompileTask("compile:sm86-fp16-triton", "sm86-fp16-triton",
                            [tasks.KernelCall(SHAPE, "contiguous"), tasks.KernelCall(SHAPE, "fused_qkv")])
TASKS = [
    tasks.EnvTask("env"),
    COMPILE,
    CELL,
    tasks.SdpaTask("sdpa@k", "k", SHAPE, 3, 20),
    SPEED,
    PAIRED,
    LONG,
    SPAN,
    CONTEXT,
    tasks.TargetMachineTask("machine", "wrapper"),
    tasks.TargetCellTask("flux1_1024", "wrapper", "flux1_1024", FIXTURE, [9, 0], 2.5),
]


def test_every_kind_has_a_task_type_and_each_type_is_tested_here():
    assert set(tasks.TASKS) == set(tasks.TaskKind)
    assert {type(task) for task in TASKS} == set(tasks.TASKS.values())


@pytest.mark.parametrize("task", TASKS, ids=lambda task: task.KIND.value)
def test_a_task_reads_back_as_itself(task):
    sent = tasks.dump_task(task)
    assert sent["kind"] == task.KIND.value
    assert tasks.parse_task(sent) == task


BUDGET = builders.budget(max_abs=0.5)
RESULTS = [
    (
        tasks.EnvTask("env"),
        tasks.EnvResult(
            Outcome.PASS,
            EnvironmentRecord(
                "0.2",
                "3.11",
                "Linux",
                "2.11.0",
                "13.0",
                "9.1",
                "580",
                "3.6",
                "2.2.0",
                "",
                {"_qattn_sm90": "ok"},
                [],
            ),
            {"0": {"sm80-fp16-cuda": ["not on sm_90"]}},
        ),
    ),
    (
        CELL,
        Cell(
            "sm90-fp8-cuda",
            "flux1_1024",
            Outcome.FAIL,
            reasons=[Reason(ReasonKind.ACCURACY, "rel L2")],
            accuracy_class=AccuracyClass.FP8,
            budget=BUDGET,
            metrics=builders.metrics(rel_l2=0.2, worst_head_cosine=0.98),
            extra_bytes_per_element=1.5,
            smooth_k_on=SmoothK(None, None, False),
        ),
    ),
    (SPEED, Speed("sm90-fp8-cuda", "k", Outcome.PASS, 1.0, samples_ms=[0.9, 1.0, 1.1])),
    (
        PAIRED,
        tasks.Paired(
            Speed("sm90-fp8-cuda", "k", Outcome.PASS, 1.0, samples_ms=[1.0]),
            Speed(
                "sdpa",
                "k",
                Outcome.PASS,
                2.0,
                samples_ms=[2.0],
                best_backend="cudnn",
                backends={"cudnn": 2.0, "flash": 2.5},
            ),
        ),
    ),
    (PAIRED, tasks.Paired(Speed("sm90-fp8-cuda", "k", Outcome.CRASH, None, detail="died"))),
    (
        LONG,
        LONG.record(
            Outcome.PASS,
            budget=BUDGET,
            metrics=builders.metrics(rel_l2=0.05, worst_head_cosine=None),
            identical={"transposed": True},
            rows=[0, 128],
            row_block=128,
        ),
    ),
    (SPAN, SPAN.record(Outcome.CRASH, detail="it died (killed by SIGABRT)", stderr_tail="Assertion")),
    (
        CONTEXT,
        CONTEXT.record(
            Outcome.FAIL,
            detail="not bit-identical to the eager call: capture",
            runs=[
                ContextRun("side_stream", 1, 1, True, True, 0.0, 0.0, 0.038),
                ContextRun("capture", 1, 1, False, True, 0.09, 1.17, 1.17),
                ContextRun("compile", 3, 3, True, True, 0.0, 0.0, 0.039),
                ContextRun("compile_reduce_overhead", 3, 3, True, True, 0.0, 0.0, 0.039),
            ],
        ),
    ),
    (tasks.TargetMachineTask("machine", "wrapper"), tasks.MachineResult(Outcome.PASS, ["no kernel"])),
    (COMPILE, COMPILE.record(Outcome.PASS, calls=2)),
]


@pytest.mark.parametrize("task, result", RESULTS, ids=[f"{t.KIND.value}{n}" for n, (t, _) in
                                                       enumerate(RESULTS)])
def test_a_result_reads_back_as_itself_with_the_time_the_worker_took(task, result):
    message = records.parse(tasks.Message, records.dump(tasks.result_message(task, 1.25, result)), "m", "")
    found = tasks.parse_result(task, message, "a test message")
    assert found == tasks.timed(result, 1.25)
    assert (found.ours if isinstance(found, tasks.Paired) else found).seconds == 1.25


def test_every_ending_of_a_task_is_its_own_report_record():
    crashed = [task.record(Outcome.CRASH, detail="it died", stderr_tail="tail") for task in TASKS]
    stored = [record for result in crashed[2:-2] for _, record in tasks.report_entries(result)]
    assert [(type(r), r.outcome, r.detail, r.stderr_tail) for r in stored] == [
        (kind, Outcome.CRASH, "it died", "tail")
        for kind in (Cell, Speed, Speed, Speed, LongCheck, SpanProbe, ContextCheck)]
    assert (stored[0].variant, stored[0].fixture) == ("sm90-fp8-cuda", "flux1_1024")
    assert [stored[n].kernel for n in (1, 2, 3)] == ["sdpa", "sm90-fp8-cuda", "sm90-fp8-cuda"]
    assert (stored[5].variant, stored[5].layout, stored[5].span, stored[5].limit) == (
        "sm90-fp8-cuda", "fused_qkv", 2_147_504_128, 2**31 - 1)
    target = crashed[-1]
    assert (target.variant, target.fixture, target.outcome) == ("wrapper", "flux1_1024", Outcome.CRASH)
    for record in stored + [target]:  # each reads back as the report reads it
        assert records.parse(type(record), records.dump(record), "r", "") == record


def test_a_paired_result_goes_into_the_report_as_sdpa_then_the_variant():
    paired = RESULTS[3][1]
    assert [(field, r.kernel) for field, r in tasks.report_entries(paired)] == [
        ("speed", "sdpa"), ("speed", "sm90-fp8-cuda")]
    assert [r.kernel for _, r in tasks.report_entries(RESULTS[4][1])] == ["sm90-fp8-cuda"]


@pytest.mark.parametrize("change, key, problem", [
    (lambda d: d.pop("kind"), "kind", "missing"),
    (lambda d: d.update(kind="celll"), "kind", "'celll', expected one of 'env', 'cell'"),
    (lambda d: d.pop("fixture"), "fixture", "missing"),
    (lambda d: d.update(fixture_path="x"), "fixture_path", "unknown key"),
    (lambda d: d.update(memory_bound="2.5"), "memory_bound", "expected a number"),
])
def test_a_malformed_task_is_one_line_naming_the_key(change, key, problem):
    sent = tasks.dump_task(CELL)
    change(sent)
    with pytest.raises(records.RecordError) as raised:
        tasks.parse_task(sent)
    assert raised.value.key == key and problem in str(raised.value)
    assert "\n" not in str(raised.value)


class _Process:
    """A worker that sends the given messages (then dies): the pool's side only."""

    def __init__(self, messages):
        self.messages = queue.Queue()
        for message in messages + [None]:
            self.messages.put(message)
        self.log_path = Path("worker-1.log")
        self.killed = False

    def start(self, todo, env=None):
        self.sent = todo

    def kill(self):
        self.killed = True

    def close(self):
        pass

    def ended(self):
        return "exit code 1"

    def stderr_tail(self):
        return "the worker's last words"


def _run(messages, task=SPEED, process=None):
    process, results = process or _Process(messages), []
    pool.run_tasks([task], lambda: process, 5.0, 5.0, lambda t, r: results.append((t, r)))
    return process, results


PASSED = records.dump(Speed("sm90-fp8-cuda", "k", Outcome.PASS, 1.0, samples_ms=[1.0]))


@pytest.mark.parametrize("message, key, problem", [
    ({"type": "finished"}, "type", "'finished', expected one of 'ready', 'start', 'result', 'done'"),
    ({"type": "start"}, "id", "missing in a 'start' message"),
    ({"type": "result", "id": SPEED.id, "seconds": 1.0}, "result", "missing in a 'result' message"),
    ({"type": "result", "id": SPEED.id, "seconds": 1.0, "result": {**PASSED, "outcome": "passed"}},
     "outcome", "'passed', expected one of 'pass', 'fail'"),
    ({"type": "result", "id": SPEED.id, "seconds": 1.0, "result": {**PASSED, "median": 1.0}},
     "median", "unknown key"),
    ({"type": "result", "id": SPEED.id, "seconds": 1.0,
      "result": {k: v for k, v in PASSED.items() if k != "ms"}},
     "ms", "missing"),
    ({"type": "result", "id": "another task", "seconds": 1.0, "result": PASSED}, "id",
     "'another task' is no task of this job"),
    ({"type": "result", "id": SPEED.id, "seconds": 1.0, "tail": ""}, "tail", "unknown key"),
])
def test_a_message_that_breaks_the_protocol_is_one_line_naming_the_key(message, key, problem):
    process = _Process([{"type": "ready"}, {"type": "start", "id": SPEED.id}, message])
    with pytest.raises(records.RecordError) as raised:
        _run([], process=process)
    error = raised.value
    assert error.key == key and problem in str(error), str(error)
    assert process.killed
    assert "\n" not in str(error) and "worker-1.log" in str(error) and "sage-qual bug" in str(error)


def test_an_environment_that_passed_without_the_environment_is_refused():
    message = {"type": "result", "id": "env", "seconds": 1.0, "result": {"outcome": "pass"}}
    with pytest.raises(records.RecordError) as raised:
        _run([{"type": "ready"}, {"type": "start", "id": "env"}, message], task=tasks.EnvTask("env"))
    assert raised.value.key == "environment" and "outcome is 'pass'" in str(raised.value)


def test_a_worker_that_follows_the_protocol_gives_typed_results():
    process, results = _run([{"type": "ready"}, {"type": "start", "id": SPEED.id},
                             {"type": "result", "id": SPEED.id, "seconds": 0.5, "result": PASSED},
                             {"type": "done"}])
    assert process.sent == [SPEED]
    assert results == [(SPEED, Speed("sm90-fp8-cuda", "k", Outcome.PASS, 1.0, samples_ms=[1.0], seconds=0.5))]
    assert not process.killed


def test_a_worker_that_dies_in_a_task_gives_that_task_a_crash_record():
    _, results = _run([{"type": "ready"}, {"type": "start", "id": LONG.id}], task=LONG)
    ((task, result),) = results
    assert task == LONG and isinstance(result, LongCheck)
    assert (result.variant, result.shape, result.layouts, result.outcome) == (
        LONG.variant, LONG.shape, LONG.layouts, Outcome.CRASH)
    assert result.detail == "the worker ran this task when it died (exit code 1)"
    assert result.stderr_tail == "the worker's last words"


def test_a_worker_given_a_malformed_job_exits_naming_the_key(tmp_path):
    process = pool.Process(pool.worker_env(), tmp_path / "worker.log")
    job = {"tasks": [{**tasks.dump_task(SPEED), "kind": "sped"}], "env": {}}
    process.proc.stdin.write((json.dumps(job) + "\n").encode())
    process.proc.stdin.flush()
    assert process.messages.get(timeout=120) is None  # nothing sent, not even "ready"
    assert process.ended() == "exit code 1"
    last = process.stderr_tail().strip().splitlines()[-1]
    assert last.endswith(
        "a task from the parent: kind: is 'sped', expected one of 'env', 'cell', 'sdpa', "
        "'speed', 'paired', 'long', 'span', 'context', 'compile', 'target_machine', 'target_cell'; "
        + tasks.FIX
    )
    process.close()


def test_collect_environment_gives_the_workers_typed_result_or_one_line_why_not(monkeypatch, tmp_path):
    """The environment task's answer reaches certify and gate as the `EnvResult` record the worker
    sent; a worker that could not collect it is a WorkerError with its detail and last stderr line."""
    _, sent = RESULTS[0]

    def worker(result):
        return lambda env, log_path, **kwargs: _Process([
            {"type": "ready"}, {"type": "start", "id": "env"},
            {"type": "result", "id": "env", "seconds": 0.5, "result": result}, {"type": "done"}])

    monkeypatch.setattr(pool, "Process", worker(records.dump(sent)))
    collected = pool.collect_environment(tasks.EnvTask("env"), tmp_path / "environment.log", 5.0)
    assert isinstance(collected, tasks.EnvResult)
    assert (collected.environment, collected.not_supported) == (sent.environment, sent.not_supported)
    crashed = {"outcome": "crash", "detail": "the worker died", "stderr_tail": "RuntimeError: no driver\n"}
    monkeypatch.setattr(pool, "Process", worker(crashed))
    with pytest.raises(pool.WorkerError) as refused:
        pool.collect_environment(tasks.EnvTask("env"), tmp_path / "environment.log", 5.0)
    assert str(refused.value) == ("collecting this machine's environment failed: crash: the worker died "
                                  "(last stderr line: RuntimeError: no driver)")
