"""Activation fixtures: attention inputs saved as safetensors files, with what they are and their bounds.

A fixture holds tensors `q`, `k`, `v` in HND layout [B, H, N, D] (K/V may have fewer heads than Q:
grouped-query attention, H_q % H_kv == 0), all three float16 or all three bfloat16, and string
metadata in the safetensors header:

    sage_qual.format  "1"
    family            model family, e.g. "qwen-image", "flux.1", "cross-attention"
    kind              "recorded" (captured from a real model) or "replica" (generated to reproduce
                      published statistics); required, so a replica can never pass for a recording
    source            JSON object: model, block, call, heads, rows, resolution, ...
    dtype             "float16" or "bfloat16", the tensors' dtype
    layout            "HND"
    provenance        free text: where the data came from; for a replica, which published numbers
                      it reproduces and from where
    bounds            JSON: {"fp16": {"max_rel_l2": x, "min_cosine": y}, "fp8": {...}}, the accuracy
                      a kernel variant of that class must reach against float32 (see accuracy_class)
    published         JSON object, optional: the published numbers a replica should reproduce
    calibration       JSON object or plain text, optional: measured or emulated numbers, or why none

Files are written with a deterministic header (sorted keys), so the same tensors and metadata give
the same bytes and the same sha256.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from .variants import Variant

FORMAT = "1"
KINDS = ("recorded", "replica")
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
_SAFETENSORS_DTYPES = {torch.float16: "F16", torch.bfloat16: "BF16"}
VARIANT_CLASSES = ("fp16", "fp8")
BOUND_KEYS = ("max_rel_l2", "min_cosine")
SUFFIX = ".safetensors"
# A channel is an outlier when its max |x| exceeds this many times the median channel's max |x|.
OUTLIER_FACTOR = 8.0
_TOP_CHANNELS = 4


class FixtureError(ValueError):
    """A fixture file or a fixture about to be saved is not valid; the message says how to fix it."""

    def __init__(self, path, field_name: str, problem: str, fix: str):
        self.path, self.field, self.problem, self.fix = str(path), field_name, problem, fix
        super().__init__(f"{path}: {field_name}: {problem}; {fix}")


def accuracy_class(variant: Variant) -> str:
    """Which bounds apply to a variant: "fp16" for FP16 P·V kernels, "fp8" for the others."""
    return "fp16" if "pv_fp16" in variant.function else "fp8"


@dataclass(frozen=True)
class Fixture:
    name: str
    path: Path
    q: torch.Tensor = field(repr=False)
    k: torch.Tensor = field(repr=False)
    v: torch.Tensor = field(repr=False)
    family: str
    kind: str
    source: dict
    dtype: torch.dtype
    provenance: str = field(repr=False)
    bounds: dict
    published: dict | None
    calibration: Any  # dict, text, or None
    sha256: str

    def bound(self, variant: Variant) -> dict:
        """{"max_rel_l2": ..., "min_cosine": ...} for this variant's accuracy class."""
        return self.bounds[accuracy_class(variant)]


def shipped_dir() -> Path | None:
    """The repository's fixtures/ directory next to the package, if this is a checkout that has one."""
    directory = Path(__file__).resolve().parent.parent / "fixtures"
    return directory if directory.is_dir() else None


def list_fixtures(directory) -> list[Path]:
    directory = Path(directory)
    if not directory.is_dir():
        raise FixtureError(directory, "directory", "not found", "give a directory of *.safetensors fixtures")
    return sorted(directory.glob("*" + SUFFIX))


# Validation, shared by load and save --------------------------------------------------------------
def _check_tensors(path, tensors: Mapping[str, torch.Tensor]) -> torch.dtype:
    for name in ("q", "k", "v"):
        if name not in tensors:
            raise FixtureError(path, f"tensor {name}", "missing",
                               "a fixture holds tensors named q, k and v in HND layout [B, H, N, D]")
        if tensors[name].dim() != 4:
            raise FixtureError(path, f"tensor {name}", f"rank {tensors[name].dim()} "
                               f"(shape {list(tensors[name].shape)})", "store [B, H, N, D] (HND layout)")
    q, k, v = tensors["q"], tensors["k"], tensors["v"]
    dtypes = {t.dtype for t in (q, k, v)}
    if len(dtypes) > 1 or q.dtype not in _SAFETENSORS_DTYPES:
        have = ", ".join(f"{n}={str(t.dtype).replace('torch.', '')}"
                         for n, t in zip("qkv", (q, k, v), strict=True))
        raise FixtureError(path, "dtype", f"unsupported or mixed ({have})",
                           "store q, k and v all as float16 or all as bfloat16")
    if k.shape != v.shape:
        raise FixtureError(path, "tensor v", f"shape {list(v.shape)} differs from k {list(k.shape)}",
                           "k and v must have the same shape [B, H_kv, N_kv, D]")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise FixtureError(path, "tensor k", f"shape {list(k.shape)} does not fit q {list(q.shape)}",
                           "q and k need the same batch size B and head dim D")
    if min(q.shape) == 0 or min(k.shape) == 0:
        raise FixtureError(path, "tensor q/k", "has an empty dimension", "store at least one row per dim")
    if q.shape[1] % k.shape[1]:
        raise FixtureError(path, "heads", f"{q.shape[1]} query heads are not a multiple of "
                           f"{k.shape[1]} K/V heads", "grouped-query attention needs H_q % H_kv == 0")
    return q.dtype


