"""The fleet step's gate, in process, on rows shaped as `merge --json` writes them (synthetic numbers):
each rule of sage_qual/qualification/decide/fleet.py on its own, where examples/fleet's end-to-end
tests (tests_fast/cli/test_fleet_recipes.py) run it on committed reports. Issue 54: the step was a
heredoc no mutation run could reach, and 3 of 11 plausible bugs in it were caught."""

import json
import re

import pytest

from sage_qual.qualification.decide import fleet
from sage_qual.qualification.decide.fleet import BadInput

PASSING = fleet.passing_verdicts("")
STRICT = fleet.passing_verdicts("1")


def served(**change) -> dict:
    return {
        "variant": "sm90-fp8-cuda",
        "min_query_tokens": 4096,
        "min_key_tokens": 4096,
        "head_dims": [128],
        "max_query_tokens": 32768,
        "max_key_tokens": 32768,
        "layouts": ["contiguous", "transposed"],
        "contexts": ["side_stream", "compile"],
        "bounds": [],
        "masks": False,
        **change,
    }


def row(host: str, families: dict, *, gpu="NVIDIA H200", undecidable="", folder=None) -> dict:
    return {
        "host": host,
        "gpu": gpu,
        "report": f"/fleet/{folder or host}/report.json",
        "families": families,
        "undecidable": undecidable,
    }


def enabled(**change) -> dict:
    return {"verdict": "enable", "served": served(**change)}


def lines(rows, gates=None, required=(), passing=PASSING) -> dict[str, str]:
    answer = fleet.decide(rows, gates or {}, list(required), passing)
    return dict(line.split(": ", 1) for line in answer.lines)


def test_every_host_enabling_the_same_range_enables_it_in_full():
    rows = [row("a", {"Wan 2.2": enabled()}), row("b", {"Wan 2.2": enabled()})]
    assert lines(rows)["Wan 2.2"] == (
        "enable (sm90-fp8-cuda on NVIDIA H200; every host: from 4,096 to 32,768 tokens, head_dim 128 "
        "(layouts: contiguous, transposed; contexts: side_stream, compile))"
    )


def test_the_range_is_the_highest_start_and_the_lowest_end_on_each_side():
    rows = [
        row("a", {"Wan 2.2": enabled(min_query_tokens=2048, min_key_tokens=8192, max_key_tokens=65536)}),
        row("b", {"Wan 2.2": enabled(max_query_tokens=16384, max_key_tokens=None)}),
    ]
    assert "from 4,096 to 16,384 query / 8,192 to 16,384 key tokens" in lines(rows)["Wan 2.2"]


def test_a_range_no_host_shares_keeps_the_family_off():
    rows = [
        row("a", {"Wan 2.2": enabled(max_query_tokens=8192, max_key_tokens=8192)}),
        row("b", {"Wan 2.2": enabled(min_query_tokens=16384, min_key_tokens=16384)}),
    ]
    assert (
        lines(rows)["Wan 2.2"] == "keep off (no range of tokens, head sizes and layouts every host verified)"
    )
    keys_apart = [
        row("a", {"Wan 2.2": enabled(max_key_tokens=8192)}),
        row("b", {"Wan 2.2": enabled(min_key_tokens=16384)}),
    ]
    assert lines(keys_apart)["Wan 2.2"].startswith("keep off (no range")


@pytest.mark.parametrize(
    "second, stated, reversed_stated",
    [
        # the shared names, in the first host's order
        (["transposed", "contiguous", "nhd"], "contiguous, transposed", "transposed, contiguous"),
        (["transposed"], "transposed", "transposed"),
    ],
)
def test_the_layouts_stated_are_those_every_host_verified(second, stated, reversed_stated):
    rows = [row("a", {"Wan 2.2": enabled()}), row("b", {"Wan 2.2": enabled(layouts=second)})]
    assert f"(layouts: {stated};" in lines(rows)["Wan 2.2"]
    assert f"(layouts: {reversed_stated};" in lines(rows[::-1])["Wan 2.2"]


