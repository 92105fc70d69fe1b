"""Building the per-GPU profile (read by `sage_qual.serving.profile`) from an analysed report."""

from __future__ import annotations

import json
from pathlib import Path

from sage_qual.serving.profile import KIND, SCHEMA_VERSION

ENVIRONMENT_KEYS = ("torch", "torch_cuda", "driver", "sageattention", "triton")
ENTRY_KEYS = ("variant", "min_query_tokens", "min_key_tokens", "head_dims", "reasons")


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
