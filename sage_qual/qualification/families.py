"""Model families: their attention shapes, their fixtures, their bounds, and their verdicts.

A family's fixtures are the fixtures whose `family` metadata names it (compared without case or
punctuation, so "Qwen-Image", "qwen_image" and "qwenimage" are one family). Accuracy bounds live
in each fixture, next to its provenance; the family adds the memory bound and the speed rule.

Shapes are [batch, heads, tokens, head_dim] of the model's own attention calls at the sizes the
seeds measured (1024² and 2048² images, the video sizes of seeds/001 and seeds/004). Image token
counts follow from the VAE's 8x downsampling and 2x2 patches: (1024 / 16)² = 4096 image tokens;
joint models add their text tokens. Where each number comes from is cited next to it.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from sage_qual.limits import MEMORY_BOUND
from sage_qual.qualification.speed import break_even, serves
from sage_qual.serving.config import KERNEL_TABLE


@dataclass(frozen=True)
class Shape:
    heads: int
    kv_heads: int
    q_tokens: int
    kv_tokens: int
    head_dim: int
    dtype: str = "bfloat16"
    batch: int = 1

    @property
    def key(self) -> str:
        """Identity of a timed shape: families that share a shape share its measurement."""
        heads = str(self.heads) if self.heads == self.kv_heads else f"{self.heads}/{self.kv_heads}"
        return f"b{self.batch} h{heads} q{self.q_tokens} k{self.kv_tokens} d{self.head_dim} {self.dtype}"

    @property
    def flops(self) -> float:
        return 4.0 * self.batch * self.heads * self.head_dim * self.q_tokens * self.kv_tokens

    def as_dict(self) -> dict:
        return asdict(self)


def self_attention(heads: int, tokens: int, head_dim: int = 128, kv_heads: int | None = None,
                   dtype: str = "bfloat16") -> Shape:
    return Shape(heads, kv_heads or heads, tokens, tokens, head_dim, dtype)


def cross_attention(heads: int, q_tokens: int, kv_tokens: int, head_dim: int = 128,
                    dtype: str = "bfloat16") -> Shape:
    return Shape(heads, heads, q_tokens, kv_tokens, head_dim, dtype)


@dataclass(frozen=True)
class Family:
    name: str
    shapes: tuple[tuple[str, Shape], ...]  # (where the call happens, its shape)
    memory_bound: float = MEMORY_BOUND
    min_speedup: float = 1.0  # against the fastest SDPA backend, at one of its shapes at least

    @property
    def key(self) -> str:
        return normalize(self.name)

    def owns(self, fixture_family: str) -> bool:
        return normalize(fixture_family) == self.key


def normalize(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


FAMILIES: tuple[Family, ...] = (
    # FLUX.1 dev: 24 heads x 128 (black-forest-labs/flux src/flux/util.py "flux-dev": hidden_size
    # 3072, num_heads 24; also sglang FluxArchConfig). Joint attention over 4096 image tokens plus
    # 512 T5 tokens (the dev pipeline pads the prompt to max_sequence_length=512).
    Family("FLUX.1", (
        ("1024² joint", self_attention(24, 4096 + 512)),
        ("2048² joint", self_attention(24, 16384 + 512)),
    )),
    # FLUX.2 Klein 9B (the model seeds/001 measured): 32 heads x 128, Qwen3 text up to 512 tokens
    # (InvokeAI invokeai/backend/flux2/util.py: Klein9B hidden_size 4096, num_attention_heads 32,
    # attention_head_dim 128; _flux2_max_seq_lengths 512). Latents: 32 channels, 2x2 patches.
    Family("FLUX.2", (
        ("1024² joint", self_attention(32, 4096 + 512)),
        ("2048² joint", self_attention(32, 16384 + 512)),
    )),
    # Z-Image: 30 heads x 128 (Tongyi-MAI/Z-Image-Turbo transformer/config.json: dim 3840,
    # n_heads 30, n_kv_heads 30, all_patch_size [2]). The noise refiner sees image tokens only,
    # the main layers image plus caption tokens (padded to a multiple of 32, at most 512).
    Family("Z-Image", (
        ("1024² noise refiner", self_attention(30, 4096)),
        ("1024² joint", self_attention(30, 4096 + 512)),
        ("2048² joint", self_attention(30, 16384 + 512)),
    )),
    # Qwen-Image: 60 joint blocks of 24 heads x 128 (exo-explore/exo
    # src/exo/worker/engines/image/models/qwen/config.py: num_heads 24, head_dim 128, patch 2);
    # text up to 512 tokens (pipeline max_sequence_length).
    Family("Qwen-Image", (
        ("1024² joint", self_attention(24, 4096 + 512)),
        ("2048² joint", self_attention(24, 16384 + 512)),
    )),
    # Krea-2: grouped-query attention, 48 query and 12 K/V heads x 128, 4608 tokens at 1024²
    # (seeds/003: "the real shape ([1, 48q/12kv, 4608, 128], bf16)"; seeds/000: 1024² and 2048²).
    Family("Krea-2", (
        ("1024² joint", self_attention(48, 4608, kv_heads=12)),
        ("2048² joint", self_attention(48, 16384 + 512, kv_heads=12)),
    )),
    # SDXL: head_dim 64, 10 heads at 640 channels and 20 at 1280, attention at latent/2 and
    # latent/4, cross-attention on 77 text tokens (Stability-AI/generative-models
    # configs/inference/sd_xl_base.yaml: num_head_channels 64, channel_mult [1, 2, 4],
    # attention_resolutions [4, 2], transformer_depth [1, 2, 10]). Run in fp16.
    Family("SDXL", (
        ("1024² self, 640 ch", self_attention(10, 4096, 64, dtype="float16")),
        ("1024² self, 1280 ch", self_attention(20, 1024, 64, dtype="float16")),
        ("1024² cross, 640 ch", cross_attention(10, 4096, 77, 64, dtype="float16")),
        ("1024² cross, 1280 ch", cross_attention(20, 1024, 77, 64, dtype="float16")),
        ("2048² self, 640 ch", self_attention(10, 16384, 64, dtype="float16")),
        ("2048² self, 1280 ch", self_attention(20, 4096, 64, dtype="float16")),
        ("2048² cross, 640 ch", cross_attention(10, 16384, 77, 64, dtype="float16")),
    )),
    # LTX-2 video stream: 32 heads x 128 (sglang LTX2ArchConfig: num_attention_heads 32,
    # attention_head_dim 128); VAE 32x spatial, 8x temporal, patch 1; Gemma text padded to 1024
    # tokens (diffusers pipeline_ltx2.py). 1248x704, 121 frames (seeds/001):
    # 39 * 22 * (120 / 8 + 1) = 13728 tokens.
    Family("LTX-2", (
        ("1248x704x121 self", self_attention(32, 13728)),
        ("1248x704x121 text cross", cross_attention(32, 13728, 1024)),
    )),
    # Wan 2.2 TI2V-5B: 24 heads x 128, VAE stride (4, 16, 16), patch (1, 2, 2), text_len 512
    # (ml-explore/mlx-examples video/Wan2.2/wan/configs/wan_ti2v_5B.py and shared_config.py).
    # 1280x704, 121 frames (seeds/001, 004): 40 * 22 * 31 = 27280 tokens; one 1280x704 image is
    # 880 tokens (seeds/004). A14B: 40 heads x 128, VAE stride (4, 8, 8) (wan_t2v_14B.py);
    # 832x480, 81 frames (seeds/004): 52 * 30 * 21 = 32760 tokens.
    Family("Wan 2.2", (
        ("5B 1280x704x121 self", self_attention(24, 27280)),
        ("5B 1280x704x121 text cross", cross_attention(24, 27280, 512)),
        ("5B 1280x704 image self", self_attention(24, 880)),
        ("A14B 832x480x81 self", self_attention(40, 32760)),
    )),
)


def find(name: str) -> Family:
    for family in FAMILIES:
        if family.key == normalize(name):
            return family
    raise KeyError(f"unknown family {name!r} (known: {', '.join(f.name for f in FAMILIES)})")


def family_of(fixture_family: str) -> Family | None:
    for family in FAMILIES:
        if family.owns(fixture_family):
            return family
    return None


# Verdicts --------------------------------------------------------------------------------------
# The reason kind `sage-qual gate` leaves out unless --require-speedup.
SPEED = "speed"


def analyze(report: dict) -> list[dict]:
    """Per GPU model of a complete report: each variant's break-even, a verdict per family, and a
    default verdict over all fixtures. Devices of one model count together: a variant passes a
    fixture only if it passed on each of them, and a shape's speedup is the lowest among them."""
    groups: dict[tuple, list[dict]] = {}
    for device in report["devices"]:
        groups.setdefault((device["name"], tuple(device["capability"])), []).append(device)
    selected = report["options"]["variants"]
    analysed = []
    for (name, capability), devices in groups.items():
        table = KERNEL_TABLE.get(capability, ())
        preference = [v for v in table if v in selected] + [v for v in selected if v not in table]
        runnable = [v for v in preference if not any(v in d["not_supported"] for d in devices)]
        context = _Context(report, devices, runnable)
        analysed.append({
            "name": name, "capability": list(capability), "devices": [d["index"] for d in devices],
            "variants": {v: {"runnable": v in runnable,
                             "reasons": sorted({r for d in devices for r in d["not_supported"].get(v, [])}),
                             "break_even": context.break_even(v, list(report["shapes"]))}
                         for v in selected},
            "families": [context.verdict(f) for f in FAMILIES if f.name in report["options"]["families"]],
            "default": context.verdict(None),
        })
    return analysed