def _json_field(path, metadata: Mapping[str, str], name: str, required: bool):
    if name not in metadata:
        if required:
            raise FixtureError(path, name, "missing", f"add the {name} metadata as a JSON object")
        return None
    try:
        value = json.loads(metadata[name])
    except json.JSONDecodeError as error:
        raise FixtureError(path, name, f"not valid JSON ({error.msg} at char {error.pos})",
                           f"store {name} as a JSON object") from None
    if not isinstance(value, dict):
        raise FixtureError(path, name, f"is a JSON {type(value).__name__}", f"store {name} as a JSON object")
    return value


def _check_bounds(path, bounds: dict) -> None:
    for cls in VARIANT_CLASSES:
        entry = bounds.get(cls)
        if not isinstance(entry, dict) or any(
                not isinstance(entry.get(key), (int, float)) or isinstance(entry.get(key), bool)
                or not math.isfinite(entry[key]) for key in BOUND_KEYS):
            raise FixtureError(path, "bounds", f"no numeric max_rel_l2 and min_cosine for class {cls!r}",
                               'give {"fp16": {"max_rel_l2": x, "min_cosine": y}, "fp8": {...}}')


def _check_metadata(path, metadata: Mapping[str, str], dtype: torch.dtype) -> dict:
    """The parsed metadata, or FixtureError naming the field."""
    if metadata.get("sage_qual.format") != FORMAT:
        raise FixtureError(path, "sage_qual.format", f"is {metadata.get('sage_qual.format')!r}",
                           f"this loader reads format {FORMAT!r}; write the file with save_fixture()")
    for name in ("family", "provenance"):
        if not metadata.get(name, "").strip():
            raise FixtureError(path, name, "missing or empty", f"say the {name} of the data")
    kind = metadata.get("kind")
    if kind not in KINDS:
        raise FixtureError(path, "kind", "missing" if kind is None else f"unknown kind {kind!r}",
                           "set kind to 'recorded' (captured from a model) or 'replica' (generated)")
    dtype_name = str(dtype).replace("torch.", "")
    if metadata.get("dtype") != dtype_name:
        raise FixtureError(path, "dtype", f"metadata says {metadata.get('dtype')!r}, tensors are "
                           f"{dtype_name}", "make the dtype metadata match the tensors")
    if metadata.get("layout") != "HND":
        raise FixtureError(path, "layout", f"is {metadata.get('layout')!r}",
                           "store tensors as HND [B, H, N, D]")
    bounds = _json_field(path, metadata, "bounds", required=True)
    _check_bounds(path, bounds)
    calibration = metadata.get("calibration")
    if calibration is not None and calibration.lstrip().startswith("{"):
        calibration = _json_field(path, metadata, "calibration", required=False)
    return {
        "family": metadata["family"],
        "kind": kind,
        "source": _json_field(path, metadata, "source", required=True),
        "provenance": metadata["provenance"],
        "bounds": bounds,
        "published": _json_field(path, metadata, "published", required=False),
        "calibration": calibration,
    }


# Reading ------------------------------------------------------------------------------------------
def _header(path, data: bytes) -> dict:
    not_safetensors = "re-create it with save_fixture() (or fetch it again if it was copied)"
    if len(data) < 8:
        raise FixtureError(path, "file", f"only {len(data)} bytes: not a safetensors file", not_safetensors)
    (length,) = struct.unpack("<Q", data[:8])
    if length > len(data) - 8:
        raise FixtureError(path, "file", f"header claims {length} bytes but the file has {len(data)}: "
                           "truncated or not a safetensors file", not_safetensors)
    try:
        header = json.loads(data[8:8 + length])
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise FixtureError(path, "file", "header is not JSON: not a safetensors file",
                           not_safetensors) from None
    if not isinstance(header, dict):
        raise FixtureError(path, "file", "header is not a JSON object", not_safetensors)
    try:
        end = max((int(entry["data_offsets"][1]) for name, entry in header.items() if name != "__metadata__"),
                  default=0)
    except (TypeError, KeyError, IndexError, ValueError):
        raise FixtureError(path, "file", "header has a tensor entry without data_offsets",
                           not_safetensors) from None
    if 8 + length + end > len(data):
        raise FixtureError(path, "file", f"truncated: tensor data ends at byte {8 + length + end}, "
                           f"the file has {len(data)}", not_safetensors)
    return header


