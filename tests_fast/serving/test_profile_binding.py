"""A profile bound to its build and its GPU (issue 27).

sageattention's version string covers thu-ml's source, the woct0rdho fork and older builds, so certify
records a digest of the package's Python sources and compiled extensions; and one model name can
hide dies of other sizes, so it records the SM count, compared within 10 % as comfy-kitchen's tuning
table does. An entry applies only to what it certified, where both sides know theirs."""

import dataclasses
import importlib.metadata
import types

import pytest

from sage_qual.kernels import sage_package
from sage_qual.serving import profile_matching as matching
from sage_qual.verdicts import profile

from ..builders import H200, machine, make_entry, make_gpu, make_profile


def package(tmp_path, files: dict[str, str]) -> types.ModuleType:
    root = tmp_path / "sageattention"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    module = types.ModuleType("sageattention")
    module.__file__ = str(root / "__init__.py")
    return module


def extension(path, data: bytes) -> types.ModuleType:
    path.write_bytes(data)
    module = types.ModuleType("sageattention._qattn_sm90")
    module.__file__ = str(path)
    return module


def test_the_digest_follows_the_python_sources_and_the_extension_binaries(tmp_path):
    files = {"__init__.py": "from .core import sageattn\n", "core.py": "def sageattn(): ...\n"}
    first = sage_package.source_digest(package(tmp_path / "a", files))
    assert first.startswith("sha256:") and len(first) == len("sha256:") + 16
    assert sage_package.source_digest(package(tmp_path / "b", {**files})) == first  # another folder
    fork = package(tmp_path / "c", {**files, "core.py": "def sageattn(): return 'sm86 -> fp16 cuda'\n"})
    assert sage_package.source_digest(fork) != first
    moved = package(tmp_path / "d", {"__init__.py": files["__init__.py"], "impl/core.py": files["core.py"]})
    assert sage_package.source_digest(moved) != first  # paths count too
    assert sage_package.source_digest(types.ModuleType("fake")) == ""  # no files: unknown
    built = package(tmp_path / "e", files)
    binary = tmp_path / "e" / "_qattn_sm90.so"
    with_binary = sage_package.source_digest(built, [extension(binary, b"built by nvcc 13.0")])
    assert with_binary != first
    assert sage_package.source_digest(built, [extension(binary, b"built by nvcc 12.8")]) != with_binary
    assert sage_package.source_digest(built, [extension(binary, b"built by nvcc 13.0")]) == with_binary


def test_a_binary_is_read_once_and_again_when_rewritten_in_place(tmp_path):
    """The per-file cache is keyed on size and mtime: a second load reads no file, and a rebuild of
    the same size is still seen."""
    import os

    built = package(tmp_path, {"__init__.py": ""})
    binary = tmp_path / "_qattn_sm90.so"
    first = sage_package.source_digest(built, [extension(binary, b"aaaa")])
    reads = sage_package._file_digest.cache_info().misses
    assert sage_package.source_digest(built, [types.SimpleNamespace(__name__="sageattention._qattn_sm90",
                                                                    __file__=str(binary))]) == first
    assert sage_package._file_digest.cache_info().misses == reads
    binary.write_bytes(b"bbbb")
    os.utime(binary, ns=(1, 1))  # another mtime, as a rebuild leaves
    assert sage_package.source_digest(built, [extension(binary, b"bbbb")]) != first


def test_install_with_a_profile_of_another_binary_warns_once_and_serves_defaults(tmp_path, caplog):
    """Issue 27's done-when: the fake package with compiled files; its profile certified one build,
    then an extension binary changes: the entry does not apply, and one WARNING says why."""
    import logging

    import sage_qual
    from sage_qual.testing import FakeCuda, FakeSageAttention

    fake = FakeSageAttention(extension_dir=tmp_path / "build")
    with FakeCuda([H200]), fake.installed():
        made = sage_package.load().source
        data = make_profile(entry=make_entry("sm89-fp8-cuda", 2048, 512))
        data["gpus"][0]["environment"]["sageattention_source"] = made
        assert sage_qual.install(profile=data).devices[0].profile_note.startswith("profile entry")
        sage_qual.uninstall()
        (tmp_path / "build" / "_qattn_sm90.so").write_bytes(b"another build of the sm90 kernel")
        caplog.set_level(logging.WARNING, logger="sage_qual")
        status = sage_qual.install(profile=data)
    assert made.startswith("sha256:") and status.enabled
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and f"sageattention build {made}" in warnings[0], warnings
    assert "no profile entry matches" in status.devices[0].profile_note


