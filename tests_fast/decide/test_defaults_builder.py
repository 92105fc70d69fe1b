"""The built-in defaults' builder (sage_qual/qualification/decide/defaults.py) on hand-made certify
profiles: each merge rule and each refusal, where tests_fast/serving/test_builtin_defaults.py checks
the shipped file against the committed runs. Issue 54: a mutation run of the builder against that
file alone left 64 of 283 mutants alive (docs/mutation.md); these tests are written at what lived."""

import json

import pytest

from sage_qual.qualification.decide import defaults as building
from sage_qual.serving import defaults
from sage_qual.verdicts import profile
from sage_qual.verdicts.env_record import ReasonKind

from ..builders import certify_profile, make_entry, reason

SM89, SM89_FP32ACC = "sm89-fp8-cuda", "sm89-fp8-cuda-fp32acc"


def built_gpu(files, name="RTX 4090") -> profile.ProfileGpu:
    [gpu] = [g for g in building.build(files, previous=None).profile.gpus if g.name == name]
    return gpu


def test_one_run_is_its_own_merge(tmp_path):
    """The default kernel from the highest threshold of the entries serving it (a family's too)."""
    run = certify_profile(tmp_path, "RTX 4090", make_entry(SM89, 3072, 512, [64, 128]),
                          {"FLUX.1": make_entry(SM89, 4096, 1024, [128])})
    gpu = built_gpu([run])
    assert (gpu.default.variant, gpu.default.served.min_query_tokens, gpu.default.served.head_dims) == (
        SM89, 4096, (64, 128))
    assert gpu.families["FLUX.1"].served.min_key_tokens == 1024


def test_the_tables_next_kernel_is_the_default_where_the_first_was_never_served(tmp_path):
    """sm_89's table lists two kernels: a run serving only the second gets it, not an entry off."""
    runs = [certify_profile(tmp_path, "RTX 4090", make_entry(SM89_FP32ACC, 2048, 512, [128]), {})
            for _ in range(2)]
    assert built_gpu(runs).default.variant == SM89_FP32ACC


@pytest.mark.parametrize("capability", [(8, 9), (7, 5)], ids=["never-served", "no-kernel-in-the-table"])
def test_a_default_kernel_never_served_leaves_the_default_off_with_the_reason(tmp_path, capability):
    off = make_entry(None, reasons=[reason("speed", "slower than SDPA")])
    default = built_gpu([certify_profile(tmp_path, "GPU", off, {}, capability=capability)], "GPU").default
    assert default.variant is None
    assert [(r.kind, r.detail) for r in default.reasons] == [
        (ReasonKind.SPEED, "the default kernel was never measured faster than torch's SDPA here")]


def test_a_family_one_run_kept_off_is_off_with_that_runs_reasons_or_its_file(tmp_path):
    served = make_entry(SM89, 2048, 512, [128])
    with_reasons = make_entry(None, reasons=[reason("non_finite", "NaN on flux")])
    without = make_entry(None)
    runs = [certify_profile(tmp_path, "RTX 4090", served, {"A": served, "B": served}),
            certify_profile(tmp_path, "RTX 4090", served, {"A": with_reasons, "B": without})]
    gpu = built_gpu(runs)
    said = {name: [(r.kind, r.detail) for r in gpu.families[name].reasons] for name in ("A", "B")}
    assert said == {"A": [(ReasonKind.NON_FINITE, "NaN on flux")],
                    "B": [(ReasonKind.SPEED, f"kept off in {runs[1]}")]}


def test_runs_that_chose_different_variants_keep_the_family_off_naming_both(tmp_path):
    runs = [certify_profile(tmp_path, "RTX 4090", make_entry(), {"A": make_entry(variant)})
            for variant in (SM89_FP32ACC, SM89)]
    [why] = built_gpu(runs).families["A"].reasons
    assert (why.kind, why.detail) == (ReasonKind.SPEED,
                                      f"the runs chose different variants ({SM89}, {SM89_FP32ACC})")


