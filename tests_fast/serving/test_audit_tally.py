"""The audit's tally (`serving.audit_tally`) on hand-made numbers: what it keeps per family and variant,
how two tallies merge (a scope into the process), its JSON snapshot and its Prometheus metrics, each
compared whole."""

import json
import math

import pytest

from sage_qual.serving import audit
from sage_qual.serving.audit_tally import DRIFT, MISS, AuditTally, Finding, prometheus_collector


def finding(judge, rel_l2, variant="sm90-fp8-cuda", family="Krea-2", bound=0.3, model=0.03):
    return Finding(
        judge,
        family,
        "cuda:0 (H, sm_90)",
        "H",
        (9, 0),
        variant,
        "thu-ml 2.2.0",
        rel_l2,
        bound,
        model,
        "q/k/v [1, 2, 48, 64] float16",
        "sample 0, rows 0-47",
    )


def tally_of_a_process() -> AuditTally:
    tally = AuditTally()
    tally.judged("Krea-2", "sm90-fp8-cuda", 0.02, 0.3, 0.025)
    tally.judged("Krea-2", "sm90-fp8-cuda", 0.04, 0.3, 0.02)
    tally.judged("Krea-2", "ck-int8-cuda", 0.01, 0.3, None)
    tally.judged("FLUX.1", "sm90-fp8-cuda", math.nan, 0.3, 0.03)
    tally.skipped["capture"] += 2
    tally.found(finding(MISS, 0.5))
    tally.found(finding(DRIFT, 0.09, bound=0.037))
    tally.retired["cuda:0 (H, sm_90)"] = "audit miss for Krea-2"
    return tally


def test_the_tally_keeps_the_worst_per_family_and_variant_and_nan_stays_worst():
    tally = tally_of_a_process()
    assert tally.audited == 4
    assert tally.worst["Krea-2"] == 0.04 and math.isnan(tally.worst["FLUX.1"])
    assert tally.worst_by_variant[("Krea-2", "sm90-fp8-cuda")] == 0.04
    assert tally.worst_by_variant[("Krea-2", "ck-int8-cuda")] == 0.01
    assert tally.worst_ratio[("Krea-2", "sm90-fp8-cuda")] == pytest.approx(2.0)  # 0.04 / 0.02
    assert ("Krea-2", "ck-int8-cuda") not in tally.worst_ratio  # not modelled: no ratio
    assert [f.judge for f in tally.misses] == [MISS] and [f.judge for f in tally.drifts] == [DRIFT]
    tally.judged("FLUX.1", "sm90-fp8-cuda", 0.9, 0.3, 0.03)
    assert math.isnan(tally.worst["FLUX.1"])


def test_a_scope_merges_into_the_process_every_number():
    process = AuditTally()
    process.judged("Krea-2", "sm90-fp8-cuda", 0.05, 0.3, 0.05)
    process.skipped["capture"] += 1
    process.found(finding(MISS, 0.4))
    process.found(finding(DRIFT, 0.08, bound=0.037))
    process.retired["cuda:1 (H, sm_90)"] = "audit drift for SDXL"
    process.add(tally_of_a_process())
    assert process.audited == 5 and process.skipped == {"capture": 3}
    assert process.worst["Krea-2"] == 0.05 and math.isnan(process.worst["FLUX.1"])
    assert process.bounds == {"Krea-2": 0.3, "FLUX.1": 0.3}
    assert process.worst_by_variant == {
        ("Krea-2", "sm90-fp8-cuda"): 0.05,
        ("Krea-2", "ck-int8-cuda"): 0.01,
        ("FLUX.1", "sm90-fp8-cuda"): process.worst_by_variant[("FLUX.1", "sm90-fp8-cuda")],
    }
    assert math.isnan(process.worst_by_variant[("FLUX.1", "sm90-fp8-cuda")])
    assert process.worst_ratio[("Krea-2", "sm90-fp8-cuda")] == pytest.approx(2.0)
    assert [f.rel_l2 for f in process.misses] == [0.4, 0.5]
    assert [f.rel_l2 for f in process.drifts] == [0.08, 0.09]
    assert process.retired == {
        "cuda:1 (H, sm_90)": "audit drift for SDXL",
        "cuda:0 (H, sm_90)": "audit miss for Krea-2",
    }


