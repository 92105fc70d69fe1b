"""Issue 28's cases, each run on e62fbf4 (where the issue measured them) and on this code.

Every case is one edit or one command from the issue, run in a child process with the tree under test
first on PYTHONPATH; the same case code runs on both trees, and the few names that moved since e62fbf4
(the stage folders) are looked up in `_Tree`. A case prints one JSON line: what the tree did
(exit code and the first line it said, or what the wrapper served) and whether that is what a user
needs (`ok`). The gate cases read run 18's H200 report (docs/results/run18-h200/certify-a, schema 2,
which both trees read) on the machine that report describes: its environment, its fixtures' checksums
and its cells' budgets are taken as this machine's, as tests_fast/cli_child.py does.

    git worktree add /tmp/e62fbf4 e62fbf4
    python docs/runs/issue28_on_e62fbf4.py /tmp/e62fbf4 . > docs/runs/issue28_on_e62fbf4.txt
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BASE_REPORT = "docs/results/run18-h200/certify-a/report.json.gz"
BASE_PROFILE = "docs/results/run18-h200/certify-a/profile.json"
SM90 = "sm90-fp8-cuda"
# Enabled on the H200 by run 18's report (docs/results/run18-h200/gates.txt: sm90-fp8-cuda from 9,728 to
# 32,768 tokens), so an edit that lifts its range shows; its longest declared call is 16,896 tokens.
FAMILY = "Qwen-Image"


CASES: dict[str, tuple[str, str, object]] = {}  # name -> (issue item, the test guarding it here, case)


def case(item: str, guard: str = ""):
    """Register a case of issue 28's item `item`, guarded on this code by tests_fast/`guard`."""
    def register(function):
        CASES[function.__name__.removeprefix("case_")] = (item, guard and f"tests_fast/{guard}", function)
        return function
    return register


class _Tree:
    """The names a case needs, wherever the tree under test keeps them."""

    def __init__(self):
        import importlib.util

        self.staged = importlib.util.find_spec("sage_qual.qualification.decide") is not None

    def gate_on_reports_machine(self, report: dict, long_budgets_on_cpu: bool = False):
        """Make `sage-qual gate` run on the machine `report` describes (see the module docstring);
        with `long_budgets_on_cpu`, this code re-derives long checks' budgets on the CPU, as it does on
        the GPU the report names (e62fbf4 has no such re-derivation)."""
        from types import SimpleNamespace

        from sage_qual import records

        if self.staged:
            from sage_qual.qualification.decide import budget_check, gate
            from sage_qual.qualification.evidence.report_model import EnvironmentRecord
        else:
            from sage_qual.qualification.report_model import EnvironmentRecord

            from sage_qual.qualification import gate
            budget_check = gate
        machine = records.parse(EnvironmentRecord, report["environment"], "report", "probe")
        stored = report["fixtures"]

        def counting(directories, family):
            from sage_qual.qualification import families
            return {f["name"]: SimpleNamespace(name=f["name"], sha256=f["sha256"])
                    for f in stored if families.counts_for(family, f["family"])}

        budget_check.budget_problem = lambda *args: ""  # the cells are not what these cases edit
        if self.staged:
            real = gate.gate
            gate.gate = lambda path, family, _machine, *rest: real(path, family, lambda: machine, *rest)
            gate.family_fixtures = counting
            if long_budgets_on_cpu:
                budget_check.long_device = lambda: "cpu"
        else:
            gate.this_machine = lambda: machine
            gate.local_fixture_files = counting

    def profile_module(self):
        from sage_qual.verdicts import profile
        return profile

    def defaults_module(self):
        from sage_qual.serving import defaults
        return defaults


def _cli(argv: list[str]) -> tuple[int, str, str]:
    from sage_qual import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(argv)
    return code, out.getvalue(), err.getvalue()


def _first(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0][:240] if lines else ""


