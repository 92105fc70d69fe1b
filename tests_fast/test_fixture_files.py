"""Fixture format: round trip, validation errors that name file and field, the shipped replicas."""

import hashlib
import json

import pytest
import torch
from safetensors.torch import save_file

from sage_qual.fixtures import fileformat as ff
from sage_qual.fixtures import replicas
from sage_qual.fixtures.replicas import FIXTURES, MAX_FILE_BYTES, MAX_TOTAL_BYTES, REPLICAS
from sage_qual.qualification.families import FAMILIES, normalize
from sage_qual.serving.variants import VARIANTS

BOUNDS = {"fp16": {"max_rel_l2": 0.05, "min_cosine": 0.998}, "fp8": {"max_rel_l2": 0.1, "min_cosine": 0.99}}


def tensors(dtype=torch.bfloat16, q_heads=4, kv_heads=2):
    g = torch.Generator().manual_seed(0)
    return {"q": torch.randn(1, q_heads, 32, 16, generator=g).to(dtype),
            "k": torch.randn(1, kv_heads, 24, 16, generator=g).to(dtype),
            "v": torch.randn(1, kv_heads, 24, 16, generator=g).to(dtype)}


def metadata(**changes):
    meta = {"sage_qual.format": "1", "family": "flux.1", "kind": "recorded", "source": '{"model": "m"}',
            "dtype": "bfloat16", "layout": "HND", "provenance": "test", "bounds": json.dumps(BOUNDS)}
    meta.update(changes)
    return {k: v for k, v in meta.items() if v is not None}


def write_raw(path, tensor_dict, meta):
    save_file(tensor_dict, str(path), metadata=meta)
    return path


def test_round_trip_keeps_tensors_and_metadata_and_is_byte_stable(tmp_path):
    t = tensors()
    kwargs = {"family": "krea-2", "kind": "replica", "source": {"model": "x", "heads": [0, 1]},
              "provenance": "made here", "bounds": BOUNDS, "published": {"cosine": 0.5},
              "calibration": {"status": "none"}}
    path = ff.save_fixture(tmp_path / "a.safetensors", t["q"], t["k"], t["v"], **kwargs)
    fixture = ff.load_fixture(path)
    assert all(torch.equal(getattr(fixture, n), t[n]) for n in "qkv")
    assert (fixture.name, fixture.family, fixture.kind) == ("a", "krea-2", "replica")
    assert fixture.dtype == torch.bfloat16
    assert fixture.source == kwargs["source"] and fixture.bounds == BOUNDS
    assert fixture.published == {"cosine": 0.5} and fixture.calibration == {"status": "none"}
    assert fixture.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    again = ff.save_fixture(tmp_path / "b.safetensors", t["q"], t["k"], t["v"], **kwargs)
    assert again.read_bytes() == path.read_bytes()
    assert fixture.bound(VARIANTS["sm90-fp8-cuda"]) == BOUNDS["fp8"]


def test_text_calibration_and_optional_fields(tmp_path):
    t = tensors(torch.float16, 2, 2)
    path = ff.save_fixture(tmp_path / "c.safetensors", t["q"], t["k"], t["v"], family="sdxl", kind="recorded",
                           source={}, provenance="p", bounds=BOUNDS, calibration="not yet calibrated")
    fixture = ff.load_fixture(path)
    assert fixture.calibration == "not yet calibrated" and fixture.published is None
    assert fixture.dtype == torch.float16


def test_accuracy_class():
    classes = {name: v.accuracy_class for name, v in VARIANTS.items()}
    assert classes["sm80-fp16-cuda"] == classes["sm86-fp16-triton"] == "fp16"
    assert {classes[n] for n in classes if not n.startswith(("sm80", "sm86"))} == {"fp8"}


def drop(name):
    t = tensors()
    del t[name]
    return t


def with_tensor(name, *shape):
    t = tensors()
    t[name] = torch.zeros(*shape, dtype=torch.bfloat16)
    return t


BAD_FILES = {
    "missing tensor": (drop("v"), metadata(), "tensor v"),
    "wrong rank": (with_tensor("q", 4, 32, 16), metadata(), "tensor q"),
    "k and v differ": (with_tensor("v", 1, 2, 20, 16), metadata(), "tensor v"),
    "head dim differs": (with_tensor("q", 1, 4, 32, 8), metadata(), "tensor k"),
    "heads not divisible": (with_tensor("q", 1, 3, 32, 16), metadata(), "heads"),
    "float32": ({n: t.float() for n, t in tensors().items()}, metadata(dtype="float32"), "dtype"),
    "dtype metadata wrong": (tensors(), metadata(dtype="float16"), "dtype"),
    "bad source JSON": (tensors(), metadata(source='{"model": '), "source"),
    "source not an object": (tensors(), metadata(source="[1, 2]"), "source"),
    "missing kind": (tensors(), metadata(kind=None), "kind"),
    "unknown kind": (tensors(), metadata(kind="synthetic"), "kind"),
    "missing bounds": (tensors(), metadata(bounds=None), "bounds"),
    "bounds without fp8": (tensors(), metadata(bounds=json.dumps({"fp16": BOUNDS["fp16"]})), "bounds"),
    "bad calibration JSON": (tensors(), metadata(calibration="{oops"), "calibration"),
    "wrong format": (tensors(), metadata(**{"sage_qual.format": "2"}), "sage_qual.format"),
    "missing family": (tensors(), metadata(family=None), "family"),
    "layout NHD": (tensors(), metadata(layout="NHD"), "layout"),
}


