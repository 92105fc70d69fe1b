"""Edits of long checks, span probes and profiles that issue 28 does not list, on this code only: does
each get refused (one line naming the field), or change nothing, or change the decision (and if so,
only towards serving less)? The gate cases read run 18's H200 report as issue28_on_e62fbf4.py does.

    python docs/runs/issue28_other_edits.py > docs/runs/issue28_other_edits.txt
"""

import copy
import importlib.util
import json
import subprocess
from pathlib import Path

HERE = Path(__file__).parent
_spec = importlib.util.spec_from_file_location("probe", HERE / "issue28_on_e62fbf4.py")
probe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(probe)
FAMILY = probe.FAMILY


def _sm90(report):
    return probe._sm90_checks(report)


def _family(report):
    return probe._longest_call_check(report)


def _sweep(report, tokens):
    return next(c for c in _sm90(report)
                if c["shape"]["q_tokens"] == tokens and c["uses"][0]["family"] is None)


def _relabel(check, tokens):
    check["shape"].update(q_tokens=tokens, kv_tokens=tokens)
    check["uses"][0].update(label=f"self {tokens}, head_dim 128")


def _span(report):
    return report["devices"][0]["span"][0]


REPORT_EDITS = {
    "long: head_dim 64": lambda r: _family(r)["shape"].update(head_dim=64),
    "long: 1 head": lambda r: _family(r)["shape"].update(heads=1, kv_heads=1),
    "long: kv_tokens alone 10^6": lambda r: _family(r)["shape"].update(kv_tokens=10**6),
    "long: q_tokens alone 10^6": lambda r: _family(r)["shape"].update(q_tokens=10**6),
    "long: dtype float16": lambda r: _family(r)["shape"].update(dtype="float16"),
    "long: dtype int8": lambda r: _family(r)["shape"].update(dtype="int8"),
    "long: batch 2": lambda r: _family(r)["shape"].update(batch=2),
    "long: batch 0": lambda r: _family(r)["shape"].update(batch=0),
    "long: not finite, outcome pass": lambda r: _family(r).update(finite=False),
    "long: rel_l2 NaN": lambda r: _family(r)["metrics"].update(rel_l2=float("nan")),
    "long: rel_l2 negative": lambda r: _family(r)["metrics"].update(rel_l2=-1.0),
    "long: rel_l2 past its budget": lambda r: _family(r)["metrics"].update(rel_l2=10.0),
    "long: cosine 1.5": lambda r: _family(r)["metrics"].update(worst_head_cosine=1.5),
    "long: identical 'yes'": lambda r: _family(r)["identical"].update(transposed="yes"),
    "long: identical false, outcome pass": lambda r: _family(r)["identical"].update(transposed=False),
    "long: unknown layout": lambda r: _family(r).update(layouts=["contiguous", "diagonal"]),
    "long: one layout twice": lambda r: _family(r).update(layouts=["contiguous", "contiguous"]),
    "long: a row past its tokens": lambda r: _family(r).update(rows=[0, 5632, 11136, 99999]),
    "long: rows out of order": lambda r: _family(r).update(rows=[5632, 0, 11136, 16768]),
    "long: a row twice": lambda r: _family(r).update(rows=[0, 0, 11136, 16768]),
    "long: a row off its block": lambda r: _family(r).update(rows=[1, 5632, 11136, 16768]),
    "long: row_block 0": lambda r: _family(r).update(row_block=0),
    "long: another variant's (sm80)": lambda r: _family(r).update(variant="sm80-fp16-cuda"),
    "long: unknown variant": lambda r: _family(r).update(variant="sm99-x"),
    "long: another family's use": lambda r: _family(r).update(
        uses=[{"family": "Wan 2.2", "label": "longest call: 16896 query / 16896 key tokens"}]),
    "long: outcome crash, no detail": lambda r: _family(r).update(outcome="crash"),
    "long: outcome 'great'": lambda r: _family(r).update(outcome="great"),
    "long: no bounds, outcome pass": lambda r: _family(r).update(bounds=None),
    "long: a negative bound": lambda r: _family(r)["bounds"].update(max_rel_l2=-1),
    "long: ran 100 tokens": lambda r: _family(r).update(ran_tokens=100),
    "sweep: 32,768 relabelled 65,536": lambda r: _relabel(_sweep(r, 32768), 65536),
    "sweep: one check twice": lambda r: r["devices"][0]["long"].append(copy.deepcopy(_sweep(r, 32768))),
    "long: the family's check removed": lambda r: r["devices"][0]["long"].remove(_family(r)),
    "sweep: the 32,768 check removed": lambda r: r["devices"][0]["long"].remove(_sweep(r, 32768)),
    "span: limit 0": lambda r: _span(r).update(limit=0),
    "span: span negative": lambda r: _span(r).update(span=-5),
    "span: 1 token": lambda r: _span(r).update(tokens=1),
    "span: 0 heads": lambda r: _span(r).update(heads=0),
    "span: another variant's": lambda r: _span(r).update(variant="sm80-fp16-cuda"),
    "span: crash turned pass": lambda r: _span(r).update(outcome="pass", rel_l2=0.01),
    "span: every probe removed": lambda r: r["devices"][0].update(span=[]),
    "device: another capability": lambda r: r["devices"][0].update(capability=[8, 9]),
}


