"""The wrapper's sampled audit on a GPU: what it costs a small model, that it catches a kernel wrong
only on later calls (and certify then keeps that variant off), and that it runs right in each
execution context. Costs are a benchmark (CUDA events, medians of interleaved repeats, the spread of
the repeats' ratios, written to the results table): nothing here asserts a time."""

import json
import os
import statistics
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import sage_qual
from sage_qual.fixtures.recorder import AuditFolder
from sage_qual.kernels.contexts import CAPTURE
from sage_qual.serving import audit, wrapper
from sage_qual.serving.config import AuditConfig

from .shapes import make_qkv

pytestmark = [pytest.mark.slow, pytest.mark.gpu]

TOKENS, HEADS, HEAD_DIM = 16384, 24, 128  # the small model: 24 heads of 128, bf16, 16k tokens


class Block(torch.nn.Module):
    """Layer norm, q/k/v projections, attention through torch's SDPA, out projection."""

    def __init__(self):
        super().__init__()
        width = HEADS * HEAD_DIM
        self.norm = torch.nn.LayerNorm(width)
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.out = torch.nn.Linear(width, width)

    def forward(self, x):
        q, k, v = self.qkv(self.norm(x)).view(1, TOKENS, 3, HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v)
        return x + self.out(attended.transpose(1, 2).reshape(1, TOKENS, HEADS * HEAD_DIM))


def small_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[Block() for _ in range(4)]).to("cuda", torch.bfloat16).eval()


def install(every: int, **kwargs):
    config = sage_qual.WrapperConfig(audit=AuditConfig(every=every, **kwargs))  # 1536/512: 16k is served
    status = sage_qual.install(config=config, family="FLUX.1")
    assert status.enabled, status.reason
    return status


def forward_ms(model, x, forwards: int) -> float:
    """GPU ms per forward, `forwards` back to back in one scope, as a pipeline runs them."""
    with torch.no_grad(), sage_qual.sage_attention_scope() as report:
        model(x)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(forwards):
            model(x)
        end.record()
        end.synchronize()
    assert report.served == report.calls, report.summary()
    return start.elapsed_time(end) / forwards


