"""The package's layers import one way: base -> kernels -> verdicts -> serving -> testing -> api ->
fixtures -> qualification -> cli (base: errors, jsonfile, limits, records, version; kernels: what can
run and the model of what it computes; verdicts: the torch-free records both the served path and the
qualification side apply, the fitness table first; serving: the wrapper's hot path only; api: the
package's own __init__).

Read from the source (ast), so a lazy import inside a function counts as much as one at the top.
"""

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent.parent / "sage_qual"
# Each layer may import its own and the layers before it, never a later one.
LAYERS = ("base", "kernels", "verdicts", "serving", "testing", "api", "fixtures", "qualification", "cli")


def layer_of(module: str) -> str:
    parts = module.split(".")
    if parts[0] != "sage_qual":
        raise ValueError(module)
    if len(parts) == 1:
        return "api"  # the package's public names, re-exported from serving
    if parts[1] in ("errors", "jsonfile", "limits", "records", "version"):
        return "base"
    if parts[1] == "__main__":
        return "cli"
    return parts[1]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(path: Path) -> set[str]:
    found = set()
    package = module_name(path).rsplit(".", 0 if path.name == "__init__.py" else 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("sage_qual")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if base.startswith("sage_qual"):
                # `from package import module` imports the module; any other name comes from `base`.
                for alias in node.names:
                    target = f"{base}.{alias.name}"
                    found.add(target if target in MODULES else base)
    return found


GRAPH = {name: {m for m in imports_of(path) if m in MODULES and m != name} for name, path in MODULES.items()}


def test_every_module_is_in_a_layer():
    assert {layer_of(m) for m in MODULES} <= set(LAYERS)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_flow_one_way(module):
    rank = LAYERS.index(layer_of(module))
    upward = sorted(m for m in GRAPH[module] if LAYERS.index(layer_of(m)) > rank)
    assert not upward, f"{module} ({layer_of(module)}) imports a later layer: {upward}"


# Inside qualification, the stages import one way too: each floor from its own and the floors
# before it. selection and measure share a floor (neither needs the other); the self-test is the top
# floor: its fault-injecting worker builds on run's Worker, which names it only by module path
# (run/pool.py, FAULTY_WORKER_MODULE), never by an import.
STAGES = (("families", "names"), ("evidence",), ("selection", "measure"), ("integrations",), ("decide",),
          ("render",), ("run",), ("selftest",))
STAGE_FLOOR = {stage: floor for floor, stages in enumerate(STAGES) for stage in stages}
MAX_MODULES_PER_STAGE, MAX_MODULE_LINES = 8, 500


def stage_of(module: str) -> str:
    return module.split(".")[2]


QUALIFICATION = sorted(m for m in MODULES if m.startswith("sage_qual.qualification.")
                       and MODULES[m].name != "__init__.py")


def test_every_qualification_module_is_in_a_stage():
    assert {stage_of(m) for m in QUALIFICATION} <= set(STAGE_FLOOR)


@pytest.mark.parametrize("module", QUALIFICATION)
def test_qualification_stages_import_one_way(module):
    floor = STAGE_FLOOR[stage_of(module)]
    upward = sorted(m for m in GRAPH[module] if m in QUALIFICATION and STAGE_FLOOR[stage_of(m)] > floor)
    assert not upward, f"{module} ({stage_of(module)}) imports a later stage: {upward}"


@pytest.mark.parametrize("stage", sorted(s for s in STAGE_FLOOR if (PACKAGE / "qualification" / s).is_dir()))
def test_a_stage_folder_holds_few_modules_each_short(stage):
    modules = [p for p in (PACKAGE / "qualification" / stage).glob("*.py") if p.name != "__init__.py"]
    assert 0 < len(modules) <= MAX_MODULES_PER_STAGE, [p.name for p in modules]
    long = {p.name: n for p in modules if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long


@pytest.mark.parametrize("module", sorted(MODULES))
def test_every_module_is_short(module):
    """The package's cap (issue 54: testing.py had grown to 520 lines)."""
    lines = len(MODULES[module].read_text().splitlines())
    assert lines <= MAX_MODULE_LINES or module in LONG_DATA_MODULES, f"{module}: {lines} lines"


# Over the cap by declarations, not logic: half of replicas' 999 lines declare the 22 replicas, each
# beside the published statistics it reproduces, next to the generator that reads them.
LONG_DATA_MODULES = {"sage_qual.fixtures.replicas"}


def test_render_reads_no_fixture_file():
    """A view draws from the report and the decisions it is given (selection's records only as types)."""
    for module in (m for m in QUALIFICATION if stage_of(m) == "render"):
        assert "sage_qual.fixtures.fileformat" not in GRAPH[module], module
        assert not re.search(r"list_fixtures|load_fixture|read_fixtures", MODULES[module].read_text()), module


# Plan once, execute anywhere (docs/plan-once.md): what a run does is data built in one module, run
# by the executors, and a cell is measured in one place.
TASK_RECORDS = {"EnvTask", "CellTask", "SdpaTask", "SpeedTask", "PairedTask", "LongTask", "SpanTask",
                "ContextTask", "TargetMachineTask", "TargetCellTask"}


def _called_names(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            function = node.func
            names.add(function.attr if isinstance(function, ast.Attribute) else getattr(function, "id", ""))
    return names


def _callers(names: set[str]) -> set[str]:
    return {m for m, path in MODULES.items() if _called_names(path) & names}


def test_every_task_is_built_by_the_plan():
    assert _callers(TASK_RECORDS) == {"sage_qual.qualification.run.plan"}


def test_only_the_gpu_executor_and_the_pool_run_worker_jobs():
    run = "sage_qual.qualification.run"
    assert _callers({"run_tasks"}) == {f"{run}.worker_executor", f"{run}.pool"}


def test_one_function_measures_a_cell():
    defined = {m for m, path in MODULES.items() for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, ast.FunctionDef)
               and node.name in ("measure_cell", "predict_cell", "_cell")}
    assert defined == {"sage_qual.qualification.measure.cell"}


def test_nothing_imports_the_cli():
    importers = sorted(m for m, deps in GRAPH.items()
                       if layer_of(m) != "cli" and any(layer_of(d) == "cli" for d in deps))
    assert not importers


def test_no_import_cycles():
    # The package __init__ files re-export, so they are left out: a cycle through them is only a name.
    graph = {m: {d for d in deps if not MODULES[d].name == "__init__.py"} for m, deps in GRAPH.items()
             if MODULES[m].name != "__init__.py"}
    state: dict[str, int] = {}
    cycles = []

    def visit(node, stack):
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, f"import cycles: {cycles}"


# Import cost, in a fresh interpreter: the layer table above is read from the source, so it cannot
# see what an import pulls in at run time.
HEAVY = ("torch", "sage_qual.serving.wrapper", "sageattention", "triton")
LIGHT = ("sage_qual", "sage_qual.cli", "sage_qual.cli.gate", "sage_qual.cli.certify",
         "sage_qual.qualification.render.report", "sage_qual.qualification.decide.gate",
         "sage_qual.qualification.decide.checked", "sage_qual.qualification.render.fleet",
         "sage_qual.qualification.run.options", "sage_qual.qualification.integrations.pytest_plugin")
PROBE = """
import importlib, runpy, sys
for name in sys.argv[1].split(","):
    importlib.import_module(name)
sys.argv = ["sage-qual", "--version"]
try:
    runpy.run_module("sage_qual", run_name="__main__")
except SystemExit as stop:
    assert stop.code in (0, None), stop.code
print("HEAVY", ",".join(sorted(name for name in %r if name in sys.modules)))
""" % (HEAVY,)


def test_version_cli_report_and_gate_import_neither_torch_nor_the_wrapper():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", PROBE, ",".join(LIGHT)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("sage-qual ") and lines[-1] == "HEAVY ", done.stdout


def test_the_public_names_load_on_first_use():
    import subprocess
    import sys

    probe = ("import sys, sage_qual; before = 'sage_qual.serving.wrapper' in sys.modules; "
             "sage_qual.install; print(before, 'sage_qual.serving.wrapper' in sys.modules, "
             "sorted(set(sage_qual.__all__) - set(dir(sage_qual))))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["False", "True", "[]"], done.stdout + done.stderr


def test_an_unknown_public_name_is_an_attribute_error():
    import sage_qual

    with pytest.raises(AttributeError, match="no attribute 'instal'"):
        sage_qual.instal  # noqa: B018


# The test suites: a test module imports helper modules (fakes, builders, shapes), never another
# test module, so collecting one module never collects (or runs the imports of) another.
TEST_DIRS = [PACKAGE.parent / "tests_fast", PACKAGE.parent / "tests_gpu"]


def imported_test_modules(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
            [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
        found += [name for name in names if name.rsplit(".", 1)[-1].startswith("test_")]
    return found


def test_no_test_module_imports_another():
    offenders = {p.name: imported_test_modules(p) for d in TEST_DIRS for p in sorted(d.rglob("*.py"))}
    assert {name: found for name, found in offenders.items() if found} == {}


# The layout table (docs/guide.md, the README's reference page) names every module, so the map a
# newcomer reads is the code's.
README = PACKAGE.parent / "docs" / "guide.md"


def _layout_rows() -> dict[str, str]:
    text = README.read_text().split("## Layout", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0].startswith("`sage_qual"):
            rows[cells[0]] = cells[1]
    return rows


def test_the_readme_layout_table_names_every_module():
    rows = _layout_rows()
    missing = []
    for name, path in MODULES.items():
        if path.name in ("__init__.py", "__main__.py"):
            continue
        stem = path.stem
        package = path.parent.relative_to(PACKAGE.parent).as_posix()  # sage_qual or sage_qual/serving
        text = " ".join(f"{key} {job}" for key, job in rows.items() if key.startswith(f"`{package}/"))
        if f"`{stem}`" not in text and f"`{stem}.py`" not in text and f"{stem}.py`" not in text:
            missing.append(name)
    assert not missing, f"docs/guide.md's layout table does not name: {missing}"


def _content_words(text: str) -> set[str]:
    return {w for w in re.findall(r"[a-z]+", text.lower()) if len(w) >= 5 and w not in _COMMON}


_COMMON = set("which where their there these those about other every after before under whose without "
              "within being while first".split())
# A module's job in the table: "`name` (what it does)", a parenthesis inside allowed.
_JOB = re.compile(r"`(\w+)` \(((?:[^()]|\([^()]*\))*)\)")


def test_the_layout_table_says_what_each_module_does_now():
    """Issue 54: the table named every module but some jobs were stale. Each job given for a module
    shares a word with the opening paragraph of the module's own docstring."""
    stale = []
    for key, job in _layout_rows().items():
        folder = PACKAGE.parent / key.strip("`").rstrip("/")
        for name, said in _JOB.findall(job):
            found = [p for p in (folder / f"{name}.py", folder / name / "__init__.py") if p.exists()]
            path = found[0] if found else None
            if path is None:
                continue  # a name that is not a module of the folder (a function, a CLI verb)
            opening = (ast.get_docstring(ast.parse(path.read_text())) or "").split("\n\n")[0]
            if not _content_words(said) & _content_words(opening):
                stale.append(f"{path.relative_to(PACKAGE.parent)}: table says {said[:60]!r}, "
                             f"the module {opening[:60]!r}")
    assert not stale, stale


def test_a_profile_is_read_and_matched_without_torch():
    """Issue 53: gate and the defaults builder read profiles; reading and matching one imports no torch
    (the visible devices are `serving.devices_here`'s)."""
    import subprocess
    import sys

    probe = ("import sys, sage_qual.verdicts.profile, sage_qual.verdicts.machine; "
             "print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "False", done.stderr


# Issue 63: serving/ is the hot path only (it held 24 modules and every shared record); the records
# live a floor below it, and import no torch, so gate, merge and the fleet read them without it.
MAX_SERVING_MODULES = 16


def test_serving_holds_the_hot_path_only():
    modules = [p.name for p in (PACKAGE / "serving").glob("*.py") if p.name != "__init__.py"]
    assert len(modules) <= MAX_SERVING_MODULES, sorted(modules)


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("sage_qual.verdicts")))
def test_the_records_floor_imports_no_torch(module):
    nodes = list(ast.walk(ast.parse(MODULES[module].read_text())))
    imported = {alias.name.split(".")[0] for node in nodes if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {(node.module or "").split(".")[0] for node in nodes if isinstance(node, ast.ImportFrom)}
    assert "torch" not in imported, module