def test_no_layout_every_host_verified_keeps_the_family_off():
    rows = [
        row("a", {"Wan 2.2": enabled(layouts=["contiguous"])}),
        row("b", {"Wan 2.2": enabled(layouts=["nhd"])}),
    ]
    assert lines(rows)["Wan 2.2"].startswith("keep off (no range of tokens, head sizes and layouts")


def test_head_sizes_are_those_every_host_served_and_none_shared_keeps_it_off():
    rows = [
        row("a", {"Wan 2.2": enabled(head_dims=[64, 128])}),
        row("b", {"Wan 2.2": enabled(head_dims=[128, 256])}),
    ]
    assert "head_dim 128 (" in lines(rows)["Wan 2.2"]
    both = [
        row("a", {"Wan 2.2": enabled(head_dims=[64, 128])}),
        row("b", {"Wan 2.2": enabled(head_dims=[128, 64])}),
    ]
    assert "head_dim 64/128 (" in lines(both)["Wan 2.2"]
    apart = [row("a", {"Wan 2.2": enabled(head_dims=[64])}), row("b", {"Wan 2.2": enabled(head_dims=[128])})]
    assert lines(apart)["Wan 2.2"].startswith("keep off (no range")


@pytest.mark.parametrize(
    "second, stated",
    [
        (["compile"], "; contexts: compile))"),
        ([], "; contexts: none))"),
        (None, "; contexts: side_stream, compile (a host without context checks: built-in rule)))"),
    ],
)
def test_the_contexts_stated_are_those_every_host_certified(second, stated):
    rows = [row("a", {"Wan 2.2": enabled()}), row("b", {"Wan 2.2": enabled(contexts=second)})]
    assert lines(rows)["Wan 2.2"].endswith(stated)


def test_no_host_with_context_checks_states_no_contexts():
    rows = [row("a", {"Wan 2.2": enabled(contexts=None)}), row("b", {"Wan 2.2": enabled(contexts=None)})]
    assert lines(rows)["Wan 2.2"].endswith("(layouts: contiguous, transposed))")


def test_masked_calls_are_stated_only_where_every_host_serves_them():
    both = [row("a", {"Wan 2.2": enabled(masks=True)}), row("b", {"Wan 2.2": enabled(masks=True)})]
    assert lines(both)["Wan 2.2"].endswith("contexts: side_stream, compile; masked calls too))")
    one = [row("a", {"Wan 2.2": enabled(masks=True)}), row("b", {"Wan 2.2": enabled()})]
    assert "mask" not in lines(one)["Wan 2.2"]
    unbounded = [row("a", {"Wan 2.2": enabled(masks=True, max_query_tokens=None)}), both[1]]
    assert "(a report without long checks; masked calls too))" in lines(unbounded)["Wan 2.2"]


def test_each_sides_bound_is_the_highest_any_host_keeps_on_torch():
    rows = [
        row("a", {"Wan 2.2": enabled(bounds=[{"side": "key", "below": 17}, {"side": "query", "below": 5}])}),
        row("b", {"Wan 2.2": enabled(bounds=[{"side": "key", "below": 33}])}),
    ]
    assert lines(rows)["Wan 2.2"].endswith(
        "; calls with fewer than 33 keys stay on torch; calls with fewer than 5 query tokens stay on torch)"
    )


def test_a_host_without_an_upper_bound_says_so_from_the_highest_start():
    rows = [
        row("a", {"Wan 2.2": enabled(max_query_tokens=None, max_key_tokens=None, min_query_tokens=9728)}),
        row("b", {"Wan 2.2": enabled(bounds=[{"side": "key", "below": 17}])}),
    ]
    assert lines(rows)["Wan 2.2"] == (
        "enable (sm90-fp8-cuda on NVIDIA H200; every host: from 9,728 query / 4,096 key tokens, "
        "head_dim 128, no upper bound verified (a report without long checks); calls with fewer than 17 "
        "keys stay on torch)"
    )


def test_each_gpu_models_variant_is_named():
    rows = [
        row("a", {"Wan 2.2": enabled()}),
        row("b", {"Wan 2.2": enabled(variant="sm89-fp8-cuda")}, gpu="RTX 4090"),
    ]
    assert lines(rows)["Wan 2.2"].startswith(
        "enable (sm89-fp8-cuda on RTX 4090, sm90-fp8-cuda on NVIDIA H200; "
    )


