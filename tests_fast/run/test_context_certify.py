"""Execution contexts in certify (issue 24): each variant checked on a side stream, under capture and
under compile (`context_check`, here on the fake GPU: `FakePlace`), the contexts certified only where
every check passed, and what the verdict, the profile, the gate and the report say about them. A
context defect (detection.CONTEXT_DEFECTS) takes exactly its context, and no family."""

import ast
import dataclasses
import json

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F

from sage_qual import records
from sage_qual.kernels.contexts import CAPTURE, CHECKS, COMPILE, CONTEXTS, SIDE_STREAM
from sage_qual.kernels.variants import VARIANTS
from sage_qual.qualification.decide import checked, profile, verdict
from sage_qual.qualification.evidence.report_model import (
    ContextCheck,
    ContextRun,
    DType,
    Outcome,
    safe_contexts,
)
from sage_qual.qualification.measure import context_check
from sage_qual.qualification.run import run as run_mod
from sage_qual.qualification.run.run import certify
from sage_qual.qualification.selftest import detection
from sage_qual.qualification.selftest import faults as worker_faults
from sage_qual.testing import FakeCuda, FakeGpu, FakeSageAttention

from .. import builders, fakes
from ..helpers import TORCH_SDPA

TRITON, SM90, CK = VARIANTS["sm86-fp16-triton"], VARIANTS["sm90-fp8-cuda"], VARIANTS["ck-int8-cuda"]
# On the fake, as on the H200 (docs/results/run19-h200/; run37-h200-suite/ for comfy-kitchen): the
# current-stream kernels (Triton's, comfy-kitchen's) are right everywhere, a legacy-stream kernel
# everywhere but under capture.
CLEAN = {TRITON.name: list(CONTEXTS), SM90.name: [SIDE_STREAM, COMPILE], CK.name: list(CONTEXTS)}
BOUNDS = {name: {"max_rel_l2": 0.08, "min_cosine": 0.99} for name in ("fp16", "fp8")}


@pytest.fixture
def fake_h200():
    torch._dynamo.reset()
    with FakeCuda([FakeGpu((9, 0), "Fake H200")]) as cuda, \
            FakeSageAttention(comfy_kitchen="0.2.40").installed() as fake:
        yield cuda, fake
    torch._dynamo.reset()


@pytest.mark.parametrize("variant", [TRITON, SM90, CK], ids=lambda v: v.name)
def test_the_checks_certify_what_the_fake_kernel_gets_right(fake_h200, variant):
    runs = context_check.check_variant(variant, context_check.FakePlace())
    assert [run.name for run in runs] == list(CHECKS)
    assert safe_contexts(runs) == CLEAN[variant.name]
    capture = next(run for run in runs if run.name == "capture")
    if variant is SM90:  # trusted, so served, and wrong: the output of a launch nothing recorded
        assert capture.served == capture.calls == 1 and not capture.bit_identical and capture.rel_l2 == 1.0


@pytest.mark.parametrize("variant", [TRITON, SM90], ids=lambda v: v.name)
def test_the_kernel_alone_is_wrong_off_the_legacy_stream_as_upstream_ships_it(fake_h200, variant):
    runs = context_check.check_variant(variant, context_check.FakePlace(), through="kernel")
    assert [run.name for run in runs] == ["side_stream", "capture"] and not any(run.error for run in runs)
    assert all(run.served == run.calls == 1 for run in runs)
    assert [run.passed for run in runs] == ([True, True] if variant is TRITON else [False, False])


def test_under_the_built_in_rule_a_capture_falls_back_and_is_torchs(fake_h200):
    measured = context_check.check_variant(SM90, context_check.FakePlace(), contexts=None)
    runs = {run.name: run for run in measured}
    capture = runs["capture"]
    assert capture.served == 0 and capture.fallbacks == {"capture": 1} and capture.torch_rel_l2 == 0.0
    assert runs["side_stream"].passed and runs["compile"].passed


@pytest.mark.parametrize("defect", detection.CONTEXT_DEFECTS, ids=lambda d: d.name)
@pytest.mark.parametrize("variant", [TRITON, SM90, CK], ids=lambda v: v.name)
def test_a_context_defect_takes_exactly_its_context(fake_h200, variant, defect):
    cuda, fake = fake_h200
    with detection.injected(defect):
        runs = context_check.check_variant(variant, context_check.FakePlace())
        # eagerly on the default stream it does not fire: no cell, so no family, can see it
        import sage_qual
        from sage_qual.serving.config import WrapperConfig
        sage_qual.install(config=WrapperConfig(min_query_tokens=1, min_key_tokens=1,
                                               kernel_table={(9, 0): (variant.name,)}))
        q, k, v = (torch.randn(1, 2, 64, 64).to(torch.bfloat16) for _ in range(3))
        with sage_qual.sage_attention_scope() as scope:
            eager = F.scaled_dot_product_attention(q, k, v)
        sage_qual.uninstall()
    assert safe_contexts(runs) == [c for c in CLEAN[variant.name] if c not in defect.reaches]
    assert scope.served == 1 and torch.allclose(eager.float(), TORCH_SDPA(q, k, v).float(), atol=1e-2)