def _reason(kind: str, detail: str) -> dict:
    return {"kind": kind, "detail": detail}


class _Context:
    """One GPU model's cells and speed, from all its devices."""

    def __init__(self, report: dict, devices: list[dict], runnable: list[str]):
        self.report, self.devices, self.runnable = report, devices, runnable
        self.shapes = report["shapes"]
        self.cells = {(c["variant"], c["fixture"], d["index"]): c for d in devices for c in d["cells"]}
        speedups, times = [], []
        for device in devices:
            sdpa = {r["shape"]: r["ms"] for r in device["speed"]
                    if r["kernel"] == "sdpa" and r["outcome"] == "pass" and r["ms"]}
            ours = [r for r in device["speed"] if r["kernel"] != "sdpa" and r["shape"] in sdpa]
            # A variant that crashed or ran out of memory at a shape counts as no speedup there.
            speedups.append({(r["kernel"], r["shape"]): sdpa[r["shape"]] / r["ms"] if r.get("ms") else 0.0
                             for r in ours})
            times.append({(r["kernel"], r["shape"]): r["ms"] for r in ours if r.get("ms")})
        # A shape counts only where every device measured it: the slowest device decides.
        self.speedup = {key: min(s[key] for s in speedups) for key in set.intersection(*map(set, speedups))}
        self.ms = {key: max(t[key] for t in times) for key in set.intersection(*map(set, times))}

    def points(self, variant: str, keys: list[str]) -> list[tuple[int, int, int, float]]:
        shapes = {k: self.shapes[k]["shape"] for k in keys if (variant, k) in self.speedup}
        return [(s["q_tokens"], s["kv_tokens"], s["head_dim"], self.speedup[(variant, k)])
                for k, s in shapes.items()]

    def break_even(self, variant: str, keys: list[str]) -> dict | None:
        return break_even(self.points(variant, keys)) if variant in self.runnable else None

    def verdict(self, family: Family | None) -> dict:
        fixtures = [f["name"] for f in self.report["fixtures"] if family is None or family.owns(f["family"])]
        result = {"family": family.name if family else None, "verdict": "keep off", "variant": None,
                  "min_query_tokens": None, "min_key_tokens": None, "head_dims": None, "reasons": [],
                  "certified": [], "rejected": {}, "speedups": {}}
        if not fixtures:
            label = family.name if family else "any family"
            result["reasons"] = [_reason("no_fixtures", f"no fixtures of {label} in this run: not certified")]
            return result
        if not self.runnable:
            result["reasons"] = [_reason("skip", "no selected variant runs on this GPU")]
            return result
        for variant in self.runnable:
            failures = [r for fixture in fixtures for r in self._failures(variant, fixture)]
            if failures:
                result["rejected"][variant] = failures
            else:
                result["certified"].append(variant)
        if not result["certified"]:
            result["reasons"] = [r for failures in result["rejected"].values() for r in failures]
            return result
        own = {k: u["label"] for k, s in self.shapes.items() for u in s["uses"]
               if family is not None and u["family"] == family.name}
        if family is None:
            relevant = list(self.shapes)
        else:  # its own calls, and the generic sweep at its head sizes
            head_dims = {shape.head_dim for _, shape in family.shapes}
            relevant = list(own) + [k for k, s in self.shapes.items() if s["shape"]["head_dim"] in head_dims
                                    and not any(u["family"] for u in s["uses"])]
        chosen, thresholds = self._choose(result["certified"], list(own), relevant)
        result["speedups"] = {own[k]: self.speedup[(chosen, k)] for k in own if (chosen, k) in self.speedup}
        if thresholds is None:
            result["reasons"].append(_reason(SPEED, f"{chosen} was not faster than the fastest SDPA backend "
                                                    f"at any measured shape"))
        else:
            result.update(variant=chosen, min_query_tokens=thresholds["min_query_tokens"],
                          min_key_tokens=thresholds["min_key_tokens"], head_dims=thresholds["head_dims"])
            served = [serves(thresholds, q, k, d) for q, k, d, _ in self.points(chosen, list(own))]
            if family is not None and not served:
                result["reasons"].append(_reason(SPEED, f"{family.name}'s own shapes were not measured (a "
                                                        "--quick run): speedup unknown"))
            elif family is not None and not any(served):
                listed = ", ".join(f"{label} {x:.2f}x" for label, x in result["speedups"].items())
                where = (f"{thresholds['min_query_tokens']} query / {thresholds['min_key_tokens']} key "
                         f"tokens, head_dim {'/'.join(map(str, thresholds['head_dims']))}")
                result["reasons"].append(_reason(SPEED, f"no speedup at its shapes: {chosen} pays only from "
                                                        f"{where}, which serves none of them ({listed})"))
        result["verdict"] = "keep off" if result["reasons"] else "enable"
        return result

    def _failures(self, variant: str, fixture: str) -> list[dict]:
        reasons = []
        for device in self.devices:
            where = f"{variant} on {fixture} (cuda:{device['index']})"
            cell = self.cells.get((variant, fixture, device["index"]))
            if cell is None:
                reasons.append(_reason("incomplete", f"{where}: not run"))
            elif cell["outcome"] == "fail":
                reasons += [_reason(r["kind"], f"{where}: {r['detail']}") for r in cell["reasons"]]
            elif cell["outcome"] != "pass":
                reasons.append(_reason(cell["outcome"], f"{where}: {cell.get('detail', '')}"))
        return reasons

    def _choose(self, candidates: list[str], own: list[str], relevant: list[str]) -> tuple[str, dict | None]:
        """The fastest candidate at the family's shapes (or all relevant ones) among those whose
        break-even serves one of its shapes, else among those that pay anywhere, else the fastest."""
        keys = own or relevant

        def total(variant):  # unmeasured ones rank last, in the order of preference
            if keys and all((variant, k) in self.ms for k in keys):
                return sum(self.ms[(variant, k)] for k in keys)
            return float("inf")

        ranked = sorted(candidates, key=lambda v: (total(v), candidates.index(v)))
        thresholds = {v: self.break_even(v, relevant) for v in ranked}
        serving = [v for v in ranked if thresholds[v] and any(
            serves(thresholds[v], q, k, d) for q, k, d, _ in self.points(v, own))]
        paying = [v for v in ranked if thresholds[v]]
        chosen = (serving or paying or ranked)[0]
        return chosen, thresholds[chosen]