def certified(source: str) -> dict:
    data = make_profile(make_gpu(H200))
    data["gpus"][0]["environment"]["sageattention_source"] = source
    return data


@pytest.mark.parametrize(("made", "here", "applies"), [
    ("sha256:aaaa", "sha256:aaaa", True), ("sha256:aaaa", "sha256:bbbb", False),
    ("", "sha256:bbbb", True), ("sha256:aaaa", "", True)],
    ids=["same-build", "another-build", "profile-before-builds", "build-unknown-here"])
def test_an_entry_applies_only_to_the_build_it_certified(made, here, applies):
    device = dataclasses.replace(machine(H200), sageattention_source=here)
    [config] = matching.device_configs(certified(made), [device])
    assert config.matched == applies
    if not applies:
        assert "sageattention build sha256:aaaa measured, sha256:bbbb here" in config.note


def with_comfy_kitchen(source: str, serves_it: bool) -> dict:
    """An H200 entry certified with comfy-kitchen build `source`, serving its variant for SDXL or not."""
    variant = "ck-int8-cuda" if serves_it else "sm90-fp8-cuda"
    data = make_profile(make_gpu(H200, families={"SDXL": make_entry(variant, 1024, 1024, head_dims=(64,))}))
    data["gpus"][0]["environment"]["other_providers"] = {"comfy-kitchen": source}
    return data


@pytest.mark.parametrize(("made", "here", "serves_it", "applies"), [
    ("sha256:cccc", "sha256:cccc", True, True), ("sha256:cccc", "sha256:dddd", True, False),
    ("sha256:cccc", "sha256:dddd", False, False), ("sha256:cccc", "", True, True)],
    ids=["same-build", "another-build", "another-build-not-served", "not-installed-here"])
def test_comfy_kitchens_build_binds_an_entry_whatever_it_serves(made, here, serves_it, applies):
    """A second provider's build binds as sageattention's does, served or not (verdicts.machine.RULES:
    the verdict chose among every variant that ran, so another comfy-kitchen could have won); as gate
    binds it. A provider not installed here is not compared."""
    device = dataclasses.replace(machine(H200), other_sources={"comfy-kitchen": here})
    [config] = matching.device_configs(with_comfy_kitchen(made, serves_it), [device], family="SDXL")
    assert config.matched == applies
    if not applies:
        assert "comfy-kitchen build sha256:cccc measured, sha256:dddd here" in config.note


def test_certify_records_comfy_kitchens_build_in_the_profile():
    """Run 35's report (comfy-kitchen 0.2.40 beside thu-ml's build on the H200) gives a profile whose
    entry carries that build, as the profile certify wrote there did not yet."""
    from pathlib import Path

    from sage_qual.qualification.decide import checked, verdict
    from sage_qual.qualification.decide import profile as building

    path = Path(__file__).resolve().parents[2] / "docs/results/run35-h200/certify/report.json.gz"
    report = checked.load(path)
    [gpu] = building.build(report, verdict.decide(report)).gpus
    assert gpu.environment.other_providers == {"comfy-kitchen": "sha256:65f98cf1050cc674"}


def test_a_profile_without_the_field_still_reads():
    data = certified("")
    del data["gpus"][0]["environment"]["sageattention_source"]
    assert profile.load(data).gpus[0].environment.sageattention_source == ""


@pytest.mark.parametrize(("made", "here", "applies"), [
    (132, 132, True), (132, 120, True), (132, 114, False), (None, 114, True), (132, None, True)],
    ids=["same", "within-10-percent", "another-die", "profile-before-sm-counts", "unknown-here"])
def test_an_entry_applies_only_to_the_sm_count_it_certified(made, here, applies):
    data = make_profile(make_gpu(H200))
    data["gpus"][0]["sm_count"] = made
    [config] = matching.device_configs(data, [dataclasses.replace(machine(H200), sm_count=here)])
    assert config.matched == applies
    if not applies:
        assert f"SM count {made} measured, {here} here" in config.note