def _gate(report: dict, family: str = FAMILY, long_budgets_on_cpu: bool = False) -> dict:
    tree = _Tree()
    tree.gate_on_reports_machine(report, long_budgets_on_cpu)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "report.json"
        path.write_text(json.dumps(report))
        code, out, err = _cli(["gate", "--family", family, "--report", str(path)])
    said = _first(err) if code == 2 else _first(out)
    return {"rc": code, "said": said[:300]}


def _base() -> dict:
    return json.loads(Path(BASE_REPORT).read_text())


def _sm90_checks(report: dict) -> list[dict]:
    return [c for c in report["devices"][0]["long"] if c["variant"] == SM90]


def _longest_call_check(report: dict) -> dict:
    return next(c for c in _sm90_checks(report) if any(u["family"] == FAMILY for u in c["uses"]))


def _refused(result: dict) -> dict:
    return {**result, "ok": result["rc"] == 2}


# -- item 1: evidence of every kind checked as strictly as cells --------------------------------------

@case("control")
def case_untouched_report():
    """The report as certify wrote it: both trees enable the family (the control)."""
    result = _gate(_base())
    return {**result, "ok": result["rc"] == 0}


@case("1", "measure/test_long_checks.py::test_a_long_check_certify_does_not_plan_is_refused")
def case_long_check_relabelled_to_a_million_tokens():
    report = _base()
    check = _longest_call_check(report)
    check["shape"]["q_tokens"] = check["shape"]["kv_tokens"] = 10**6
    for use in check["uses"]:
        use["label"] = "longest call: 1000000 query / 1000000 key tokens"
    return _refused(_gate(report))


@case("1", "measure/test_long_checks.py::test_a_long_check_certify_does_not_plan_is_refused")
def case_extra_sweep_check_at_a_billion_tokens():
    report = _base()
    extra = copy.deepcopy(next(c for c in _sm90_checks(report) if c["shape"]["q_tokens"] == 32768))
    extra["shape"]["q_tokens"] = extra["shape"]["kv_tokens"] = 10**9
    extra["uses"] = [{"family": None, "label": "self 1000000000, head_dim 128"}]
    report["devices"][0]["long"].append(extra)
    return _refused(_gate(report))


@case("1", "decide/test_gate_long_budgets.py::test_gate_refuses_a_loosened_long_check")
def case_failing_long_check_with_its_budget_loosened_100x():
    """Numbers past the budget, the budget loosened 100x (cosine and norm ratios' distance from 1
    likewise), outcome pass: the gate must re-derive the budget as it does a cell's."""
    report = _base()
    check = _longest_call_check(report)
    check["metrics"] = {name: (value * 3 if "rel_l2" in name or name == "max_abs_error" else value)
                        for name, value in check["metrics"].items()}
    check["bounds"] = {name: (1 - (1 - value) * 100 if name in ("min_cosine", "min_norm_ratio")
                              else 1 + (value - 1) * 100 if name == "max_norm_ratio" else value * 100)
                       for name, value in check["bounds"].items()}
    return _refused(_gate(report, long_budgets_on_cpu=True))


@case("1", "measure/test_long_checks.py::test_a_layout_compared_but_not_declared_is_refused")
def case_contiguous_only_layouts_claiming_the_other_three():
    report = _base()
    for check in _sm90_checks(report):
        check["layouts"] = ["contiguous"]  # `identical` still says transposed, fused_qkv, nhd are
    return _refused(_gate(report))


@case("1", "evidence/test_report_checks.py::test_a_measured_long_check_judged_rows_inside_its_call")
def case_long_check_that_sampled_no_rows():
    report = _base()
    _longest_call_check(report)["rows"] = []
    return _refused(_gate(report))


@case("1", "run/test_span_certify.py::test_span_probes_without_the_long_checks_are_refused")
def case_span_probes_without_long_checks():
    """The key removed (an empty list keeps the family off on both trees: no range verified)."""
    report = _base()
    del report["devices"][0]["long"]
    return _refused(_gate(report))