def test_a_host_that_keeps_the_family_off_or_never_ran_it_keeps_it_off_naming_each():
    rows = [
        row("a", {"Wan 2.2": {"verdict": "keep off", "served": None}, "SDXL": enabled()}),
        row("b", {"Wan 2.2": enabled()}, folder="b-folder"),
        row("c", {"SDXL": enabled()}),
    ]
    decided = lines(rows)
    assert decided["Wan 2.2"] == "keep off (a NVIDIA H200 (a): keep off; c NVIDIA H200 (c): not run)"
    assert decided["SDXL"] == "keep off (b NVIDIA H200 (b-folder): not run)"


def test_safe_no_speedup_anywhere_is_said_and_counts_as_off_only_when_speedup_is_required():
    safe = {"verdict": "safe, no speedup", "served": None}
    rows = [row("a", {"SDXL": enabled()}), row("b", {"SDXL": safe})]
    assert lines(rows)["SDXL"] == "safe, no speedup"
    assert fleet.decide(rows, {}, ["SDXL"], PASSING).exit_code(["SDXL"]) == 0
    strict = fleet.decide(rows, {}, ["SDXL"], STRICT)
    assert strict.lines == ("SDXL: keep off (b NVIDIA H200 (b): safe, no speedup)",)
    assert strict.exit_code(["SDXL"]) == 1


def test_an_undecidable_report_keeps_every_family_off_in_its_own_words():
    rows = [row("a", {"Wan 2.2": enabled()}), row("b", {}, undecidable="b/report.json is a predicted report")]
    assert lines(rows)["Wan 2.2"] == "keep off (b NVIDIA H200 (b): b/report.json is a predicted report)"


def test_a_hosts_own_gate_must_have_said_enable_where_it_answered(tmp_path):
    for host in ("a", "b"):
        (tmp_path / host).mkdir()
    (tmp_path / "b" / "gates.jsonl").write_text(json.dumps({"family": "Wan 2.2", "exit_code": 1}) + "\n")
    rows = [
        {
            **row(host, {"Wan 2.2": enabled(), "SDXL": enabled()}),
            "report": str(tmp_path / host / "report.json"),
        }
        for host in ("a", "b")
    ]
    gates = fleet.gate_answers([r["report"] for r in rows])
    assert gates == {str(tmp_path / "b"): {"Wan 2.2": 1}}  # a has no gates.jsonl
    decided = lines(rows, gates)
    assert decided["Wan 2.2"] == "keep off (b NVIDIA H200 (b): gate exit 1)"
    assert decided["SDXL"] == "keep off (b NVIDIA H200 (b): gate exit missing)"  # b's gates.jsonl has none


def test_a_family_only_a_gate_answered_gets_a_line():
    rows = [row("a", {"Wan 2.2": enabled()})]
    decided = lines(rows, {"/fleet/a": {"Krea": 0}})
    assert list(decided) == ["Wan 2.2", "Krea"] and decided["Krea"] == "keep off (a NVIDIA H200 (a): not run)"


@pytest.mark.parametrize(
    "required, code",
    [
        ([], 0),
        (["Wan 2.2"], 0),
        (["SDXL"], 1),
        (["Wan 2.2", "SDXL"], 1),
        (["SDXL", "Wan 2.2"], 1),
        (["Wan 2.2", "Krea"], 2),
    ],
)
def test_the_exit_code_is_1_when_any_required_family_is_off_and_2_for_one_no_report_ran(required, code):
    rows = [row("a", {"Wan 2.2": enabled(), "SDXL": {"verdict": "keep off", "served": None}})]
    answer = fleet.decide(rows, {}, required, PASSING)
    assert answer.exit_code(required) == code
    assert len(answer.lines) == 2  # the lines are written whatever the code
    assert answer.unknown == tuple(f for f in required if f == "Krea")


