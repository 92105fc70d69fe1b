"""The built-in defaults (sage_qual/serving/default_profile.json): built from the newest committed H200
certify runs, applied by install() without config and profile on fake CUDA: the H200 gets each
family's verdict of those runs with its range, a GPU never measured the most conservative entry of
its compute capability, a capability never measured today's table and thresholds, another build one
WARNING."""

import dataclasses
import functools
import json
import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import sage_qual
from sage_qual import records
from sage_qual.limits import STATUS_LINE_LIMIT
from sage_qual.qualification.decide import checked, verdict
from sage_qual.qualification.decide import defaults as building
from sage_qual.serving import defaults
from sage_qual.serving import profile_matching as matching
from sage_qual.serving.config import DEFAULT_CONFIG, KERNEL_TABLE
from sage_qual.testing import FakeCuda, FakeGpu, FakeSageAttention
from sage_qual.verdicts import profile

from ..builders import certify_profile, make_entry, reason
from ..helpers import newest_certify_run

RESULTS = Path(__file__).resolve().parent.parent.parent / "docs" / "results"
SOURCES = [RESULTS / "run29-h200" / f"certify-{n}" / "report.json.gz" for n in (1, 2, 3)] + [
    RESULTS / f"run{n}-h200" / "certify" / "report.json.gz" for n in (30, 31, 33, 34, 35)] + [
    RESULTS / "run39-h200" / f"certify-{n}" / "report.json.gz" for n in (1, 2, 3)] + [
    RESULTS / "run40-h200" / "certify" / "report.json.gz"]
H100_SOURCES = [RESULTS / run / "certify" / "report.json.gz" for run in ("run42-h100", "run43-h100")]
H200 = FakeGpu((9, 0), "NVIDIA H200", 139.8)  # as torch names the GPUs of docs/results
H100 = FakeGpu((9, 0), "NVIDIA H100 80GB HBM3", 79.2)
H800 = FakeGpu((9, 0), "NVIDIA H800", 79.6)  # an sm_90 model no run measured
RTX4090 = FakeGpu((8, 9), "NVIDIA GeForce RTX 4090", 24.0)


@functools.cache
def decided(path: Path) -> tuple[verdict.GpuDecision, ...]:
    """A source report decided afresh, once per module: nine tests read the same twelve (2-3 s each
    time, 2026-12-07 --durations)."""
    return tuple(verdict.decide(checked.load(path)))


def installed(gpus, **options):
    fake = FakeSageAttention()
    cuda = FakeCuda(gpus)
    with cuda, fake.installed():
        status = sage_qual.install(**options)
    return status


def call(tokens: int, device_gpus, **options):
    """One [1, 2, tokens, 128] bf16 call in a scope after install(**options) on these fake GPUs."""
    fake = FakeSageAttention()
    q = torch.randn(1, 2, tokens, 128, generator=torch.Generator().manual_seed(0), dtype=torch.bfloat16)
    with FakeCuda(device_gpus), fake.installed():
        status = sage_qual.install(**options)
        with sage_qual.sage_attention_scope() as report:
            F.scaled_dot_product_attention(q, q, q)
    return status, report


def served_thresholds_of_the_sources(sources=SOURCES, variant="sm90-fp8-cuda", head_dim=128):
    """The highest (query, key) thresholds any source run served `variant` from at `head_dim`."""
    found = []
    for path in sources:
        for gpu in building.load_run(path).gpus:
            for entry in (gpu.default, *gpu.families.values()):
                if entry.variant == variant and head_dim in entry.served.head_dims:
                    found.append((entry.served.min_query_tokens, entry.served.min_key_tokens))
    return max(q for q, _ in found), max(k for _, k in found)


def test_the_packaged_data_is_what_the_builder_makes_of_the_runs_it_lists():
    """A hand edit of the data file, or a changed source, fails here: rebuild it with the command."""
    checkout = RESULTS.parent.parent
    _, sources = defaults.read()
    built = records.dump(building.build([checkout / s.file for s in sources], previous=None))
    for source in built["sources"]:  # the paths as the command was given them, relative to the checkout
        source["file"] = str(Path(source["file"]).relative_to(checkout))
    assert built == json.loads(defaults.DATA.read_text())