def test_certify_records_the_sm_count_from_the_device_to_the_profile():
    from sage_qual.qualification.decide import profile as building
    from sage_qual.qualification.decide import verdict

    from .. import builders

    fixture = builders.fixture()
    devices = [builders.device([builders.cell("sm90-fp8-cuda", fixture)], index=i, sm_count=n)
               for i, n in ((0, 132), (1, 130))]
    report = builders.report(devices, [fixture])
    [gpu] = verdict.decide(report)
    assert gpu.sm_count == 130  # the fewest of the model's devices
    assert building.build(report, [gpu]).gpus[0].sm_count == 130
    unknown = builders.report([devices[0], dataclasses.replace(devices[1], sm_count=None)], [fixture])
    assert verdict.decide(unknown)[0].sm_count is None


class Installed(importlib.metadata.Distribution):
    """A distribution whose install records are the files given (name -> text)."""

    def __init__(self, files: dict[str, str]):
        self.files_ = files

    def read_text(self, filename):
        return self.files_.get(filename)

    def locate_file(self, path):
        return path


@pytest.mark.parametrize("files, expected", [
    ({"direct_url.json": '{"url": "https://github.com/thu-ml/SageAttention", "vcs_info": '
                         '{"vcs": "git", "commit_id": "4bc3e3b"}}'},
     "git https://github.com/thu-ml/SageAttention@4bc3e3b"),
    ({"direct_url.json": '{"url": "file:///src/SageAttention", "dir_info": {"editable": true}}'},
     "local /src/SageAttention"),
    ({"direct_url.json": '{"url": "file:///w/sageattention-2.2.0-cp312-cp312-linux_x86_64.whl", '
                         '"archive_info": {}}'}, "wheel sageattention-2.2.0-cp312-cp312-linux_x86_64.whl"),
    ({"WHEEL": "Wheel-Version: 1.0\nTag: cp312-cp312-linux_x86_64\n"}, "wheel cp312-cp312-linux_x86_64"),
    ({}, ""),  # setup.py install: nothing recorded
    ({"direct_url.json": "not json"}, ""),
    ({"direct_url.json": "[1]"}, ""),
])
def test_the_origin_is_what_the_installer_recorded(files, expected):
    assert sage_package.origin(Installed(files)) == expected


def test_env_shows_the_build_and_its_origin():
    from sage_qual.serving import environment

    from ..builders import environment as env_record

    env = env_record([], sageattention_source="sha256:0123456789abcdef", sageattention_origin="git u@c")
    assert "2.2.0 (build sha256:0123456789abcdef) from git u@c" in environment.render_text(env)
    assert " from " not in environment.render_text(dataclasses.replace(env, sageattention_origin=""))


def test_comfy_kitchens_build_is_recorded_by_its_files_and_binds_the_profile(tmp_path, caplog):
    """Issue 54: comfy-kitchen's build was recorded by its version, and every fake's digest was empty,
    so no test took the path. The fake now has files: the environment records their digest, a profile
    certified with it applies, and a rebuilt extension of the same version does not."""
    import logging

    import sage_qual
    from sage_qual.testing import FakeCuda, FakeSageAttention

    fake = FakeSageAttention(extension_dir=tmp_path / "build", comfy_kitchen="0.2.40")
    with FakeCuda([H200]), fake.installed():
        made = sage_package.load_all()["comfy-kitchen"].source
        assert made.startswith("sha256:") and made != sage_package.load().source
        data = with_comfy_kitchen(made, serves_it=True)
        data["gpus"][0]["environment"]["sageattention_source"] = sage_package.load().source
        assert sage_qual.install(profile=data, family="SDXL").devices[0].profile_matched
        sage_qual.uninstall()
        [binary] = (tmp_path / "build" / "comfy_kitchen").glob("*.so")
        binary.write_bytes(b"another build of comfy-kitchen 0.2.40")
        caplog.set_level(logging.WARNING, logger="sage_qual")
        status = sage_qual.install(profile=data, family="SDXL")
        sage_qual.uninstall()
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert f"comfy-kitchen build {made} measured, sha256:" in warning
    assert not status.devices[0].profile_matched
