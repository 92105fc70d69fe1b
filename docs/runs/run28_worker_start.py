"""Run 28: how long a certify worker takes from its start to its first message (READY, sent once
its job arrived and its modules are imported), forked from the zygote (`pool.Process`) against a
fresh interpreter (`python -m sage_qual.qualification.run.worker --preload`, what `pool` started
before the zygote). Each way 5 times in a row, the job given at once; prints the seconds and their
median. Run from the repository root: `python docs/runs/run28_worker_start.py`."""

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sage_qual import records
from sage_qual.qualification.evidence import tasks
from sage_qual.qualification.run import plan, pool

JOB = (json.dumps(records.dump(tasks.Job([tasks.dump_task(plan.environment_check())], {}))) + "\n").encode()


def until_ready(stdin, stdout) -> None:
    stdin.write(JOB)
    stdin.flush()
    for line in stdout:
        if json.loads(line)["type"] == "ready":
            return
    raise RuntimeError("the worker ended before it was ready")


def forked(log: Path) -> float:
    start = time.perf_counter()
    process = pool.Process(pool.worker_env(), log, preload=True)
    process.start([plan.environment_check()])
    while (message := process.messages.get(timeout=600)) is not None and message["type"] != "ready":
        pass
    took = time.perf_counter() - start
    process.kill()
    return took


def fresh(log: Path) -> float:
    start = time.perf_counter()
    with open(log, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", pool.WORKER_MODULE, "--preload"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                env=pool.worker_env(), start_new_session=True)
    until_ready(proc.stdin, proc.stdout)
    took = time.perf_counter() - start
    proc.kill()
    proc.wait()
    return took


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        for name, start in (("fresh interpreter", fresh), ("forked from the zygote", forked)):
            seconds = [start(Path(folder) / f"{name[:5]}-{n}.log") for n in range(5)]
            listed = ", ".join(f"{s:.2f}" for s in seconds)
            print(f"{name}: {listed} s; median {statistics.median(seconds):.2f} s")


if __name__ == "__main__":
    main()