def test_the_h200_default_entry_is_the_highest_threshold_any_run_served_the_kernel_from():
    measured, sources = defaults.read()
    [h200] = [gpu for gpu in measured.gpus if gpu.name == "NVIDIA H200"]
    assert (h200.label, h200.environment.torch) == ("NVIDIA H200 (sm_90)", "2.11.0+cu130")
    assert {s.file for s in sources if s.gpu == "NVIDIA H200"} == \
        {str(p.relative_to(RESULTS.parent.parent)) for p in SOURCES}
    entry = h200.default
    assert entry.variant == KERNEL_TABLE[(9, 0)][0] and entry.served.head_dims == (128,)
    thresholds = (entry.served.min_query_tokens, entry.served.min_key_tokens)
    assert thresholds == served_thresholds_of_the_sources() == (13824, 13824)


@pytest.mark.parametrize("name", ["NVIDIA H200", "nvidia h200 ", "  NVIDIA H200"])
def test_an_h200_gets_its_measured_thresholds_and_4k_tokens_go_to_torch(name):
    status, report = call(4096, [FakeGpu((9, 0), name, 139.8)])
    assert status.enabled, status.reason
    [device] = status.devices
    assert device.variant.name == "sm90-fp8-cuda"
    assert (device.config.min_query_tokens, device.config.min_key_tokens, device.config.head_dims) == \
        (13824, 13824, (128,))
    assert device.profile_note.startswith("built-in defaults, measured on NVIDIA H200 (sm_90)")
    # The case: a [.., 4096, 128] call, 0.75x of cuDNN on the H200, now stays on torch.
    assert (report.served, dict(report.fallbacks)) == (0, {"short": 1})
    assert report.details["short"] == "tokens=4096/4096 (needs >= 13824/13824)"


def test_an_h100_gets_its_own_measured_thresholds():
    """Runs 42 and 43 measured the H100 apart from the H200s: its thresholds are the most conservative
    of its own runs'."""
    [device] = installed([H100]).devices
    assert device.profile_note.startswith("built-in defaults, measured on NVIDIA H100 80GB HBM3 (sm_90)")
    thresholds = (device.config.min_query_tokens, device.config.min_key_tokens)
    assert thresholds == served_thresholds_of_the_sources(H100_SOURCES) == (12672, 12672)
    assert device.config.head_dims == (128,)


def test_a_gpu_never_measured_keeps_the_table_with_the_strictest_thresholds_of_its_capability():
    status = installed([H800])
    [device] = status.devices
    assert device.variant.name == "sm90-fp8-cuda"  # today's table
    assert (device.config.min_query_tokens, device.config.min_key_tokens, device.config.head_dims) == \
        (13824, 13824, (128,))  # the H200's, the higher of the two models measured
    # the rule and its range whole; the list of models measured is what a long line gives up first
    assert "NVIDIA H800 never measured, not certified (run sage-qual certify): all families as the " \
        "strictest sm_90 measured (...): sm90-fp8-cuda 13,824 to 32,768 tokens, head_dim 128 " in \
        device.profile_note
    assert len(device.profile_note) <= STATUS_LINE_LIMIT