def _span_edit(edit) -> dict:
    report = _base()
    edit(report["devices"][0]["span"][0])
    return _refused(_gate(report))


@case("1", "evidence/test_report_checks.py::test_a_span_probe_sits_at_its_limit_in_a_known_layout")
def case_span_probe_claiming_2_to_the_40():
    def edit(probe):
        probe.update(limit=2**40, span=2**40 + 1)
    return _span_edit(edit)


@case("1", "evidence/test_report_checks.py::test_a_span_probe_sits_at_its_limit_in_a_known_layout")
def case_span_probe_with_an_unknown_layout():
    return _span_edit(lambda probe: probe.update(layout="diagonal"))


@case("1", "evidence/test_report_checks.py::test_a_span_probe_sits_at_its_limit_in_a_known_layout")
def case_span_probe_with_an_unknown_side():
    return _span_edit(lambda probe: probe.update(side="sideways"))


@case("1", "evidence/test_report_checks.py::test_a_span_probe_spans_what_its_shape_does")
def case_span_probe_with_its_tokens_edited_apart_from_its_span():
    """Found after the issue's cases: 5 tokens beside a span of 2,147,504,128 elements."""
    return _span_edit(lambda probe: probe.update(tokens=5))


def _profile_load(edit) -> dict:
    profile = _Tree().profile_module()
    data = json.loads(Path(BASE_PROFILE).read_text())
    edit(data)
    try:
        profile.load(data)
    except profile.ProfileError as error:
        return {"rc": 2, "said": _first(str(error)), "ok": True}
    return {"rc": 0, "said": "loaded", "ok": False}


@case("1", "serving/test_profile_range.py::test_a_malformed_span_limit_is_refused")
def case_profile_max_span_elements_2_to_the_40():
    def edit(data):
        for gpu in data["gpus"]:
            gpu["max_span_elements"] = 2**40
    return _profile_load(edit)


@case("1", "serving/test_profile.py::test_one_machine_twice_is_refused_and_another_software_is_another_entry")
def case_profile_with_one_gpu_model_twice():
    return _profile_load(lambda data: data["gpus"].append(copy.deepcopy(data["gpus"][0])))


@case("1", "serving/test_profile.py::test_an_entry_serving_a_variant_its_gpu_cannot_run_is_refused")
def case_profile_entry_serving_a_variant_its_gpu_cannot_run():
    """Found after the issue's cases: the H200's entries (sm90-fp8-cuda) on an sm_89 GPU."""
    def edit(data):
        data["gpus"][0].update(name="NVIDIA GeForce RTX 4090", capability=[8, 9])
    return _profile_load(edit)


@case("1", "serving/test_builtin_defaults.py::"
      "test_a_broken_defaults_file_names_the_file_the_key_and_the_rebuild")
def case_builtin_defaults_with_a_negative_threshold():
    """The message must name the file and how to rebuild it (e62fbf4 said 'profile: ...' with
    certify's fix)."""
    defaults = _Tree().defaults_module()
    data = json.loads(Path(defaults.DATA).read_text())
    entry = next(e for gpu in data["profile"]["gpus"] for e in [gpu["default"], *gpu["families"].values()]
                 if isinstance(e.get("min_query_tokens"), int))
    entry["min_query_tokens"] = -1
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / Path(defaults.DATA).name
        path.write_text(json.dumps(data))
        try:
            defaults.read(path)
        except Exception as error:  # noqa: BLE001 - what each tree raises is the finding
            said = _first(str(error))
            return {"rc": 2, "said": f"{type(error).__name__}: {said}",
                    "ok": path.name in said and "rebuild" in said.lower()}
    return {"rc": 0, "said": "read", "ok": False}


# -- item 2: the copy path serves only what the direct path would -------------------------------------