def load_fixture(path, device="cpu") -> Fixture:
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as error:
        raise FixtureError(path, "file", f"cannot be read ({error.strerror or error})",
                           "give the path of a fixture file") from None
    header = _header(path, data)
    try:
        tensors = load_safetensors(data)
    except SafetensorError as error:
        raise FixtureError(path, "file", f"safetensors cannot read it ({error})",
                           "re-create it with save_fixture()") from None
    dtype = _check_tensors(path, tensors)
    meta = _check_metadata(path, header.get("__metadata__") or {}, dtype)
    return Fixture(
        name=path.name.removesuffix(SUFFIX),
        path=path,
        q=tensors["q"].to(device), k=tensors["k"].to(device), v=tensors["v"].to(device),
        dtype=dtype,
        sha256=hashlib.sha256(data).hexdigest(),
        **meta,
    )


# Writing ------------------------------------------------------------------------------------------
def _encode(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """safetensors bytes with sorted keys; the library's writer orders metadata differently each run."""
    header: dict[str, Any] = {"__metadata__": metadata}
    blobs, offset = [], 0
    for name in sorted(tensors):
        # Raw bytes in the host's order; safetensors is little-endian, as is every host torch targets.
        blob = tensors[name].detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[tensors[name].dtype],
                        "shape": list(tensors[name].shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # tensor data starts 8-byte aligned
    return struct.pack("<Q", len(text)) + text + b"".join(blobs)


def _dump(value) -> str:
    return json.dumps(value, sort_keys=True)


def save_fixture(path, q, k, v, *, family: str, kind: str, source: dict, provenance: str, bounds: dict,
                 published: dict | None = None, calibration=None) -> Path:
    """Validate and write a fixture; `calibration` may be a dict or a text. Returns the path."""
    path = Path(path)
    tensors = {"q": q, "k": k, "v": v}
    dtype = _check_tensors(path, tensors)
    metadata = {
        "sage_qual.format": FORMAT,
        "family": family,
        "kind": kind,
        "source": _dump(source),
        "dtype": str(dtype).replace("torch.", ""),
        "layout": "HND",
        "provenance": provenance,
        "bounds": _dump(bounds),
    }
    if published is not None:
        metadata["published"] = _dump(published)
    if calibration is not None:
        metadata["calibration"] = calibration if isinstance(calibration, str) else _dump(calibration)
    _check_metadata(path, metadata, dtype)
    path.write_bytes(_encode(tensors, metadata))
    return path


# Statistics ---------------------------------------------------------------------------------------
def channel_stats(x: torch.Tensor) -> dict:
    """Per-channel max |x| over batch, heads and tokens; outliers by the OUTLIER_FACTOR rule."""
    channel_max = x.detach().abs().amax(dim=(0, 1, 2)).float().cpu()
    median = float(channel_max.median())
    order = torch.argsort(channel_max, descending=True).tolist()
    limit = OUTLIER_FACTOR * median
    return {
        "max_abs": float(channel_max.max()),
        "median_channel_max": median,
        "top_channels": [[c, float(channel_max[c])] for c in order[:_TOP_CHANNELS]],
        "outlier_channels": [[c, float(channel_max[c])] for c in order if float(channel_max[c]) > limit],
    }


def describe(fixture: Fixture) -> dict:
    """Shapes, dtype, channel statistics and the metadata of a fixture, as plain JSON-ready data.

    Outlier channels: those whose max |x| exceeds OUTLIER_FACTOR (8) times the median over channels
    of the per-channel max |x| (all taken over batch, heads and tokens).
    """
    v_channel_mean = fixture.v.float().mean(dim=(0, 1, 2))
    worst = int(v_channel_mean.abs().argmax())
    return {
        "name": fixture.name,
        "path": str(fixture.path),
        "family": fixture.family,
        "kind": fixture.kind,
        "dtype": str(fixture.dtype).replace("torch.", ""),
        "layout": "HND",
        "shapes": {n: list(t.shape) for n, t in (("q", fixture.q), ("k", fixture.k), ("v", fixture.v))},
        "gqa_group": fixture.q.shape[1] // fixture.k.shape[1],
        "size_bytes": fixture.path.stat().st_size,
        "sha256": fixture.sha256,
        "outlier_rule": f"channel max |x| > {OUTLIER_FACTOR:g} x median channel max |x|",
        "channels": {n: channel_stats(t) for n, t in (("q", fixture.q), ("k", fixture.k), ("v", fixture.v))},
        "v_mean": {"overall": float(fixture.v.float().mean()),
                   "max_abs_channel_mean": float(v_channel_mean[worst].abs()), "channel": worst},
        "source": fixture.source,
        "provenance": fixture.provenance,
        "bounds": fixture.bounds,
        "published": fixture.published,
        "calibration": fixture.calibration,
    }