def test_a_required_family_an_undecidable_report_may_have_run_is_kept_off_not_unknown():
    rows = [row("a", {}, undecidable="a/report.json is a --quick report")]
    answer = fleet.decide(rows, {}, ["Wan 2.2"], PASSING)
    why = "a/report.json is a --quick report"
    assert answer.lines == (f"Wan 2.2: keep off (no report that decides ran it; {why})",)
    assert answer.exit_code(["Wan 2.2"]) == 1 and answer.unknown == ()


@pytest.mark.parametrize(
    "value, passing",
    [
        ("1", {"enable"}),
        (" Yes ", {"enable"}),
        ("TRUE", {"enable"}),
        ("on", {"enable"}),
        ("0", {"enable", "safe, no speedup"}),
        ("no", {"enable", "safe, no speedup"}),
        ("Off", {"enable", "safe, no speedup"}),
        ("false", {"enable", "safe, no speedup"}),
        ("", {"enable", "safe, no speedup"}),
    ],
)
def test_require_speedup_spellings(value, passing):
    assert fleet.passing_verdicts(value) == passing


def test_an_unknown_require_speedup_is_bad_input_naming_the_spellings():
    with pytest.raises(BadInput, match=r"REQUIRE_SPEEDUP='2': give 1 \(or true, yes, on\) or 0"):
        fleet.passing_verdicts("2")


@pytest.mark.parametrize(
    "text, problem",
    [
        ('{"family": "Wan 2.2", "exit_co', "line 2: not JSON"),
        ('{"family": "Wan 2.2", "exit_code": true}', "line 2: not a `sage-qual gate --json` answer"),
        ('{"family": 3, "exit_code": 0}', "line 2: not a `sage-qual gate --json` answer"),
        ('{"exit_code": 0}', "line 2: not a `sage-qual gate --json` answer"),
        ('{"family": " ", "exit_code": 0}', "line 2: not a `sage-qual gate --json` answer"),
        ('{"family": "Wan 2.2", "exit_code": "0"}', "line 2: not a `sage-qual gate --json` answer"),
        ('"Wan 2.2"', "line 2: not a `sage-qual gate --json` answer"),
        ('{"family": "SDXL", "exit_code": 0}', "lines 1 and 2: both answer SDXL"),
    ],
)
def test_a_bad_gates_file_is_bad_input_naming_the_file_and_line(tmp_path, text, problem):
    answers = tmp_path / "a" / "gates.jsonl"
    answers.parent.mkdir()
    answers.write_text(json.dumps({"family": "SDXL", "exit_code": 0}) + "\n" + text + "\n")
    with pytest.raises(BadInput, match="^" + re.escape(f"{answers} {problem}")):
        fleet.gate_answers([str(tmp_path / "a" / "report.json")])


def test_one_family_answered_on_two_hosts_is_two_answers(tmp_path):
    for host, code in (("a", 0), ("b", 3)):
        (tmp_path / host).mkdir()
        answer = json.dumps({"family": "Wan 2.2", "exit_code": code})
        (tmp_path / host / "gates.jsonl").write_text(f"\n{answer}\n")
    gates = fleet.gate_answers([str(tmp_path / h / "report.json") for h in ("a", "b")])
    assert gates == {str(tmp_path / "a"): {"Wan 2.2": 0}, str(tmp_path / "b"): {"Wan 2.2": 3}}


def test_main_writes_and_prints_the_lines_then_names_an_unknown_family(tmp_path, monkeypatch, capsys):
    merged = tmp_path / "fleet.json"
    merged.write_text(json.dumps({"rows": [row("a", {"Wan 2.2": enabled()})]}))
    monkeypatch.setenv("REQUIRED_FAMILIES", " wan 2.2 , Krea-2,")
    monkeypatch.delenv("REQUIRE_SPEEDUP", raising=False)
    code = fleet.main([str(merged), str(tmp_path / "gates.txt"), "/fleet/a/report.json"])
    written = (tmp_path / "gates.txt").read_text()
    assert code == 2 and written.startswith("Wan 2.2: enable (") and written.endswith(")\n")
    out, err = capsys.readouterr()
    assert out == written and err == "REQUIRED_FAMILIES names families no report ran: Krea-2\n"


