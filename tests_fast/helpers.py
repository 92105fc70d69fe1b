"""Helpers shared by the wrapper's tests: small attention inputs and an installed wrapper on fake GPUs."""

import contextlib
import itertools
from pathlib import Path

import torch
import torch.nn.functional as F

import sage_qual
from sage_qual.testing import FakeCuda, FakeGpu, FakeSageAttention

TORCH_SDPA = F.scaled_dot_product_attention  # torch's own function, read before any install
# Low thresholds keep tensors small where the test is not about the thresholds.
SMALL = sage_qual.WrapperConfig(min_query_tokens=32, min_key_tokens=16, check_rows=16)
Q_TOKENS, K_TOKENS = 48, 24


def rand(*shape, dtype=torch.float16, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def qkv(batch=1, heads=2, kv_heads=None, q_tokens=Q_TOKENS, k_tokens=K_TOKENS, head_dim=64,
        dtype=torch.float16, seed=0):
    kv_heads = kv_heads or heads
    return (rand(batch, heads, q_tokens, head_dim, dtype=dtype, seed=seed + 1),
            rand(batch, kv_heads, k_tokens, head_dim, dtype=dtype, seed=seed + 2),
            rand(batch, kv_heads, k_tokens, head_dim, dtype=dtype, seed=seed + 3))


@contextlib.contextmanager
def wrapped(gpus=((9, 0),), config=SMALL, fake=None, names=None, torch_cuda=(13, 0)):
    """The wrapper installed on fake GPUs of these capabilities (named GPU0, GPU1, ... unless `names`);
    yields (fake cuda, fake sageattention)."""
    fake = fake if fake is not None else FakeSageAttention()
    names = names or [f"GPU{i}" for i in range(len(gpus))]
    devices = [FakeGpu(cap, name) for cap, name in zip(gpus, names, strict=True)]
    with FakeCuda(devices, torch_cuda=torch_cuda) as cuda, fake.installed():
        status = sage_qual.install(config=config)
        assert status.enabled, status.reason
        yield cuda, fake


def records(caplog, level):
    """The messages sage_qual logged at this level."""
    return [r.getMessage() for r in caplog.records if r.name == "sage_qual" and r.levelno == level]


def retired(index=0):
    return {d.index: d for d in sage_qual.install_status().devices}[index].retired


def builtin_sm90_thresholds() -> str:
    """The built-in defaults' thresholds for the H200 ("Q/K"), as a note quotes them."""
    from sage_qual.serving import defaults
    [h200] = [gpu for gpu in defaults.read()[0].gpus if gpu.name == "NVIDIA H200"]
    return f"{h200.default.served.min_query_tokens}/{h200.default.served.min_key_tokens}"


RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results"


def flat(text: str) -> str:
    """`text` on one line, its runs of whitespace one space: a document's sentence however wrapped."""
    return " ".join(text.split())


def newest_certify_run(gpu: str = "") -> Path:
    """The newest run folder of docs/results/ (by its run number) that holds certify reports, of one
    GPU model where `gpu` names it as the folders do (h200, h100), else of any."""
    folders = [f for f in RESULTS.glob(f"run*-{gpu}*") if list(f.glob("certify*/report.json.gz"))]
    return max(folders, key=lambda folder: int(folder.name[3:].split("-")[0]))


def newest_h200_run() -> Path:
    return newest_certify_run("h200")


def table_rows(text: str, header: str) -> list[list[str]]:
    """The cells of the first Markdown table in `text` whose header row starts with `header` ("| code |"),
    each stripped of spaces and bold marks."""
    lines = text.splitlines()
    start = next(n for n, line in enumerate(lines) if line.startswith(header))
    rows = itertools.takewhile(lambda line: line.startswith("|"), lines[start + 2:])
    return [[cell.strip().replace("*", "") for cell in row.strip().strip("|").split("|")] for row in rows]
