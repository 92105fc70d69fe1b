"""The per-GPU profile: break-even thresholds, conversion to a WrapperConfig, and install(profile=...)
changing which calls the wrapper serves (fake CUDA and fake sageattention on CPU tensors)."""

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import sage_qual
from sage_qual import records
from sage_qual.qualification.decide import bounds, checked, verdict
from sage_qual.qualification.decide import profile as building
from sage_qual.qualification.measure import judge, speed
from sage_qual.qualification.measure.speed import Thresholds, break_even
from sage_qual.serving import profile_matching as matching
from sage_qual.serving.config import DEFAULT_CONFIG, KERNEL_TABLE
from sage_qual.testing import FakeCuda, FakeGpu, FakeSageAttention, on_device
from sage_qual.verdicts import profile

from ..builders import (
    H100,
    H200,
    RTX4090,
    edited,
    flat_entry,
    machine,
    make_entry,
    make_gpu,
    make_profile,
    reason,
    refusal,
    with_default,
)
from ..helpers import builtin_sm90_thresholds

TORCH_SDPA = F.scaled_dot_product_attention  # torch's own, read before any install


# break_even ------------------------------------------------------------------------------------
def self_points(speedups: dict[int, float], head_dim: int = 128):
    return [(n, n, head_dim, x) for n, x in speedups.items()]


def test_break_even_is_the_first_length_from_which_every_shape_was_faster():
    result = break_even(self_points({1024: 0.8, 2048: 1.1, 4096: 1.3, 8192: 1.5}))
    assert result == Thresholds(min_query_tokens=2048, min_key_tokens=2048, head_dims=[128],
                                served_shapes=3, measured_shapes=4)


def test_break_even_keeps_short_keys_out_when_they_were_slower():
    points = self_points({1024: 0.8, 2048: 1.1, 4096: 1.3}) + [(4096, 77, 128, 0.7), (4096, 512, 128, 1.05)]
    result = break_even(points)
    assert (result.min_query_tokens, result.min_key_tokens, result.served_shapes) == (2048, 512, 3)


def test_break_even_none_when_never_faster_and_equal_is_not_faster():
    assert break_even(self_points({1024: 0.5, 4096: 0.9, 16384: 1.0})) is None


def test_a_failure_at_the_largest_shape_serves_nothing():
    # The failed shape (speedup 0) is the largest: every threshold pair would serve it.
    assert break_even(self_points({2048: 1.2, 4096: 1.4, 8192: 0.0})) is None


def test_a_head_size_that_is_slower_everywhere_is_left_out():
    points = (self_points({1024: 0.9, 4096: 1.3, 16384: 1.6})
              + self_points({1024: 0.5, 4096: 0.8, 16384: 0.9}, head_dim=64))
    result = break_even(points)
    assert (result.head_dims, result.min_query_tokens, result.served_shapes) == ([128], 4096, 2)


# Profiles: reading, validation, and each device's own configuration ---------------------------
def test_a_matching_device_gets_the_entry_and_others_keep_the_table():
    [only] = matching.device_configs(make_profile(entry=make_entry(min_q=4096, min_k=1024)),
                                    [machine(H200)])
    config = only.config
    assert config.kernel_table[(9, 0)] == ("sm89-fp8-cuda",)
    assert (config.min_query_tokens, config.min_key_tokens, config.head_dims) == (4096, 1024, (128,))
    assert {c: v for c, v in config.kernel_table.items() if c != (9, 0)} == \
        {c: v for c, v in KERNEL_TABLE.items() if c != (9, 0)}
    assert only.note.startswith("profile entry Fake H200 (sm_90): sm89-fp8-cuda >= 4096/1024")


def test_an_entry_without_a_variant_leaves_the_gpu_without_kernel():
    [only] = matching.device_configs(make_profile(entry=make_entry(variant=None)), [machine(H200)])
    assert only.config.kernel_table[(9, 0)] == ()
    assert only.config.min_query_tokens == DEFAULT_CONFIG.min_query_tokens