def test_main_turns_bad_input_into_exit_2_with_the_steps_name(tmp_path, monkeypatch, capsys):
    merged = tmp_path / "fleet.json"
    merged.write_text(json.dumps({"rows": []}))
    monkeypatch.setenv("REQUIRE_SPEEDUP", "maybe")
    assert fleet.main([str(merged), str(tmp_path / "gates.txt")]) == 2
    assert capsys.readouterr().err.startswith("merge_and_gate.sh: REQUIRE_SPEEDUP='maybe'")
    assert not (tmp_path / "gates.txt").exists()


def test_hosts_sharing_one_length_serve_at_that_length():
    rows = [
        row("a", {"Wan 2.2": enabled(max_query_tokens=16384, max_key_tokens=16384)}),
        row("b", {"Wan 2.2": enabled(min_query_tokens=16384, min_key_tokens=16384)}),
    ]
    assert "every host: from 16,384 to 16,384 tokens, head_dim 128" in lines(rows)["Wan 2.2"]


def test_a_lower_bound_after_a_higher_one_keeps_the_higher():
    rows = [
        row("a", {"Wan 2.2": enabled(bounds=[{"side": "key", "below": 33}])}),
        row("b", {"Wan 2.2": enabled(bounds=[{"side": "key", "below": 17}])}),
    ]
    assert lines(rows)["Wan 2.2"].endswith("; calls with fewer than 33 keys stay on torch)")


def test_a_required_family_decided_nowhere_keeps_every_other_line_and_verdict():
    rows = [
        row("a", {"Wan 2.2": enabled(), "SDXL": {"verdict": "keep off", "served": None}}),
        row("b", {}, undecidable="b/report.json is a --quick report"),
    ]
    answer = fleet.decide(rows, {}, ["Krea"], PASSING)
    assert [line.split(":")[0] for line in answer.lines] == ["Wan 2.2", "SDXL", "Krea"]
    assert answer.kept_off == ("Wan 2.2", "SDXL", "Krea")  # Wan 2.2: b decides nothing


def test_a_gates_file_that_is_not_text_is_bad_input_not_a_crash(tmp_path):
    answers = tmp_path / "a" / "gates.jsonl"
    answers.parent.mkdir()
    answers.write_bytes(b'{"family": "Wan 2.2", "exit_code": 0}\n\xff\xfe\x00garbage\n')
    with pytest.raises(BadInput, match=re.escape(f"{answers} line 2: not JSON")):
        fleet.gate_answers([str(tmp_path / "a" / "report.json")])


def test_each_bad_gates_line_says_how_to_mend_it(tmp_path):
    answers = tmp_path / "a" / "gates.jsonl"
    answers.parent.mkdir()
    mends = {
        "{": "a gate answer cut short? run the host's gate again, or remove the line",
        "[]": "(it needs a family name and an integer exit_code): run the host's gate again, or "
        "remove the line",
        '{"family": "Wan 2.2", "exit_code": 0}\n{"family": "Wan 2.2", "exit_code": 0}': (
            "both answer Wan 2.2: run the host's gates again into an empty gates.jsonl, or remove one line"
        ),
    }
    for text, mend in mends.items():
        answers.write_text(text + "\n")
        with pytest.raises(BadInput) as raised:
            fleet.gate_answers([str(tmp_path / "a" / "report.json")])
        assert str(raised.value).endswith(mend)