def test_a_gpu_model_never_measured_that_gets_a_kernel_is_said_in_one_warning_with_its_rule(caplog):
    """Issue 54: install(family=...) on a GPU model no run measured said enabled=True with no WARNING,
    so nothing told that the verdict is a rule, not a certified one."""
    for gpu, rule in ((RTX4090, "by the default rule, from 1,536 query tokens"),
                      (H800, "as the strictest sm_90 measured (...): sm90-fp8-cuda 13,824 to 32,768 tokens")):
        caplog.clear()
        with FakeCuda([gpu]), FakeSageAttention().installed(), caplog.at_level(logging.INFO, "sage_qual"):
            status = sage_qual.install(family="FLUX.1")
            sage_qual.uninstall()
        assert status.enabled
        [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert warning.startswith("built-in defaults: cuda:0: ") and "not certified" in warning
        assert rule in status.devices[0].profile_note and "family FLUX.1" in status.devices[0].profile_note
    caplog.clear()
    with FakeCuda([H200]), FakeSageAttention().installed(), caplog.at_level(logging.WARNING, "sage_qual"):
        assert sage_qual.install(family="FLUX.1").enabled  # a model measured: no warning
        sage_qual.uninstall()
    assert not caplog.records


def test_a_capability_never_measured_keeps_todays_table_and_thresholds():
    status, report = call(1536, [RTX4090])
    [device] = status.devices
    assert device.config == DEFAULT_CONFIG and "no sm_89 GPU was measured" in device.profile_note
    assert report.served == 1


def test_the_strictest_thresholds_take_the_highest_counts_at_the_head_sizes_all_models_served(tmp_path):
    data = json.loads(defaults.DATA.read_text())
    other = json.loads(json.dumps(data["profile"]["gpus"][0]))
    other.update(name="Fake sm90 card", memory_gib=80.0)
    other["default"]["served"].update(min_query_tokens=4096, min_key_tokens=32768, head_dims=[64, 128])
    data["profile"]["gpus"].append(other)
    path = tmp_path / "defaults.json"
    path.write_text(json.dumps(data))
    machine = matching.LocalDevice(H800.name, (9, 0), H800.memory_gib, "2.13.0", "13.0", "2.2.0")
    [unknown] = defaults.device_configs([machine], path=path)
    assert (unknown.config.min_query_tokens, unknown.config.min_key_tokens, unknown.config.head_dims) == \
        (13824, 32768, (128,))
    # the range is kept whole; the list of models measured is the part a long line gives up first
    assert "as the strictest sm_90 measured (" in unknown.note and not unknown.matched
    assert "(...): sm90-fp8-cuda 13,824 to 32,768 query / 32,768 key tokens" in unknown.note
    card = matching.LocalDevice("Fake sm90 card", (9, 0), 80.0, "2", "", "")
    [measured] = defaults.device_configs([card], path=path)
    assert (measured.config.min_query_tokens, measured.config.head_dims) == (4096, (64, 128))


def test_a_family_the_h200_runs_kept_off_is_not_served_on_an_h200_or_an_unmeasured_sm90():
    for gpu in (H200, H800):
        status = installed([gpu], family="LTX-2")
        assert not status.enabled and len(status.reason) <= STATUS_LINE_LIMIT
        [device] = status.devices
        assert device.variant is None and "family LTX-2 kept off" in status.reason
        assert device.profile_reasons == (
            "sm86-fp16-triton never measured faster than 1.05x the fastest SDPA backend (lower 95 % bound)",
        )
    assert installed([H200], family="Wan 2.2").devices[0].variant.name == "sm90-fp8-cuda"


def newest_runs(gpu: str) -> list[Path]:
    """The full certify reports of the newest run folder of docs/results/ of one GPU model."""
    paths = sorted(newest_certify_run(gpu).glob("certify*/report.json.gz"))
    reports = [(path, checked.load(path)) for path in paths]
    return [path for path, r in reports if r.complete and not r.predicted and not r.options.quick]


@pytest.mark.parametrize("gpu", ["h200", "h100"])
def test_the_defaults_are_built_from_the_newest_committed_runs(gpu):
    """A certify run committed after the defaults' sources fails here until they are rebuilt from it."""
    _, sources = defaults.read()
    newest = newest_runs(gpu)
    assert newest, "no full certify run under docs/results"
    listed = {RESULTS.parent.parent / s.file for s in sources}
    missing = [str(p.relative_to(RESULTS.parent.parent)) for p in newest if p not in listed]
    assert not missing, f"rebuild the built-in defaults from {missing} (docs/certify.md, Built-in defaults)"


def _fields_set(record) -> set[str]:
    return {f.name for f in dataclasses.fields(record) if getattr(record, f.name) not in (None, [], "")}


def test_the_defaults_carry_every_field_the_newest_run_sets():
    """A field a profile carries (of the GPU, its environment or an entry) that the newest run set and
    the defaults dropped fails here: a new field cannot be forgotten by the builder again."""
    measured, _ = defaults.read()
    [h200] = [gpu for gpu in measured.gpus if gpu.name == H200.name]
    [newest] = building.load_run(newest_runs("h200")[-1]).gpus
    assert _fields_set(newest) - _fields_set(h200) == set()
    assert _fields_set(newest.environment) - _fields_set(h200.environment) == set()
    for name, entry in newest.families.items():
        if entry.variant:
            assert _fields_set(entry) - _fields_set(h200.families[name]) - {"reasons"} == set(), name


@pytest.mark.parametrize("family", ["FLUX.1", "FLUX.2", "Z-Image", "Qwen-Image", "Krea-2", "SDXL", "LTX-2",
                                    "Wan 2.2"])
def test_install_on_an_h200_gives_each_family_the_runs_verdict_and_range(family):
    """The sources (the newest run among them: test_the_defaults_are_built_from_the_newest_committed_runs)
    decided afresh: the family's variant, from the highest threshold to the lowest verified length."""
    decisions = [decided(path)[0].family(family) for path in SOURCES]
    [device] = installed([H200], family=family).devices
    if decisions[0].variant is None:
        assert device.variant is None
        return
    assert device.variant.name == decisions[0].variant
    config = device.config
    served = [d.served for d in decisions]
    assert config.min_query_tokens == max(s.min_query_tokens for s in served)
    assert config.max_query_tokens == min(s.max_query_tokens for s in served)
    assert config.layouts == served[0].layouts and config.contexts == served[0].contexts
    assert [(b.side, b.below) for b in config.bounds] == [(b.side, b.below) for b in served[0].bounds]


def test_the_default_entry_serves_no_length_past_the_verified_range(monkeypatch):
    [device] = installed([H200]).devices
    served = [d.served.max_query_tokens for path in SOURCES
              for d in decided(path)[0].families if d.served]
    assert device.config.max_query_tokens is not None and device.config.max_query_tokens <= min(served)
    # What the wrapper falls back to is a stand-in: torch's SDPA at 40,000 tokens took 23 s on the CPU.
    sage_qual.uninstall()
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda q, k, v, **_: torch.empty_like(q))
    try:
        status, report = call(40_000, [H200])
    finally:
        sage_qual.uninstall()
    assert report.served == 0 and dict(report.fallbacks) == {"long": 1}, report.summary()


