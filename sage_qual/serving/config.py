"""The wrapper's thresholds and kernel table in one typed object.

A per-GPU profile written by `sage-qual certify` replaces these values (`install(config=...)`);
the defaults below are the ones the InvokeAI backend shipped, measured on an RTX 4090 (seeds/001).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from sage_qual.serving.variants import BLACKWELL, VARIANTS, BoxFacts, Capability, Variant

# Preference order per compute capability; the first variant this box supports wins. Follows
# upstream sageattn(): (8, 7) and unknown capabilities get no kernel.
KERNEL_TABLE: Mapping[Capability, tuple[str, ...]] = {
    (8, 0): ("sm80-fp16-cuda",),
    (8, 6): ("sm86-fp16-triton",),
    (8, 9): ("sm89-fp8-cuda", "sm89-fp8-cuda-fp32acc"),
    (9, 0): ("sm90-fp8-cuda",),
    **{cap: ("sm120-fp8-perwarp", "sm120-fp8-perwarp-fp32acc") for cap in BLACKWELL},
}


@dataclass(frozen=True)
class WrapperConfig:
    # Below these lengths quantizing costs more than the kernel saves (break-even on an RTX 4090).
    min_query_tokens: int = 1536
    min_key_tokens: int = 512
    head_dims: tuple[int, ...] = (64, 128)
    # First-call check: the last `check_rows` query rows of one sample and one K/V group.
    check_rows: int = 1024
    # Fp8 kernels land near 0.04 on random data (H200, notes/); 0.5 only catches broken kernels.
    check_max_rel_l2: float = 0.5
    # Consecutive Triton cache write failures (OSError) before a device is retired.
    cache_error_limit: int = 3
    kernel_table: Mapping[Capability, tuple[str, ...]] = field(default_factory=lambda: dict(KERNEL_TABLE))

    def kernel_for(self, box: BoxFacts) -> tuple[Variant | None, str]:
        """The variant serving a GPU, or None with the reason it gets none."""
        candidates = self.kernel_table.get(box.capability)
        if not candidates:
            known = ", ".join("sm_%d%d" % cap for cap in sorted(self.kernel_table))
            return None, "sm_%d%d has no SageAttention kernel (kernels for: %s)" % (*box.capability, known)
        reasons = []
        for name in candidates:
            why_not = VARIANTS[name].not_supported_reasons(box)
            if not why_not:
                return VARIANTS[name], ""
            reasons.append(f"{name}: {'; '.join(why_not)}")
        return None, " | ".join(reasons)


DEFAULT_CONFIG = WrapperConfig()
