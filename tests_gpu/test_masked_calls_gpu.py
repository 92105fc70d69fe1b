"""Masked calls through the wrapper on the GPU (issue 42), for each variant that takes a mask: a
batch of two prompts of unequal length, its key-padding mask [2, 1, 1, N] bool (and the same as an
additive bias), served eagerly, on a busy side stream, under CUDA-graph capture and replay on new
values, and under torch.compile, each bit-identical to the eager masked call and within the variant's
bound of torch's masked SDPA; the extra memory within the suite's bound. In a child process: a
kernel fault under capture must not reach the test process."""

import pytest

from sage_qual import limits
from sage_qual.kernels.variants import VARIANTS

from .child import run_child

pytestmark = [pytest.mark.slow, pytest.mark.gpu]

MASKED_VARIANTS = [name for name, variant in VARIANTS.items() if variant.takes_mask]
BOUND = 0.12  # relative L2 against torch's masked SDPA, as test_contexts_gpu.py's fp8 class bound

# The child's start: only the variant under test, masked calls allowed, from the first token.
INSTALLED = """
import json
import torch
import torch.nn.functional as F
import sage_qual
from sage_qual.serving.config import WrapperConfig

cap = torch.cuda.get_device_capability(0)
config = WrapperConfig(min_query_tokens=1, min_key_tokens=1, kernel_table={{cap: ({name!r},)}}, masks=True)
status = sage_qual.install(config=config)
assert status.enabled, status.reason
g = torch.Generator("cuda").manual_seed(0)
"""

SCRIPT = INSTALLED + """shape = (2, 24, 4160, 128)
q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
kept = torch.tensor([4160, 4160 - 40], device="cuda")
keep = (torch.arange(4160, device="cuda")[None, :] < kept[:, None])[:, None, None, :]
bias = torch.zeros(keep.shape, device="cuda", dtype=torch.bfloat16).masked_fill(~keep, float("-inf"))
rows = {{}}

def rel_l2(out, ref):
    return float((out.float() - ref.float()).norm() / ref.float().norm())

for kind, mask in (("bool", keep), ("additive", bias)):
    # torch takes an additive mask only in the query's dtype: float32 for the float32 reference.
    torch_out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                               attn_mask=mask if kind == "bool" else mask.float())

    def call():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    with sage_qual.sage_attention_scope() as report:
        eager = call()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before - eager.numel() * eager.element_size()
    rows[kind + " eager"] = {{"served": report.served, "fallbacks": dict(report.fallbacks), "identical": True,
                             "rel_l2": rel_l2(eager, torch_out),
                             "extra_bytes_per_element": extra / (3 * q.numel())}}

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), sage_qual.sage_attention_scope() as report:
        torch.cuda._sleep(10_000_000)  # keep the side stream busy
        out = call()
    torch.cuda.current_stream().wait_stream(side)
    rows[kind + " side_stream"] = {{"served": report.served, "fallbacks": dict(report.fallbacks),
                                   "identical": torch.equal(out, eager)}}

    warm = torch.cuda.Stream()
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):
        call()
    torch.cuda.current_stream().wait_stream(warm)
    graph = torch.cuda.CUDAGraph()
    saved = [t.clone() for t in (q, k, v)]
    with sage_qual.sage_attention_scope() as report:
        with torch.cuda.graph(graph):
            captured = call()
    for t in (q, k, v):
        t.copy_(torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g))
    graph.replay()
    with sage_qual.sage_attention_scope():
        fresh = call()
    torch.cuda.synchronize()
    rows[kind + " capture"] = {{"served": report.served, "fallbacks": dict(report.fallbacks),
                               "identical": torch.equal(captured, fresh)}}
    for t, old in zip((q, k, v), saved):
        t.copy_(old)

    compiled = torch.compile(call)
    with sage_qual.sage_attention_scope() as report:
        out = compiled()
    rows[kind + " compile"] = {{"served": report.served, "fallbacks": dict(report.fallbacks),
                               "identical": torch.equal(out, eager)}}
print(json.dumps(rows))
"""


