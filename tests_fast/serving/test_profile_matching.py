"""Which profile entry a device gets, and what a person is told (issue 19 item 5, issue 17 item 3):
GPU names without case or space, a near match (another torch patch release) applies, a mismatch is
one WARNING naming the nearest entry and what differs, a family the nearest entry keeps off stays
off, profile errors come first, and every status line stays at most 200 characters with the full
lists in attributes."""

import copy
import json
import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from packaging.version import Version

import sage_qual
from sage_qual.limits import STATUS_LINE_LIMIT
from sage_qual.serving import profile_matching as matching
from sage_qual.testing import FakeCuda, FakeGpu, FakeSageAttention

from ..builders import H200, machine, make_entry, make_gpu, make_profile, reason
from ..helpers import builtin_sm90_thresholds, records

CURRENT = (
    Path(__file__).resolve().parent.parent.parent / "docs/results/run11-h200x2/certify-gpu0/profile.json"
)
OFF = make_entry(variant=None, reasons=[reason("non_finite", "sm90-fp8-cuda on flux1_ip: NaN")])


def install(gpus=(H200,), sage=True, **options):
    fake = FakeSageAttention()
    with FakeCuda(list(gpus)):
        if not sage:
            return sage_qual.install(**options)
        with fake.installed():
            return sage_qual.install(**options)


def warnings(caplog):
    return records(caplog, logging.WARNING)


# GPU names ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["fake h200", "  FAKE H200 ", "Fake H200\n"])
def test_gpu_names_compare_without_case_or_surrounding_space(name):
    certified = make_profile(make_gpu(entry=make_entry(min_q=4096)))
    certified["gpus"][0]["name"] = name
    [only] = matching.device_configs(certified, [machine(H200)])
    assert only.matched and only.config.min_query_tokens == 4096


def test_inner_spaces_and_other_models_still_differ():
    certified = make_profile(make_gpu(entry=make_entry(min_q=4096)))
    certified["gpus"][0]["name"] = "FakeH200"
    [only] = matching.device_configs(certified, [machine(H200)])
    assert not only.matched and only.config.min_query_tokens != 4096


# Near match: the same model with another torch patch release ----------------------------------------
@pytest.mark.parametrize("certified_torch, here, applies", [
    ("2.11.0+cu130", "2.11.1+cu130", True),
    ("2.11.1+cu130", "2.11.0+cu130", True),
    ("2.11.0+cu130", "2.12.0+cu130", False),  # another minor release: SDPA backends may change
    ("2.11.0+cu130", "2.11.1+cu128", False),  # another CUDA build of torch
    ("2.11.0+cu130", "2.11.0", False),
])
def test_another_torch_patch_release_is_a_near_match_that_applies(certified_torch, here, applies):
    certified = make_profile(make_gpu(entry=make_entry(min_q=4096), torch_version=certified_torch))
    [only] = matching.device_configs(certified, [machine(H200, torch_version=here)])
    assert only.matched == applies
    assert (only.config.min_query_tokens == 4096) == applies
    if applies:
        said = f"near match (torch {certified_torch} measured, {here} here): profile entry Fake"
        assert only.note.startswith(said)


def another_patch_release(version: str) -> str:
    release = Version(version)
    local = f"+{release.local}" if release.local else ""
    return f"{release.major}.{release.minor}.{release.micro + 1}{local}"


def test_a_near_match_is_not_a_warning(caplog):
    certified = make_profile(make_gpu(entry=make_entry("sm90-fp8-cuda", 4096, 512),
                                      torch_version=another_patch_release(torch.__version__)))
    status = install(profile=certified)
    assert status.enabled and status.devices[0].config.min_query_tokens == 4096
    assert warnings(caplog) == []


