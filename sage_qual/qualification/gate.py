"""`sage-qual gate` and `sage-qual merge`: decisions and a fleet table from certify reports.

gate exits 0 to enable a family on this machine, 1 to keep it off (every reason printed), 2 when
it cannot decide: no report, a partial one, or a stale one (made on another GPU model, driver,
torch, sageattention or other fixtures than this machine has). Without --require-speedup a
family is enabled when a variant passed all its fixtures on every GPU model here: the profile's
thresholds then keep calls that measured slower on PyTorch. With it, the variant must also have
measured faster at one of the family's own shapes.
"""

from __future__ import annotations

from pathlib import Path

from sage_qual.errors import UsageError
from sage_qual.fixtures import fileformat
from sage_qual.qualification import report
from sage_qual.qualification.certify import fixture_dirs
from sage_qual.qualification.families import FAMILIES, SPEED, Family


def local_fixtures(directories: list[str] | None, family: Family) -> dict[str, str]:
    """This machine's fixtures of the family: name -> sha256."""
    found = {}
    for directory in fixture_dirs(directories):
        try:
            for path in fileformat.list_fixtures(directory):
                fixture = fileformat.load_fixture(path)
                if family.owns(fixture.family):
                    found[fixture.name] = fixture.sha256
        except fileformat.FixtureError as error:
            raise UsageError(str(error)) from None
    return found


def _model(gpu: dict) -> str:
    return "%s (sm_%d%d)" % (gpu["name"], *gpu["capability"])


def stale(data: dict, family: Family, here: dict, local: dict[str, str]) -> list[str]:
    """How the report's machine differs from this one, for this family; empty when it does not."""
    made, differences = data["environment"], []
    for key, label in (("driver", "NVIDIA driver"), ("torch", "torch"), ("sageattention", "sageattention")):
        if made[key] != here[key]:
            differences.append(f"{label} {made[key] or 'none'} in the report, {here[key] or 'none'} here")
    certified = {_model(g) for g in data["gpus"]}
    for model in sorted({_model(g) for g in here["gpus"]} - certified):
        differences.append(f"{model} here is not in the report")
    recorded = {f["name"]: f["sha256"] for f in data["fixtures"] if family.owns(f["family"])}
    for name in sorted(set(recorded) | set(local)):
        if name not in local:
            differences.append(f"fixture {name} is in the report but not here")
        elif name not in recorded:
            differences.append(f"fixture {name} is here but not in the report")
        elif recorded[name] != local[name]:
            differences.append(f"fixture {name} changed (sha256 {local[name][:12]} here, "
                               f"{recorded[name][:12]} in the report)")
    return differences


def decide(data: dict, family: Family, here: dict, local: dict[str, str],
           require_speedup: bool) -> tuple[int, list[str]]:
    """(exit code, lines to print); code 2 comes with one line saying why no decision is possible."""
    if not data["complete"]:
        return 2, [f"the report is partial: {report.status_line(data)}"]
    if family.name not in data["options"]["families"]:
        ran = ", ".join(data["options"]["families"])
        return 2, [f"the report did not certify {family.name} (it ran: {ran})"]
    differences = stale(data, family, here, local)
    if differences:
        return 2, [f"stale report: {'; '.join(differences)}. Run `sage-qual certify` on this machine again"]
    models_here = {_model(g) for g in here["gpus"]}
    code, lines = 0, []
    for gpu in data["gpus"]:
        if _model(gpu) not in models_here:
            continue
        verdict = next(v for v in gpu["families"] if v["family"] == family.name)
        reasons = [r for r in verdict["reasons"] if require_speedup or r["kind"] != SPEED]
        where = f"{family.name} on {_model(gpu)}"
        if reasons:
            code = 1
            lines.append(f"{where}: keep off")
            lines += [f"  - {r['kind']}: {r['detail']}" for r in reasons]
        elif verdict["variant"]:
            lines.append(f"{where}: enable ({verdict['variant']} from {verdict['min_query_tokens']} query "
                         f"and {verdict['min_key_tokens']} key tokens, head_dim "
                         f"{'/'.join(map(str, verdict['head_dims']))})")
        else:  # safe, but it measured slower everywhere: the profile serves nothing
            lines.append(f"{where}: enable (passes with {', '.join(verdict['certified'])}; no measured "
                         "speedup, so the profile serves no call: --require-speedup would keep it off)")
    return code, lines


# merge -------------------------------------------------------------------------------------------------
def merge_rows(reports: list[tuple[Path, dict]]) -> list[dict]:
    rows = []
    for path, data in reports:
        env = data["environment"]
        common = {"host": data["host"], "report": str(path), "complete": data["complete"],
                  "driver": env["driver"], "torch": env["torch"], "sageattention": env["sageattention"]}
        if not data["complete"]:
            for device in data["devices"]:
                rows.append({**common, "gpu": device["name"], "capability": device["capability"],
                             "devices": [device["index"]], "families": {}})
            continue
        for gpu in data["gpus"]:
            rows.append({**common, "gpu": gpu["name"], "capability": gpu["capability"],
                         "devices": gpu["devices"],
                         "families": {v["family"]: {"verdict": v["verdict"], "variant": v["variant"],
                                                    "min_query_tokens": v["min_query_tokens"],
                                                    "min_key_tokens": v["min_key_tokens"],
                                                    "reasons": sorted({r["kind"] for r in v["reasons"]})}
                                      for v in gpu["families"]}})
    return rows


def merge_markdown(rows: list[dict]) -> str:
    names = [f.name for f in FAMILIES if any(f.name in row["families"] for row in rows)]
    header = ["host", "GPU", "sm", "GPUs", "driver", "torch", "sageattention"] + names
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [row["host"], row["gpu"], "%d%d" % tuple(row["capability"]), str(len(row["devices"])),
                 row["driver"] or "-", row["torch"], row["sageattention"] or "-"]
        for name in names:
            verdict = row["families"].get(name)
            if not row["complete"]:
                cells.append("partial report")
            elif verdict is None:
                cells.append("not run")
            elif verdict["verdict"] == "enable":
                cells.append(f"on: {verdict['variant']} >= "
                             f"{verdict['min_query_tokens']}/{verdict['min_key_tokens']}")
            else:
                cells.append("off: " + ", ".join(verdict["reasons"]))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