def test_the_family_entry_is_taken():
    families = {"FLUX.1": make_entry("sm90-fp8-cuda", 4608, 512)}
    [only] = matching.device_configs(make_profile(families=families), [machine(H200)], family="flux.1")
    assert only.config.kernel_table[(9, 0)] == ("sm90-fp8-cuda",) and only.config.min_query_tokens == 4608
    with pytest.raises(profile.ProfileError, match="no entry for family SDXL"):
        matching.device_configs(make_profile(families=families), [machine(H200)], family="SDXL")


@pytest.mark.parametrize("device, why", [
    (machine(H100),
     "nearest Fake H200 (sm_90) differs: GPU Fake H200 (sm_90) measured, Fake H100 (sm_90) here"),
    (machine(FakeGpu((9, 0), "Fake H200", 80.0)),
     "nearest Fake H200 (sm_90) differs: memory 141 GiB measured, 80 here"),
    (machine(H200, torch_version="1.0.0"),
     f"nearest Fake H200 (sm_90) differs: torch {torch.__version__} measured, 1.0.0 here"),
    (machine(H200, torch_cuda="12.8"), "nearest Fake H200 (sm_90) differs: CUDA 13.0 measured, 12.8 here"),
    (machine(H200, sageattention="2.2.1"),
     "nearest Fake H200 (sm_90) differs: sageattention 2.2.0 measured, 2.2.1 here"),
])
def test_a_device_the_profile_does_not_describe_keeps_the_defaults_and_says_why(device, why):
    [only] = matching.device_configs(make_profile(entry=make_entry(min_q=9999)), [device])
    assert only.config == DEFAULT_CONFIG
    assert why in only.note and "no profile entry matches: defaults here (1536/512 tokens)" in only.note
    assert not only.matched


BAD_ENTRIES = {
    "unknown variant": (
        edited(make_entry(), variant="sm91-turbo"),
        "default.served.variant: 'sm91-turbo' is not a SageAttention",
    ),
    "negative threshold": (
        edited(make_entry(), min_query_tokens=-5),
        "default.served.min_query_tokens: is -5, expected a token count",
    ),
    "threshold a string": (
        edited(make_entry(), min_key_tokens="512"),
        "default.served.min_key_tokens: is the string '512', expected an integer",
    ),
    "float threshold": (
        edited(make_entry(), min_key_tokens=512.5),
        "default.served.min_key_tokens: is a number",
    ),
    "head dim the kernels do not take": (
        edited(make_entry(), head_dims=[96]),
        "96 is not a head size the kernels take",
    ),
    "no head dims": (edited(make_entry(), head_dims=[]), "default.served.head_dims: empty"),
    "thresholds beside no served record": (
        {**make_entry(variant=None), "min_query_tokens": 4096},
        "default.min_query_tokens: unknown key",
    ),
    "reason of a kind no verdict gives": (
        {**make_entry(variant=None), "reasons": [{"kind": "vibes", "detail": "x"}]},
        "default.reasons[0].kind: is the string 'vibes', expected one of 'accuracy'",
    ),
}


@pytest.mark.parametrize("name", BAD_ENTRIES)
def test_a_profile_with_bad_values_is_refused(name):
    entry, message = BAD_ENTRIES[name]
    said = refusal(entry)
    assert message in said and "\n" not in said


@pytest.mark.parametrize("content, message", [
    ('{"kind": "sage-qual-report"}', "is not a sage-qual profile"),
    ('{"kind": "sage-qual-profile", "schema_version": 7}', "schema version 7"),
    ("nope", "is not JSON"),
    ('{"kind": "sage-qual-profile", "schema_version": 2, "gpus": []', "cut short"),
])
def test_load_refuses_what_is_not_a_profile(tmp_path, content, message):
    path = tmp_path / "profile.json"
    path.write_text(content)
    with pytest.raises(profile.ProfileError, match=message):
        profile.load(path)


def test_one_machine_twice_is_refused_and_another_software_is_another_entry():
    """Issue 28: the same GPU model twice was read, and which entry served was left to their order."""
    data = make_profile()
    data["gpus"].append({**copy.deepcopy(data["gpus"][0]), "default": make_entry(min_q=4096)})
    with pytest.raises(
        profile.ProfileError,
        match=r"gpus\[1\]: Fake H200 \(sm_90\) with this memory, SM count and "
        r"software is gpus\[0\] already",
    ):
        profile.load(data)
    assert len(profile.load(make_profile(make_gpu(), make_gpu(torch_version="2.12.0"))).gpus) == 2