def test_an_h200_gets_the_span_limit_and_an_unmeasured_sm90_the_verified_range():
    measured, _ = defaults.read()
    [h200] = [gpu for gpu in measured.gpus if gpu.name == H200.name]
    [on_h200] = installed([H200]).devices
    assert on_h200.config.max_span_elements == h200.max_span_elements is not None
    [on_h800] = installed([H800]).devices
    default = h200.default.served
    assert (on_h800.config.max_query_tokens, on_h800.config.layouts, on_h800.config.contexts) == \
        (default.max_query_tokens, default.layouts, default.contexts)
    assert on_h800.config.kernel_table == DEFAULT_CONFIG.kernel_table  # never measured: today's table


def test_another_sageattention_build_keeps_the_verified_range_with_one_warning(caplog):
    fake = FakeSageAttention(version="2.2.1")
    with FakeCuda([H200]), fake.installed(), caplog.at_level(logging.WARNING, logger="sage_qual"):
        status = sage_qual.install(family="Wan 2.2")
    [device] = status.devices
    assert device.variant.name == "sm90-fp8-cuda" and device.config.max_query_tokens == 75600
    assert device.profile_note.startswith(
        "built-in defaults: another build's (verified range only; certify this "
        "build for its own profile), measured on NVIDIA H200 (sm_90) with "
        "sageattention 2.2.0 measured, 2.2.1 here: "
    )
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert warnings[0].startswith("built-in defaults: cuda:0: another build's (verified")
    assert "certify this build for its own profile" in warnings[0]


