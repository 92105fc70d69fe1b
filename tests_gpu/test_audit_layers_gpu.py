"""The audit on a GPU, in each execution context: a model of 60 attention layers whose kernel is wrong in
one layer only, from step 10 on, is found, retired and recorded within the stated bound
(`audit.FOUND_WITHIN` x every calls of that layer); a kernel whose error is three times its own on every
call, still under the fitness bound, is found by conformance as a drift. Each test asserts the kernel
under test served the calls it judged."""

import os

import pytest
import torch
import torch.nn.functional as F

import sage_qual
from sage_qual.fixtures.recorder import AuditFolder
from sage_qual.serving import audit, wrapper
from sage_qual.serving.config import AuditConfig

from .shapes import make_qkv

pytestmark = [pytest.mark.slow, pytest.mark.gpu]

LAYERS, WRONG_LAYER, FIRST_WRONG_STEP = 60, 17, 10
SHAPE = (1, 24, 24, 4096, 4096, 128)  # [B, H, H_kv, N_q, N_k, D]: served at the default 1536/512 tokens
CONTEXTS = ("eager", "side_stream", "compile")


def attend(context):
    """The model's attention call as each context makes it."""
    if context == "compile":
        return torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v) * 1.0, fullgraph=True)
    return F.scaled_dot_product_attention


def run_steps(context, q, k, v, steps, stop):
    """`steps` steps of LAYERS calls in `context`, each step's output read (as a pipeline does), until
    `stop()`; returns the scope's report."""
    call = attend(context)
    stream = torch.cuda.Stream() if context == "side_stream" else torch.cuda.current_stream()
    with sage_qual.sage_attention_scope() as report:
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(steps):
                for _ in range(LAYERS):
                    call(q, k, v)
                stream.synchronize()
                if stop():
                    break
        torch.cuda.current_stream().wait_stream(stream)
    return report


def install(family, **audit_options):
    contexts = ("side_stream", "compile")
    config = sage_qual.WrapperConfig(audit=AuditConfig(**audit_options), contexts=contexts)
    status = sage_qual.install(config=config, family=family)
    assert status.enabled, status.reason
    return status


@pytest.mark.parametrize("context", CONTEXTS)
def test_one_wrong_layer_of_sixty_is_found_retired_and_recorded_within_the_bound(
    sage, box, tmp_path, record, context
):
    every = sage_qual.WrapperConfig().audit.every
    status = install(
        "Krea-2", every=every, record=AuditFolder(str(tmp_path / "misses")), seed=CONTEXTS.index(context)
    )
    served, counts = wrapper._installed.kernels[0], {"calls": 0, "wrong": 0}

    def one_layer_wrong(q, k, v, sm_scale, attn_mask):
        number = counts["calls"]
        counts["calls"] += 1
        out = served(q, k, v, sm_scale=sm_scale, attn_mask=attn_mask)
        if number % LAYERS == WRONG_LAYER and number // LAYERS >= FIRST_WRONG_STEP:
            counts["wrong"] += 1
            return out * 1.5
        return out

    wrapper._installed.kernels[0] = one_layer_wrong
    q, k, v = make_qkv(SHAPE, torch.bfloat16)
    bound = audit.FOUND_WITHIN * every  # calls of the wrong layer
    try:
        report = run_steps(
            context,
            q,
            k,
            v,
            FIRST_WRONG_STEP + bound + 1,
            lambda: bool(audit.retired_before(0, status.devices[0].name, "Krea-2")),
        )
    finally:
        sage_qual.uninstall()
    assert report.served > 0 and counts["calls"] == report.served  # the kernel under test served them
    assert report.audit.misses, report.summary()
    miss = report.audit.misses[0]
    assert miss.judge == "miss" and miss.fixture and os.path.exists(miss.fixture), miss
    assert 0 < counts["wrong"] <= bound, f"{counts['wrong']} wrong calls served, bound {bound}"
    record(
        test=f"audit-one-layer-of-60-{context}",
        variant=miss.variant,
        fixture=os.path.basename(miss.fixture),
        kind="recorded",
        rel_l2=miss.rel_l2,
        wrong_calls_served=counts["wrong"],
        bound_calls=bound,
        audit_every=every,
        calls_served=report.served,
        audited=report.audit.audited,
    )


@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("drift", ["retire", "warn"])
def test_a_kernel_three_times_its_own_error_is_a_drift(sage, box, record, context, drift):
    """From the second call on the kernel's error against torch is three times its own (torch + 3 x
    (kernel - torch)): still under the fitness bound 0.3, off its numerics model."""
    install("FLUX.1", every=10, drift=drift, seed=CONTEXTS.index(context))
    served, original, counts = wrapper._installed.kernels[0], wrapper._installed.original, {"calls": 0}

    def drifting(q, k, v, sm_scale, attn_mask):
        counts["calls"] += 1
        out = served(q, k, v, sm_scale=sm_scale, attn_mask=attn_mask)
        if counts["calls"] == 1:  # the first-call check judges the kernel as it is
            return out
        exact = original(q, k, v, scale=sm_scale)
        return exact + 3 * (out - exact)

    wrapper._installed.kernels[0] = drifting
    q, k, v = make_qkv(SHAPE, torch.bfloat16)
    try:
        report = run_steps(context, q, k, v, 1, lambda: False)
        kept_serving = not sage_qual.install_status().devices[0].retired
    finally:
        sage_qual.uninstall()
    assert report.served > 0 and counts["calls"] == report.served
    assert report.audit.drifts and not report.audit.misses, report.summary()
    found = report.audit.drifts[0]
    assert found.rel_l2 < 0.3 and found.model_rel_l2 is not None and found.rel_l2 > found.bound, found
    assert kept_serving is (drift == "warn")
    record(
        test=f"audit-drift-3x-{context}-{drift}",
        variant=found.variant,
        fixture="4k random bf16",
        kind="random",
        rel_l2=found.rel_l2,
        model_rel_l2=found.model_rel_l2,
        conformance_bound=found.bound,
        calls_served=report.served,
        drifts=len(report.audit.drifts),
    )