def _copy_path(requires_grad: bool, autocast: bool) -> dict:
    """A float16 strided view past a 60,000-element span limit on the fake H200 (the fake CUDA's
    autocast is CPU autocast, here to bfloat16): the direct path refuses it for grad or autocast, so
    the copy path must not serve it."""
    import torch
    import torch.nn.functional as F

    import sage_qual
    from sage_qual.serving.config import WrapperConfig
    from sage_qual.testing import FakeCuda, FakeGpu, FakeSageAttention

    fused = torch.randn(1, 64, 3 * 3 * 128, dtype=torch.float16, requires_grad=requires_grad)
    q, k, v = (t.unflatten(-1, (3, 128)).transpose(1, 2) for t in fused.chunk(3, dim=-1))  # 72,960 each
    config = WrapperConfig(min_query_tokens=1, min_key_tokens=1, max_span_elements=60_000,
                           kernel_table={(9, 0): (SM90,)})

    def autocasting():
        return torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()

    fake = FakeSageAttention()
    with FakeCuda([FakeGpu((9, 0), "Fake H200", 141.0)]), fake.installed():
        sage_qual.install(config=config)
        with sage_qual.sage_attention_scope() as report, autocasting():
            out = F.scaled_dot_product_attention(q, k, v)
        sage_qual.uninstall()
    with autocasting():
        wanted = F.scaled_dot_product_attention(q, k, v).dtype
    said = f"served {report.served}, from copies {report.copied}, fallbacks {dict(report.fallbacks)}"
    ok = report.served == 0
    if requires_grad:
        try:
            out.float().sum().backward()
            said += "; backward() computed the gradient"
        except RuntimeError as error:
            said += f"; backward() raised {_first(str(error))[:80]}"
            ok = False
    if autocast:
        said += f"; output {out.dtype} where torch gives {wanted}"
        ok = ok and out.dtype == wanted
    return {"rc": 0, "said": said, "ok": ok}


@case("2", "properties/test_copy_path.py::"
      "test_a_long_strided_view_that_requires_grad_goes_to_torch_and_backward_works")
def case_strided_view_past_the_span_that_requires_grad():
    return _copy_path(requires_grad=True, autocast=False)


@case("2", "properties/test_copy_path.py::test_a_span_refusal_means_every_other_rule_passed")
def case_strided_view_past_the_span_under_autocast():
    return _copy_path(requires_grad=False, autocast=True)


# -- item 3: tests that pass on any x86-64 CPU --------------------------------------------------------

@case("3", "fixtures/test_fixture_files.py::test_shipped_files_regenerate_as_shipped_on_any_cpu")
def case_fixture_regeneration_test_under_avx2():
    """The tree's own test of the shipped fixtures' regeneration, on this CPU's own capability (the
    control) and with ATEN_CPU_CAPABILITY=avx2, as on a CPU without AVX-512."""
    tests = sorted(Path("tests_fast").rglob("test_fixture_files.py"))
    names = ("test_shipped_files_regenerate_byte_for_byte",  # e62fbf4's
             "test_shipped_files_regenerate_as_shipped_on_any_cpu")
    text = tests[0].read_text()
    name = next(n for n in names if f"def {n}(" in text)
    plugin = ("sage_qual.qualification.integrations.pytest_plugin" if _Tree().staged
              else "sage_qual.qualification.pytest_plugin")  # the tree's own, not the installed one's
    said, codes = [], []
    for capability in ("", "avx2"):
        env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
        env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
        if capability:
            env["ATEN_CPU_CAPABILITY"] = capability
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", plugin,
                               f"{tests[0]}::{name}"], capture_output=True, text=True, timeout=600, env=env)
        tail = [line for line in done.stdout.splitlines() if " passed" in line or " failed" in line]
        said.append(f"{capability or 'default'}: {tail[-1] if tail else _first(done.stdout)}")
        codes.append(done.returncode)
    return {"rc": codes[-1], "said": f"{name}: {'; '.join(said)}", "ok": codes == [0, 0]}


# -- item 4: the decision code's plausible bugs --------------------------------------------------------

