"""The registry's kernel contract against the installed SageAttention: each kernel function's keyword
names and defaults, as `sage_qual.kernels.variants.KERNEL_FUNCTIONS` declares them (and the fake
kernels of `sage_qual.testing` are made from), and the malformed calls the real kernels refuse
before they launch, which the fakes refuse too.
"""

import concurrent.futures
import inspect
import json
import subprocess
import sys

import pytest

from sage_qual.kernels.variants import FP16_TRITON, KERNEL_FUNCTIONS, VARIANTS

pytestmark = [pytest.mark.slow, pytest.mark.gpu]


@pytest.mark.parametrize("function", list(KERNEL_FUNCTIONS))
def test_keyword_contract_matches_the_installed_kernel(function, packages, record):
    contract = KERNEL_FUNCTIONS[function]
    package = packages[contract.provider]
    if isinstance(package, str):
        pytest.skip(package)
    real = getattr(package.module, function, None)
    assert real is not None, f"{contract.provider} {package.version} has no {function}"
    parameters = list(inspect.signature(real).parameters.values())
    named = [(p.name, p.default) for p in parameters if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    record(test="kernel_contract", kind=function, keywords=", ".join(name for name, _ in named[3:]))
    assert [name for name, _ in named[:3]] == ["q", "k", "v"]
    assert named[3:] == list(contract.keywords)
    if contract.provider == "thu-ml":  # thu-ml's end in **kwargs: why every keyword is required by name
        assert parameters[-1].kind is inspect.Parameter.VAR_KEYWORD


# Each malformed call runs in a child process: a kernel that does not check a shape may crash the
# whole process (sm80-fp16-cuda segfaulted on one in-process here, H200, docs/results/README.md) and a
# test must never take the suite down with it.
CHILD = """
import json, sys, torch
from sage_qual.kernels import sage_package
from sage_qual.kernels.providers import PROVIDERS
from sage_qual.kernels.variants import VARIANTS
variant, case = VARIANTS[sys.argv[1]], sys.argv[2]

def tensors(heads=4, kv_heads=2, q_tokens=256, kv_tokens=128, head_dim=64, dtype=torch.float16, batch=1):
    gen = torch.Generator("cuda").manual_seed(0)
    make = lambda h, n: torch.randn(batch, h, n, head_dim, device="cuda", dtype=dtype, generator=gen)
    return make(heads, q_tokens), make(kv_heads, kv_tokens), make(kv_heads, kv_tokens)

MALFORMED = {
    "float32": lambda: tensors(dtype=torch.float32),
    "head_dim=256": lambda: tensors(head_dim=256),
    "last_dim_not_contiguous": lambda: tuple(t.transpose(2, 3).contiguous().transpose(2, 3)
                                             for t in tensors()),
    "batch_mismatch": lambda: (tensors()[0], *tensors(batch=2)[1:]),
    "heads_not_a_multiple": lambda: tensors(heads=4, kv_heads=3),
    "head_dim_mismatch": lambda: (tensors()[0], *tensors(head_dim=128)[1:]),
}
kernel = sage_package.load(PROVIDERS[variant.provider]).kernel(variant)
try:
    kernel(*MALFORMED[case](), **variant.call_keywords(0.125))
    torch.cuda.synchronize()
    print(json.dumps({"outcome": "ran"}))
except (AssertionError, ValueError, RuntimeError) as error:
    torch.cuda.synchronize()  # the refusal happened before a launch: the context is still usable
    print(json.dumps({"outcome": "refused", "error": f"{type(error).__name__}: {error}"[:200]}))
"""
# Cases the kernels check before launch (core.py's asserts and ValueErrors, the C++ CHECK_SHAPE and
# num_qo_heads % num_kv_heads); True: a shape check, which upstream's Triton kernel does not make.
MALFORMED = {"float32": False, "head_dim=256": False, "last_dim_not_contiguous": False,
             "batch_mismatch": True, "heads_not_a_multiple": True, "head_dim_mismatch": True}


# What comfy-kitchen's int8_attention takes where thu-ml's kernels refuse it: float32 inputs and a
# head_dim up to 256 (padded to its 256-wide tile).
TAKEN_BY_COMFY_KITCHEN = ("float32", "head_dim=256")


def _child_outcome(variant_name: str, case: str) -> str:
    result = subprocess.run([sys.executable, "-c", CHILD, variant_name, case], capture_output=True,
                            text=True, timeout=180)
    lines = result.stdout.strip().splitlines()
    if result.returncode == 0 and lines:
        return json.loads(lines[-1])["outcome"]
    return f"crashed (exit {result.returncode})"


@pytest.fixture(scope="module")
def malformed_outcomes(gpu0):
    """Every (variant, case) child at once, eight at a time: each spends seconds importing torch."""
    cells = [(v, c) for v in VARIANTS if not gpu0.reasons[v] for c in MALFORMED
             if not (MALFORMED[c] and VARIANTS[v].function == FP16_TRITON)
             and not (c in TAKEN_BY_COMFY_KITCHEN and VARIANTS[v].provider == "comfy-kitchen")]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        return dict(zip(cells, pool.map(lambda cell: _child_outcome(*cell), cells), strict=True))


@pytest.mark.parametrize("case", list(MALFORMED))
@pytest.mark.parametrize("variant_name", list(VARIANTS))
def test_the_real_kernel_never_runs_what_the_fake_refuses(variant_name, case, runnable, record,
                                                          malformed_outcomes):
    """The fake refuses these calls; the real kernel must not run them either: it refuses them, or
    crashes its (child) process, which is why the wrapper keeps them from it."""
    runnable(variant_name)
    if MALFORMED[case] and VARIANTS[variant_name].function == FP16_TRITON:
        pytest.skip("upstream's Triton kernel does not check shapes and would read out of bounds")
    if case in TAKEN_BY_COMFY_KITCHEN and VARIANTS[variant_name].provider == "comfy-kitchen":
        pytest.skip(f"comfy-kitchen takes {case} (sage_attention.py, _validate_inputs)")
    outcome = malformed_outcomes[(variant_name, case)]
    record(test="kernel_contract_malformed", variant=variant_name, kind=case, outcome=outcome)
    assert outcome != "ran", f"{variant_name} ran a call the fake refuses ({case})"
