"""Model families: their attention shapes, their fixtures, their bounds and their speed rule.

A family's fixtures are the fixtures whose `family` metadata names it (compared without case or
punctuation, so "Qwen-Image", "qwen_image" and "qwenimage" are one family). Accuracy bounds live
in each fixture, next to its provenance; the family adds the memory bound and the speed rule
(`min_speedup`: the lower confidence bound of the speedup a shape must clear to be served).
Verdicts are `sage_qual.qualification.decide.verdict`'s.

Each family also declares its call space (`calls`, `layouts`): per call site the smallest and the
largest call the model makes at the resolutions and durations its sources support, and the memory
layouts its integrations hand the kernel (`LAYOUTS`). certify checks accuracy at every family's
longest call in each of its layouts (`long_check`), and a verdict enables a family only up to the
length and in the layouts so verified.

Shapes are [batch, heads, tokens, head_dim] of the model's own attention calls at the sizes the
InvokeAI SageAttention PRs measured (1024² and 2048² images; the video sizes of InvokeAI PRs #9657
and #9665). Image token
counts follow from the VAE's 8x downsampling and 2x2 patches: (1024 / 16)² = 4096 image tokens;
joint models add their text tokens. Where each number comes from is cited next to it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from sage_qual.limits import MEMORY_BOUND
from sage_qual.verdicts import fitness


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


# The memory layouts an integration may hand the kernel, by the name profiles and reports use.
LAYOUTS = {
    "contiguous": "contiguous [B, H, N, D] tensors",
    "transposed": "a contiguous [B, N, H, D] projection viewed as [B, H, N, D] by transpose(1, 2)",
    "fused_qkv": "q, k and v as views into one [B, N, (H + 2 KV) * D] projection (sequence stride "
                 "(H + 2 KV) * D), viewed as [B, H, N, D]",
    "nhd": "contiguous [B, N, H, D] tensors passed with tensor_layout=\"NHD\"",
}
# Where each layout comes from (cited by the families that declare it):
# - transposed: diffusers' attention dispatch (src/diffusers/models/attention_dispatch.py, the
#   native SDPA backend) permutes its [B, N, H, D] projections to [B, H, N, D] views, so
#   F.scaled_dot_product_attention, and the wrapper behind it, sees non-contiguous views;
# - nhd: ComfyUI's attention_sage (comfy/ldm/modules/attention.py) calls sageattn on [B, N, H, D]
#   tensors with tensor_layout="NHD";
# - fused_qkv: black-forest-labs/flux src/flux/modules/layers.py splits one qkv Linear's output by
#   rearrange "B L (K H D) -> K B H L D": views with sequence stride 3 * H * D (q and k pass an
#   RMSNorm, v stays a view); issue 16 reproduced the int32-offset fault with such views at a Wan 2.2
#   A14B size, and kijai/ComfyUI-KJNodes PR 748 fixed a long strided V view in video workflows.
COMMON_LAYOUTS = ("contiguous", "transposed", "nhd")

# The generic sweep's self-attention, timed by certify and long-checked past the fixtures: 24 heads
# (FLUX.1's and Qwen-Image's) from 1k to 32k tokens; --quick times three of the lengths.
GENERIC_HEADS = 24
SELF_TOKENS = (1024, 2048, 4096, 8192, 16384, 32768)
QUICK_SELF_TOKENS = (1024, 4096, 16384)


@dataclass(frozen=True)
class CallSite:
    """One place a model calls attention: its smallest and largest call (same heads, head_dim and
    dtype; the token counts span the resolutions and durations the model supports).

    `fixtures` names the fixtures that reproduce this site's own stress (by file name). A failure on
    one of them bounds a verdict instead of vetoing it when the served range excludes every call of
    the site (`verdict`, "Bounds"); a fixture no site names stands for the family's main calls, and its
    failure keeps the family off."""
    label: str
    smallest: Shape
    largest: Shape
    fixtures: tuple[str, ...] = ()

    def covers(self, q_tokens: int, kv_tokens: int, head_dim: int) -> bool:
        """Whether a fixture of this shape can stand for the site: its head size, its keys within
        the site's (fixtures keep a call's keys whole) and no more queries than the largest call
        (a fixture may ship a slice of them)."""
        a, b = self.smallest, self.largest
        return head_dim == b.head_dim and a.kv_tokens <= kv_tokens <= b.kv_tokens and q_tokens <= b.q_tokens

    def problems(self) -> list[str]:
        found = []
        a, b = self.smallest, self.largest
        if (a.heads, a.kv_heads, a.head_dim, a.dtype) != (b.heads, b.kv_heads, b.head_dim, b.dtype):
            found.append(f"{self.label}: smallest and largest differ in heads, head_dim or dtype")
        if a.q_tokens > b.q_tokens or a.kv_tokens > b.kv_tokens:
            found.append(f"{self.label}: smallest call is longer than the largest")
        if b.heads % b.kv_heads:
            found.append(f"{self.label}: {b.heads} heads are not a multiple of {b.kv_heads} KV heads")
        return found


@dataclass(frozen=True)
class Family:
    name: str
    shapes: tuple[tuple[str, Shape], ...]  # (where the call happens, its shape): timed for speed
    memory_bound: float = MEMORY_BOUND
    min_speedup: float = 1.0  # against the fastest SDPA backend, at one of its shapes at least
    calls: tuple[CallSite, ...] = ()  # the call space: every call site from smallest to largest
    layouts: tuple[str, ...] = COMMON_LAYOUTS  # what its integrations pass (LAYOUTS)

    @property
    def key(self) -> str:
        return normalize(self.name)

    @property
    def longest(self) -> Shape:
        """Its longest call: the largest call site with the most query tokens (keys break a tie)."""
        return max((site.largest for site in self.calls), key=lambda s: (s.q_tokens, s.kv_tokens))

    def owns(self, fixture_family: str) -> bool:
        return normalize(fixture_family) == self.key


# The fixture family of situations every model family creates: such fixtures count for each one.
GENERIC = "generic"


normalize = fitness.family_key  # the one family key (verdicts.fitness)


def site(label: str, smallest: Shape, largest: Shape, fixtures: tuple[str, ...] = ()) -> CallSite:
    return CallSite(label, smallest, largest, fixtures)


# Call spaces: the smallest and largest call of each site. Where no source names a model's limits,
# the range is the sizes the cited measurements used (1024² and 2048² images), and says so.
FAMILIES: tuple[Family, ...] = (
    # FLUX.1 dev: 24 heads x 128 (black-forest-labs/flux src/flux/util.py "flux-dev": hidden_size
    # 3072, num_heads 24; also sglang FluxArchConfig). Joint attention over 4096 image tokens plus
    # 512 T5 tokens (the dev pipeline pads the prompt to max_sequence_length=512).
    # Call space: 1024² to 2048² (the sizes InvokeAI PR #9657 measured); BFL's reference code passes
    # fused-QKV views (LAYOUTS). With an IP-Adapter, the image tokens also attend to the adapter's
    # image-prompt tokens: 4, or 16 for the larger projection (huggingface/diffusers
    # src/diffusers/loaders/transformer_flux.py, _convert_ip_adapter_image_proj_to_diffusers:
    # num_image_text_embeds), the unconditional batch item's all zero (the fixture's field report).
    Family("FLUX.1", (
        ("1024² joint", self_attention(24, 4096 + 512)),
        ("2048² joint", self_attention(24, 16384 + 512)),
    ), calls=(site("joint", self_attention(24, 4096 + 512), self_attention(24, 16384 + 512)),
              site("IP-Adapter image prompt", cross_attention(24, 4096, 4), cross_attention(24, 16384, 16),
                   fixtures=("flux1_ip_adapter_zero_uncond",))),
        layouts=COMMON_LAYOUTS + ("fused_qkv",)),
    # FLUX.2 Klein 9B (the model InvokeAI PR #9657 measured): 32 heads x 128, Qwen3 text up to 512 tokens
    # (InvokeAI invokeai/backend/flux2/util.py: Klein9B hidden_size 4096, num_attention_heads 32,
    # attention_head_dim 128; _flux2_max_seq_lengths 512). Latents: 32 channels, 2x2 patches.
    # Call space: 1024² to 2048² (PR #9657's sizes).
    Family("FLUX.2", (
        ("1024² joint", self_attention(32, 4096 + 512)),
        ("2048² joint", self_attention(32, 16384 + 512)),
    ), calls=(site("joint", self_attention(32, 4096 + 512), self_attention(32, 16384 + 512)),)),
    # Z-Image: 30 heads x 128 (Tongyi-MAI/Z-Image-Turbo transformer/config.json: dim 3840,
    # n_heads 30, n_kv_heads 30, all_patch_size [2]). The noise refiner sees image tokens only,
    # the main layers image plus caption tokens (padded to a multiple of 32, at most 512).
    # Call space: 1024² to 2048².
    Family("Z-Image", (
        ("1024² noise refiner", self_attention(30, 4096)),
        ("1024² joint", self_attention(30, 4096 + 512)),
        ("2048² joint", self_attention(30, 16384 + 512)),
    ), calls=(site("noise refiner", self_attention(30, 4096), self_attention(30, 16384)),
              site("joint", self_attention(30, 4096 + 512), self_attention(30, 16384 + 512)))),
    # Qwen-Image: 60 joint blocks of 24 heads x 128 (exo-explore/exo
    # src/exo/worker/engines/image/models/qwen/config.py: num_heads 24, head_dim 128, patch 2);
    # text up to 512 tokens (pipeline max_sequence_length). Call space: 1024² to 2048².
    Family("Qwen-Image", (
        ("1024² joint", self_attention(24, 4096 + 512)),
        ("2048² joint", self_attention(24, 16384 + 512)),
    ), calls=(site("joint", self_attention(24, 4096 + 512), self_attention(24, 16384 + 512)),)),
    # Krea-2: grouped-query attention, 48 query and 12 K/V heads x 128, 4608 tokens at 1024²
    # (4096 image + 512 text tokens; 1024² and 2048² as InvokeAI PR #9662 measured: its call space).
    Family("Krea-2", (
        ("1024² joint", self_attention(48, 4608, kv_heads=12)),
        ("2048² joint", self_attention(48, 16384 + 512, kv_heads=12)),
    ), calls=(site("joint", self_attention(48, 4608, kv_heads=12),
                   self_attention(48, 16384 + 512, kv_heads=12)),)),
    # SDXL: head_dim 64, 10 heads at 640 channels and 20 at 1280, attention at latent/2 and
    # latent/4, cross-attention on 77 text tokens (Stability-AI/generative-models
    # configs/inference/sd_xl_base.yaml: num_head_channels 64, channel_mult [1, 2, 4],
    # attention_resolutions [4, 2], transformer_depth [1, 2, 10]). Run in fp16. Call space:
    # 1024² (its native size) to 2048². With an IP-Adapter, each cross-attention also attends to 4
    # image-prompt tokens (huggingface/diffusers src/diffusers/loaders/unet.py,
    # _convert_ip_adapter_image_proj_to_diffusers: num_image_text_embeds 4), 16 with IP-Adapter Plus
    # (instantX-research/InstantStyle infer_style_plus.py: IPAdapterPlusXL num_tokens=16).
    Family("SDXL", (
        ("1024² self, 640 ch", self_attention(10, 4096, 64, dtype="float16")),
        ("1024² self, 1280 ch", self_attention(20, 1024, 64, dtype="float16")),
        ("1024² cross, 640 ch", cross_attention(10, 4096, 77, 64, dtype="float16")),
        ("1024² cross, 1280 ch", cross_attention(20, 1024, 77, 64, dtype="float16")),
        ("2048² self, 640 ch", self_attention(10, 16384, 64, dtype="float16")),
        ("2048² self, 1280 ch", self_attention(20, 4096, 64, dtype="float16")),
        ("2048² cross, 640 ch", cross_attention(10, 16384, 77, 64, dtype="float16")),
    ), calls=(
        site("self, 640 ch", self_attention(10, 4096, 64, dtype="float16"),
             self_attention(10, 16384, 64, dtype="float16")),
        site("self, 1280 ch", self_attention(20, 1024, 64, dtype="float16"),
             self_attention(20, 4096, 64, dtype="float16")),
        site("cross, 640 ch", cross_attention(10, 4096, 77, 64, dtype="float16"),
             cross_attention(10, 16384, 77, 64, dtype="float16")),
        site("cross, 1280 ch", cross_attention(20, 1024, 77, 64, dtype="float16"),
             cross_attention(20, 4096, 77, 64, dtype="float16")),
        site("IP-Adapter, 640 ch", cross_attention(10, 4096, 4, 64, dtype="float16"),
             cross_attention(10, 16384, 16, 64, dtype="float16"), fixtures=("sdxl_ip_adapter_zero_uncond",)),
        site("IP-Adapter, 1280 ch", cross_attention(20, 1024, 4, 64, dtype="float16"),
             cross_attention(20, 4096, 16, 64, dtype="float16"), fixtures=("sdxl_ip_adapter_zero_uncond",)),
    )),
    # LTX-2 video stream: 32 heads x 128 (sglang LTX2ArchConfig: num_attention_heads 32,
    # attention_head_dim 128); VAE 32x spatial, 8x temporal, patch 1; Gemma text padded to 1024
    # tokens (diffusers pipeline_ltx2.py). 1248x704, 121 frames (InvokeAI PR #9657):
    # 39 * 22 * (120 / 8 + 1) = 13728 tokens. Call space: that one measured size (no source here
    # names LTX-2's largest; a longer video is a call past the verified range, left to torch).
    Family("LTX-2", (
        ("1248x704x121 self", self_attention(32, 13728)),
        ("1248x704x121 text cross", cross_attention(32, 13728, 1024)),
    ), calls=(site("self", self_attention(32, 13728), self_attention(32, 13728)),
              site("text cross", cross_attention(32, 13728, 1024), cross_attention(32, 13728, 1024)))),
    # Wan 2.2 TI2V-5B: 24 heads x 128, VAE stride (4, 16, 16), patch (1, 2, 2), text_len 512
    # (ml-explore/mlx-examples video/Wan2.2/wan/configs/wan_ti2v_5B.py and shared_config.py).
    # 1280x704, 121 frames (InvokeAI PRs #9657, #9665): 40 * 22 * 31 = 27280 tokens; one 1280x704
    # image is 880 tokens (InvokeAI PR #9665). A14B: 40 heads x 128, VAE stride (4, 8, 8)
    # (wan_t2v_14B.py); 832x480, 81 frames (InvokeAI PR #9665): 52 * 30 * 21 = 32760 tokens.
    # Call space: 5B from one 1280x704 image (880) to 1280x704x121 (27280); A14B from 832x480x81
    # (32760) to 1280x720x81, its largest size (Wan-Video/Wan2.2 wan/configs/__init__.py
    # SIZE_CONFIGS '1280*720'; 81 frames, frame_num in shared_config.py):
    # (1280 / 16) * (720 / 16) * (80 / 4 + 1) = 80 * 45 * 21 = 75600 tokens (issue 16).
    Family("Wan 2.2", (
        ("5B 1280x704x121 self", self_attention(24, 27280)),
        ("5B 1280x704x121 text cross", cross_attention(24, 27280, 512)),
        ("5B 1280x704 image self", self_attention(24, 880)),
        ("A14B 832x480x81 self", self_attention(40, 32760)),
    ), calls=(
        site("5B self", self_attention(24, 880), self_attention(24, 27280)),
        site("5B text cross", cross_attention(24, 880, 512), cross_attention(24, 27280, 512)),
        site("A14B self", self_attention(40, 32760), self_attention(40, 75600)),
        site("A14B text cross", cross_attention(40, 32760, 512), cross_attention(40, 75600, 512)),
    ), layouts=COMMON_LAYOUTS + ("fused_qkv",)),
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


def counts_for(family: Family | None, fixture_family: str) -> bool:
    """A fixture counts for a family when it is the family's own or generic; for None (every
    family at once) every fixture counts."""
    return family is None or family.owns(fixture_family) or normalize(fixture_family) == GENERIC


def sites_of(fixture: str, family: Family | None = None) -> list[tuple[Family, CallSite]]:
    """The call sites that name `fixture` as reproducing their stress, of `family` (None: of every
    family)."""
    return [(owner, call) for owner in FAMILIES if family is None or owner is family
            for call in owner.calls if fixture in call.fixtures]


def memory_bound(fixture_family: str) -> float:
    """The extra-memory bound a fixture is judged by: its owning family's, else the default."""
    owner = family_of(fixture_family)
    return owner.memory_bound if owner else MEMORY_BOUND


def call_space_problems(families: tuple[Family, ...] = FAMILIES) -> list[str]:
    """What makes a family's call-space declaration unusable (empty: all are)."""
    found = []
    for family in families:
        if not family.calls:
            found.append(f"{family.name}: no call sites declared")
        unknown = [name for name in family.layouts if name not in LAYOUTS]
        if unknown or "contiguous" not in family.layouts:
            found.append(f"{family.name}: layouts {list(family.layouts)} (known: {', '.join(LAYOUTS)}; "
                         "contiguous is the reference and always declared)")
        found += [f"{family.name}: {p}" for site in family.calls for p in site.problems()]
    owners: dict[str, str] = {}
    for family in families:
        for call in family.calls:
            for name in call.fixtures:
                if owners.setdefault(name, family.name) != family.name:
                    found.append(f"{family.name}: site {call.label} names fixture {name}, which "
                                 f"{owners[name]} names too (a fixture stands for one family's calls)")
    return found
