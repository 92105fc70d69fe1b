"""A profile bound to its build (issue 27): sageattention's version string covers thu-ml's source, the
woct0rdho fork and older builds, so certify records a digest of the package's Python sources and an
entry applies only to the build it certified (where both sides know theirs)."""

import dataclasses
import types

import pytest

from sage_qual.serving import profile, sage_package

from ..builders import H200, machine, make_gpu, make_profile


def package(tmp_path, files: dict[str, str]) -> types.ModuleType:
    root = tmp_path / "sageattention"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    module = types.ModuleType("sageattention")
    module.__file__ = str(root / "__init__.py")
    return module


def test_the_digest_follows_the_python_sources_only(tmp_path):
    files = {"__init__.py": "from .core import sageattn\n", "core.py": "def sageattn(): ...\n"}
    first = sage_package.source_digest(package(tmp_path / "a", files))
    assert first.startswith("sha256:") and len(first) == len("sha256:") + 16
    again = package(tmp_path / "b", {**files})
    (tmp_path / "b" / "sageattention" / "_qattn_sm90.so").write_bytes(b"a rebuilt binary")
    assert sage_package.source_digest(again) == first  # a rebuild of one source keeps it
    fork = package(tmp_path / "c", {**files, "core.py": "def sageattn(): return 'sm86 -> fp16 cuda'\n"})
    assert sage_package.source_digest(fork) != first
    moved = package(tmp_path / "d", {"__init__.py": files["__init__.py"], "impl/core.py": files["core.py"]})
    assert sage_package.source_digest(moved) != first  # paths count too
    assert sage_package.source_digest(types.ModuleType("fake")) == ""  # no files: unknown


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
    [config] = profile.device_configs(certified(made), [device])
    assert config.matched == applies
    if not applies:
        assert "sageattention build sha256:aaaa, sha256:bbbb here" in config.note


def test_a_profile_without_the_field_still_reads():
    data = certified("")
    del data["gpus"][0]["environment"]["sageattention_source"]
    assert profile.load(data).gpus[0].environment.sageattention_source == ""