@pytest.mark.parametrize("where", ["default", "families.FLUX.1"])
def test_an_entry_serving_a_variant_its_gpu_cannot_run_is_refused(where):
    """sm90-fp8-cuda (sm_90 only) on an RTX 4090's entry was read and failed its first call there."""
    sm90 = make_entry(variant="sm90-fp8-cuda")
    data = make_profile(make_gpu(H200, sm90 if where == "default" else None,
                                 {"FLUX.1": sm90} if where != "default" else None))
    assert profile.load(data).gpus[0].label == "Fake H200 (sm_90)"  # where it runs
    data["gpus"][0].update(name=RTX4090.name, capability=list(RTX4090.capability))
    with pytest.raises(profile.ProfileError, match=rf"gpus\[0\]\.{where}\.variant: sm90-fp8-cuda does not "
                                                   r"run on sm_89 \(capability \[8, 9\]\)"):
        profile.load(data)


def test_a_negative_memory_size_is_refused():
    data = make_profile()
    data["gpus"][0]["memory_gib"] = -1
    with pytest.raises(profile.ProfileError, match=r"gpus\[0\]\.memory_gib: is -1(\.0)?, expected at least"):
        profile.load(data)


def test_a_version_1_profile_still_reads():
    old = {"kind": "sage-qual-profile", "schema_version": 1, "created": "2026-11-29T20:00:00+00:00",
           "host": "h", "gpu": {"name": "Fake H200", "capability": [9, 0]},
           "environment": make_gpu()["environment"], "fixtures": {}, "default": flat_entry(), "families": {}}
    loaded = profile.load(old)
    assert loaded.gpus[0].memory_gib is None and loaded.gpus[0].default.variant == "sm89-fp8-cuda"
    [only] = matching.device_configs(old, [machine(H200)])
    assert only.config.min_query_tokens == 2048


@pytest.mark.parametrize("change, message", [
    ({"gpu": {"name": "Fake H200", "capability": [9]}}, "profile: gpu.capability: has 1 items, expected 2"),
    ({"gpus": []}, "profile: gpus: unknown key"),
    ({"default": {**flat_entry(), "variant": "sm99-nope"}}, "profile: default.variant: 'sm99-nope' is not"),
])
def test_a_broken_version_1_profile_names_its_own_key(change, message):
    """A version 1 file is read by its own record: a problem names the key as that file spells it."""
    old = {"kind": "sage-qual-profile", "schema_version": 1, "created": "c", "host": "h",
           "gpu": {"name": "Fake H200", "capability": [9, 0]}, "environment": make_gpu()["environment"],
           "fixtures": {}, "default": flat_entry(), "families": {}, **change}
    with pytest.raises(profile.ProfileError) as refused:
        profile.load(old)
    assert str(refused.value).startswith(message) and "\n" not in str(refused.value), str(refused.value)


# install(profile=...) --------------------------------------------------------------------------
@pytest.fixture
def fake():
    fake = FakeSageAttention()
    with FakeCuda([H200]), fake.installed():
        yield fake


def attention(tokens: int, head_dim: int = 128, kv_tokens: int | None = None, device: int = 0):
    g = torch.Generator().manual_seed(tokens)
    q = torch.randn(1, 1, tokens, head_dim, generator=g, dtype=torch.bfloat16)
    kv = torch.randn(1, 1, kv_tokens or tokens, head_dim, generator=g, dtype=torch.bfloat16)
    if device:
        q, kv = (on_device(t, device) for t in (q, kv))
    with sage_qual.sage_attention_scope() as report:
        F.scaled_dot_product_attention(q, kv, kv)
    return report


def test_without_profile_the_default_thresholds_serve_1536_tokens():
    """On a compute capability nothing was measured on (sm_89 here) the built-in defaults change nothing."""
    fake = FakeSageAttention()
    with FakeCuda([RTX4090]), fake.installed():
        assert sage_qual.install().enabled
        assert attention(1536).served == 1


