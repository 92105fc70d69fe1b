"""The audit's loop on the fake kernel, end to end: a kernel wrong only on some calls is caught in
production by the wrapper's audit, the call is recorded in a folder, `sage-qual audit` lists it,
certify on a fake GPU runs that folder beside the shipped fixtures and keeps the variant off the
family, and gate exits 1 naming the recorded fixture. Each step is needed: without the audit nothing
is recorded, without the recording the folder is empty, and a report that did not read the folder
enables the family."""

import dataclasses
import json
from pathlib import Path

import jsonschema
import pytest
import torch.nn.functional as F

import sage_qual
from sage_qual.cli import main
from sage_qual.fixtures import fileformat
from sage_qual.fixtures.recorder import AuditFolder
from sage_qual.qualification.selftest import faults as worker_faults
from sage_qual.serving.config import AuditConfig

from .. import fakes
from ..helpers import SMALL, qkv, wrapped

GPU = "Fake H200"


def on_fake_gpu(monkeypatch, gpu=GPU):
    """certify's workers run on one fake sm_90 GPU of this name (the test hook)."""
    monkeypatch.setenv(worker_faults.TEST_HOOK, json.dumps({"gpus": [{"name": gpu, "capability": [9, 0]}]}))


STRICT = {"fp16": {"max_rel_l2": 0.05, "min_cosine": 0.998}, "fp8": {"max_rel_l2": 0.12, "min_cosine": 0.99}}


@pytest.fixture
def shipped(tmp_path, monkeypatch):
    """A shipped fixtures folder of one small Krea-2 fixture (the fake kernel is exact on it)."""
    folder = tmp_path / "shipped"
    folder.mkdir()
    fakes.random_fixture(folder, "krea2_small", "Krea-2", STRICT)
    monkeypatch.setattr(fileformat, "shipped_dir", lambda: folder)
    return folder


def outlier_in_k(fake):
    """Wrong (rows shifted, finite) only on calls whose K has a channel 8x the median channel."""
    def make(exact):
        channel_max = fake.calls[-1].k.float().abs().amax(dim=(0, 1, 2))
        return exact.roll(1, dims=2) * 2 if channel_max.max() > 8 * channel_max.median() else exact
    return make


def after_call(count):
    calls = [0]

    def make(exact):
        calls[0] += 1
        return exact if calls[0] <= count else exact.roll(1, dims=2) * 2
    return make


def production(folder, defect, every=5, calls=40, audit=True):
    """A Krea-2 process on the fake H200, its kernel given `defect`: every 4th call has an outlier
    channel in K. Returns the scope's report."""
    plain = qkv()
    outlier = tuple(t.clone() for t in plain)
    outlier[1][..., 3] *= 50
    audit_config = AuditConfig(every=every if audit else 0, record=AuditFolder(str(folder)))
    with wrapped(config=dataclasses.replace(SMALL, audit=audit_config), names=[GPU]) as (_, fake):
        sage_qual.install(config=dataclasses.replace(SMALL, audit=audit_config), family="Krea-2")
        fake.return_value(defect(fake) if defect is outlier_in_k else defect)
        with sage_qual.sage_attention_scope() as report:
            for call in range(calls):
                F.scaled_dot_product_attention(*(outlier if call % 4 == 3 else plain))
    return report


def certify_and_gate(tmp_path, monkeypatch, capsys, folder, gpu=GPU):
    """certify on a fake GPU named `gpu` with `folder` beside the shipped fixtures, then gate --json."""
    on_fake_gpu(monkeypatch, gpu)
    out = tmp_path / "out"
    assert main(["certify", "--variants", "sm90-fp8-cuda", "--fixtures", str(folder), "--families", "Krea-2",
                 "--out", str(out)]) == 0
    capsys.readouterr()
    code = main(["gate", "--family", "Krea-2", "--report", str(out / "report.json"), "--fixtures",
                 str(folder), "--json"])
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("defect", ["outlier-calls-only", "after-call-12"])
def test_the_audit_catches_the_defect_records_it_and_certify_then_keeps_the_family_off(
        tmp_path, monkeypatch, capsys, shipped, defect):
    folder = tmp_path / "misses"
    # A fresh defect each run: after_call counts the calls it has seen.
    report = production(folder, outlier_in_k if defect == "outlier-calls-only" else after_call(12))
    assert report.audit.misses, report.summary()
    [recorded] = folder.glob("audit-*.safetensors")
    assert report.audit.misses[0].fixture == str(recorded)
    # The loop: certify runs the folder beside the shipped fixture, gate names the recorded one.
    code, answer = certify_and_gate(tmp_path, monkeypatch, capsys, folder)
    assert code == 1, answer
    [gpu] = answer["gpus"]
    audit_reasons = [r["detail"] for r in gpu["reasons"] if r["kind"] == "audit"]
    assert audit_reasons and all(recorded.stem in detail for detail in audit_reasons), gpu["reasons"]
    assert "recorded miss in production" in audit_reasons[0]
    report_md = (tmp_path / "out" / "report.md").read_text()
    assert f"| {recorded.stem} | Krea-2 | recorded |" in report_md
    assert "krea2_small | Krea-2 | replica" in report_md