# A mismatch: one WARNING, naming the nearest entry and what differs ---------------------------------
def test_a_mismatch_is_one_warning_naming_the_nearest_entry_and_what_differs(caplog):
    other_torch = make_gpu(entry=make_entry("sm90-fp8-cuda", 4096, 512), torch_version="1.0.0")
    other_model = make_gpu(gpu=FakeGpu((8, 9), "Fake RTX 4090", 24.0))
    status = install(gpus=(H200, H200), profile=make_profile(other_model, other_torch))
    assert status.enabled
    [warning] = warnings(caplog)
    assert len(warning) <= STATUS_LINE_LIMIT
    assert warning.startswith("profile: cuda:0 and 1 more GPUs: no profile entry matches")
    assert f"no profile entry matches: defaults here ({builtin_sm90_thresholds()} tokens)" in warning
    said = f"nearest Fake H200 (sm_90) differs: torch 1.0.0 measured, {torch.__version__} here"
    assert warning.endswith(said)


def test_a_matching_profile_warns_nothing(caplog):
    assert install(profile=make_profile(entry=make_entry("sm90-fp8-cuda", 4096, 512))).enabled
    assert warnings(caplog) == []


# A family the nearest entry keeps off is never served by the defaults --------------------------------
def test_a_family_the_nearest_entry_keeps_off_stays_off():
    families = {"FLUX.1": OFF, "Wan 2.2": make_entry()}
    certified = make_profile(make_gpu(torch_version="1.0.0", families=families))
    status = install(profile=certified, family="FLUX.1")
    assert not status.enabled
    [device] = status.devices
    assert device.variant is None and device.profile_reasons == ("sm90-fp8-cuda on flux1_ip: NaN",)
    assert "the nearest keeps family FLUX.1 off, so off here" in status.reason
    assert len(status.reason) <= STATUS_LINE_LIMIT
    # A family it serves gets the defaults (it was not certified with this torch), with the warning.
    served = install(profile=certified, family="Wan 2.2")
    assert served.enabled and served.devices[0].variant.name == "sm90-fp8-cuda"


def test_all_families_kept_off_by_the_nearest_entry_stay_off_without_a_family():
    status = install(profile=make_profile(make_gpu(entry=OFF, sageattention="2.1.1")))
    assert not status.enabled and "nearest keeps all families off" in status.reason


# Profile errors come first ---------------------------------------------------------------------------
@pytest.mark.parametrize("gpus, sage", [((), True), ((), False), ((H200,), False)])
@pytest.mark.parametrize("content, message", [(None, "cannot read profile"), ("garbage", "is not JSON")])
def test_a_broken_profile_is_reported_whatever_the_machine_lacks(tmp_path, gpus, sage, content, message):
    path = tmp_path / "profile.json"
    if content is not None:
        path.write_text(content)
    status = install(gpus=gpus, sage=sage, profile=path)
    assert not status.enabled and message in status.reason


def test_a_good_profile_on_a_box_without_gpu_names_the_missing_gpu():
    status = install(gpus=(), sage=False, profile=make_profile())
    assert status.reason.startswith("no CUDA GPU is visible")


# Status lines a person can act on --------------------------------------------------------------------
def h200_profile_for_this_machine() -> dict:
    """The committed H200 profile of run 11 (FLUX.1 and SDXL fail, four families enabled), made to
    match the fake H200 of this test."""
    data = json.loads(CURRENT.read_text())
    data["gpus"][0].update(name=H200.name, memory_gib=H200.memory_gib)
    data["gpus"][0]["environment"].update(torch=torch.__version__, torch_cuda="13.0", sageattention="2.2.0")
    return data


def test_a_profile_without_family_says_in_one_line_which_families_it_enables_and_how_to_pick_one():
    certified = h200_profile_for_this_machine()
    status = install(profile=copy.deepcopy(certified))
    assert not status.enabled and len(status.reason) <= STATUS_LINE_LIMIT and "\n" not in status.reason
    assert "enables only Z-Image, Qwen-Image, Krea-2, Wan 2.2 here" in status.reason
    assert 'install(profile=..., family="Wan 2.2")' in status.reason
    [device] = status.devices
    assert device.profile_reasons == tuple(r["detail"] for r in certified["gpus"][0]["default"]["reasons"])
    assert len(device.profile_reasons) == 16
    picked = install(profile=copy.deepcopy(certified), family="Wan 2.2")
    assert picked.enabled and picked.devices[0].config.min_query_tokens == 9728


