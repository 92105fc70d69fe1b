"""The built-in defaults' rules (sage_qual/serving/defaults.py) on a hand-made defaults file of two sm_89
models: what a model never measured gets, what a capability never measured gets, each note and each
refusal in full. tests_fast/serving/test_builtin_defaults.py checks the shipped file; issue 54's
mutation run of the module left 27 mutants alive against it (docs/mutation.md)."""

import json

import pytest

from sage_qual.serving import defaults
from sage_qual.serving import profile_matching as matching
from sage_qual.serving.config import DEFAULT_CONFIG
from sage_qual.testing import FakeGpu
from sage_qual.verdicts import profile
from sage_qual.verdicts.served import Bound, Served

from ..builders import make_entry, make_gpu, make_profile, reason

SM89 = "sm89-fp8-cuda"
NAN = make_entry(None, reasons=[reason("non_finite", "NaN on flux"), reason("speed", "slow too")])


def defaults_file(tmp_path, families_4080=None) -> str:
    gpus = [make_gpu(FakeGpu((8, 9), "RTX 4090", 24.0), make_entry(SM89, 2048, 512, [64, 128]),
                     {"FLUX.1": NAN, "SDXL": make_entry(SM89, 4096, 512, [64])}, "2.13.0"),
            make_gpu(FakeGpu((8, 9), "RTX 4080", 16.0), make_entry(SM89, 3072, 256, [128]),
                     families_4080 or {}, "2.13.0")]
    path = tmp_path / "defaults.json"
    path.write_text(json.dumps({"kind": defaults.KIND, "schema_version": 1, "sources": [],
                                "profile": make_profile(*gpus)}))
    return path


def device(name="RTX 4070", capability=(8, 9), memory_gib=12.0, sageattention="2.2.0",
           source="") -> matching.LocalDevice:
    return matching.LocalDevice(name, capability, memory_gib, "2.13.0", "13.0", sageattention, source)


def config_of(path, family=None, **where) -> matching.DeviceConfig:
    [found] = defaults.device_configs([device(**where)], family, DEFAULT_CONFIG, path)
    return found


def test_a_family_kept_off_on_a_measured_model_stays_off_on_its_unmeasured_kin(tmp_path):
    found = config_of(defaults_file(tmp_path), "FLUX.1")
    assert found.note == ("built-in defaults: RTX 4070 never measured, off as on RTX 4090, RTX 4080: family "
                          "FLUX.1 kept off: NaN on flux")
    assert found.reasons == ("NaN on flux", "slow too") and found.config.kernel_table[(8, 9)] == ()


def test_a_family_kept_off_without_a_reason_says_none_was_recorded(tmp_path):
    found = config_of(defaults_file(tmp_path, {"Wan 2.2": make_entry(None)}), "Wan 2.2")
    assert found.note.endswith("family Wan 2.2 kept off: no reason recorded") and found.reasons == ()


def test_an_unmeasured_model_gets_todays_table_at_its_kins_strictest_thresholds_with_a_warning(tmp_path):
    found = config_of(defaults_file(tmp_path))
    assert found.matched is False
    assert found.config.kernel_table == DEFAULT_CONFIG.kernel_table  # the table stays; the range is the kin's
    assert (found.config.min_query_tokens, found.config.min_key_tokens, found.config.head_dims) == (3072, 512,
                                                                                                     (128,))
    assert found.note.startswith("built-in defaults: RTX 4070 never measured, not certified (run "
                                 "sage-qual certify): all families as the strictest sm_89 measured "
                                 "(RTX 4090, RTX 4080): ")


def test_a_capability_no_run_measured_with_a_kernel_serves_by_the_default_rule_with_a_warning(tmp_path):
    found = config_of(defaults_file(tmp_path), "FLUX.1", name="A100", capability=(8, 0))
    assert found.config == DEFAULT_CONFIG and found.matched is False
    assert found.note.startswith("built-in defaults: no sm_80 GPU was measured, so not certified (run "
                                 "sage-qual certify here): family FLUX.1 by the default rule, from ")


def test_a_capability_without_a_kernel_is_left_to_the_table_silently(tmp_path):
    found = config_of(defaults_file(tmp_path), name="T4", capability=(7, 5))
    assert (found.config, found.note, found.reasons, found.matched) == (DEFAULT_CONFIG, "", (), True)


def test_every_difference_of_another_build_is_named(tmp_path):
    path = defaults_file(tmp_path)
    data = json.loads(path.read_text())
    data["profile"]["gpus"][0]["environment"]["sageattention_source"] = "sha256:aaaaaaaaaaaaaaaa"
    path.write_text(json.dumps(data))
    found = config_of(path, name="RTX 4090", memory_gib=24.0, sageattention="2.2.1",
                      source="sha256:bbbbbbbbbbbbbbbb")
    assert found.matched is False
    assert "with sageattention 2.2.0 measured, 2.2.1 here; sageattention build " in found.note


def test_the_strictest_entry_of_kin_skips_a_model_that_serves_nothing():
    served = profile.Entry(Served(SM89, 2048, 512, [128]), [])
    off = profile.Entry(None, [reason("speed", "slow")])
    assert defaults.most_conservative([off, served]) == served
    assert defaults.most_conservative([off]) is None


def test_equal_bounds_keep_the_first_ones_reason():
    first, second = Bound("key", 17, "IP-Adapter, run 25"), Bound("key", 17, "another run")
    assert defaults.merged_bounds([Served(SM89, 1, 1, [128], bounds=[b]) for b in (first, second)]) == [first]


@pytest.mark.parametrize("make, said", [
    (lambda p: p.mkdir(), "cannot read built-in defaults {path}: "),
    (lambda p: p.write_text("{"), "built-in defaults {path} are not JSON: "),
    (lambda p: p.write_text(json.dumps({"kind": defaults.KIND, "schema_version": 1, "profile": {}})),
     "built-in defaults {path}: sources: missing; "),
], ids=["unreadable", "not-json", "no-sources"])
def test_a_defaults_file_that_cannot_be_read_is_named_with_the_fix(tmp_path, make, said):
    path = tmp_path / "default_profile.json"
    make(path)
    with pytest.raises(profile.ProfileError) as error:
        defaults.read(path)
    assert str(error.value).startswith(said.format(path=path))
    if "cannot read" not in said:
        assert str(error.value).endswith(defaults.FIX)