# The records: judged from their numbers -------------------------------------------------------------
def run(name, identical=True, served=1, calls=1, diff=0.0, rel=0.0, error=""):
    return ContextRun(name, calls, served, identical, True, diff, rel, 0.04, error=error)


def check_of(runs, outcome=None):
    passed = all(r.passed for r in runs)
    return ContextCheck("sm90-fp8-cuda", [1, 24, 16384, 128], DType("bfloat16"),
                        outcome or (Outcome.PASS if passed else Outcome.FAIL), runs)


@pytest.mark.parametrize("edit, key", [
    (lambda d: d["runs"][1].update(bit_identical=True), "bit_identical"),  # identical, yet 1.17 apart
    (lambda d: d.update(outcome="pass"), "outcome"),  # a failing capture relabelled
    (lambda d: d["runs"].pop(), "runs"),  # a check left out
    (lambda d: d["runs"][0].update(served=5), "served"),
    (lambda d: d["runs"][0].update(name="graphs"), "name"),
])
def test_an_edited_context_check_is_refused_naming_the_key(edit, key):
    data = records.dump(check_of([run("side_stream"), run("capture", False, diff=0.09, rel=1.17),
                                  run("compile", calls=3, served=3), run("compile_reduce_overhead")]))
    edit(data)
    with pytest.raises(records.RecordError) as raised:
        records.parse(ContextCheck, data, "a report", "certify again")
    assert key in str(raised.value)


def test_a_context_is_safe_only_when_every_check_of_it_passed():
    runs = [run("side_stream"), run("capture"), run("compile"),
            run("compile_reduce_overhead", served=2, calls=3)]
    assert safe_contexts(runs) == [SIDE_STREAM, CAPTURE]
    assert safe_contexts(runs[:1]) == [SIDE_STREAM]  # unchecked contexts are never safe
    assert not run("side_stream", error="RuntimeError: capture invalidated").passed


@pytest.mark.parametrize(
    "ran, said",
    [
        (run("side_stream", served=0, calls=0), "it made no call, so nothing was checked"),
        (run("capture", served=1, calls=2), "served 1 of 2 calls (no reason)"),
        (
            run("compile", identical=False, diff=0.5, rel=0.02),
            "not bit-identical to the eager call (relative L2 0.02)",
        ),
        (run("capture", error="RuntimeError: capture invalidated"), "RuntimeError: capture invalidated"),
        (run("side_stream"), ""),
    ],
)
def test_a_context_run_says_why_it_failed_from_its_numbers(ran, said):
    """A side-stream run of no call was said "not bit-identical (relative L2 0)" (issue 43)."""
    assert ran.failure() == said


def test_a_context_check_says_where_it_serves_and_where_it_falls_back_not_fail():
    """"outcome fail" read as broken for a variant safe in two of three contexts (issue 43)."""
    legacy = check_of([run("side_stream"), run("capture", identical=False, diff=1.0, rel=1.0), run("compile"),
                       run("compile_reduce_overhead")])
    assert legacy.decided() == "safe in side_stream, compile; falls back under capture"
    assert check_of([run(name) for name in CHECKS]).decided() == "safe in side_stream, capture, compile"
    crashed = dataclasses.replace(legacy, outcome=Outcome.CRASH, runs=[])
    assert crashed.decided() == "crash"
    assert run_mod.describe(legacy) == ("sm90-fp8-cuda in every context: safe in side_stream, compile; falls "
                                        "back under capture")


# certify end to end on the fake GPU -----------------------------------------------------------------
@pytest.fixture(scope="module")
def certified(tmp_path_factory):
    """One certify run on a fake H200 for the module's end-to-end tests: the sm90 and Triton
    variants, with the compile defect injected into the Triton variant's context check."""
    root = tmp_path_factory.mktemp("certify")
    fixtures = root / "fixtures"
    fixtures.mkdir()
    fakes.random_fixture(fixtures, "c-flux", "flux.1", BOUNDS, tokens=64)
    hook = {"gpus": [{"name": "Fake H200", "capability": [9, 0]}],
            "context_faults": {TRITON.name: "compile_pattern"}}
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv(worker_faults.TEST_HOOK, json.dumps(hook))
        out = root / "out"
        certify(builders.gpu_request(out, devices="0", variants=[SM90.name, TRITON.name], families=["FLUX.1"],
                                    fixture_dirs=[str(fixtures)], timeout=60.0))
    return out, checked.load(out / "report.json")