@pytest.mark.parametrize("name", MASKED_VARIANTS)
def test_a_masked_call_is_served_and_right_in_every_context(name, runnable, record):
    runnable(name)
    rows = run_child(SCRIPT.format(name=name), timeout=420)
    for label, row in rows.items():
        record(test="masked-call", variant=name, fixture=label, kind="random", served=row["served"],
               identical=row["identical"], fallbacks=",".join(row["fallbacks"]) or "-",
               rel_l2=row.get("rel_l2"), extra_bytes_per_element=row.get("extra_bytes_per_element"))
    for label, row in rows.items():
        assert row["served"] == 1 and not row["fallbacks"], (label, row)  # the kernel served it
        assert row["identical"], (label, row)
    for kind in ("bool", "additive"):
        eager = rows[f"{kind} eager"]
        assert eager["rel_l2"] <= BOUND, eager
        assert eager["extra_bytes_per_element"] <= limits.MEMORY_BOUND, eager


KEYLESS_SCRIPT = INSTALLED + """
from torch.nn.attention import SDPBackend, sdpa_kernel
from sage_qual.serving import wrapper
from sage_qual.serving.torch_sdpa import TORCH_SDPA

q, k, v = (torch.randn((2, 8, 1024, 128), device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
keep = torch.ones((2, 1, 1024, 1024), device="cuda", dtype=torch.bool)
keep[:, :, 7] = False  # query row 7 keeps no key
keep[1, :, :, 900:] = False  # item 1 is a shorter prompt
bias = torch.zeros(keep.shape, device="cuda", dtype=torch.bfloat16).masked_fill(~keep, float("-inf"))

def row(out):  # what an output holds on row 7
    r = out[:, :, 7].float()
    return "nan" if r.isnan().any() else "zero" if (r == 0).all() else "other"

rows = {{}}
for kind, mask in (("bool", keep), ("additive", bias)):
    found = {{}}
    for backend in (SDPBackend.MATH, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        try:
            with sdpa_kernel([backend]):
                found["torch " + backend.name] = row(TORCH_SDPA(q, k, v, attn_mask=mask))
        except RuntimeError as error:
            found["torch " + backend.name] = "refused: " + str(error).splitlines()[0][:80]
    found["kernel"] = row(wrapper._installed.kernels[0](q, k, v, sm_scale=128 ** -0.5, attn_mask=mask))
    float_mask = mask if kind == "bool" else mask.float()  # torch takes a bias in the query's dtype
    reference = TORCH_SDPA(q.float(), k.float(), v.float(), attn_mask=float_mask)
    with sage_qual.sage_attention_scope() as report:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.cuda.synchronize()
    finite = bool(out.isfinite().all())
    rows[kind] = {{**found, "served": report.served, "wrapper": row(out), "finite": finite,
                  "rel_l2": float((out.float() - reference).norm() / reference.norm())}}
print(json.dumps(rows))
"""


@pytest.mark.parametrize("name", MASKED_VARIANTS)
def test_a_query_row_without_keys_gets_what_torch_gives_it(name, runnable, record):
    """Issue 54: what torch's CUDA backends and the kernel give a query row its mask keeps no key for
    (recorded), and the wrapper serving the call with torch's answer on that row, finite."""
    runnable(name)
    rows = run_child(KEYLESS_SCRIPT.format(name=name), timeout=300)
    for kind, row in rows.items():
        record(test="keyless-row", variant=name, fixture=kind, kind="random", served=row["served"],
               rel_l2=row["rel_l2"], **{key.replace(" ", "_"): value for key, value in row.items()
                                        if key.startswith("torch") or key in ("kernel", "wrapper")})
    for kind, row in rows.items():
        assert row["served"] == 1, (kind, row)  # the kernel served it
        assert row["finite"] and row["wrapper"] == row["torch MATH"] == "zero", (kind, row)
        assert row["rel_l2"] <= BOUND, (kind, row)
