"""Kernel defects measured on real hardware: kept as strict expected failures, never loosened.

Key: (variant, fixture stem). Value: what was measured, where, and why it is the kernel's fault.
An entry that starts passing fails the run (strict xfail), so a fixed kernel is noticed.

A cell where the numerics model predicts a non-finite output (sage_qual/kernels/numerics.py) is
an expected failure in test_accuracy.py even before it is listed here, provided the kernel is
non-finite too; once a GPU run has measured it, it gets an entry here with its numbers
(`python -m tests_gpu.known_defects RESULTS_JSON` lists the measured, unlisted ones).
"""

import json
import sys

KNOWN_DEFECTS: dict[tuple[str, str], str] = {
    ("sm86-fp16-triton", "qwen_image_b52_value_offset"): (
        "sageattn_qk_int8_pv_fp16_triton returns inf when V sits near 3500 in every channel: measured on "
        "the H200 in device run 1 (2026-11-29, torch 2.11.0+cu130, triton 3.6.0, SageAttention 2.2.0; "
        "docs/runs/run1/probe.jsonl) at every V spread from 1 to 3000, where the CUDA kernels stayed at "
        "0.0004-0.031 relative L2; matches the black/NaN Qwen-Image images on Ampere traced to this "
        "Triton path (ComfyUI #9773). Cause (upstream triton/attn_qk_int8_per_block.py): each 64-key "
        "block's P.V is summed in fp16 (`tl.dot(p, v, out_dtype=tl.float16)`), and 3500 times a block's "
        "P sum passes 65504; the numerics model predicts inf on exactly this cell (docs/numerics.md)."),
    ("sm80-fp16-cuda-fp16acc", "qwen_image_b52_value_offset"): (
        "sageattn_qk_int8_pv_fp16_cuda with pv_accum_dtype='fp16+fp32' returns inf on this file: measured "
        "on the H200 in device run 5 (2026-11-30, torch 2.11.0+cu130, SageAttention 2.2.0; "
        "docs/results/run5-h200x2-pytest-slow/), where the same kernel with fp32 accumulation gave "
        "0.0012 relative L2. The fp16 accumulator of each 64-key block overflows (V near 3500 times a "
        "block of softmax weights passes fp16's 65504), as upstream warns for this mode (thu-ml #93); "
        "the numerics model predicts inf on exactly this cell. No GPU's wrapper default uses this variant."),
}

# FP8 P.V quantizes V per channel with scale max |v| / scale_max and no epsilon (upstream fused.cu
# MeanScaleKernel), so a channel that is zero in every token divides 0 by 0.
_ZERO_V = (
    "{function} returns NaN when a V channel is zero in every token, as in IP-Adapter's unconditional "
    "batch item (the image projection of a zero embedding): measured on the H200 in device run 8 "
    "(2026-11-30, torch 2.11.0+cu130, SageAttention 2.2.0; "
    "docs/results/run8-h200x2-final/suite/gpu_results.json.gz); the V scale of such a channel is 0, with no "
    "epsilon, and the numerics model predicts NaN on exactly these cells (docs/numerics.md). Field "
    "report: black images with IP-Adapter, fixed by an epsilon (cubiq/ComfyUI_IPAdapter_plus PR #784).")
for _variant, _function in (("sm89-fp8-cuda", "sageattn_qk_int8_pv_fp8_cuda"),
                            ("sm89-fp8-cuda-fp32acc", "sageattn_qk_int8_pv_fp8_cuda"),
                            ("sm90-fp8-cuda", "sageattn_qk_int8_pv_fp8_cuda_sm90"),
                            ("sm120-fp8-perwarp", "sageattn_qk_int8_pv_fp8_cuda"),
                            ("sm120-fp8-perwarp-fp32acc", "sageattn_qk_int8_pv_fp8_cuda")):
    for _fixture in ("flux1_ip_adapter_zero_uncond", "sdxl_ip_adapter_zero_uncond"):
        KNOWN_DEFECTS[(_variant, _fixture)] = _ZERO_V.format(function=_function)