@pytest.mark.parametrize("case", BAD_FILES)
def test_validation_error_names_file_and_field(tmp_path, case):
    tensor_dict, meta, field = BAD_FILES[case]
    path = write_raw(tmp_path / "bad.safetensors", tensor_dict, meta)
    with pytest.raises(ff.FixtureError) as caught:
        ff.load_fixture(path)
    assert caught.value.field == field
    message = str(caught.value)
    assert message.startswith(f"{path}: {field}: ") and "; " in message  # file, field, problem; fix


def test_missing_kind_says_how_to_fix(tmp_path):
    path = write_raw(tmp_path / "k.safetensors", tensors(), metadata(kind=None))
    with pytest.raises(ff.FixtureError, match="'recorded'.*'replica'"):
        ff.load_fixture(path)


@pytest.mark.parametrize("cut", [4, 100, -10])
def test_truncated_file(tmp_path, cut):
    good = ff.save_fixture(tmp_path / "g.safetensors", *tensors().values(), family="f", kind="replica",
                           source={}, provenance="p", bounds=BOUNDS)
    data = good.read_bytes()
    bad = tmp_path / "t.safetensors"
    bad.write_bytes(data[:cut])
    with pytest.raises(ff.FixtureError) as caught:
        ff.load_fixture(bad)
    assert caught.value.field == "file" and str(bad) in str(caught.value)
    assert "truncated" in str(caught.value) or "not a safetensors" in str(caught.value)


def test_not_safetensors_and_missing_file(tmp_path):
    text = tmp_path / "notes.safetensors"
    text.write_text("hello, this is not a fixture at all")
    for path in (text, tmp_path / "absent.safetensors"):
        with pytest.raises(ff.FixtureError) as caught:
            ff.load_fixture(path)
        assert caught.value.field == "file" and str(path) in str(caught.value)


def test_save_refuses_invalid_fixture_and_writes_nothing(tmp_path):
    t = tensors()
    path = tmp_path / "x.safetensors"
    with pytest.raises(ff.FixtureError, match="kind"):
        ff.save_fixture(path, t["q"], t["k"], t["v"], family="f", kind="synthetic", source={}, provenance="p",
                        bounds=BOUNDS)
    with pytest.raises(ff.FixtureError, match="heads"):
        ff.save_fixture(path, t["q"][:, :3], t["k"], t["v"], family="f", kind="replica", source={},
                        provenance="p", bounds=BOUNDS)
    assert not path.exists()


def test_describe_finds_outlier_channels_and_v_mean(tmp_path):
    q = torch.ones(1, 1, 64, 16)
    q[..., 5] = 100.0  # 100 > 8 x median channel max (1)
    q[..., 6] = 7.0  # under the 8x rule
    v = torch.ones(1, 1, 64, 16)
    v[..., 3] = -2.0  # the largest |channel mean|, not an outlier
    path = ff.save_fixture(tmp_path / "d.safetensors", q.half(), q.half(), v.half(), family="f",
                           kind="replica", source={}, provenance="p", bounds=BOUNDS)
    info = ff.describe(ff.load_fixture(path))
    assert info["channels"]["q"]["outlier_channels"] == [[5, 100.0]]
    assert info["channels"]["q"]["top_channels"][:2] == [[5, 100.0], [6, 7.0]]
    assert info["channels"]["v"]["outlier_channels"] == []
    assert info["v_mean"]["channel"] == 3 and info["v_mean"]["max_abs_channel_mean"] == 2.0
    assert info["shapes"]["q"] == [1, 1, 64, 16] and info["dtype"] == "float16"
    json.dumps(info)  # machine-readable as it is


# The shipped replicas ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def shipped():
    directory = ff.shipped_dir()
    assert directory is not None, "fixtures/ is missing next to the package"
    return {path.name[:-len(ff.SUFFIX)]: ff.load_fixture(path) for path in ff.list_fixtures(directory)}


def test_shipped_fixtures_are_labelled_replicas_within_size(shipped):
    assert set(shipped) == {r.name for r in FIXTURES}
    published = {r.name for r in REPLICAS}
    for fixture in shipped.values():
        assert fixture.kind == "replica"
        assert fixture.path.stat().st_size <= MAX_FILE_BYTES
        calibration = fixture.calibration
        # Kernel numbers only with the GPU run they came from.
        assert ("H200" in calibration["status"] and calibration["kernels"]) or (
            "not run on a GPU" in calibration["status"] and not calibration["kernels"])
        assert calibration["reproduction"]
        if fixture.name in published:  # the published calls' shapes, which the wrapper serves
            assert fixture.q.shape[2] >= 1536 and fixture.k.shape[2] >= 512
        else:  # a stress fixture says which field report it stands for
            assert fixture.source["field_report"]
    assert sum(f.path.stat().st_size for f in shipped.values()) <= MAX_TOTAL_BYTES


def test_every_fixture_belongs_to_a_family_or_the_generic_set(shipped):
    keys = {f.key for f in FAMILIES} | {"generic"}
    orphans = {f.name: f.family for f in shipped.values() if normalize(f.family) not in keys}
    assert not orphans, "fixtures no family's verdict reads"


@pytest.mark.parametrize("replica", FIXTURES, ids=lambda r: r.name)
def test_shipped_fixture_matches_generator(shipped, replica):
    fixture = shipped[replica.name]
    for name, tensor in zip("qkv", replica.tensors(), strict=True):
        assert torch.equal(getattr(fixture, name), tensor), f"{name} differs from the generator"
    assert (fixture.family, fixture.source, fixture.provenance, fixture.published) == (
        replica.family, replica.source, replica.provenance, replica.published)
    assert fixture.bounds == replica.bounds()


def test_shipped_files_regenerate_byte_for_byte(tmp_path):
    written = replicas.write(tmp_path)
    for path in written:
        assert path.read_bytes() == (ff.shipped_dir() / path.name).read_bytes(), (
            f"{path.name}: run `python -m sage_qual.fixtures.replicas --out fixtures/`")