def test_a_scope_summary_stays_one_short_line_with_its_details_intact():
    certified = h200_profile_for_this_machine()
    status = install(profile=copy.deepcopy(certified))
    with sage_qual.sage_attention_scope() as report:
        pass
    assert report.not_installed == status.reason
    assert len(report.summary()) <= STATUS_LINE_LIMIT
    with FakeCuda([H200]), FakeSageAttention().installed():
        assert sage_qual.install(config=sage_qual.WrapperConfig(min_query_tokens=32, min_key_tokens=16,
                                                                check_rows=16)).enabled
        long_mask = torch.zeros(1, 1, 48, 24, dtype=torch.bool)
        q = torch.randn(1, 2, 48, 64, dtype=torch.float16)
        k = torch.randn(1, 2, 24, 64, dtype=torch.float16)
        with sage_qual.sage_attention_scope() as report:
            F.scaled_dot_product_attention(q, k, k, attn_mask=long_mask)
            F.scaled_dot_product_attention(q, k, k, dropout_p=0.5)
            F.scaled_dot_product_attention(q.float(), k.float(), k.float())
            F.scaled_dot_product_attention(q[..., :40], k[..., :40], k[..., :40])
            F.scaled_dot_product_attention(q[:, :, :8], k, k)
    assert len(report.fallbacks) == 5 and report.calls == 5
    summary = report.summary()
    assert len(summary) <= STATUS_LINE_LIMIT
    assert all(f"{reason}=1" in summary for reason in report.fallbacks)
    assert "dtype=(torch.float32" in report.details["dtype"]  # the detail the line left out


# Everything that binds an entry ranks it (issue 43) --------------------------------------------------
def with_binding(gpu: dict, source: str = "", sm_count=None) -> dict:
    gpu = copy.deepcopy(gpu)
    gpu["environment"]["sageattention_source"] = source
    gpu["sm_count"] = sm_count
    return gpu


SERVING = make_gpu(entry=make_entry(min_q=1024, min_k=1024))
KEEPING_OFF = make_gpu(entry=OFF)


@pytest.mark.parametrize("order", ["other-first", "this-first"])
def test_the_entry_of_this_build_wins_over_another_builds_whatever_the_order(order):
    """Issue 43's case: two entries that differ only in the build; the other build's serves, this
    build's keeps everything off. Ranked without the build, the first was picked, found to differ,
    and the defaults served what this build's entry keeps on torch."""
    other, this = with_binding(SERVING, source="aaaa"), with_binding(KEEPING_OFF, source="bbbb")
    certified = make_profile(*((other, this) if order == "other-first" else (this, other)))
    [only] = matching.device_configs(certified, [machine(H200, source="bbbb")])
    assert only.matched and only.config.kernel_table[H200.capability] == ()
    assert "certifies no SageAttention variant" in only.note


@pytest.mark.parametrize("order", ["other-first", "this-first"])
def test_the_entry_of_this_sm_count_wins_over_a_cut_down_dies(order):
    cut, full = with_binding(KEEPING_OFF, sm_count=114), with_binding(SERVING, sm_count=132)
    certified = make_profile(*((cut, full) if order == "other-first" else (full, cut)))
    [only] = matching.device_configs(certified, [machine(H200, sm_count=132)])
    assert only.matched and only.config.min_query_tokens == 1024


def test_an_exact_match_wins_over_a_near_one():
    """A near match (another torch patch release) applies only when nothing matches exactly."""
    near = make_gpu(entry=make_entry(min_q=8192), torch_version=another_patch_release(torch.__version__))
    exact = make_gpu(entry=make_entry(min_q=1024))
    for gpus in ((near, exact), (exact, near)):
        [only] = matching.device_configs(make_profile(*gpus), [machine(H200)])
        assert only.matched and only.config.min_query_tokens == 1024 and not only.note.startswith("near")


def test_an_unrecorded_build_or_sm_count_is_not_compared():
    certified = make_profile(with_binding(SERVING))
    [only] = matching.device_configs(certified, [machine(H200, source="bbbb", sm_count=132)])
    assert only.matched and only.config.min_query_tokens == 1024
