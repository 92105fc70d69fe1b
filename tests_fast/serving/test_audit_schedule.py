"""Which served calls the audit takes (`serving.audit.Schedule`): a defect in any one layer of a model is
found within the stated bound whatever the number of attention calls per step and `every`, every
(layer, slice) pair is reached, and the rate stays one in `every`.

A model issues its calls in the same order every step, so layer l of a step of L calls is the served
call number c with c mod L = l. The bound (serving/audit.py): every layer is audited within
FOUND_WITHIN x every of its own calls, from any onset, except with probability exp(-20)."""

import dataclasses

import numpy as np
import pytest
import torch.nn.functional as F

import sage_qual
from sage_qual.serving import audit, slice_check
from sage_qual.serving.config import AuditConfig

from ..helpers import SMALL, qkv, retired, wrapped

EVERY = (1, 7, 10, 100, 1000)
CALLS_PER_STEP = range(1, 257)


def longest_unaudited_run(positions: np.ndarray, calls: int, horizon: int) -> int:
    """The most calls of one layer in a row (from any onset before `horizon`) none of which is audited,
    over every layer of a step of `calls` calls."""
    steps = horizon // calls
    audited = positions[positions < steps * calls]
    layers, rounds = audited % calls, audited // calls
    if len(set(layers.tolist())) < calls:
        return steps  # a layer never audited
    order = np.lexsort((rounds, layers))
    layers, rounds = layers[order], rounds[order]
    first = np.r_[True, layers[1:] != layers[:-1]]  # each layer's first audit
    last = np.r_[layers[1:] != layers[:-1], True]
    between = np.diff(rounds) - 1
    return int(max(rounds[first].max(), (steps - 1 - rounds[last]).max(), between[~first[1:]].max(initial=0)))


@pytest.mark.parametrize("every", EVERY)
def test_a_defect_in_any_one_layer_is_found_within_the_stated_bound(every):
    bound = audit.FOUND_WITHIN * every  # calls of the wrong layer
    horizon_steps = 2 * bound  # two bounds' worth of steps: onsets anywhere in the first
    positions = np.array(
        [p for p, _ in audit.draws(every, "0:0", horizon_steps * max(CALLS_PER_STEP) // every + 1)]
    )
    for calls in CALLS_PER_STEP:
        worst = longest_unaudited_run(positions, calls, horizon_steps * calls)
        assert worst < bound, f"{calls} calls per step, every {every}: {worst} calls of one layer unaudited"


def test_a_fixed_period_would_fail_the_bound():
    """The audit before this schedule took the 100th, 200th, ... call: 60 calls per step saw 3 layers."""
    every, calls = 100, 60
    fixed = np.arange(every - 1, 2 * audit.FOUND_WITHIN * every * calls, every)
    assert longest_unaudited_run(fixed, calls, len(fixed) * every) >= audit.FOUND_WITHIN * every


@pytest.mark.parametrize("every", [1, 3, 100])
def test_the_schedule_audits_exactly_one_call_in_each_block_of_every(every):
    schedule = audit.Schedule(every, "7:1")
    taken = [(n, number) for n in range(50 * every) if (number := schedule.due()) is not None]
    assert taken == audit.draws(every, "7:1", 50)
    assert [n // every for n, _ in taken] == list(range(50))


def test_the_schedule_is_seeded_per_device_and_config():
    first = audit.draws(100, "0:0", 20)
    assert first == audit.draws(100, "0:0", 20)
    assert first != audit.draws(100, "0:1", 20) and first != audit.draws(100, "1:0", 20)


@pytest.mark.parametrize("calls, shape, kv_heads", [(60, (2, 8, 1000), 4), (37, (1, 24, 4096), 24)])
def test_every_layer_sees_every_slice_in_time(calls, shape, kv_heads):
    """Per layer, audits walk every (sample, head group, row block) of its shape: within a coupon
    collector's time over layers x slices (4 x that, at every = 10)."""
    every, rows = 10, 256
    batch, heads, tokens = shape
    slices = batch * kv_heads * -(-tokens // rows)
    audits = 4 * int(calls * slices * (np.log(calls * slices) + 1))
    seen = {
        (p % calls, slice_check.audit_slice(n, shape, kv_heads, rows).text())
        for p, n in audit.draws(every, "0:0", audits)
    }
    assert len(seen) == calls * slices


@pytest.mark.parametrize("calls, wrong_layer", [(60, 17), (60, 18), (57, 17), (40, 17), (30, 7)])
def test_the_issue_table_rerun_on_the_fake_kernel_finds_the_wrong_layer_within_the_bound(calls, wrong_layer):
    """Issue 62's table (the default AuditConfig, one layer's output ten times its bound wrong): the
    fixed period missed 60/17, 40/17 and 30/7 for ever; each is now found, retired and counted within
    FOUND_WITHIN x every calls of the wrong layer, and the wrong layer's calls stop at the retirement."""
    every = sage_qual.WrapperConfig().audit.every
    counts = {"calls": 0, "wrong": 0}

    def wrong_in_one_layer(exact):
        number = counts["calls"]
        counts["calls"] += 1
        if number % calls == wrong_layer:
            counts["wrong"] += 1
            return exact.roll(1, dims=2) * 3
        return exact

    tensors = qkv(heads=1, q_tokens=32, k_tokens=16)
    with wrapped(config=dataclasses.replace(SMALL, audit=AuditConfig())) as (_, fake):
        fake.return_value(wrong_in_one_layer)
        with sage_qual.sage_attention_scope() as report:
            for _ in range(audit.FOUND_WITHIN * every + 1):  # steps: the bound in calls of one layer
                for _ in range(calls):
                    F.scaled_dot_product_attention(*tensors)
                if retired():
                    break
    assert report.audit.misses and retired().startswith("audit miss"), report.summary()
    assert 0 < counts["wrong"] <= audit.FOUND_WITHIN * every, counts
    assert report.served == counts["calls"]  # every call of the loop was the kernel's until the miss
