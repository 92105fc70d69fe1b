"""Device run 20, call 3: does each kernel function give a query row block the same output wherever
the block sits (long_check's every-row comparison), and do the long checks of code 23f0426+fix pass?

Run on the GPU box after SageAttention is built: `python3 docs/runs/run20_row_order_probe.py`.
Prints one JSON line per check: variant, call, outcome, rows_identical, reasons, seconds.
"""

import json
import time

from sage_qual.qualification import families
from sage_qual.qualification.evidence import tasks
from sage_qual.qualification.evidence.report_model import ShapeUse
from sage_qual.qualification.run import worker

CALLS = [(name, families.self_attention(24, 32768))
         for name in ("sm90-fp8-cuda", "sm89-fp8-cuda", "sm80-fp16-cuda", "sm86-fp16-triton")]
CALLS.append(("sm90-fp8-cuda", families.self_attention(40, 75600)))
bench = worker.Worker(worker.GpuBench(), {})
for variant, shape in CALLS:
    task = tasks.LongTask(f"{variant}~{shape.key}", variant, tasks.shape_spec(shape.as_dict()),
                          [ShapeUse(None, "probe")], ["contiguous", "transposed", "fused_qkv", "nhd"])
    start = time.monotonic()
    result = bench.run(task)
    print(json.dumps({"variant": variant, "tokens": shape.q_tokens, "heads": shape.heads,
                      "outcome": result.outcome.value, "rows_identical": result.rows_identical,
                      "identical": result.identical, "reasons": [r.detail for r in result.reasons],
                      "detail": result.detail, "seconds": round(time.monotonic() - start, 1)}), flush=True)