def _compare(edit) -> dict:
    first = _base()
    second = copy.deepcopy(first)
    edit(second)
    with tempfile.TemporaryDirectory() as folder:
        paths = [Path(folder) / "a.json", Path(folder) / "b.json"]
        for path, report in zip(paths, (first, second), strict=True):
            path.write_text(json.dumps(report))
        code, out, err = _cli(["compare", *map(str, paths)])
    said = next((line.strip() for line in out.splitlines() if "H100" in line), _first(out + err))
    return {"rc": code, "said": said[:300], "ok": code == 1 and "H100" in said}


@case("4", "cli/test_compare.py::"
      "test_a_gpu_model_in_one_report_only_is_a_difference_and_the_others_still_compared")
def case_compare_a_gpu_model_in_one_report_only():
    """The second report also holds an H100: a difference (exit 1) naming it."""
    def edit(report):
        extra = copy.deepcopy(report["devices"][0])
        extra.update(index=1, name="NVIDIA H100 80GB HBM3")
        report["devices"].append(extra)
    return _compare(edit)


# -- item 5: papercuts ---------------------------------------------------------------------------------

def _command(argv: list[str], env: dict | None = None, timeout: float = 120,
             watch_torch: bool = False) -> dict:
    code = ("import sys\nfrom sage_qual import cli\ncode = cli.main(sys.argv[1:])\n"
            "print('torch imported' if 'torch' in sys.modules else 'no torch')\nsys.exit(code)")
    environ = {k: v for k, v in os.environ.items() if k != "SAGE_QUAL_TEST_WORKER"}
    start = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                              timeout=timeout, env={**environ, **(env or {})})
    except subprocess.TimeoutExpired as expired:
        err = expired.stderr.decode() if isinstance(expired.stderr, bytes) else (expired.stderr or "")
        return {"rc": "still running", "seconds": round(time.monotonic() - start, 1),
                "stderr_lines": len(err.splitlines()), "said": _first(err)}
    result = {"rc": done.returncode, "seconds": round(time.monotonic() - start, 1),
              "said": _first(done.stderr),
              "stderr_lines": len(done.stderr.splitlines()),
              "progress_lines": sum("% done" in line for line in (done.stdout + done.stderr).splitlines())}
    if watch_torch:
        result["torch"] = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    return result


@case("5", "run/test_emulate_run.py::test_a_prediction_in_a_log_prints_a_line_at_each_tenth")
def case_emulate_progress_when_stderr_is_a_file():
    """The README's first command with its output to files (progress lines count on either stream)."""
    with tempfile.TemporaryDirectory() as folder:
        result = _command(["certify", "--emulate", "--quick", "--out", f"{folder}/out"], timeout=300)
    return {**result, "ok": result.get("progress_lines", 0) > 0}


@case("5", "cli/test_papercuts.py::test_certify_refuses_before_importing_torch_or_starting_a_worker")
def case_certify_a_misspelt_family():
    with tempfile.TemporaryDirectory() as folder:
        result = _command(["certify", "--families", "Flux 9", "--out", f"{folder}/out"], watch_torch=True)
    return {**result, "ok": result["rc"] == 2 and result["seconds"] < 2 and result["torch"] == "no torch"}


@case("5", "cli/test_papercuts.py::test_certify_refuses_before_importing_torch_or_starting_a_worker")
def case_certify_without_a_gpu():
    with tempfile.TemporaryDirectory() as folder:
        result = _command(["certify", "--out", f"{folder}/out"], env={"CUDA_VISIBLE_DEVICES": ""},
                          watch_torch=True)
    return {**result, "ok": result["rc"] == 2 and "--emulate" in result["said"] and result["seconds"] < 2}


@case("5", "run/test_certify_checks.py::test_an_out_holding_a_previous_report_is_refused_unless_forced")
def case_certify_into_an_out_holding_a_report():
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "report.json").write_text("{}")
        result = _command(["certify", "--emulate", "--quick", "--out", folder], timeout=20)
    return {**result, "ok": result["rc"] == 2 and "--force" in result["said"]}


