"""Compare the CPU emulation (sage_qual.emulation) with the H200 kernels of device run 1 on the same
synthetic statistics (fresh CPU random draws, not the same tensors), one head per case.
Output kept in emulation_vs_h200.txt."""

import itertools
import json
from pathlib import Path

import torch
from sage_qual.variants import VARIANTS

from sage_qual import emulation

HERE = Path(__file__).parent
gpu = {}
for line in (HERE / "probe.jsonl").read_text().splitlines():
    row = json.loads(line)
    if row["probe"] == "outlier":
        key = (row["spread"], row["text"], row["where"], row["sigma"], row["variant"], row["smooth_k"])
        gpu[key] = (row["rel_l2"], row["cos"])

generator = torch.Generator().manual_seed(0)
N, D = 4096, 128


def noise(*shape):
    return torch.randn(*shape, generator=generator)


for spread, text, where, sigma in itertools.product((0.0, 5.0), (0, 512), ("qk", "k"), (1.0, 3.0)):
    q, k, v = noise(1, 1, N, D) * sigma, noise(1, 1, N, D) * sigma, noise(1, 1, N, D)
    for tensor, has_outlier in ((q, "q" in where), (k, True)):
        if has_outlier:
            tensor[:, :, text:, 7] = 600 + spread * noise(1, 1, N - text)
    q, k, v = (t.bfloat16() for t in (q, k, v))
    ref = emulation.reference(q, k, v)
    for name in ("sm90-fp8-cuda", "sm86-fp16-triton"):
        scheme = emulation.scheme_for(VARIANTS[name])
        for smooth in (True, False):
            emulated = emulation.errors(emulation.emulate(q, k, v, scheme, smooth_k=smooth), ref)
            measured = gpu[(spread, text, where, sigma, name, smooth)]
            case = f"{where:3} t{text:4} sp{spread} s{sigma} {name[:5]} {'on ' if smooth else 'off'}"
            print(f"{case} emu {emulated['rel_l2']:.3f}/{emulated['cosine']:.3f}  "
                  f"gpu {measured[0]:.3f}/{measured[1]:.3f}")