def test_gate_without_the_folder_still_keeps_the_family_off_and_says_the_file_is_absent(
        tmp_path, monkeypatch, capsys, shipped):
    """A CI job may gate on a host without the misses' folder: the report's miss stands (exit 1, not
    'stale: certify again', which without the folder would drop the miss)."""
    folder = tmp_path / "misses"
    production(folder, outlier_in_k)
    [recorded] = folder.glob("audit-*.safetensors")
    certify_and_gate(tmp_path, monkeypatch, capsys, folder)
    assert main(["gate", "--family", "Krea-2", "--report", str(tmp_path / "out" / "report.json"),
                 "--json"]) == 1
    answer = json.loads(capsys.readouterr().out)
    assert any(recorded.stem in r["detail"] for r in answer["gpus"][0]["reasons"] if r["kind"] == "audit")
    assert any(recorded.stem in line and "--fixtures" in line for line in answer["differences"]), answer


@pytest.mark.parametrize("every", [3, 5, 8])
def test_the_audit_catches_a_defect_within_every_calls_of_its_start(tmp_path, every):
    report = production(tmp_path / "misses", after_call(12), every=every, calls=12 + 2 * every + 1)
    assert report.audit.misses
    # Audited within `every` calls of the first wrong one, acted on when the next audit reads it.
    assert report.served <= 12 + 2 * every and report.fallbacks["device"] >= 1, report.summary()


