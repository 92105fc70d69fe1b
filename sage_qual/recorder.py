"""Record real attention inputs as fixtures: wrap torch's SDPA for a block and save chosen calls.

    with record_sdpa("fixtures/", family="flux.1", model="FLUX.1 dev fp8, 1024x1024, step 0",
                     select=pipe.transformer.transformer_blocks[0], heads=[5], query_rows=slice(0, 1536)):
        pipe(prompt, num_inference_steps=1)

`select` chooses the calls: a call index or a collection of them (0-based, counting every SDPA call
made while recording), a predicate `select(q, k, v) -> bool` (e.g. on shapes), or an nn.Module (the
calls made during its forward). Each chosen call is sliced to stay small and written at once as a
`kind=recorded` fixture; `Recording.paths` lists them, `Recording.skipped` says why others were not.

Slicing: `heads` are query heads; their K/V heads come along, so grouped-query pairs stay right
(the kept query heads must take equally many heads from each kept K/V head). Query rows can be cut
freely. Cutting key rows changes the softmax, so it changes the problem: keep all keys unless the
file would be too large. The full call's shapes and channel statistics (max |x|, top and outlier
channels, as `fixture_files.describe` gives them) are stored in `source`, so one can tell whether
the slice kept the outliers.

Limits: torch's function is swapped on the module `torch.nn.functional`; code that imported the
function by name before recording started is not seen. Not thread-safe: record from one thread.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .fixture_files import DTYPES, channel_stats, save_fixture

# Until a GPU calibrates them: a few times the error of each class on random data on the H200
# (FP16 P·V 0.011-0.013, FP8 P·V 0.038 relative L2).
DEFAULT_BOUNDS = {"fp16": {"max_rel_l2": 0.05, "min_cosine": 0.998},
                  "fp8": {"max_rel_l2": 0.12, "min_cosine": 0.99}}

Rows = slice | Sequence[int] | None
Select = int | Collection[int] | Callable[..., bool] | torch.nn.Module


@dataclass
class Recording:
    paths: list[Path] = field(default_factory=list)
    skipped: list[tuple[int, str]] = field(default_factory=list)  # (call index, reason)
    calls: int = 0  # SDPA calls seen while recording


def _rows(rows: Rows, n: int) -> list[int]:
    if rows is None:
        return list(range(n))
    if isinstance(rows, slice):
        return list(range(n))[rows]
    bad = [r for r in rows if not 0 <= r < n]
    if bad:
        raise ValueError(f"rows {bad} outside 0..{n - 1}")
    return list(rows)


def _heads(heads: Sequence[int] | None, q_heads: int, kv_heads: int) -> tuple[list[int], list[int]]:
    """Query heads and the K/V heads they use; refuses choices that break the grouping."""
    group = q_heads // kv_heads
    chosen = sorted(set(range(group) if heads is None else heads))
    if not chosen or chosen[0] < 0 or chosen[-1] >= q_heads:
        raise ValueError(f"heads {list(heads or [])} outside 0..{q_heads - 1}")
    kv = sorted({h // group for h in chosen})
    per_kv = [sum(1 for h in chosen if h // group == j) for j in kv]
    if len(set(per_kv)) > 1:
        raise ValueError(f"query heads {chosen} take {per_kv} heads from K/V heads {kv}: choose the same "
                         "number of query heads from each K/V head, so the saved grouping stays right")
    return chosen, kv


def _refusal(q, k, v, attn_mask, dropout_p, is_causal, scale) -> str:
    """Why a call cannot become a fixture ('' if it can)."""
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)):
        return "not 4-D [B, H, N, D] tensors"
    if q.dtype not in DTYPES.values() or not q.dtype == k.dtype == v.dtype:
        return f"dtype {q.dtype}, {k.dtype}, {v.dtype} (fixtures hold fp16 or bf16)"
    if attn_mask is not None or is_causal or dropout_p:
        return "masked, causal or with dropout (fixtures hold plain attention)"
    if scale is not None and not math.isclose(scale, q.shape[-1] ** -0.5, rel_tol=1e-6):
        return f"scale {scale} is not 1/sqrt(head_dim) (fixtures use the default scale)"
    if k.shape != v.shape or q.shape[1] % k.shape[1]:
        return f"shapes q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)} do not fit"
    return ""


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-").lower() or "fixture"


@contextlib.contextmanager
def record_sdpa(out_dir, *, family: str, select: Select, model: str = "unnamed model",
                heads: Sequence[int] | None = None, query_rows: Rows = None, key_rows: Rows = None,
                module_name: str | None = None, bounds: dict | None = None, note: str = ""):
    """Record chosen SDPA calls while active; yields a Recording. See the module docstring.

    heads: query heads to keep (default: the first K/V head's group, i.e. head 0 without GQA).
    module_name: how the selected module is named in `source` (default: its class name).
    bounds: per variant class, as fixture_files describes; DEFAULT_BOUNDS until calibrated.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    functional = torch.nn.functional
    original = functional.scaled_dot_product_attention
    recording = Recording()
    chooser = _Chooser(select)
    if isinstance(select, torch.nn.Module):
        module_name = module_name or type(select).__name__

    def capture(index, q, k, v):
        q_heads, kv_heads = _heads(heads, q.shape[1], k.shape[1])
        q_rows, k_rows = _rows(query_rows, q.shape[2]), _rows(key_rows, k.shape[2])

        def cut(t, hs, rs):
            return t[:, hs][:, :, rs].detach().to("cpu", copy=True).contiguous()

        source = {
            "model": model, "call": index, "heads": q_heads, "kv_heads": kv_heads,
            "query_rows": _span(q_rows), "key_rows": _span(k_rows),
            "full_call": {"q": list(q.shape), "k": list(k.shape), "v": list(v.shape),
                          "channels": {n: channel_stats(t)
                                       for n, t in zip("qkv", (q, k, v), strict=True)}},
        }
        if module_name is not None:
            source["module"] = module_name
        where = f" in {module_name}" if module_name else ""
        path = save_fixture(
            out_dir / f"{_slug(family)}-{_slug(model)}-call{index:04d}.safetensors",
            cut(q, q_heads, q_rows), cut(k, kv_heads, k_rows), cut(v, kv_heads, k_rows),
            family=family, kind="recorded", source=source, bounds=bounds or DEFAULT_BOUNDS,
            provenance=(f"Recorded by sage_qual.recorder from {model}: SDPA call {index}{where}, query heads "
                        f"{q_heads} with K/V heads {kv_heads}, query rows {source['query_rows']}, key rows "
                        f"{source['key_rows']}, torch {torch.__version__}. {note}").strip(),
            calibration="not calibrated: bounds are " + ("the caller's" if bounds else "recorder defaults"))
        recording.paths.append(path)

    def recording_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
                       **kwargs):
        index = recording.calls
        recording.calls += 1
        if chooser.chosen(index, query, key, value):
            reason = _refusal(query, key, value, attn_mask, dropout_p, is_causal, scale)
            if reason:
                recording.skipped.append((index, reason))
            else:
                capture(index, query, key, value)
        return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                        scale=scale, **kwargs)

    functional.scaled_dot_product_attention = recording_sdpa
    try:
        yield recording
    finally:
        functional.scaled_dot_product_attention = original
        chooser.close()


class _Chooser:
    """Decides which calls to record: by index, by predicate, or inside a module's forward."""

    def __init__(self, select: Select):
        self.select = select
        self.depth = 0  # forward depth of the selected module
        self.hooks = []
        if isinstance(select, torch.nn.Module):
            # always_call: a forward that raises still leaves the module.
            self.hooks = [select.register_forward_pre_hook(self._enter),
                          select.register_forward_hook(self._leave, always_call=True)]
        elif not callable(select):
            self.indices = {select} if isinstance(select, int) else set(select)

    def _enter(self, *_):
        self.depth += 1

    def _leave(self, *_):
        self.depth -= 1

    def chosen(self, index: int, q, k, v) -> bool:
        if isinstance(self.select, torch.nn.Module):
            return self.depth > 0
        if callable(self.select):
            return bool(self.select(q, k, v))
        return index in self.indices

    def close(self) -> None:
        for hook in self.hooks:
            hook.remove()


def _span(rows: list[int]) -> list[int] | str:
    """Rows as 'start:stop' when contiguous (short in metadata), else the list."""
    if rows and rows == list(range(rows[0], rows[-1] + 1)):
        return f"{rows[0]}:{rows[-1] + 1}"
    return rows
