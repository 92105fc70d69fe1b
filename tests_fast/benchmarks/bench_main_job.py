"""The README's main job, timed as a user runs it: the whole `sage-qual certify --emulate` process
(pytest-benchmark, median of 5 rounds; nothing asserts a time). `process-start` times
`sage-qual --help` in the same run, the start-up every command pays, as the baseline.

Not collected by the suite (the file name is not test_*.py): run it alone, with nothing else on
the machine, `python -m pytest tests_fast/benchmarks/bench_main_job.py -p no:xdist
--benchmark-json=docs/benchmarks/main-job.json` (docs/benchmarks.md, "The main job").
"""

import shutil
import subprocess
import sys

import pytest

ROUNDS = 5


def _command(*args: str):
    def run():
        subprocess.run([sys.executable, "-m", "sage_qual", *args], check=True, stdout=subprocess.DEVNULL)
    return run


def test_process_start(benchmark):
    benchmark.pedantic(_command("--help"), rounds=ROUNDS, iterations=1)


@pytest.mark.parametrize("mode", [[], ["--quick"]], ids=["full", "quick"])
def test_main_job(benchmark, tmp_path, mode):
    out = tmp_path / "predicted"

    def fresh():  # each round writes a new folder, as a first run does
        shutil.rmtree(out, ignore_errors=True)
        return (), {}

    benchmark.pedantic(_command("certify", "--emulate", *mode, "--out", str(out)), setup=fresh, rounds=ROUNDS,
                       iterations=1)