def test_main_reads_its_arguments_and_the_environment(tmp_path, monkeypatch, capsys):
    """As the script runs it: the arguments from the command line, no REQUIRED_FAMILIES set."""
    merged = tmp_path / "fleet.json"
    merged.write_text(
        json.dumps(
            {"rows": [row("a", {"Wan 2.2": enabled(), "SDXL": {"verdict": "keep off", "served": None}})]}
        )
    )
    decisions = tmp_path / "gates.txt"
    monkeypatch.setattr("sys.argv", ["fleet", str(merged), str(decisions), "/fleet/a/report.json"])
    monkeypatch.delenv("REQUIRED_FAMILIES", raising=False)
    monkeypatch.delenv("REQUIRE_SPEEDUP", raising=False)
    assert fleet.main() == 0
    assert [line.split(":")[0] for line in decisions.read_text().splitlines()] == ["Wan 2.2", "SDXL"]
    assert capsys.readouterr().out == decisions.read_text()
    monkeypatch.setenv("REQUIRED_FAMILIES", "SDXL")
    assert fleet.main() == 1
    monkeypatch.setenv("REQUIRED_FAMILIES", "krea-2,FLUX.2")
    assert fleet.main() == 2
    assert capsys.readouterr().err == "REQUIRED_FAMILIES names families no report ran: Krea-2, FLUX.2\n"
    monkeypatch.setenv("REQUIRED_FAMILIES", "Krea,Foo")
    assert fleet.main() == 2
    assert capsys.readouterr().err == (
        "merge_and_gate.sh: REQUIRED_FAMILIES: unknown family 'Krea' (known: FLUX.1, FLUX.2, Z-Image, "
        "Qwen-Image, Krea-2, SDXL, LTX-2, Wan 2.2): give a family by one of those names\n"
    )


def test_one_family_spelt_three_ways_is_one_family(tmp_path):
    """'FLUX.1', 'flux.1' and 'FLUX.1 ' counted as three families, so a keep-off and an enable of one
    family both stood (issue 64): the gates' names are each family's one name, and a second spelling
    is a second answer."""
    for host, answers in (
        ("a", ['{"family": "flux.1", "exit_code": 0}']),
        ("b", ['{"family": "FLUX.1 ", "exit_code": 1}']),
    ):
        (tmp_path / host).mkdir()
        (tmp_path / host / "gates.jsonl").write_text("\n".join(answers) + "\n")
    gates = fleet.gate_answers([str(tmp_path / h / "report.json") for h in ("a", "b")])
    assert gates == {str(tmp_path / "a"): {"FLUX.1": 0}, str(tmp_path / "b"): {"FLUX.1": 1}}
    (tmp_path / "a" / "gates.jsonl").write_text(
        '{"family": "FLUX.1", "exit_code": 0}\n{"family": "flux 1", "exit_code": 1}\n'
    )
    with pytest.raises(fleet.BadInput, match="lines 1 and 2: both answer FLUX.1"):
        fleet.gate_answers([str(tmp_path / "a" / "report.json")])


@pytest.mark.parametrize(
    "argv, said",
    [
        ([], "usage: python -m sage_qual.qualification.decide.fleet"),
        (["missing.json", "out.txt"], "missing.json: not the output of `sage-qual merge --json`"),
    ],
)
def test_the_module_run_with_bad_arguments_says_one_line_and_exits_2(
    tmp_path, monkeypatch, capsys, argv, said
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("REQUIRED_FAMILIES", raising=False)
    assert fleet.main(argv) == 2
    assert said in capsys.readouterr().err


@pytest.mark.parametrize("content", ["not json", '{"rows": 3}', '{"rows": [{"host": "a"}]}', "[]"])
def test_a_fleet_file_that_is_not_merges_rows_is_bad_input(tmp_path, monkeypatch, capsys, content):
    merged = tmp_path / "fleet.json"
    merged.write_text(content)
    monkeypatch.delenv("REQUIRED_FAMILIES", raising=False)
    assert fleet.main([str(merged), str(tmp_path / "out.txt")]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith(f"merge_and_gate.sh: {merged}") and "run merge --json again" in err and "\n" == err[-1]
    )


def test_the_modules_help_exits_0(capsys):
    assert fleet.main(["--help"]) == 0
    assert "REQUIRED_FAMILIES" in capsys.readouterr().out


def test_a_gates_file_with_no_answer_keeps_every_family_off_as_missing(tmp_path):
    """A host whose gate loop wrote nothing (only blank lines) answered no family: none is enabled there."""
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "gates.jsonl").write_text("\n\n")
    report = str(tmp_path / "a" / "report.json")
    gates = fleet.gate_answers([report])
    assert gates == {str(tmp_path / "a"): {}}
    assert lines([{**row("a", {"Wan 2.2": enabled()}), "report": report}], gates)["Wan 2.2"] == (
        "keep off (a NVIDIA H200 (a): gate exit missing)"
    )