def test_the_warning_for_another_build_keeps_its_advice_beside_a_long_gpu_name_and_two_digests(
    caplog, tmp_path
):
    """Device run 42: on an H100 80GB HBM3 with a fresh build (two build digests in the line), the
    200-character WARNING lost its advice to certify the build."""
    fake = FakeSageAttention(extension_dir=tmp_path / "sageattention")  # a build with a digest of its own
    with FakeCuda([H100]), fake.installed(), caplog.at_level(logging.WARNING, logger="sage_qual"):
        status = sage_qual.install()
    [device] = status.devices
    assert device.variant.name == "sm90-fp8-cuda" and device.config.min_query_tokens == 12672
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "sageattention build sha256:" in device.profile_note  # both digests, in the note
    assert len(warning) <= STATUS_LINE_LIMIT and "certify this build for its own profile" in warning


def test_a_config_of_ones_own_replaces_the_built_in_defaults():
    status, report = call(1536, [H200], config=sage_qual.WrapperConfig())
    assert status.devices[0].config == DEFAULT_CONFIG and report.served == 1


@pytest.mark.parametrize("content, message", [
    ("{", "built-in defaults .* are not JSON"),
    ('{"kind": "sage-qual-default-profile", "schema_version": 1, "sources": []}', "profile: missing"),
    ('{"kind": "sage-qual-default-profile", "schema_version": 1, "sources": [], "profile": {}}',
     "is not a sage-qual profile"),
])
def test_a_broken_data_file_is_one_line_naming_it(tmp_path, content, message):
    path = tmp_path / "defaults.json"
    path.write_text(content)
    with pytest.raises(profile.ProfileError, match=message) as refused:
        defaults.read(path)
    assert "\n" not in str(refused.value)


# The builder: adding a GPU model from a certify run ----------------------------------------------
OFF = make_entry(None, reasons=[reason("non_finite", "sm89-fp8-cuda on flux: NaN")])


