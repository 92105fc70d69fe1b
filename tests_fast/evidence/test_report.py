"""report.json: the typed model, its generated schema, strict loading, atomic writing, rendering.

The JSON files in tests_fast/data are hand-made samples with synthetic numbers (see the README
there) in schema version 1, the format certify wrote before version 2: they also prove that
version 1 still reads, upgraded to the current version (3).
"""

import copy
import dataclasses
import json
import re
from pathlib import Path

import pytest

from sage_qual import cli, records
from sage_qual.qualification.decide import checked
from sage_qual.qualification.evidence import files, report_model
from sage_qual.qualification.render import plots

from .. import builders

jsonschema = pytest.importorskip("jsonschema")  # a test dependency; the GPU box lacks it

DATA = Path(__file__).parent.parent / "data"
SAMPLES = sorted(DATA.glob("sample_*.json"))
H200 = DATA / "sample_h200_2gpu.json"


def sample(name: str = "sample_h200_2gpu.json") -> dict:
    return json.loads((DATA / name).read_text())


def as_current(data: dict) -> dict:
    """A version 1 sample as certify writes the current version: the same evidence, no stored
    analysis, every limit of a budget present (null where version 1 had none)."""
    return files.upgrade(data, 1)


@pytest.fixture(scope="module")
def validator():
    schema = files.schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def errors(validator, data) -> list[str]:
    return [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(data)]


def test_the_committed_schema_is_the_generated_one():
    assert files.schema() == json.loads(json.dumps(files.json_schema())), \
        "report_schema.json is stale: regenerate it with evidence.files.write_schema()"


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.stem)
def test_version_1_samples_read_and_their_evidence_validates_as_the_current_version(path, validator):
    data = json.loads(path.read_text())
    loaded = checked.load(path)
    assert loaded.schema_version == report_model.SCHEMA_VERSION and loaded.host == data["host"]
    assert len(loaded.devices) == len(data["devices"])
    assert errors(validator, as_current(data)) == []
    assert errors(validator, records.dump(loaded)) == []  # and as this sage-qual writes it back


@pytest.mark.parametrize("damage", [lambda d: d.update(complete="false"), lambda d: d.pop("environment"),
                                    lambda d: d["devices"][0]["cells"][0].update(speedy=True),
                                    lambda d: d["devices"][0]["speed"][0].update(outcome="slow"),
                                    lambda d: d["devices"][0].update(capability=[9]),
                                    lambda d: d["fixtures"][0].update(sha256="not-a-hash")],
                         ids=["string complete", "no environment", "unknown key", "unknown outcome",
                              "short capability", "bad sha256"])
def test_the_schema_rejects_what_load_refuses(validator, damage):
    data = as_current(sample())
    damage(data)
    assert errors(validator, data)


COMMITTED = sorted(Path(__file__).resolve().parent.parent.parent.glob("docs/results/*/report.json.gz"))


@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: p.parent.name)
def test_committed_reports_still_read(path):
    assert checked.load(path).devices


CURRENT = Path(__file__).resolve().parent.parent.parent / "docs" / "results" / "run11-h200x2"


def test_current_reports_were_made_on_the_shipped_fixtures():
    """Reports that claim to be current (docs/results/run11-h200x2/) name the shipped fixtures' hashes,
    so `gate` on them is not stale. The older runs' folders are history and may differ."""
    from sage_qual.fixtures import fileformat

    reports = sorted(CURRENT.rglob("report.json.gz"))
    if not reports:
        pytest.skip(f"no {CURRENT.relative_to(CURRENT.parents[2])}/**/report.json yet: the final GPU run "
                    "fills it")
    shipped = {p.name.removesuffix(".safetensors"): fileformat.load_fixture(p).sha256
               for p in fileformat.list_fixtures(fileformat.shipped_dir())}
    for path in reports:
        recorded = {f.name: f.sha256 for f in checked.load(path).fixtures}
        assert recorded, f"{path} names no fixtures"
        stale = sorted(name for name, sha in recorded.items() if shipped.get(name) != sha)
        assert not stale, f"{path}: fixtures changed or missing since the run: {stale}"


# Damage of every sort is refused with one line naming the file, the key and the fix. ------------
def edit(change):
    def damaged(tmp_path):
        data = sample()
        change(data)
        path = tmp_path / "report.json"
        path.write_text(json.dumps(data))
        return path
    return damaged


def first_cell(data, outcome):
    return next(c for d in data["devices"] for c in d["cells"] if c["outcome"] == outcome)