def test_runs_that_share_no_head_size_keep_the_family_off_saying_so(tmp_path):
    runs = [certify_profile(tmp_path, "RTX 4090", make_entry(), {"A": make_entry(SM89, head_dims=[dim])})
            for dim in (64, 128)]
    entry = built_gpu(runs).families["A"]
    assert entry.variant is None
    assert [(r.kind, r.detail) for r in entry.reasons] == [(ReasonKind.SPEED, "the runs share no head size")]


def test_the_newest_run_gives_the_software_whatever_order_or_names_the_files_have(tmp_path):
    older = certify_profile(tmp_path, "RTX 4090", make_entry(), {}, torch_version="2.12.0")
    newer = certify_profile(tmp_path, "RTX 4090", make_entry(), {}, torch_version="2.13.0")
    older = older.rename(tmp_path / "z-older.json")  # names sort against their dates
    assert built_gpu([newer, older]).environment.torch == "2.13.0"
    assert built_gpu([older, newer]).environment.torch == "2.13.0"


def test_every_model_kept_from_the_previous_file_keeps_its_sources(tmp_path):
    previous = tmp_path / "previous.json"
    previous.write_text(defaults.DATA.read_text())
    _, shipped_sources = defaults.read()
    assert len({s.gpu for s in shipped_sources}) >= 2  # the shipped file's H200 and H100 runs
    runs = tmp_path / "runs"
    runs.mkdir()
    added = certify_profile(runs, "RTX 4090", make_entry(), {})
    built = building.build([added], previous=previous)
    assert [s.file for s in built.sources] == [s.file for s in shipped_sources] + [str(added)]


def test_the_command_keeps_the_models_of_the_file_it_writes_not_the_shipped_ones(tmp_path, capsys):
    runs = tmp_path / "runs"
    runs.mkdir()
    out = tmp_path / "mine.json"
    assert building.main([str(certify_profile(runs, "RTX 4090", make_entry(), {})), "--out", str(out)]) == 0
    assert building.main([str(certify_profile(runs, "RTX 4080", make_entry(), {})), "--out", str(out)]) == 0
    assert [gpu.name for gpu in defaults.read(out)[0].gpus] == ["RTX 4090", "RTX 4080"]
    assert capsys.readouterr().out.splitlines()[-1] == f"wrote {out}: RTX 4090 (sm_89), RTX 4080 (sm_89)"


def test_the_command_writes_the_shipped_files_format(tmp_path):
    """One space of indent and a final newline, as default_profile.json is committed, so a rebuild's
    diff shows only what changed."""
    runs = tmp_path / "runs"
    runs.mkdir()
    out = tmp_path / "d.json"
    assert building.main([str(certify_profile(runs, "RTX 4090", make_entry(), {})), "--out", str(out)]) == 0
    text = out.read_text()
    assert text == json.dumps(json.loads(text), indent=1) + "\n"


@pytest.mark.parametrize("content, said", [(b"{not json", "is not JSON: "), (None, "cannot read ")],
                         ids=["not-json", "unreadable"])
def test_a_file_that_is_no_run_is_refused_naming_it(tmp_path, capsys, content, said):
    path = tmp_path / "run.json"
    if content is None:
        path.mkdir()  # a folder where a file was meant: unreadable as a file
    else:
        path.write_bytes(content)
    assert building.main([str(path), "--out", str(tmp_path / "d.json")]) == 2
    err = capsys.readouterr().err
    expected = f"error: {said}{path}: " if said == "cannot read " else f"error: {path} {said}"
    assert err.startswith(expected), err
    assert not (tmp_path / "d.json").exists()


def test_the_commands_help_names_it_and_what_it_takes(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "2000")  # argparse wraps at the terminal's width, paths at a hyphen
    with pytest.raises(SystemExit) as done:
        building.main(["--help"])
    said = " ".join(capsys.readouterr().out.split())
    assert done.value.code == 0
    assert said.startswith("usage: python -m sage_qual.qualification.decide.defaults [-h] [--out OUT] runs "
                           "[runs ...]")
    assert ("Build the built-in defaults from certify runs (report.json, decided with this code's rules, or "
            "profile.json): every run of a GPU model merged to its most conservative entry; models the files "
            "do not name are kept.") in said
    assert "runs report.json or profile.json files written by certify" in said
    assert f"--out OUT the data file to write (default: {defaults.DATA})" in said