def test_certify_checks_every_variant_in_every_context_and_the_profile_keeps_what_passed(certified):
    out, typed = certified
    checks = {c.variant: c for c in typed.devices[0].contexts}
    assert set(checks) == {SM90.name, TRITON.name}
    assert checks[SM90.name].safe_contexts == CLEAN[SM90.name]
    assert checks[TRITON.name].safe_contexts == [SIDE_STREAM, CAPTURE]  # the injected compile defect
    assert checks[SM90.name].ran_shape == [1, 2, 64, 64] and checks[SM90.name].shape == [1, 24, 16384, 128]
    # The fake's times mean nothing: both variants ten times faster than SDPA at every shape, every
    # sample alike (a noisy sample would widen the interval), so the verdicts serve.
    def faster(device):
        sdpa = {s.shape: s for s in device.speed if s.kernel == "sdpa"}
        def timed(s, ms):
            return dataclasses.replace(s, ms=ms, samples_ms=[ms] * len(s.samples_ms))
        return [timed(s, 1.0) if s.kernel == "sdpa" else timed(s, 0.1) if s.ms and s.shape in sdpa else s
                for s in device.speed]
    fast = dataclasses.replace(typed, devices=[dataclasses.replace(d, speed=faster(d))
                                               for d in typed.devices])
    (gpu,) = verdict.decide(fast)
    entries = records.dump(profile.build(fast, [gpu]))["gpus"][0]
    served = [(d, entries["families"][d.family] if d.family else entries["default"])
              for d in gpu.families + [gpu.default] if d.variant]
    assert served, [d.reasons for d in gpu.families + [gpu.default]]
    for decision, entry in served:
        expected = CLEAN[SM90.name] if decision.variant == SM90.name else [SIDE_STREAM, CAPTURE]
        assert list(decision.served.contexts) == entry["served"]["contexts"] == expected
        assert f"contexts: {', '.join(expected)}" in decision.served.text()
        if decision.variant == TRITON.name:
            assert any(r.kind.value == "context" and "compile" in r.detail for r in decision.range_reasons)
    md = (out / "report.md").read_text()
    assert "### Execution contexts" in md
    assert f"| {SM90.name} | 1x2x64x64 | identical | differs (rel L2 1) | identical | identical |" in md


def test_the_context_checks_workers_start_with_the_sweep_not_after_it(certified):
    """Their tasks declare what they import (`ContextTask.IMPORTS`): workers started during the sweep
    import it before their job, so the last sweep worker started after them."""
    out, _ = certified
    first_task = {int(log.stem.split("-")[1]): log.read_text().split("first ", 1)[1].split(",")[0]
                  for log in (out / "logs").glob("worker-*.log") if "first " in log.read_text()}
    contexts = [n for n, task in first_task.items() if task.endswith("#contexts")]
    sweep = [n for n, task in first_task.items() if "#" not in task and "^" not in task]
    assert len(contexts) == 2 and sweep
    assert max(contexts) < max(sweep), first_task


def test_a_decision_without_context_checks_keeps_the_built_in_rule(certified):
    """A report from before the checks (contexts null), or whose checks a crash ended."""
    out, typed = certified
    old = dataclasses.replace(typed, devices=[dataclasses.replace(d, contexts=None) for d in typed.devices])
    crashed = dataclasses.replace(typed, devices=[dataclasses.replace(d, contexts=[
        dataclasses.replace(c, outcome=Outcome.CRASH, runs=[], detail="the worker died") for c in d.contexts])
        for d in typed.devices])
    for decision in [*verdict.decide(old)[0].families, verdict.decide(old)[0].default]:
        assert decision.served is None or decision.served.contexts is None
    (gpu,) = verdict.decide(crashed)
    checked = verdict._Model(crashed, crashed.devices, [SM90.name, TRITON.name])
    contexts, reasons = checked.contexts(SM90.name)
    assert contexts == []  # nothing certified: the default stream only
    assert any("context check crash: the worker died" in r.detail for r in reasons)


def test_the_triton_variants_kernels_compile_ahead_beside_its_job_on_its_gpu_and_triton_cache(certified):
    """The compile-ahead (`plan.compile_ahead`) runs in a worker of its own whose environment is the
    Triton job's: the same GPU and the same Triton cache, where the job then finds the kernels."""
    out, _ = certified
    env_of = {}
    for log in (out / "logs").glob("worker-*.log"):
        head = log.read_text().split("\n", 1)[0]
        if "first " in head:
            first, env = head.split("first ", 1)[1].split(", env ", 1)
            env_of[first] = ast.literal_eval(env)
    ahead, job = env_of[f"compile:{TRITON.name}"], env_of[f"{TRITON.name}|c-flux"]
    assert ahead == job and ahead["TRITON_CACHE_DIR"]
