"""Where a certify context check spends its time, on the GPU (issue 40: certify grew past 150 s).

For each variant named, in a fresh process as a certify worker would be: the seconds of each of the
four checks of `context_check.check_variant` (side stream, capture, compile, compile with
reduce-overhead) and of the whole call. One JSON line per variant. Run on a GPU box with
SageAttention installed: `python docs/runs/run30_context_profile.py sm90-fp8-cuda sm86-fp16-triton`.
"""

import json
import subprocess
import sys
import time

CHILD = """
import json, sys, time
started = time.perf_counter()
from sage_qual.qualification.measure import context_check
from sage_qual.kernels.variants import VARIANTS
imported = time.perf_counter() - started
seconds = {}
timed = context_check._run
def timing(name, counter, measure):
    begun = time.perf_counter()
    try:
        return timed(name, counter, measure)
    finally:
        seconds[name] = round(time.perf_counter() - begun, 2)
context_check._run = timing
begun = time.perf_counter()
runs = context_check.check_variant(VARIANTS[sys.argv[1]])
total = round(time.perf_counter() - begun, 2)
print(json.dumps({"variant": sys.argv[1], "import_s": round(imported, 2), "check_variant_s": total,
                  "runs_s": seconds, "bit_identical": {r.name: r.bit_identical for r in runs}}))
"""


def main() -> None:
    for variant in sys.argv[1:]:
        begun = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", CHILD, variant], capture_output=True, text=True)
        line = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else json.dumps(
            {"variant": variant, "error": done.stderr[-500:]})
        found = json.loads(line)
        found["process_s"] = round(time.perf_counter() - begun, 2)
        print(json.dumps(found), flush=True)


if __name__ == "__main__":
    main()