DAMAGE = {
    "complete is a string": (
        edit(lambda d: d.update(complete="false")),
        "complete: is the string 'false', expected true or false",
    ),
    "complete missing": (edit(lambda d: d.pop("complete")), "complete: missing"),
    "environment missing": (edit(lambda d: d.pop("environment")), "environment: missing"),
    "options missing": (edit(lambda d: d.pop("options")), "options: missing"),
    "gpu name a number": (
        edit(lambda d: d["environment"]["gpus"][0].update(name=7)),
        "environment.gpus[0].name: is a number, expected a string",
    ),
    "families not a list": (
        edit(lambda d: d["options"].update(families="FLUX.1")),
        "options.families: is the string 'FLUX.1', expected a list",
    ),
    "unknown key": (
        edit(lambda d: d["devices"][0]["cells"][0].update(speedy=True)),
        "devices[0].cells[0].speedy: unknown key",
    ),
    "unknown outcome": (
        edit(lambda d: d["devices"][0]["speed"][0].update(outcome="slow")),
        "devices[0].speed[0].outcome: is the string 'slow', expected one of",
    ),
    "crash without detail": (
        edit(lambda d: first_cell(d, "crash").pop("detail")),
        "detail: empty for a cell",
    ),
    "NaN time": (
        edit(lambda d: d["devices"][0]["speed"][0].update(ms=float("nan"))),
        "devices[0].speed[0].ms: is nan, expected a finite number",
    ),
    "negative time": (
        edit(lambda d: d["devices"][0]["speed"][0].update(ms=-1.0)),
        "expected a positive time",
    ),
    "median edited": (
        edit(lambda d: d["devices"][0]["speed"][0].update(samples_ms=[1.0, 2.0, 3.0])),
        "devices[0].speed[0].ms: 0.0486331 is not the median of samples_ms (2)",
    ),
    "fastest backend edited": (
        edit(lambda d: d["devices"][0]["speed"][0]["backends"].update(other=0.001)),
        "devices[0].speed[0].best_backend: ",
    ),
    "backend screen edited": (
        edit(lambda d: d["devices"][0]["speed"][0]["backends"].update(cudnn=99.0)),
        "is not the fastest of backends (",
    ),
    "boolean index": (
        edit(lambda d: d["devices"][0].update(index=True)),
        "devices[0].index: is a boolean, expected an integer",
    ),
    "capability of three": (
        edit(lambda d: d["devices"][0].update(capability=[9, 0, 0])),
        "devices[0].capability: has 3 items, expected 2",
    ),
    "cell of an unknown fixture": (
        edit(lambda d: d["devices"][0]["cells"][0].update(fixture="ghost")),
        "'ghost' is not in `fixtures`",
    ),
    "future schema": (
        edit(lambda d: d.update(schema_version=6)),
        "schema_version: 6 is newer than this sage-qual reads (1, 2, 3, 4, 5); upgrade sage-qual",
    ),
    "complete without finish": (
        edit(lambda d: d.update(finished=None)),
        "finished: null in a report marked complete",
    ),
}


@pytest.mark.parametrize("name", DAMAGE)
def test_load_refuses_damage_naming_file_key_and_fix(tmp_path, name):
    make, message = DAMAGE[name]
    path = make(tmp_path)
    with pytest.raises(report_model.ReportError) as refused:
        checked.load(path)
    text = str(refused.value)
    assert text.startswith(f"{path}: ") and message in text and "\n" not in text
    assert "certify" in text or "upgrade" in text  # the fix


def test_a_truncated_report_is_refused(tmp_path):
    path = tmp_path / "report.json"
    path.write_text(H200.read_text()[:5000])
    with pytest.raises(report_model.ReportError, match="not JSON, or cut short"):
        checked.load(path)


@pytest.mark.parametrize("content, message", [
    ("[1, 2]", "not a sage-qual report"),
    ('{"kind": "something-else"}', "not a sage-qual report"),
    ('{"kind": "sage-qual-report", "schema_version": "1"}',
     "schema_version: '1' is not a report schema version"),
    ("{not json", "not JSON"),
])
def test_load_refuses_foreign_files(tmp_path, content, message):
    path = tmp_path / "report.json"
    path.write_text(content)
    with pytest.raises(report_model.ReportError, match=message):
        checked.load(path)


def test_load_missing_report_says_to_certify(tmp_path):
    with pytest.raises(report_model.ReportError, match="run `sage-qual certify` first"):
        checked.load(tmp_path / "absent.json")


# Cells whose stored outcome disagrees with their numbers --------------------------------------
def pass_cell_with_failing_numbers(data):
    cell = first_cell(data, "pass")
    cell["rel_l2"] = cell["bounds"]["max_rel_l2"] * 3


def fail_cell_edited_to_pass(data):
    cell = first_cell(data, "fail")
    cell.update(outcome="pass", reasons=[])


def every_cell_fails_but_says_pass(data):
    for device in data["devices"]:
        for cell in device["cells"]:
            if cell["outcome"] == "pass":
                cell["worst_head_cosine"] = 0.1


