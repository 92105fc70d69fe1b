"""Run a GPU scenario in a child process, so a fault that poisons the CUDA context (or an
exhausted memory cap) can never reach the test process."""

import json
import os
import subprocess
import sys
import textwrap


def run_child(script: str, timeout: float = 240, env: dict | None = None) -> dict:
    """Run `script` with a fresh interpreter; it prints one JSON object as its last stdout line."""
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                            timeout=timeout, env={**os.environ, **(env or {})})
    if result.returncode != 0 or not result.stdout.strip():
        raise AssertionError(f"child exited {result.returncode}; stderr tail:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])