def test_the_snapshot_is_every_number_as_json_data():
    snapshot = tally_of_a_process().snapshot()
    json.dumps(snapshot, allow_nan=False)  # no NaN: not finite is null

    def as_json(f, rel_l2, bound):
        return {
            "judge": f,
            "family": "Krea-2",
            "device": "cuda:0 (H, sm_90)",
            "gpu": "H",
            "capability": [9, 0],
            "variant": "sm90-fp8-cuda",
            "build": "thu-ml 2.2.0",
            "rel_l2": rel_l2,
            "bound": bound,
            "model_rel_l2": 0.03,
            "call": "q/k/v [1, 2, 48, 64] float16",
            "slice": "sample 0, rows 0-47",
            "fixture": "",
        }

    assert snapshot == {
        "audited": 4,
        "skipped": {"capture": 2},
        "worst": [
            {
                "family": "Krea-2",
                "variant": "sm90-fp8-cuda",
                "rel_l2": 0.04,
                "fitness_bound": 0.3,
                "kernel_over_model": pytest.approx(2.0),
            },
            {
                "family": "Krea-2",
                "variant": "ck-int8-cuda",
                "rel_l2": 0.01,
                "fitness_bound": 0.3,
                "kernel_over_model": None,
            },
            {
                "family": "FLUX.1",
                "variant": "sm90-fp8-cuda",
                "rel_l2": None,
                "fitness_bound": 0.3,
                "kernel_over_model": None,
            },
        ],
        "misses": [as_json(MISS, 0.5, 0.3)],
        "drifts": [as_json(DRIFT, 0.09, 0.037)],
        "retired": [{"device": "cuda:0 (H, sm_90)", "why": "audit miss for Krea-2"}],
    }


def test_the_summary_line():
    assert tally_of_a_process().summary() == (
        "audit: 4 calls (2 skipped: capture=2), worst Krea-2 0.04 (bound 0.3), worst FLUX.1 nan (bound 0.3), "
        "1 misses, 1 drifts"
    )


def test_the_prometheus_metrics_whole():
    prometheus_client = pytest.importorskip("prometheus_client")
    registry = prometheus_client.CollectorRegistry()
    registry.register(prometheus_collector(tally_of_a_process))
    lines = [
        line
        for line in prometheus_client.generate_latest(registry).decode().splitlines()
        if not line.startswith("# ") and "_created" not in line
    ]
    assert lines == [
        "sage_qual_audit_calls_total 4.0",
        'sage_qual_audit_skipped_total{reason="capture"} 2.0',
        'sage_qual_audit_worst_rel_l2{family="Krea-2",variant="sm90-fp8-cuda"} 0.04',
        'sage_qual_audit_worst_rel_l2{family="Krea-2",variant="ck-int8-cuda"} 0.01',
        'sage_qual_audit_worst_rel_l2{family="FLUX.1",variant="sm90-fp8-cuda"} NaN',
        'sage_qual_audit_worst_kernel_over_model{family="Krea-2",variant="sm90-fp8-cuda"} 2.0',
        'sage_qual_audit_worst_kernel_over_model{family="FLUX.1",variant="sm90-fp8-cuda"} NaN',
        'sage_qual_audit_fitness_bound{family="Krea-2"} 0.3',
        'sage_qual_audit_fitness_bound{family="FLUX.1"} 0.3',
        'sage_qual_audit_findings_total{family="Krea-2",judge="miss",variant="sm90-fp8-cuda"} 1.0',
        'sage_qual_audit_findings_total{family="Krea-2",judge="drift",variant="sm90-fp8-cuda"} 1.0',
        "sage_qual_audit_retired_devices 1.0",
    ]
    said = {
        line.split()[2]: line
        for line in prometheus_client.generate_latest(registry).decode().splitlines()
        if line.startswith("# HELP")
    }
    from sage_qual.serving.audit_tally import METRICS

    for name, help_text in METRICS.items():
        assert said[name] == f"# HELP {name} {help_text}"


def test_without_prometheus_client_the_collector_names_the_fix(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_prometheus(name, *args, **kwargs):
        if name.startswith("prometheus_client"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_prometheus)
    with pytest.raises(
        ImportError, match=r'pip install prometheus_client, or the extra: pip install -e "\.\[metrics\]"'
    ):
        prometheus_collector(audit.audit_tally)


def test_a_skipped_audit_is_counted_in_the_scope_and_the_process():
    scope = AuditTally()
    for _ in range(3):
        audit.skipped(scope, "capture")
    assert scope.skipped == {"capture": 3} and audit.audit_tally().skipped == {"capture": 3}