def test_profile_thresholds_decide_which_calls_are_served(fake):
    status = sage_qual.install(profile=make_profile(entry=make_entry("sm89-fp8-cuda", 2048, 512)))
    assert status.enabled, status.reason
    assert status.devices[0].variant.name == "sm89-fp8-cuda"
    assert dict(attention(1536).fallbacks) == {"short": 1}  # served without the profile
    assert dict(attention(2048, kv_tokens=256).fallbacks) == {"short": 1}
    assert attention(2048).served == 1
    assert dict(attention(2048, head_dim=64).fallbacks) == {"head_dim": 1}  # it measured slower at 64
    assert [c.function for c in fake.calls] == ["sageattn_qk_int8_pv_fp8_cuda"]


def test_profile_from_a_file(fake, tmp_path):
    path = tmp_path / "profile.json"
    building.save(profile.load(make_profile(entry=make_entry("sm90-fp8-cuda", 1024, 64))), path)
    status = sage_qual.install(profile=path)
    assert status.enabled and status.devices[0].variant.name == "sm90-fp8-cuda"
    assert attention(1024, kv_tokens=64).served == 1


def test_a_mixed_box_applies_the_profile_per_device():
    """H200 certified; an H100 (same capability) and an RTX 4090 in the same box keep the defaults: the
    H100 those of the built-in defaults for a GPU never measured on sm_90, the RTX 4090 today's."""
    fake = FakeSageAttention()
    with FakeCuda([H200, H100, RTX4090]), fake.installed():
        status = sage_qual.install(profile=make_profile(entry=make_entry("sm89-fp8-cuda", 16384, 16384)))
        assert status.enabled, status.reason
        h200, h100, rtx = status.devices
        assert h200.variant.name == "sm89-fp8-cuda"
        assert h200.profile_note.startswith("profile entry Fake H200")
        assert h100.variant.name == "sm90-fp8-cuda"  # the default table, not the H200's certified kernel
        assert rtx.variant.name == "sm89-fp8-cuda"
        for device in (h100, rtx):
            assert "no profile entry matches" in device.profile_note
            assert "defaults here" in device.profile_note
        assert (
            f"({builtin_sm90_thresholds()} tokens)" in h100.profile_note
            and "(1536/512 tokens)" in rtx.profile_note
        )
        # 4096 tokens: below the H200's certified 16,384 and the sm_90 built-in 16,384, above 1536
        assert dict(attention(4096, device=0).fallbacks) == {"short": 1}
        assert dict(attention(4096, device=1).fallbacks) == {"short": 1}
        assert attention(4096, device=2).served == 1
        assert f"{h100.config.min_query_tokens}/{h100.config.min_key_tokens}" == builtin_sm90_thresholds()
        assert [c.device for c in fake.calls] == [2]


@pytest.mark.parametrize("bad, message", [
    (make_profile(entry=make_entry(variant=None, reasons=[reason("accuracy",
                                                                 "sm90-fp8-cuda on qwen: L2 0.3")])),
     "the profile certifies no SageAttention variant on Fake H200 (sm_90): sm90-fp8-cuda on qwen: L2 0.3"),
    ({"kind": "something"}, "is not a sage-qual profile"),
    (with_default(edited(make_entry(), variant="sm91-turbo")), "is not a SageAttention variant"),
    (with_default(edited(make_entry(), min_query_tokens=-1)), "expected a token count of at least 1"),
])
def test_install_refuses_a_profile_that_cannot_be_used(fake, bad, message):
    status = sage_qual.install(profile=copy.deepcopy(bad))
    assert not status.enabled
    assert message in status.reason and "\n" not in status.reason
    assert F.scaled_dot_product_attention is TORCH_SDPA


def test_install_refuses_an_unreadable_profile_file(fake, tmp_path):
    status = sage_qual.install(profile=tmp_path / "missing.json")
    assert not status.enabled and "cannot read profile" in status.reason


def test_profile_built_by_certify_installs(fake, tmp_path):
    """A profile from a (sample) report, made to match this fake machine, selects its entry."""
    data = checked.load(Path(__file__).parent.parent / "data" / "sample_rtx4090.json")
    built = records.dump(building.build(data, verdict.decide(data)))
    assert profile.load(built).gpus[0].name == "NVIDIA GeForce RTX 4090"
    built["gpus"][0].update(name=H200.name, capability=list(H200.capability), memory_gib=H200.memory_gib)
    built["gpus"][0]["environment"].update(torch=torch.__version__, sageattention="2.2.0", torch_cuda="13.0")
    status = sage_qual.install(profile=built, family="FLUX.1")
    assert status.enabled and status.devices[0].variant.name == "sm89-fp8-cuda"
    assert dict(attention(2048).fallbacks) == {"short": 1}  # sample break-even: 4608 query tokens


