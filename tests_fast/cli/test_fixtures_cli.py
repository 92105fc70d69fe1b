"""`fixtures list` and `fixtures show` through the command line (`sage_qual.cli.main`)."""

import json
import shutil

from sage_qual import cli
from sage_qual.fixtures.fileformat import list_fixtures, shipped_dir
from sage_qual.fixtures.replicas import FIXTURES


def run(*argv):
    return cli.main(list(argv))  # as the command line runs it: refusals are printed by cli.main


def test_list_shipped_directory_by_default(capsys):
    assert run("fixtures", "list") == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert err == "" and len(lines) == len(FIXTURES)
    krea = next(line for line in lines if line.startswith("krea2_b0_outlier_gqa"))
    assert krea.split()[1:3] == ["krea-2", "replica"]
    assert (
        "q 1x4x1536x128" in krea and "kv 1x1x768x128" in krea and "bfloat16" in krea and krea.endswith("MB")
    )
    z_image = next(line for line in lines if line.startswith("z_image_padded_caption_batch"))
    assert z_image.endswith("MB  masked (2x1x1x576)")


def test_show_names_a_masked_calls_mask(capsys):
    assert run("fixtures", "show", str(shipped_dir() / "z_image_padded_caption_batch.safetensors")) == 0
    assert ("  attn_mask    bool [2, 1, 1, 576]: a masked call, run only by a variant that takes a mask"
            in capsys.readouterr().out.splitlines())


def test_show_text_and_json(capsys):
    path = shipped_dir() / "qwen_image_b0_outlier_head.safetensors"
    assert run("fixtures", "show", str(path)) == 0
    text = capsys.readouterr().out
    assert "qwen_image_b0_outlier_head" in text and "outlier channels 37 (600)" in text
    assert "measured on the kernels: NVIDIA H200" in text and "reproduction: Partly reproduced" in text
    assert "kernels sm90-fp8-cuda" in text and "not the kernel" in text and "relative L2 <= 0.2" in text
    assert run("fixtures", "show", str(path), "--json") == 0
    info = json.loads(capsys.readouterr().out)
    assert info["kind"] == "replica" and info["channels"]["k"]["outlier_channels"][0][0] == 37
    assert info["shapes"]["q"] == [1, 1, 1536, 128]


def test_show_bad_file_is_one_line_exit_2(tmp_path, capsys):
    bad = tmp_path / "broken.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{\"q\": 1")
    assert run("fixtures", "show", str(bad)) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1
    assert str(bad) in err and "Traceback" not in err


def test_list_reports_a_bad_file_and_still_lists_the_rest(tmp_path, capsys):
    for path in list_fixtures(shipped_dir())[:2]:
        shutil.copy(path, tmp_path)
    (tmp_path / "zz_empty.safetensors").write_bytes(b"")
    assert run("fixtures", "list", str(tmp_path)) == 2
    out, err = capsys.readouterr()
    assert len(out.splitlines()) == 2
    expected = (f"sage-qual fixtures: {tmp_path / 'zz_empty.safetensors'}: file: only 0 bytes: not a "
                "safetensors file; re-create it with save_fixture() (or fetch it again if it was copied)")
    assert err.splitlines() == [expected]


def test_list_missing_directory(tmp_path, capsys):
    assert run("fixtures", "list", str(tmp_path / "nope")) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and "directory" in err


def test_show_takes_the_name_that_list_prints(capsys):
    assert run("fixtures", "list") == 0
    name = capsys.readouterr().out.splitlines()[0].split()[0]
    assert run("fixtures", "show", name, "--json") == 0
    assert json.loads(capsys.readouterr().out)["name"] == name


def test_show_an_unknown_name_lists_the_known_ones(capsys):
    assert run("fixtures", "show", "flux9_4096") == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1
    assert "flux9_4096: name: no such file, and no shipped fixture of that name; give a path or one of: " \
        in err
    assert "flux1_1024" in err
