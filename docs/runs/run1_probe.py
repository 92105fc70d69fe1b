"""Device run 1 (H200): wrapper acceptance on a FLUX shape, and calibration sweeps for replicas.

Run on the GPU box after SageAttention is installed; writes JSON lines to argv[1].
Calibration: which synthetic statistics reproduce the published effects (seeds/001, 000):
  - a Q/K channel near +600 for every image token: K smoothing on breaks it, off does not;
  - V about 3500 in every channel: ~17 % relative error for every variant, 0.2 % for bf16 SDPA.
"""

import itertools
import json
import logging
import sys

import torch
import torch.nn.functional as F
from sage_qual.variants import VARIANTS

import sage_qual
from sage_qual import measure, sage_package

out_path = sys.argv[1]
rows = []
logging.basicConfig(level=logging.DEBUG, format="%(levelname)s %(name)s: %(message)s", stream=sys.stdout)

# 1. Acceptance: install() and a served FLUX.1 1024^2 call ([1, 24, 4608, 128] bf16) with its check.
status = sage_qual.install()
print("install:", status.enabled, status.reason, status.version)
gen = torch.Generator("cuda").manual_seed(0)
q, k, v = (torch.randn(1, 24, 4608, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
with sage_qual.sage_attention_scope() as report:
    out = F.scaled_dot_product_attention(q, k, v)
ref = measure.reference(q, k, v)
acc = measure.accuracy(out, q, k, v, ref)
print("FLUX served:", report.served, "of", report.calls, dict(report.fallbacks), acc)
rows.append({"probe": "flux-acceptance", "served": report.served, "calls": report.calls, **acc.as_dict()})
sage_qual.uninstall()

package = sage_package.load()
variants = [VARIANTS[n] for n in ("sm80-fp16-cuda", "sm86-fp16-triton", "sm89-fp8-cuda", "sm90-fp8-cuda",
                                   "sm120-fp8-perwarp")]


def run_all(label, q, k, v, params):
    ref = measure.reference(q, k, v)
    sdpa_err, _, _ = measure.compare(measure.TORCH_SDPA(q, k, v, enable_gqa=q.shape[1] != k.shape[1]), ref)
    for variant, smooth in itertools.product(variants, (True, False)):
        out = measure.call_kernel(package, variant, q, k, v, smooth_k=smooth)
        rel, cos, finite = measure.compare(out, ref)
        row = {"probe": label, **params, "variant": variant.name, "smooth_k": smooth,
               "rel_l2": rel, "cos": cos, "finite": finite, "sdpa_rel_l2": sdpa_err}
        rows.append(row)
        print(json.dumps(row))


def noise(*shape):
    return torch.randn(*shape, device="cuda", generator=gen)


# 2. Outlier channel sweep: [1, 4, N, 128] bf16, channel 7 of q and/or k near `mag` for image tokens.
N, D = 4096, 128
for mag, spread, text, where, sigma in itertools.product((600.0,), (0.0, 5.0), (0, 512), ("qk", "k"),
                                                       (1.0, 3.0)):
    q, k, v = noise(1, 4, N, D) * sigma, noise(1, 4, N, D) * sigma, noise(1, 4, N, D)
    for t, on in ((q, "q" in where), (k, True)):
        if on:
            t[:, :, text:, 7] = mag + spread * noise(1, 4, N - text)
    q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
    run_all("outlier", q, k, v, {"mag": mag, "spread": spread, "text": text, "where": where, "sigma": sigma})

# 3. Large V sweep: V = mean + noise * sd in every channel.
for mean, sd in itertools.product((3500.0,), (1.0, 30.0, 300.0, 3000.0)):
    q, k = noise(1, 4, N, D).to(torch.bfloat16), noise(1, 4, N, D).to(torch.bfloat16)
    v = (mean + sd * noise(1, 4, N, D)).to(torch.bfloat16)
    run_all("large-v", q, k, v, {"mean": mean, "sd": sd})

with open(out_path, "w") as f:
    for row in rows:
        f.write(json.dumps(row) + "\n")
