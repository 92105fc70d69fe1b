"""Model families: their attention shapes, their fixtures, their bounds and their speed rule.

A family's fixtures are the fixtures whose `family` metadata names it (compared without case or
punctuation, so "Qwen-Image", "qwen_image" and "qwenimage" are one family). Accuracy bounds live
in each fixture, next to its provenance; the family adds the memory bound and the speed rule
(`min_speedup`: the lower confidence bound of the speedup a shape must clear to be served).
Verdicts are `sage_qual.qualification.verdict`'s.

Shapes are [batch, heads, tokens, head_dim] of the model's own attention calls at the sizes the
InvokeAI SageAttention PRs measured (1024² and 2048² images; the video sizes of InvokeAI PRs #9657
and #9665). Image token
counts follow from the VAE's 8x downsampling and 2x2 patches: (1024 / 16)² = 4096 image tokens;
joint models add their text tokens. Where each number comes from is cited next to it.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from sage_qual.limits import MEMORY_BOUND


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
    # FLUX.2 Klein 9B (the model InvokeAI PR #9657 measured): 32 heads x 128, Qwen3 text up to 512 tokens
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
    # (4096 image + 512 text tokens; 1024² and 2048² as InvokeAI PR #9662 measured).
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
    # tokens (diffusers pipeline_ltx2.py). 1248x704, 121 frames (InvokeAI PR #9657):
    # 39 * 22 * (120 / 8 + 1) = 13728 tokens.
    Family("LTX-2", (
        ("1248x704x121 self", self_attention(32, 13728)),
        ("1248x704x121 text cross", cross_attention(32, 13728, 1024)),
    )),
    # Wan 2.2 TI2V-5B: 24 heads x 128, VAE stride (4, 16, 16), patch (1, 2, 2), text_len 512
    # (ml-explore/mlx-examples video/Wan2.2/wan/configs/wan_ti2v_5B.py and shared_config.py).
    # 1280x704, 121 frames (InvokeAI PRs #9657, #9665): 40 * 22 * 31 = 27280 tokens; one 1280x704
    # image is 880 tokens (InvokeAI PR #9665). A14B: 40 heads x 128, VAE stride (4, 8, 8)
    # (wan_t2v_14B.py); 832x480, 81 frames (InvokeAI PR #9665): 52 * 30 * 21 = 32760 tokens.
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