def test_audit_cost_in_a_small_model(sage, box, record):
    """The model with the audit at the default rate, at one call in 1 (the cost of every audit) and
    off, interleaved; ratios to off per repeat, their median and spread."""
    model = small_model()
    x = torch.randn(1, TOKENS, HEADS * HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    rates = {"default": sage_qual.WrapperConfig().audit.every, "every_call": 1, "off": 0}
    times = {name: [] for name in rates}
    try:
        for _ in range(7):
            for name, every in rates.items():
                install(every)
                times[name].append(forward_ms(model, x, 50))  # 200 attention calls: 2 audits at 1 in 100
        install(rates["default"])
        with torch.no_grad(), sage_qual.sage_attention_scope() as report:
            for _ in range(50):
                model(x)
        assert report.audit.audited == 200 // rates["default"] and not report.audit.misses, report.summary()
        assert not report.audit.drifts, report.summary()  # the real kernel on its numerics model
        kernel_over_model = max(report.audit.worst_ratio.values())
    finally:
        sage_qual.uninstall()
    ratios = {name: [t / off for t, off in zip(times[name], times["off"], strict=True)]
              for name in ("default", "every_call")}
    numbers = {f"{name}_ms": statistics.median(t) for name, t in times.items()}
    for name, found in ratios.items():
        numbers.update({f"{name}_over_off": statistics.median(found), f"{name}_over_off_min": min(found),
                        f"{name}_over_off_max": max(found)})
    record(test="audit-cost", variant=sage_qual.install_status().version or "", fixture="4-layer 16k bf16",
           kind="random", audit_every=rates["default"], kernel_over_model=kernel_over_model, **numbers)


def test_audit_catches_a_kernel_wrong_on_later_calls(sage, box, tmp_path, record):
    """The served kernel turns wrong after 60 good calls (finite, plausible, rows shifted: as a CUDA
    graph replayed with stale inputs); the audit at 1 in 10 catches it within 10 calls, retires the
    GPU for the family once its numbers are read (the next served call), and records the call; certify with
    that folder keeps the variant off Krea-2 on this GPU model and gate exits 1 naming the recorded
    fixture."""
    folder = tmp_path / "misses"
    status = sage_qual.install(config=sage_qual.WrapperConfig(audit=AuditConfig(every=10, record=AuditFolder(
        str(folder)))), family="Krea-2")
    assert status.enabled, status.reason
    variant = status.devices[0].variant.name
    served, good_calls = wrapper._installed.kernels[0], 60
    calls = [0]

    def later_wrong(q, k, v, sm_scale, attn_mask):
        calls[0] += 1
        out = served(q, k, v, sm_scale=sm_scale, attn_mask=attn_mask)
        return out if calls[0] <= good_calls else out.roll(1, dims=2)

    wrapper._installed.kernels[0] = later_wrong
    q, k, v = make_qkv((1, 48, 12, 4608, 4608, 128), torch.bfloat16)
    try:
        with sage_qual.sage_attention_scope() as report:
            for _ in range(100):  # each output read, as a pipeline that checks its results: no run-ahead
                F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
                torch.cuda.synchronize()
    finally:
        sage_qual.uninstall()
    assert calls[0] > good_calls, "the defect never came into play"
    miss = report.audit.misses[0]  # the next audit, read at the scope's exit, may miss too
    # Audited within 10 calls, judged at the next served call once its numbers arrived.
    # The next block of 10 holds an audit (at worst its last call), judged at the call after it.
    assert calls[0] <= good_calls + 2 * 10 + 1, f"{calls[0] - good_calls} wrong calls served before it acted"
    assert miss.fixture and os.path.exists(miss.fixture), miss
    assert audit.retired_before(0, status.devices[0].name, "Krea-2")
    out = tmp_path / "certify"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # a full certify: gate decides nothing from a --quick one
    certify = subprocess.run([sys.executable, "-m", "sage_qual", "certify", "--fixtures", str(folder),
                              "--families", "Krea-2", "--variants", variant, "--out", str(out)],
                             capture_output=True, text=True, env=env, timeout=400)
    assert certify.returncode == 0, certify.stderr[-2000:]
    gate = subprocess.run([sys.executable, "-m", "sage_qual", "gate", "--family", "Krea-2", "--report",
                           str(out / "report.json"), "--json"], capture_output=True, text=True, env=env,
                          timeout=300)
    answer = json.loads(gate.stdout)
    named = [r["detail"] for gpu in answer["gpus"] for r in gpu["reasons"] if r["kind"] == "audit"]
    assert gate.returncode == 1, gate.stdout[-2000:]
    assert any(os.path.basename(miss.fixture).removesuffix(".safetensors") in line for line in named), named
    record(test="audit-catches-later-defect", variant=variant, fixture=os.path.basename(miss.fixture),
           kind="recorded", rel_l2=miss.rel_l2, wrong_calls_served=calls[0] - good_calls,
           gate_exit=gate.returncode)


def test_audit_in_each_execution_context(sage, box):
    """On a side stream and under torch.compile the audit judges the real kernel's output within its
    bound; under CUDA-graph capture (Triton's kernel, which can be captured) it is skipped and counted."""
    q, k, v = make_qkv((1, 24, 24, 4608, 4608, 128), torch.bfloat16)
    contexts = ("side_stream", "capture", "compile")
    status = sage_qual.install(config=sage_qual.WrapperConfig(audit=AuditConfig(every=1), contexts=contexts))
    assert status.enabled, status.reason
    try:
        with sage_qual.sage_attention_scope() as report:
            F.scaled_dot_product_attention(q, k, v)  # the default stream's first call, checked
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                F.scaled_dot_product_attention(q, k, v)
            torch.cuda.current_stream().wait_stream(side)
            compiled = torch.compile(lambda a, b, c: F.scaled_dot_product_attention(a, b, c) * 1.0,
                                     fullgraph=True)
            compiled(q, k, v)
        assert report.audit.audited >= 3, report.summary()
        assert not report.audit.misses and not report.audit.drifts, report.summary()
        # Capture needs a kernel that launches on torch's current stream: Triton's, where this GPU runs it.
        triton = {(9, 0): ("sm86-fp16-triton",)}
        config = sage_qual.WrapperConfig(audit=AuditConfig(every=1), contexts=contexts, kernel_table=triton)
        status = sage_qual.install(config=config)
        assert status.enabled and status.devices[0].variant.name == "sm86-fp16-triton", status.reason
        with sage_qual.sage_attention_scope() as captured:
            F.scaled_dot_product_attention(q, k, v)  # checked and audited eagerly first
            graph = torch.cuda.CUDAGraph()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.graph(graph, stream=side):
                F.scaled_dot_product_attention(q, k, v)
        assert captured.served == 2 and captured.audit.skipped[CAPTURE] == 1, captured.summary()
        assert captured.audit.audited == 1 and not captured.audit.misses and not captured.audit.drifts, \
            captured.summary()
    finally:
        sage_qual.uninstall()