def test_the_command_adds_a_gpu_model_and_keeps_the_others(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    data = out / "defaults.json"
    data.write_text(defaults.DATA.read_text())
    runs = tmp_path / "runs"
    runs.mkdir()
    sm89 = "sm89-fp8-cuda"
    first = certify_profile(runs, "RTX 4090", OFF, {
        "FLUX.1": make_entry(sm89, 2048, 512, [64, 128]), "SDXL": make_entry(sm89, 4096, 512, [64]),
        "Wan 2.2": OFF})
    second = certify_profile(runs, "RTX 4090", OFF, {
        "FLUX.1": make_entry(sm89, 3072, 256, [128]), "Wan 2.2": make_entry(sm89, 1024, 512, [128]),
        "SDXL": make_entry("sm89-fp8-cuda-fp32acc", 4096, 512, [64])})
    assert building.main([str(first), str(second), "--out", str(data)]) == 0
    assert "NVIDIA H200 (sm_90), NVIDIA H100 80GB HBM3 (sm_90), RTX 4090 (sm_89)" in capsys.readouterr().out
    measured, sources = defaults.read(data)
    *kept, rtx = measured.gpus
    assert tuple(kept) == defaults.read()[0].gpus
    assert [s.file for s in sources][-2:] == [str(first), str(second)]
    # The default kernel where every run served it: head_dim 128 (the second run served no 64), from
    # the highest thresholds of those entries.
    assert (rtx.default.variant, rtx.default.served.min_query_tokens, rtx.default.served.min_key_tokens,
            rtx.default.served.head_dims) == ("sm89-fp8-cuda", 3072, 512, (128,))
    flux, sdxl, wan = (rtx.families[name] for name in ("FLUX.1", "SDXL", "Wan 2.2"))
    assert (
        flux.variant,
        flux.served.min_query_tokens,
        flux.served.min_key_tokens,
        flux.served.head_dims,
    ) == ("sm89-fp8-cuda", 3072, 512, (128,))
    assert sdxl.variant is None and "different variants" in sdxl.reasons[0].detail
    assert wan.variant is None and wan.reasons[0].detail == "sm89-fp8-cuda on flux: NaN"  # off once: off


def test_the_command_refuses_what_is_not_a_run(tmp_path, capsys):
    bad = tmp_path / "fleet.json"
    bad.write_text('{"kind": "sage-qual-fleet"}')
    assert building.main([str(bad), "--out", str(tmp_path / "d.json")]) == 2
    assert "is not a sage-qual profile" in capsys.readouterr().err
    broken = tmp_path / "report.json"
    broken.write_text('{"kind": "sage-qual-report"}')
    assert building.main([str(broken), "--out", str(tmp_path / "d.json")]) == 2
    assert "schema_version" in capsys.readouterr().err
    assert not (tmp_path / "d.json").exists()


def test_a_broken_defaults_file_names_the_file_the_key_and_the_rebuild(tmp_path):
    """Issue 28: a negative threshold there was named as "profile: ..." with certify's fix."""
    data = json.loads(defaults.DATA.read_text())
    data["profile"]["gpus"][0]["default"]["served"]["min_query_tokens"] = -5
    path = tmp_path / "default_profile.json"
    path.write_text(json.dumps(data))
    with pytest.raises(profile.ProfileError) as error:
        defaults.read(path)
    assert str(error.value) == (
        f"built-in defaults {path}: profile: gpus[0].default.served.min_query_tokens: "
        f"is -5, expected a token count of at least 1; {defaults.FIX}"
    )


def test_a_merge_of_equal_entries_is_the_entry_whatever_field_it_sets():
    """Issue 53: the defaults' merge built the merged Served by position and dropped `masks`, so the
    built-in defaults could never serve a masked call however a run certified it. Every field of
    Served is set away from its default here; a field the merge forgets comes back as its default."""
    from sage_qual.verdicts.served import Bound, Served

    served = Served(variant="ck-int8-cuda", min_query_tokens=9_728, min_key_tokens=640, head_dims=[64, 128],
                    max_query_tokens=32_768, max_key_tokens=16_384, layouts=["contiguous", "transposed"],
                    contexts=["side_stream"], bounds=[Bound("key", 17, "a test")], masks=True)
    defaulted = {f.name for f in dataclasses.fields(Served)
                 if f.default is not dataclasses.MISSING and getattr(served, f.name) == f.default}
    assert not defaulted, f"set {sorted(defaulted)} away from their defaults, so a dropped field shows"
    entry = profile.Entry(served, [reason("speed", "a test")])
    assert defaults.merged(served.variant, [entry, entry], served.head_dims) == entry
    masked_once = profile.Entry(dataclasses.replace(served, masks=False), entry.reasons)
    assert defaults.merged(served.variant, [entry, masked_once], served.head_dims).served.masks is False


@pytest.mark.parametrize("spans, kept", [((2**31 - 1, 2**30), 2**30), ((2**30, None), None)],
                         ids=["the-lowest", "none-where-a-run-verified-none"])
def test_the_span_limit_merged_over_runs_is_the_lowest_any_run_verified(tmp_path, spans, kept):
    """Issue 54's surviving mutant: the merge could keep the wrong end of a span limit."""
    files = []
    for span in spans:
        path = certify_profile(tmp_path, "RTX 4090", make_entry("sm89-fp8-cuda", 2048, 512, [128]), {})
        data = json.loads(path.read_text())
        data["gpus"][0]["max_span_elements"] = span
        path.write_text(json.dumps(data))
        files.append(path)
    [rtx] = [gpu for gpu in building.build(files, previous=None).profile.gpus if gpu.name == "RTX 4090"]
    assert rtx.max_span_elements == kept
