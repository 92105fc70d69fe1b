"""Builders shared by the fast suite's test modules (test modules import this, never each other):
serving profiles and the machine they are matched against (test_profile and the modules reading
profiles), and the long-check records certify writes for the sample H200 report (test_long_checks,
test_profile_range_contract)."""

from pathlib import Path

import torch

from sage_qual.qualification import families, tasks
from sage_qual.qualification.report_model import ShapeUse
from sage_qual.serving import profile
from sage_qual.testing import FakeGpu

SAMPLE = Path(__file__).parent / "data" / "sample_h200_2gpu.json"
H200 = FakeGpu((9, 0), "Fake H200", 141.0)
H100 = FakeGpu((9, 0), "Fake H100", 80.0)
RTX4090 = FakeGpu((8, 9), "Fake RTX 4090", 24.0)


# Serving profiles ---------------------------------------------------------------------------------
def make_entry(variant="sm89-fp8-cuda", min_q=2048, min_k=512, head_dims=(128,), reasons=()):
    return {"variant": variant, "min_query_tokens": min_q if variant else None,
            "min_key_tokens": min_k if variant else None, "head_dims": list(head_dims) if variant else None,
            "reasons": list(reasons)}


def make_gpu(gpu=H200, entry=None, families=None, torch_version=None, sageattention="2.2.0",
             torch_cuda="13.0"):
    return {"name": gpu.name, "capability": list(gpu.capability), "memory_gib": gpu.memory_gib,
            "environment": {"torch": torch_version or torch.__version__, "torch_cuda": torch_cuda,
                            "driver": "580.159.04", "sageattention": sageattention, "triton": "3.6.0"},
            "default": entry or make_entry(), "families": families or {}}


def make_profile(*gpus, **one):
    return {"kind": "sage-qual-profile", "schema_version": 2, "created": "2026-11-29T20:00:00+00:00",
            "host": "test", "fixtures": {}, "gpus": list(gpus) or [make_gpu(**one)]}


def refusal(entry) -> str:
    """What `profile.load` says of a profile whose default entry is `entry` (it must refuse it)."""
    try:
        profile.load(make_profile(entry=entry))
    except profile.ProfileError as refused:
        return str(refused)
    raise AssertionError(f"the profile with entry {entry!r} was accepted")


def machine(gpu, torch_version=None, sageattention="2.2.0", torch_cuda="13.0"):
    return profile.Machine(gpu.name, gpu.capability, gpu.memory_gib, torch_version or torch.__version__,
                           torch_cuda, sageattention)


# Long-check records ------------------------------------------------------------------------------
GOOD = {"rel_l2": 0.05, "worst_head_cosine": 0.999}
BOUNDS = {"max_rel_l2": 0.06, "min_cosine": 0.99}


def record(variant, heads, tokens, families_, layouts, outcome="pass", metrics=GOOD, identical=None):
    shape = families.self_attention(heads, tokens).as_dict()
    uses = [{"family": f, "label": "test"} for f in families_] or [{"family": None, "label": "sweep"}]
    entry = {"variant": variant, "shape": shape, "uses": uses, "layouts": layouts, "outcome": outcome}
    if outcome in ("pass", "fail"):
        same = {name: True for name in layouts if name != "contiguous"} if identical is None else identical
        entry.update(bounds=BOUNDS, metrics=dict(metrics), finite=True, identical=same)
    else:
        entry["detail"] = "the worker ran this task when it died (killed by SIGSEGV)"
    return entry


def long_records(variant, fail_at=None, how="accuracy"):
    """Every check certify plans for the sample's families, for one variant; the one at `fail_at`
    tokens fails `how`: accuracy, crash, or a transposed view that differs (layout)."""
    everything = list(families.LAYOUTS)
    planned = [(24, 8192, [], everything), (24, 16384, [], everything), (24, 32768, [], everything),
               (24, 16896, ["FLUX.1", "Qwen-Image"], everything), (40, 75600, ["Wan 2.2"], everything)]
    records = []
    for heads, tokens, users, layouts in planned:
        if tokens != fail_at:
            records.append(record(variant, heads, tokens, users, layouts))
        elif how == "accuracy":
            records.append(record(variant, heads, tokens, users, layouts, "fail", {**GOOD, "rel_l2": 0.2}))
        elif how == "layout":
            records.append(record(variant, heads, tokens, users, layouts, "fail",
                                  identical={"transposed": False, "fused_qkv": True, "nhd": True}))
        else:
            records.append(record(variant, heads, tokens, users, layouts, how))
    return records


def long_task(shape: families.Shape, layouts, variant: str = "sm90-fp8-cuda") -> tasks.LongTask:
    """A long check's task at `shape` in `layouts`, standing for one test call."""
    planned = tasks.LongPlan(tasks.shape_spec(shape.as_dict()), [ShapeUse(None, "a test's call")],
                             list(layouts))
    return tasks.long_task(f"{variant}~{shape.key}", variant, planned)
