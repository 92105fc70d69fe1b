"""No thread of certify's parent is left reading a worker's pipe once the worker is gone: a daemon
thread woken by the pipe's end while the interpreter shuts down aborts the parent (SIGABRT, exit
-6) instead of letting it exit with its code, as tests_fast/run/test_certify_targets.py's SIGTERM test
once saw under load."""

import threading

import pytest

from sage_qual.qualification.run import pool


@pytest.mark.parametrize("end", ["kill", "close"])
def test_ending_a_worker_ends_its_reader(tmp_path, end):
    before = set(threading.enumerate())
    process = pool.Process(pool.worker_env(), tmp_path / "worker.log")
    getattr(process, end)()
    assert process.proc.returncode is not None
    assert not [t for t in threading.enumerate() if t not in before and t.is_alive()]
    assert process.messages.get(timeout=1) is None  # the reader saw the pipe's end before it stopped


def test_closing_the_pool_ends_its_spares_readers(tmp_path):
    before = set(threading.enumerate())
    workers = pool.Pool(tmp_path)
    workers.prefetch(2)
    workers.close()
    assert not [t for t in threading.enumerate() if t not in before and t.is_alive()]