# comfy-kitchen 0.2.40 (PyPI wheel, build sha256:65f98cf1050cc674) on the H200, torch 2.11.0+cu130,
# 2026-12-04: certify run 35 (docs/results/run35-h200/certify/) and its GPU tests, run 36
# (docs/results/run36-h200-comfy-kitchen/). Its numerics model lands within 8.7 % of the kernel's
# relative L2 on every fixture (numerics_vs_kernel.md there); these cells miss their budgets all the same.
_CK = "comfy_kitchen int8_attention (ck-int8-cuda), runs 35 and 36 on the H200: "
KNOWN_DEFECTS.update({
    ("ck-int8-cuda", "qwen_image_b0_outlier_head"): _CK + (
        "relative L2 0.438 and output norm 1.128 of the reference (budget 1.116): Q and K share one "
        "outlier channel near 600, and the block-Hadamard rotation spreads it over every channel before "
        "INT8 quantization (thu-ml's sm90 kernel: 0.097 on this file)."),
    ("ck-int8-cuda", "krea2_b0_outlier_gqa"): _CK + (
        "relative L2 0.508 (within its model-derived budget 0.58, as the rotation predicts): unfit for "
        "Krea-2, past the fixture's fitness bound 0.3 (sage_qual/verdicts/fitness.py), and over the "
        "first-call check's 0.3, so the wrapper keeps the call on torch and the served-call test fails."),
    ("ck-int8-cuda", "qwen_image_b52_value_sinks"): _CK + (
        "output norm 0.968 of the reference (budget 0.9938) and worst head cosine 0.9983 (budget 0.9992)."),
    ("ck-int8-cuda", "flux2_joint_padded_text"): _CK + (
        "output norm 1.0023 of the reference, over its budget of 1.002; the model does not carry the "
        "kernel's small norm bias."),
    # Certify run 40 (docs/results/run40-h200/certify/, build sha256:83ecf6af24833fba), same
    # measurement as the accuracy test: masked calls stay on torch for comfy-kitchen on the H200.
    ("ck-int8-cuda", "qwen_image_padded_prompt_batch"): (
        "comfy_kitchen int8_attention (ck-int8-cuda), certify run 40 on the H200: on the masked "
        "Qwen-Image batch, relative L2 0.0151 (model 0.0133, budget 0.01467) and output norm 1.005 of the "
        "reference (budget 1.002): the kernel's norm bias again, which the model does not carry."),
})

# Long calls (tests_gpu/test_long_calls.py): (variant, call of test_long_calls.CALLS) -> what was
# measured. comfy-kitchen's "norm bias" of runs 35-43 (1.007-1.009 against budgets of 1.007) was the
# long checks' model running a key tile of 64 where the kernel runs 128 past 1,024 keys; with the
# call's scheme (issue 54) its 4,096- and 32,768-token calls pass (device run 49, H100).
LONG_CALL_DEFECTS: dict[tuple[str, str], str] = {
    ("ck-int8-cuda", "75.6k"): (
        "comfy_kitchen int8_attention (ck-int8-cuda), device run 49 on the H100 (comfy-kitchen 0.2.40, "
        "2026-12-07): at the Wan 2.2 call of 75,600 tokens and 40 heads, a worst query-row block of "
        "0.04566 relative L2 against the model's budget of 0.04499; certify run 48 measured the same "
        "(docs/results/run48-h100/)."),
}


# Where the numerics model misses the kernel by more than model_check.TOLERANCE
# (tests_gpu/test_numerics_vs_kernel.py): (variant, fixture stem) -> what was measured.
MODEL_MISSES: dict[tuple[str, str], str] = {
    ("ck-int8-cuda", "qwen_image_padded_prompt_batch"): (
        "comfy_kitchen int8_attention (ck-int8-cuda) with the fixture's [2, 1, 1, N] key mask: kernel "
        "relative L2 0.0151, model 0.0133 (model / kernel 0.883), output norm 1.005 against the model's "
        "1.001; the same numbers on the H200 (certify run 40, docs/results/run40-h200/) and the H100 "
        "(run 42, docs/results/run42-h100/pytest-call1/numerics_vs_kernel.md): the kernel's norm bias, "
        "which the model "
        "does not carry; the masked Z-Image batch agrees (0.994)."
    ),
}


def model_miss_marks(variant: str, fixture: str) -> list:
    import pytest

    reason = MODEL_MISSES.get((variant, fixture))
    return [pytest.mark.xfail(strict=True, raises=AssertionError, reason=reason)] if reason else []


def long_call_marks(variant: str, call: str) -> list:
    import pytest

    reason = LONG_CALL_DEFECTS.get((variant, call))
    return [pytest.mark.xfail(strict=True, raises=AssertionError, reason=reason)] if reason else []


def marks(variant: str, fixture: str) -> list:
    import pytest

    reason = KNOWN_DEFECTS.get((variant, fixture))
    return [pytest.mark.xfail(strict=True, raises=AssertionError, reason=reason)] if reason else []


def unlisted(results_path) -> list[dict]:
    """Accuracy rows of a `pytest -m slow` results table that were non-finite as the model predicted
    and are not in KNOWN_DEFECTS yet: each becomes an entry with its numbers."""
    rows = json.loads(open(results_path).read())
    return [r for r in rows if r.get("test") == "accuracy" and r.get("finite") is False
            and r.get("model_finite") is False and (r["variant"], r["fixture"]) not in KNOWN_DEFECTS]


if __name__ == "__main__":
    for row in unlisted(sys.argv[1]):
        print(f"{row['variant']} on {row['fixture']} ({row['gpu']}): non-finite, rel L2 {row['rel_l2']}, "
              f"family {row.get('family')}")