@case("5", "cli/test_exit_codes.py::test_every_command_help_has_a_description_and_its_exit_codes")
def case_help_texts():
    from sage_qual import cli

    parser = cli.build_parser()
    commands = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction").choices
    lacking = [name for name, sub in commands.items()
               if not sub.description or "exit codes" not in sub.format_help()]
    return {"rc": 0, "said": f"without a description or exit codes: {', '.join(lacking) or 'none'}",
            "ok": not lacking}


@case("5", "cli/test_papercuts.py::test_a_garbled_test_hook_is_named_with_the_fix")
def case_garbled_test_hook_variable():
    result = _command(["gate", "--family", "FLUX.1", "--report", BASE_REPORT],
                      env={"SAGE_QUAL_TEST_WORKER": "{garbage"})
    return {**result, "ok": result["rc"] == 2 and "SAGE_QUAL_TEST_WORKER" in result["said"]}


# -- item 6: docs that cannot drift --------------------------------------------------------------------

@case("6", "contracts/test_docs_numbers.py::test_the_4096_token_example_is_the_current_report")
def case_the_4096_token_example():
    """README's and docs/certify.md's example at 4,096 tokens against the tree's current report
    (docs/results/current, GPU 0): each must state SDPA's time over the kernel's, the convention, as
    tests_fast/contracts/test_docs_numbers.py checks it."""
    shape = "b1 h24 q4096 k4096 d128 bfloat16"
    report = json.loads(Path("docs/results/current/certify-gpu0/report.json").read_text())
    speed = {row["kernel"]: row["ms"] for row in report["devices"][0]["speed"] if row["shape"] == shape}
    sage, sdpa = speed[SM90], speed["sdpa"]
    wanted = f"{sdpa / sage:.2f}x"
    docs = {name: " ".join(Path(name).read_text().split()) for name in ("README.md", "docs/certify.md")}
    stated = {name: text[text.index("4,096 tokens"):][:90] for name, text in docs.items()}
    return {"rc": 0, "said": f"report: {sage:.3f} ms against cuDNN's {sdpa:.3f} ms, {wanted}; "
                             f"docs: {json.dumps(stated)}",
            "ok": all(wanted in text for text in stated.values())}


def _run_case(tree: Path, name: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree.resolve()), "XDG_CACHE_HOME": tempfile.mkdtemp()}
    env.pop("SAGE_QUAL_TEST_WORKER", None)
    start = time.monotonic()
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--case", name], cwd=tree,
                          capture_output=True, text=True, env=env, timeout=900)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        return {"rc": f"probe failed ({done.returncode})", "said": _first(done.stderr.splitlines()[-1]
                                                                          if done.stderr else ""), "ok": None}
    return {**json.loads(lines[-1]), "probe_s": round(time.monotonic() - start, 1)}


def main(argv: list[str]) -> int:
    if argv[:1] == ["--case"]:
        print(json.dumps(CASES[argv[1]][2]()))
        return 0
    trees = [Path(a) for a in argv]
    heads = [subprocess.run(["git", "-C", str(t), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() for t in trees]
    print(f"# issue 28's cases on {', '.join(heads)} ({time.strftime('%Y-%m-%d', time.gmtime())}, "
          f"{os.cpu_count()} CPUs, python {sys.version.split()[0]})")
    for name in os.environ.get("CASES", "").split(",") if os.environ.get("CASES") else CASES:
        item, guard, _ = CASES[name]
        if guard:  # the guarding test is in the newest tree
            path, test = guard.split("::")
            assert f"def {test}(" in (trees[-1] / path).read_text(), guard
        for tree, head in zip(trees, heads, strict=True):
            print(json.dumps({"case": name, "item": item, "code": head, **_run_case(tree, name),
                              "guarded_by": guard}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
