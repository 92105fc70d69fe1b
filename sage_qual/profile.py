"""The per-GPU profile certify writes, and the wrapper configuration it turns into.

A profile belongs to one GPU model (name and compute capability) with one torch and one
sageattention. Per family, and by default for all of them, it names the fastest variant that
passed every fixture on that GPU, or none, with the head sizes and the query and key lengths
at which that variant measured faster than the fastest SDPA backend. `config_from_profile()` turns an entry
into a `WrapperConfig`, so a certified GPU never serves a call of a size that measured slower, nor
a variant that failed; `install(profile=...)` refuses a profile made on other hardware or
software, since nothing in it was measured there.

    {"kind": "sage-qual-profile", "schema_version": 1, "created": ..., "host": ...,
     "gpu": {"name": "NVIDIA H200", "capability": [9, 0]},
     "environment": {"torch": ..., "torch_cuda": ..., "driver": ..., "sageattention": ..., "triton": ...},
     "fixtures": {name: sha256},
     "default": ENTRY, "families": {"FLUX.1": ENTRY, ...}}
    ENTRY = {"variant": name or null, "min_query_tokens": int or null, "min_key_tokens": int or null,
             "head_dims": [int] or null, "reasons": [{"kind", "detail"}]}
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Mapping

from . import jsonfile, platform, sage_package
from .config import DEFAULT_CONFIG, WrapperConfig

KIND = "sage-qual-profile"
SCHEMA_VERSION = 1
ENVIRONMENT_KEYS = ("torch", "torch_cuda", "driver", "sageattention", "triton")
ENTRY_KEYS = ("variant", "min_query_tokens", "min_key_tokens", "head_dims", "reasons")


class ProfileError(ValueError):
    """A profile that cannot be read or used; the message says why."""


def break_even(points: list[tuple[int, int, int, float]], min_speedup: float = 1.0) -> dict | None:
    """Where a variant pays, from measured (query tokens, key tokens, head_dim, speedup) points.

    The wrapper serves a call when its head_dim is in `head_dims` and it has at least
    `min_query_tokens` and `min_key_tokens`. Chosen among head_dim sets and thresholds at measured
    lengths: the one that serves the most measured shapes such that every shape it serves was
    faster than `min_speedup`. Ties go to fewer head sizes, then larger thresholds: nothing is
    served where nothing was measured. None when no measured shape was faster. A shape the variant
    failed at counts with speedup 0.
    """
    dims = sorted({d for _, _, d, _ in points})
    subsets = [[d for i, d in enumerate(dims) if mask >> i & 1] for mask in range(1, 2 ** len(dims))]
    best, best_key = None, None
    for head_dims in subsets:
        for min_q in sorted({q for q, _, _, _ in points}):
            for min_k in sorted({k for _, k, _, _ in points}):
                served = [s for q, k, d, s in points if q >= min_q and k >= min_k and d in head_dims]
                if served and all(s > min_speedup for s in served):
                    key = (len(served), -len(head_dims), min_q, min_k)
                    if best_key is None or key > best_key:
                        best_key = key
                        best = {"min_query_tokens": min_q, "min_key_tokens": min_k, "head_dims": head_dims,
                                "served_shapes": len(served), "measured_shapes": len(points)}
    return best


def serves(thresholds: dict, q_tokens: int, kv_tokens: int, head_dim: int) -> bool:
    return (q_tokens >= thresholds["min_query_tokens"] and kv_tokens >= thresholds["min_key_tokens"]
            and head_dim in thresholds["head_dims"])


def build(report: dict, gpu: dict) -> dict:
    """The profile of one analysed GPU model of a complete report (see families.analyze)."""
    env = report["environment"]
    return {
        "kind": KIND,
        "schema_version": SCHEMA_VERSION,
        "created": report["finished"],
        "host": report["host"],
        "gpu": {"name": gpu["name"], "capability": gpu["capability"]},
        "environment": {key: env[key] for key in ENVIRONMENT_KEYS},
        "fixtures": {f["name"]: f["sha256"] for f in report["fixtures"]},
        "default": _entry(gpu["default"]),
        "families": {f["family"]: _entry(f) for f in gpu["families"]},
    }


def _entry(verdict: dict) -> dict:
    return {key: verdict[key] for key in ENTRY_KEYS}


def save(profile: dict, path: Path) -> None:
    Path(path).write_text(json.dumps(profile, indent=1) + "\n")


def load(source) -> dict:
    """A profile from a path or an already parsed dict; ProfileError when it is not one."""
    if isinstance(source, Mapping):
        data, where = dict(source), "profile"
    else:
        where = str(source)
        data = jsonfile.read(source, ProfileError, unreadable="cannot read profile {path}: {reason}",
                             not_json="profile {path} is not JSON: {reason}")
    return jsonfile.check(data, where, KIND, SCHEMA_VERSION, ProfileError,
                          wrong_kind="{where} is not a sage-qual profile (written by `sage-qual certify`)",
                          wrong_version="{where} has profile schema version {found!r}; this sage-qual reads "
                                        "version {expected}: certify again")


def entry(profile: dict, family: str | None = None) -> dict:
    if family is None:
        return profile["default"]
    from .families import find

    name = find(family).name  # KeyError for an unknown family
    if name not in profile["families"]:
        raise ProfileError(f"the profile has no entry for family {name} (certify did not run it)")
    return profile["families"][name]


def config_from_profile(profile, family: str | None = None,
                        base: WrapperConfig = DEFAULT_CONFIG) -> WrapperConfig:
    """`base` with the profile's GPU served by its certified variant (or none), its thresholds and
    head sizes."""
    profile = load(profile)
    chosen = entry(profile, family)
    capability = tuple(profile["gpu"]["capability"])
    table = dict(base.kernel_table)
    table[capability] = (chosen["variant"],) if chosen["variant"] else ()
    if not chosen["variant"]:
        return dataclasses.replace(base, kernel_table=table)
    return dataclasses.replace(base, kernel_table=table, min_query_tokens=chosen["min_query_tokens"],
                               min_key_tokens=chosen["min_key_tokens"], head_dims=tuple(chosen["head_dims"]))


def config_for_machine(profile, family: str | None = None,
                       base: WrapperConfig = DEFAULT_CONFIG) -> WrapperConfig:
    """config_from_profile() after checking that this process has what the profile was measured on.

    Raises SageUnavailable (what install() reports) when the profile is unreadable, was made on a
    GPU model not visible here or with another torch or sageattention, or certifies no variant
    for the GPUs here.
    """
    import torch

    try:
        profile = load(profile)
        chosen = entry(profile, family)
    except (ProfileError, KeyError) as error:
        raise sage_package.SageUnavailable(error.args[0]) from None
    unavailable = sage_package.SageUnavailable
    cuda = platform.current()
    gpu = profile["gpu"]
    certified = (gpu["name"], tuple(gpu["capability"]))
    here = [(cuda.device_name(i), cuda.capability(i)) for i in range(cuda.device_count())]
    label = "%s (sm_%d%d)" % (gpu["name"], *gpu["capability"])
    if certified not in here:
        have = ", ".join("%s (sm_%d%d)" % (name, *cap) for name, cap in here) or "no CUDA GPU"
        raise unavailable(f"the profile was certified on {label}; this machine has {have}: "
                          "run `sage-qual certify` here")
    env = profile["environment"]
    if env["torch"] != torch.__version__:
        raise unavailable(f"the profile was certified with torch {env['torch']}; this process runs torch "
                          f"{torch.__version__}: certify again")
    version = sage_package.load().version
    if env["sageattention"] != version:
        raise unavailable(f"the profile was certified with sageattention {env['sageattention']}; this "
                          f"process has {version}: certify again")
    if not chosen["variant"] and all(h == certified for h in here):
        why = "; ".join(r["detail"] for r in chosen["reasons"]) or "no reason recorded"
        scope = f" for family {family}" if family else ""
        raise unavailable(f"the profile certifies no SageAttention variant on {label}{scope}: {why}")
    return config_from_profile(profile, family, base)
