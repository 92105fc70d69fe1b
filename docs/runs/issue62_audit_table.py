"""Issue 62's table rerun on the fake kernel (CPU): the default AuditConfig, a model of L attention calls
per step whose kernel output is wrong in one layer only (rows shifted, x3). Prints one Markdown row per
case: calls served until the audit retired the GPU, audits, misses, wrong calls served. Counts only: the
same on any CPU. Run from the checkout: PYTHONPATH=. python docs/runs/issue62_audit_table.py (output: issue62_audit_table.txt)."""

import dataclasses
import logging

import torch.nn.functional as F

import sage_qual
from sage_qual.serving import audit
from sage_qual.serving.config import AuditConfig
from tests_fast.helpers import SMALL, qkv, retired, wrapped

logging.disable(logging.WARNING)
print("| calls per step (L) | wrong layer | calls served | audits | misses | wrong calls served |")
print("| --- | --- | --- | --- | --- | --- |")
for calls, wrong in [(60, 17), (60, 18), (57, 17), (40, 17), (30, 7)]:
    counts = {"calls": 0, "wrong": 0}

    def make(exact, calls=calls, wrong=wrong, counts=counts):
        number = counts["calls"]
        counts["calls"] += 1
        if number % calls == wrong:
            counts["wrong"] += 1
            return exact.roll(1, dims=2) * 3
        return exact

    tensors = qkv(heads=1, q_tokens=32, k_tokens=16)
    with wrapped(config=dataclasses.replace(SMALL, audit=AuditConfig())) as (_, fake):
        fake.return_value(make)
        with sage_qual.sage_attention_scope() as report:
            for _ in range(audit.FOUND_WITHIN * AuditConfig().every + 1):
                for _ in range(calls):
                    F.scaled_dot_product_attention(*tensors)
                if retired():
                    break
        sage_qual.uninstall()
    audit.reset_process()
    print(f"| {calls} | {wrong} | {report.served:,} | {report.audit.audited} | {len(report.audit.misses)} | "
          f"{counts['wrong']} |")