# A loosened budget is not among them: budgets are derived from the numerics model per cell
# (qualification/measure/budgets.py), which a report alone cannot recompute; the fixture's class bounds are
# provenance only and may be tighter than a cell's budget (flux1_ip_adapter_zero_uncond).
@pytest.mark.parametrize("damage", [pass_cell_with_failing_numbers, fail_cell_edited_to_pass,
                                    every_cell_fails_but_says_pass])
def test_cells_that_disagree_with_their_numbers_are_refused(tmp_path, damage):
    path = edit(damage)(tmp_path)
    with pytest.raises(report_model.ReportError, match=r"devices\[\d\]\.cells\[\d+\] .*(outcome|bounds)"):
        checked.load(path)


@pytest.mark.parametrize("argv", [["gate", "--family", "FLUX.1", "--report"], ["merge"]],
                         ids=["gate", "merge"])
@pytest.mark.parametrize("name", ["complete is a string", "environment missing", "gpu name a number",
                                  "future schema"])
def test_gate_and_merge_refuse_damage_with_exit_2_and_one_line(tmp_path, capsys, argv, name):
    path = DAMAGE[name][0](tmp_path)
    code = cli.main(argv + [str(path)])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.count("\n") == 1 and "Traceback" not in err
    assert str(path) in err


def test_gate_refuses_a_report_whose_cells_were_edited_to_pass(tmp_path, capsys):
    path = edit(every_cell_fails_but_says_pass)(tmp_path)
    code = cli.main(["gate", "--family", "FLUX.1", "--report", str(path)])
    _, err = capsys.readouterr()
    assert code == 2 and "its numbers say 'fail'" in err


# Writing and rendering -------------------------------------------------------------------------
def test_writer_rewrites_the_file_after_each_change(tmp_path, validator):
    partial = checked.parse(as_current(sample("sample_partial.json")), "sample_partial.json")
    writer = files.Writer(tmp_path / "report.json", partial)
    cell = partial.devices[0].cells[0]
    writer.append(1, "cells", cell)
    on_disk = json.loads((tmp_path / "report.json").read_text())
    assert on_disk["devices"][1]["cells"] == [records.dump(cell)]
    assert on_disk["complete"] is False
    assert errors(validator, on_disk) == []
    assert not list(tmp_path.glob("*.tmp"))
    writer.replace(complete=True, finished="2026-12-01T02:00:00+00:00")
    assert checked.load(tmp_path / "report.json") == writer.report


def test_appends_write_what_a_whole_dump_writes(tmp_path):
    # Appends dump only what they add: the file must still be the whole record's dump, each time.
    partial = checked.parse(as_current(sample("sample_partial.json")), "sample_partial.json")
    writer = files.Writer(tmp_path / "report.json", partial)
    for position, field, items in [(1, "cells", partial.devices[0].cells[:2]), (0, "speed", []),
                                   (1, "speed", partial.devices[0].speed[:1]), (1, "cells", [])]:
        writer.append(position, field, *items)
        assert json.loads((tmp_path / "report.json").read_text()) == records.dump(writer.report)
    assert writer.report.devices[1].cells[-2:] == partial.devices[0].cells[:2]


@pytest.mark.parametrize("change", [
    {"metrics": builders.metrics(rel_l2=float("inf"))},  # JSON has no infinity
    {"outcome": "crash"},  # a crash says why in its detail
])
def test_writer_refuses_what_the_reader_would_refuse(tmp_path, change):
    partial = checked.parse(as_current(sample("sample_partial.json")), "sample_partial.json")
    writer = files.Writer(tmp_path / "report.json", partial)
    before = (tmp_path / "report.json").read_text()
    broken = dataclasses.replace(partial.devices[0].cells[0], detail="", **change)
    with pytest.raises(records.RecordError):
        writer.append(1, "cells", broken)
    assert (tmp_path / "report.json").read_text() == before and writer.report == partial  # unchanged


