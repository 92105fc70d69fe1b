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
import re
from typing import Mapping

import torch

from sage_qual import jsonfile
from sage_qual.serving import platform, sage_package
from sage_qual.serving.config import DEFAULT_CONFIG, WrapperConfig

KIND = "sage-qual-profile"
SCHEMA_VERSION = 1


class ProfileError(ValueError):
    """A profile that cannot be read or used; the message says why."""


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
    for name, chosen in profile["families"].items():
        if _normalize(name) == _normalize(family):
            return chosen
    raise ProfileError(f"the profile has no entry for family {family} (it has: "
                       f"{', '.join(profile['families']) or 'none'}): certify that family")


def _normalize(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


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