@pytest.mark.parametrize("run", ["certify-b", "certify-e"])
def test_the_built_profile_is_the_one_run_13_wrote(run, tmp_path, monkeypatch):
    """The record-building profile gives what certify wrote for run 13 (docs/results/run13-h200x2), as
    the wrapper reads it: the verified ranges, layouts, reasons and span limit of every entry. Bounds
    (issue 26) came later: with them only SDXL's entry and the default change (run 13 has no fixture of
    FLUX.1's calls with two items, so FLUX.1's IP-Adapter failure is not bounded)."""
    monkeypatch.setattr(speed, "RUN_TO_RUN_SPREAD", 0.0)  # the bar run 13's profiles were written with
    monkeypatch.setattr(judge, "fitness_reasons", lambda metrics, fitness: [])  # a later judge (issue 52)
    folder = Path(__file__).resolve().parents[2] / "docs" / "results" / "run13-h200x2" / run
    data = checked.load(folder / "report.json.gz")
    committed = profile.load(folder / "profile.json")
    building.save(building.build(data, verdict.decide(data)), tmp_path / "bounded.json")
    with monkeypatch.context() as patched:
        patched.setattr(bounds, "sites_of", lambda fixture, family=None: [])
        building.save(building.build(data, verdict.decide(data)), tmp_path / "profile.json")
    assert profile.load(tmp_path / "profile.json") == committed
    [now], [then] = profile.load(tmp_path / "bounded.json").gpus, committed.gpus
    changed = {name for name in then.families if now.families[name] != then.families[name]}
    assert changed == {"SDXL"} and now.default != then.default
    for entry in [now.families[name] for name in changed] + [now.default]:
        if entry.variant:
            assert [(b.side, b.below) for b in entry.served.bounds] == [("key", 17)]


def test_the_profile_schema_accepts_what_certify_builds():
    jsonschema = pytest.importorskip("jsonschema")
    data = checked.load(Path(__file__).parent.parent / "data" / "sample_h200_2gpu.json")
    built = records.dump(building.build(data, verdict.decide(data)))
    assert list(jsonschema.Draft202012Validator(profile.json_schema()).iter_errors(built)) == []


# Confidence bounds -----------------------------------------------------------------------------
def test_median_interval_uses_order_statistics():
    samples = [float(x) for x in range(1, 21)]  # 20 calls: ranks 5 and 16 (95 %, binomial normal approx.)
    assert speed.median_interval(list(reversed(samples))) == (5.0, 16.0)
    assert speed.median_interval([3.0]) == (3.0, 3.0)
    assert speed.median_interval([1.0, 2.0, 3.0, 4.0, 5.0]) == (1.0, 5.0)  # five calls: the extremes
    with pytest.raises(ValueError):
        speed.median_interval([])


def test_speedup_bounds_take_the_pessimistic_ends():
    sdpa, ours = [float(x) for x in range(10, 30)], [float(x) for x in range(5, 25)]
    low, median, high = speed.speedup_bounds(19.5, sdpa, 14.5, ours)
    assert (low, high) == (14.0 / 20.0, 25.0 / 9.0) and median == 19.5 / 14.5
    assert speed.speedup_bounds(2.0, [], 1.0, []) == (2.0, 2.0, 2.0)  # version 1: medians only


def test_each_devices_profile_note_is_logged(fake, caplog):
    caplog.set_level("INFO", logger="sage_qual")
    sage_qual.install(profile=make_profile(gpu=H100))
    note = (
        f"no profile entry matches: defaults here ({builtin_sm90_thresholds()} tokens); nearest Fake H100 "
        "(sm_90) "
        "differs: GPU Fake H100 (sm_90) measured, Fake H200 (sm_90) here"
    )
    infos = [r.getMessage() for r in caplog.records if r.levelname == "INFO"]
    assert [m for m in infos if "no profile entry" in m] == [f"cuda:0 (Fake H200, sm_90): {note}"]
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == \
        [f"profile: cuda:0: {note}"]