def test_render_complete_report(tmp_path):
    data = sample()
    files = builders.rendered(checked.parse(data, "r.json"), tmp_path)
    names = {f.name for f in files}
    assert {"report.md", "report.html", "accuracy-cuda0.png", "accuracy-cuda1.png", "speedup-0.png"} <= names
    md = (tmp_path / "report.md").read_text()
    assert md.startswith("# SageAttention certification, sample-h200-2gpu")
    assert ("| FLUX.1 | enable | sm90-fp8-cuda | from 4,608 query / 512 key tokens, head_dim 128 (no upper "
            "bound verified: a report without long checks) |") in md
    assert "| SDXL | safe, no speedup | - |" in md
    assert "no fixtures of FLUX.2 in this run: not certified" in md
    assert "sm90-fp8-cuda on wan22-video-self (cuda:0): the worker ran this task when it died" in md
    assert "CUDA error: an illegal memory access was encountered" in md  # the crash's stderr tail
    assert "NVIDIA driver  580.159.04" in md  # the environment block
    assert data["fixtures"][0]["sha256"] in md
    page = (tmp_path / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 3
    assert "PARTIAL" not in page


def test_render_ignores_a_stored_verdict_section(tmp_path):
    """A version 1 report's stored verdicts are dropped: what renders is decided from the cells."""
    data = sample()
    for verdict in data["gpus"][0]["families"]:
        verdict["verdict"] = "enable"
    builders.rendered(checked.parse(data, "r.json"), tmp_path)
    assert "| Wan 2.2 | keep off |" in (tmp_path / "report.md").read_text()


def test_render_partial_report_says_so(tmp_path):
    data = sample("sample_partial.json")
    builders.rendered(checked.parse(data, "r.json"), tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "PARTIAL REPORT" in md and "No verdicts are drawn" in md
    assert "### Verdicts" not in md
    assert 'class="partial"' in (tmp_path / "report.html").read_text()


def test_one_row_heatmap_is_not_squashed_and_avoids_red_green(tmp_path):
    matplotlib = pytest.importorskip("matplotlib")
    from PIL import Image

    data = sample()
    device = data["devices"][0]
    device["cells"] = [c for c in device["cells"] if c["variant"] == "sm90-fp8-cuda"]
    builders.rendered(checked.parse(data, "r.json"), tmp_path)
    width, height = Image.open(tmp_path / "accuracy-cuda0.png").size
    assert height >= plots.MIN_HEIGHT_INCHES * 110 - 1  # dpi 110
    assert matplotlib.colormaps["cividis"]  # the sequential, colour-blind-safe map the heatmap uses
    pixels = list(Image.open(tmp_path / "accuracy-cuda0.png").convert("RGB").get_flattened_data())
    # cividis has no saturated red or green: no pixel is strongly red- or green-dominant
    assert not any(r > 150 and g < 100 and b < 100 for r, g, b in pixels)
    assert not any(g > 130 and r < 100 and b < 110 for r, g, b in pixels)


def _paths(value, prefix=()):
    yield prefix
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _paths(item, (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _paths(item, (*prefix, index))


REPLACEMENTS = [None, True, 0, -1, 1.5, float("nan"), "", "x", [], {}, [1, "a"], {"k": 1}]


@pytest.mark.parametrize("seed", range(2))
def test_any_damage_is_a_report_error_or_reads(tmp_path, capsys, seed):
    """Replace or delete random keys of a sample (75 damaged copies per seed): reading, deciding
    and merging either work or refuse with ReportError / exit 2, never anything else."""
    import random

    from sage_qual.qualification.decide import verdict

    rng = random.Random(seed)
    original = sample()
    paths = [p for p in _paths(original) if p]
    for _ in range(75):
        data = copy.deepcopy(original)
        path = rng.choice(paths)
        parent = data
        for step in path[:-1]:
            parent = parent[step]
        if rng.random() < 0.3 and isinstance(parent, dict):
            del parent[path[-1]]
        else:
            parent[path[-1]] = copy.deepcopy(rng.choice(REPLACEMENTS))
        try:
            verdict.decide(checked.parse(data, "damaged.json"))
        except report_model.ReportError as error:
            assert "\n" not in str(error) and str(error).startswith("damaged.json: ")
        target = tmp_path / "damaged.json"
        target.write_text(json.dumps(data))
        assert cli.main(["merge", str(target)]) in (0, 2)
        capsys.readouterr()


def test_a_cell_holds_every_accuracy_metric_the_worker_measures():
    """The worker stores accuracy.Accuracy's fields in each cell; the model must know them all, or
    a GPU run's own report would not read back."""
    import dataclasses

    from sage_qual.qualification.measure import accuracy

    stored = {f.name for f in dataclasses.fields(report_model.Cell)} | {
        f.name for f in dataclasses.fields(report_model.Metrics)}  # a cell's metrics
    assert {f.name for f in dataclasses.fields(accuracy.Accuracy)} <= stored


@pytest.mark.parametrize(
    "old, new",
    [
        ("rel_l2", "metrics.rel_l2"),
        ("finite", "metrics.finite"),
        ("worst_head_cosine", "metrics.worst_head_cosine"),
        ("bounds", "budget"),
    ],
)
def test_a_cell_read_by_its_schema_3_name_says_where_the_number_went(old, new):
    """A downstream test of the pytest plugin written against schema 3 (`cell.rel_l2`) is told the new
    path."""
    cell = builders.cell("sm90-fp8-cuda", builders.fixture())
    with pytest.raises(
        AttributeError, match=rf"^Cell\.{old} is Cell\.{re.escape(new)} since report schema 4$"
    ):
        getattr(cell, old)
    with pytest.raises(AttributeError, match="has no attribute 'rel_l3'"):
        _ = cell.rel_l3
    assert not hasattr(cell, old)