def test_without_the_audit_nothing_is_recorded_and_the_family_is_enabled(tmp_path, monkeypatch, capsys,
                                                                         shipped):
    folder = tmp_path / "misses"
    report = production(folder, outlier_in_k, audit=False)
    assert not report.audit.misses and not list(folder.glob("*.safetensors"))
    on_fake_gpu(monkeypatch)
    out = tmp_path / "out"
    assert main(["certify", "--variants", "sm90-fp8-cuda", "--families", "Krea-2", "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["gate", "--family", "Krea-2", "--report", str(out / "report.json")]) == 0


def test_a_recorded_miss_keeps_off_only_its_own_gpu_model(tmp_path, monkeypatch, capsys, shipped):
    folder = tmp_path / "misses"
    production(folder, outlier_in_k)
    code, answer = certify_and_gate(tmp_path, monkeypatch, capsys, folder, gpu="Fake H100")
    assert code == 0, answer


# sage-qual audit FOLDER --------------------------------------------------------------------------------

def test_the_audit_command_lists_the_misses_with_exit_1_and_an_empty_folder_with_exit_0(tmp_path, capsys):
    folder = tmp_path / "misses"
    production(folder, after_call(1), every=2, calls=4)
    assert main(["audit", str(folder), "--json"]) == 1
    answer = json.loads(capsys.readouterr().out)
    [found] = answer["misses"]
    assert answer["exit_code"] == 1 and found["family"] == "Krea-2" and found["miss"]["gpu"] == GPU
    assert found["miss"]["variant"] == "sm90-fp8-cuda"
    assert found["miss"]["rel_l2"] > found["miss"]["max_rel_l2"]
    assert main(["audit", str(folder)]) == 1
    assert f"{found['fixture']} [Krea-2, recorded]: sm90-fp8-cuda: recorded miss in production" in \
        capsys.readouterr().out
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["audit", str(empty)]) == 0
    assert capsys.readouterr().out == f"no recorded misses in {empty}\n"


def test_a_replica_in_the_folder_is_listed_apart_and_never_as_a_miss(tmp_path, capsys):
    folder = tmp_path / "misses"
    folder.mkdir()
    fakes.random_fixture(folder, "a_replica", "Krea-2", STRICT)
    assert main(["audit", str(folder), "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["misses"] == [] and answer["others"] == ["a_replica"]


def drifted_after(count):
    """20 % off torch from call `count` on: fit for Krea-2 (0.3), several times the model's error."""
    calls = [0]

    def make(exact):
        calls[0] += 1
        return exact if calls[0] <= count else exact * 1.2
    return make


def test_a_drift_is_recorded_as_a_drift_and_certify_then_keeps_the_variant_off(tmp_path, monkeypatch, capsys,
                                                                              shipped):
    folder = tmp_path / "drifts"
    report = production(folder, drifted_after(12))
    assert report.audit.drifts and not report.audit.misses, report.summary()
    [recorded] = folder.glob("audit-*.safetensors")
    assert main(["audit", str(folder)]) == 1
    listed = capsys.readouterr().out
    assert "sm90-fp8-cuda: recorded drift in production: the audit measured relative L2 0.2 where its " \
           "numerics model gives " in listed
    fixture = fileformat.load_fixture(recorded)
    assert fixture.bounds["fp8"]["max_rel_l2"] == 0.3  # the file's own bound is the family's fitness bound
    assert fixture.provenance.startswith("recorded by the audit in production: sm90-fp8-cuda")
    assert "drift: relative L2 0.2 over the bound" in fixture.provenance
    code, answer = certify_and_gate(tmp_path, monkeypatch, capsys, folder)
    assert code == 1, answer
    [gpu] = answer["gpus"]
    assert any(r["kind"] == "audit" and "recorded drift in production" in r["detail"] for r in gpu["reasons"])


def test_a_fixture_whose_provenance_says_the_audit_but_whose_record_is_gone_is_bad_input(tmp_path, capsys):
    """`sage-qual audit` said "no recorded misses" (exit 0) for a recorded miss whose source.audit was
    set to null (issue 64)."""
    folder = tmp_path / "misses"
    production(folder, after_call(1), every=2, calls=4)
    [path] = folder.glob("audit-*.safetensors")
    fixture = fileformat.load_fixture(path)
    fileformat.save_fixture(path, fixture.q, fixture.k, fixture.v, family=fixture.family, kind=fixture.kind,
                            source={**fixture.source, "audit": None}, provenance=fixture.provenance,
                            bounds=fixture.bounds)
    assert main(["audit", str(folder)]) == 2
    error = capsys.readouterr().err
    assert f"{path}: source.audit: missing, where its provenance says the audit recorded it" in error


@pytest.mark.parametrize("edit, said", [
    (lambda audit: audit.pop("gpu"), "source.audit: gpu: missing"),
    (lambda audit: audit.update(rel_l2="big"), "source.audit: rel_l2"),
    (lambda audit: audit.update(gpu=" "), "source.audit: gpu: is empty"),
])
def test_a_damaged_record_is_refused_with_the_file_and_the_fix(tmp_path, capsys, edit, said):
    folder = tmp_path / "misses"
    production(folder, after_call(1), every=2, calls=4)
    [path] = folder.glob("audit-*.safetensors")
    fixture = fileformat.load_fixture(path)
    source = json.loads(json.dumps(fixture.source))
    edit(source["audit"])
    fileformat.save_fixture(path, fixture.q, fixture.k, fixture.v, family=fixture.family, kind=fixture.kind,
                            source=source, provenance=fixture.provenance, bounds=fixture.bounds)
    assert main(["audit", str(folder)]) == 2
    error = capsys.readouterr().err
    assert str(path) in error and said in error and "re-record it with the wrapper's audit" in error


def test_a_missing_folder_is_refused():
    assert main(["audit", "/no/such/folder"]) == 2



def test_the_committed_schema_is_the_generated_one_and_an_answer_meets_it(tmp_path, capsys):
    from sage_qual.cli import audit

    root = Path(__file__).resolve().parents[2]
    assert json.loads((root / audit.SCHEMA_FILE).read_text()) == audit.schema(), \
        "regenerate docs/audit_schema.json from sage_qual.cli.audit.schema()"
    folder = tmp_path / "misses"
    production(folder, after_call(1), every=2, calls=4)
    main(["audit", str(folder), "--json"])
    jsonschema.validate(json.loads(capsys.readouterr().out), audit.schema())
    main(["audit", str(tmp_path / "none"), "--json"])
    jsonschema.validate(json.loads(capsys.readouterr().out), audit.schema())


# The worst real calls --------------------------------------------------------------------------------

SITES = {"a": (48, 24, 1.001), "b": (64, 32, 1.005), "c": (96, 48, 1.01)}  # q tokens, keys, output factor


def several_sites(folder, max_worst, calls=30):
    """A Krea-2 process on the fake H200 whose three call sites (shapes) each run a little off torch,
    all fit and on the model: 0.1 %, 0.5 % and 1 %."""
    tensors = {site: qkv(q_tokens=q, k_tokens=k) for site, (q, k, _) in SITES.items()}
    factor = {q: f for q, _, f in SITES.values()}
    config = dataclasses.replace(SMALL, audit=AuditConfig(every=1, record=AuditFolder(str(folder),
                                                                                    max_worst=max_worst)))
    with wrapped(config=config, names=[GPU]) as (_, fake):
        sage_qual.install(config=config, family="Krea-2")
        fake.return_value(lambda exact: exact * factor[exact.shape[2]])
        with sage_qual.sage_attention_scope() as report:
            for call in range(calls):
                F.scaled_dot_product_attention(*tensors["abc"[call % 3]])
    return report


def test_the_audit_keeps_the_worst_call_of_each_site_within_its_bound(tmp_path, capsys):
    folder = tmp_path / "seen"
    report = several_sites(folder, max_worst=2)
    assert report.audit.audited == 30 and not report.audit.misses and not report.audit.drifts
    files = list(folder.glob("*.safetensors"))
    assert len(files) == 2  # the bound: max_worst sites, the two worst (b and c)
    worst = sorted(fileformat.load_fixture(p).source["worst"]["rel_l2"] for p in files)
    assert worst == pytest.approx([0.005, 0.01], rel=0.05)
    calls = {fileformat.load_fixture(p).source["worst"]["call"] for p in files}
    assert sorted(call[:20] for call in calls) == [
        "q/k/v [1, 2, 64, 64]", "q/k/v [1, 2, 96, 64]"]  # sites b and c; a's 0.1 % was displaced
    fixture = fileformat.load_fixture(files[0])
    assert fixture.kind == "recorded" and fixture.family == "Krea-2"
    assert fixture.provenance.startswith("recorded by the audit as the worst call of its site: sm90-fp8-cuda")
    assert "channels" in fixture.source["full_call"] and fixture.bounds["fp8"]["max_rel_l2"] == 0.3
    assert main(["audit", str(folder)]) == 0  # worst calls are no misses
    assert "no recorded misses" in capsys.readouterr().out


def test_a_site_keeps_one_file_its_worst(tmp_path):
    folder = tmp_path / "seen"
    several_sites(folder, max_worst=16)
    files = list(folder.glob("worst-*.safetensors"))
    assert len(files) == 3  # one per site, rewritten when a worse call of it came
    assert len({fileformat.load_fixture(p).source["worst"]["call"] for p in files}) == 3


def test_certify_runs_the_worst_calls_beside_the_shipped_fixtures(tmp_path, monkeypatch, capsys, shipped):
    folder = tmp_path / "seen"
    several_sites(folder, max_worst=2, calls=9)
    code, answer = certify_and_gate(tmp_path, monkeypatch, capsys, folder)
    report_md = (tmp_path / "out" / "report.md").read_text()
    for path in folder.glob("*.safetensors"):
        assert f"| {path.stem} | Krea-2 | recorded |" in report_md
    assert "krea2_small | Krea-2 | replica" in report_md
    [gpu] = answer["gpus"]
    assert not [r for r in gpu["reasons"] if r["kind"] == "audit"]  # no miss among them


def test_no_worst_call_is_kept_at_max_worst_0(tmp_path):
    several_sites(tmp_path / "seen", max_worst=0, calls=6)
    assert not list(tmp_path.rglob("*.safetensors"))