def _profile(report_dir="docs/results/run25-h200/certify"):
    return json.loads(Path(report_dir, "profile.json").read_text())


def _entry(data):
    return data["gpus"][0]["families"]["FLUX.1"]


PROFILE_EDITS = {
    "profile: max below min": lambda d: _entry(d).update(max_query_tokens=100),
    "profile: min 0": lambda d: _entry(d).update(min_query_tokens=0),
    "profile: min 10624.5": lambda d: _entry(d).update(min_query_tokens=10624.5),
    "profile: min true": lambda d: _entry(d).update(min_query_tokens=True),
    "profile: no head sizes": lambda d: _entry(d).update(head_dims=[]),
    "profile: head size 1000": lambda d: _entry(d).update(head_dims=[1000]),
    "profile: head size '128'": lambda d: _entry(d).update(head_dims=["128"]),
    "profile: unknown layout": lambda d: _entry(d).update(layouts=["diagonal"]),
    "profile: no layouts": lambda d: _entry(d).update(layouts=[]),
    "profile: unknown context": lambda d: _entry(d).update(contexts=["warp"]),
    "profile: unknown variant": lambda d: _entry(d).update(variant="sm99"),
    "profile: variant null, thresholds kept": lambda d: _entry(d).update(variant=None),
    "profile: bound on side 'middle'": lambda d: _entry(d)["bounds"][0].update(side="middle"),
    "profile: bound below -3": lambda d: _entry(d)["bounds"][0].update(below=-3),
    "profile: capability [9]": lambda d: d["gpus"][0].update(capability=[9]),
    "profile: an sm_89 GPU with sm_90 entries": lambda d: d["gpus"][0].update(capability=[8, 9]),
    "profile: memory -1": lambda d: d["gpus"][0].update(memory_gib=-1),
    "profile: max_span_elements 0": lambda d: d["gpus"][0].update(max_span_elements=0),
    "profile: max_span_elements as a string": lambda d: d["gpus"][0].update(max_span_elements="2147483647"),
    "profile: schema 99": lambda d: d.update(schema_version=99),
    "profile: no GPU": lambda d: d.update(gpus=[]),
    "profile: an unknown key": lambda d: _entry(d).update(speedup=3),
    "profile: a reason of kind 'whatever'": lambda d: _entry(d)["reasons"][0].update(kind="whatever"),
}


def _gate_lines(control):
    for name, edit in REPORT_EDITS.items():
        report = probe._base()
        edit(report)
        found = probe._gate(report)
        verdict = "refused" if found["rc"] == 2 else "same" if found == control else "changed"
        yield f"{verdict:8} {name}: exit {found['rc']}: {found['said'][:230]}"


def _profile_lines():
    from sage_qual.verdicts import profile

    for name, edit in PROFILE_EDITS.items():
        data = _profile()
        edit(data)
        try:
            profile.load(data)
            yield f"read     {name}"
        except profile.ProfileError as error:
            yield f"refused  {name}: {str(error)[:230]}"


def main() -> None:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    control = probe._gate(probe._base())
    print(f"# code {head}: {FAMILY} on run 18's report untouched: exit {control['rc']}: {control['said']}")
    for line in _gate_lines(control):
        print(line, flush=True)
    for line in _profile_lines():
        print(line, flush=True)


if __name__ == "__main__":
    main()
