"""The main job's torch threads (`run.in_process.free_cpus`): the CPUs this process may use less those
other processes keep running as it starts, read from /proc without counting its own threads."""

import os
import subprocess
import sys

import pytest

from sage_qual.qualification.run import in_process


@pytest.mark.parametrize("usable, others, threads", [(2, 0, 2), (2, 1, 1), (2, 2, 1), (2, 7, 1), (16, 3, 13)])
def test_the_threads_are_the_usable_cpus_less_the_others_running(monkeypatch, usable, others, threads):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(usable)))
    monkeypatch.setattr(in_process, "others_running", lambda: others)
    assert in_process.free_cpus() == threads


def test_a_cpu_bound_process_beside_it_is_counted_and_its_own_threads_are_not():
    quiet = in_process.others_running(samples=3)
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        busy = max(in_process.others_running(samples=5) for _ in range(3))
    finally:
        spinner.kill()
        spinner.wait()
    assert busy >= 1 and busy >= quiet


def test_without_proc_it_takes_every_cpu(monkeypatch):
    def unreadable(self, *args, **kwargs):
        raise OSError("no /proc here")

    monkeypatch.setattr(in_process.Path, "read_text", unreadable)
    assert in_process.others_running() == 0


def test_omp_num_threads_given_is_kept(monkeypatch):
    import torch

    before = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(in_process, "free_cpus", lambda: pytest.fail("sized anyway"))
    in_process.InProcessExecutor()
    assert torch.get_num_threads() == before


def test_without_omp_num_threads_the_executor_sizes_torch_to_the_free_cpus(monkeypatch):
    import torch

    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(in_process, "free_cpus", lambda: 1)
    try:
        in_process.InProcessExecutor()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
