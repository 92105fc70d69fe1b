"""Certify's workers are forked from one zygote per parent (`pool._Forked`), and each still starts as
a fresh interpreter would: its own process and session, and the parent's environment of the moment
it was started, not the zygote's."""

import json
import multiprocessing.forkserver
import os
import time
from pathlib import Path

from sage_qual.qualification.run import plan, pool
from sage_qual.qualification.selftest import faults as worker_faults


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_workers_are_forked_from_one_zygote_in_sessions_of_their_own(tmp_path):
    workers = [pool.Process(pool.worker_env(), tmp_path / f"worker-{n}.log") for n in range(2)]
    try:
        zygotes = {parent_of(process.proc.pid) for process in workers}
        assert len(zygotes) == 1 and os.getpid() not in zygotes  # not this process's own children
        # The child makes its session first thing after the fork (`Process.kill` covers the moment before).
        deadline = time.monotonic() + 30
        while not all(os.getsid(p.proc.pid) == p.proc.pid for p in workers) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert all(os.getsid(process.proc.pid) == process.proc.pid for process in workers)
    finally:
        for process in workers:
            process.close()
    assert [process.ended() for process in workers] == ["exit code 0"] * 2  # idle spares: stdin closed


def test_a_worker_gets_the_environment_of_its_start_not_the_zygotes(tmp_path, monkeypatch):
    """The zygote is started here under one test hook (a fake GPU "A"); workers started after the
    hook changed, and after it was removed, see the change (no GPU on this CPU-only box)."""
    def gpus_seen(name: str) -> list[str]:
        result = pool.collect_environment(plan.environment_check(), tmp_path / f"{name}.log", 120.0)
        return [gpu.name for gpu in result.environment.gpus]

    def fake(name: str) -> str:
        return json.dumps({"gpus": [{"name": name, "capability": [9, 0]}]})

    multiprocessing.forkserver._forkserver._stop()  # private: so that the next start is a new zygote
    monkeypatch.setenv(worker_faults.TEST_HOOK, fake("Fake A"))
    assert gpus_seen("a") == ["Fake A"]
    monkeypatch.setenv(worker_faults.TEST_HOOK, fake("Fake B"))
    assert gpus_seen("b") == ["Fake B"]
    monkeypatch.delenv(worker_faults.TEST_HOOK)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert gpus_seen("none") == []


def test_certify_starts_the_zygote_before_it_imports_torch(tmp_path):
    """`start_zygote` returns at once, and the workers then forked come from that zygote: its imports
    run beside the parent's import of torch (cli/certify.py calls it before importing run)."""
    pool.start_zygote()
    started = multiprocessing.forkserver._forkserver._forkserver_pid
    assert started is not None
    worker = pool.Process(pool.worker_env(), tmp_path / "worker.log")
    try:
        assert parent_of(worker.proc.pid) == started
    finally:
        worker.close()



def loaded(pid: int, library: str) -> bool:
    return library in Path(f"/proc/{pid}/maps").read_text()


def test_a_worker_started_with_imports_has_them_before_its_job(tmp_path):
    """`Pool.prefetch(imports=...)`: the spare imports them while it waits, and only a `take` asking for
    them gets it. Seen from outside: the extension module sqlite3 loads, mapped into that worker alone."""
    workers = pool.Pool(tmp_path)
    workers.prefetch(1)
    workers.prefetch(1, imports=("sqlite3",))
    plain, warm = workers.take(), workers.take(imports=("sqlite3",))
    try:
        assert (plain.imports, warm.imports) == ((), ("sqlite3",))
        deadline = time.monotonic() + 60
        while not loaded(warm.proc.pid, "_sqlite3") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert loaded(warm.proc.pid, "_sqlite3") and not loaded(plain.proc.pid, "_sqlite3")
        assert workers.spares == []
    finally:
        for process in (plain, warm):
            process.close()
