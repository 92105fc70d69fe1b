"""A bounded profile on the GPU (issue 26): the wrapper serves exactly the range and bound it holds.

The profile is the one certify builds from run 25's H200 report (docs/results/run25-h200/certify/),
its machine fields set to this box's: FLUX.1 gets sm90-fp8-cuda from 10,624 to 32,768 tokens, with
calls of fewer than 17 keys kept on torch, because every CUDA kernel gave non-finite output on the
IP-Adapter fixture (4 keys, the unconditional item's K and V all zero) and passed flux1_two_images
(two batch items). On another GPU model the tests skip: the evidence is an H200's.
"""

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import sage_qual
from sage_qual.fixtures import fileformat
from sage_qual.qualification.decide import checked, verdict
from sage_qual.qualification.decide import profile as building
from sage_qual.serving import devices_here
from sage_qual.verdicts import profile

from .conftest import FIXTURE_DIR

pytestmark = [pytest.mark.slow, pytest.mark.gpu]

RUN25 = Path(__file__).resolve().parents[1] / "docs" / "results" / "run25-h200" / "certify" / "report.json.gz"
IP_ADAPTER = FIXTURE_DIR / "flux1_ip_adapter_zero_uncond.safetensors"


@pytest.fixture(scope="module")
def run25_profile(sage) -> profile.Profile:
    data = checked.load(RUN25)
    built = building.build(data, verdict.decide(data))
    [gpu], here = built.gpus, devices_here.this_machine()[0]
    if not profile.same_gpu_name(gpu.name, here.name) or tuple(gpu.capability) != here.capability:
        pytest.skip(f"run 25's profile is an {gpu.name}'s; this GPU is {here.name}")
    environment = dataclasses.replace(gpu.environment, torch=here.torch, torch_cuda=here.torch_cuda,
                                      sageattention=here.sageattention)
    gpu = dataclasses.replace(gpu, memory_gib=here.memory_gib, environment=environment)
    return dataclasses.replace(built, gpus=[gpu])


def flux1_entry(run25_profile, **changes) -> profile.Profile:
    """The profile with what its FLUX.1 entry serves changed as a hand edit would."""
    [gpu] = run25_profile.gpus
    entry = gpu.families["FLUX.1"]
    served = dataclasses.replace(entry.served, **changes)
    families = {**gpu.families, "FLUX.1": dataclasses.replace(entry, served=served)}
    return dataclasses.replace(run25_profile, gpus=[dataclasses.replace(gpu, families=families)])


@pytest.fixture
def installed():
    def install(certified: profile.Profile):
        sage_qual.uninstall()
        status = sage_qual.install(profile=certified, family="FLUX.1")
        assert status.enabled, status.reason
        return status

    yield install
    sage_qual.uninstall()


def joint(tokens: int, kv_tokens: int | None = None):
    g = torch.Generator(device="cuda").manual_seed(tokens)
    q = torch.randn(1, 24, tokens, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    kv = torch.randn(1, 24, kv_tokens or tokens, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    return q, kv, kv


def ip_adapter():
    fixture = fileformat.load_fixture(IP_ADAPTER, device="cuda")
    return fixture.q, fixture.k, fixture.v


def routed(q, k, v):
    with sage_qual.sage_attention_scope() as report:
        out = F.scaled_dot_product_attention(q, k, v)
    torch.cuda.synchronize()
    return report, out


def test_the_run_25_entry_is_the_bounded_one(run25_profile):
    served = run25_profile.gpus[0].families["FLUX.1"].served  # decided as tests_fast/decide/test_bounds.py
    assert (served.variant, served.min_key_tokens, served.max_query_tokens) == ("sm90-fp8-cuda", 12672, 32768)
    assert [(b.side, b.below) for b in served.bounds] == [("key", 17)]


# Relative to the entry: below its threshold, at it, FLUX.1's 2048² call, its verified end and past it.
EDGES = [(-1, "min", "short"), (0, "min", None), (16896, None, None), (0, "max", None), (1, "max", "long")]


@pytest.mark.parametrize(("offset", "edge", "fallback"), EDGES,
                         ids=["below-min", "min", "2048sq", "max", "past-max"])
def test_the_profile_serves_its_range_and_no_more(run25_profile, installed, offset, edge, fallback):
    served = run25_profile.gpus[0].families["FLUX.1"].served
    tokens = offset + {"min": served.min_query_tokens, "max": served.max_query_tokens, None: 0}[edge]
    installed(run25_profile)
    report, out = routed(*joint(tokens))
    if fallback is None:
        assert report.served == 1, dict(report.fallbacks)
        assert bool(torch.isfinite(out).all())
    else:
        assert (report.served, dict(report.fallbacks)) == (0, {fallback: 1})


def test_the_ip_adapter_call_is_short_under_the_certified_thresholds(run25_profile, installed):
    installed(run25_profile)
    q, k, v = ip_adapter()
    report, out = routed(q, k, v)
    assert dict(report.fallbacks) == {"short": 1}
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v))


def test_with_the_thresholds_lowered_by_hand_the_bound_keeps_it_on_torch(run25_profile, installed):
    installed(flux1_entry(run25_profile, min_query_tokens=1, min_key_tokens=1))
    q, k, v = ip_adapter()
    report, out = routed(q, k, v)
    assert dict(report.fallbacks) == {"bound": 1}, report.details
    assert "calls with fewer than 17 keys stay on torch" in report.details["bound"]
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v)) and bool(torch.isfinite(out).all())
    seventeen = routed(*joint(2048, kv_tokens=17))[0]  # the first key count past the bound is served
    assert seventeen.served == 1, dict(seventeen.fallbacks)


def test_without_the_bound_the_kernel_gets_the_ip_adapter_call(run25_profile, installed, record):
    """What the bound prevents: the same lowered entry without it hands the call to the kernel."""
    installed(flux1_entry(run25_profile, min_query_tokens=1, min_key_tokens=1, bounds=[]))
    report, out = routed(*ip_adapter())
    handed = report.served + report.fallbacks.get("kernel_error", 0)
    assert handed == 1, dict(report.fallbacks)
    record(test="bound-removed", variant="sm90-fp8-cuda", fixture=IP_ADAPTER.stem, kind="replica",
           served=report.served, kernel_error=report.fallbacks.get("kernel_error", 0),
           finite=bool(torch.isfinite(out).all()))
