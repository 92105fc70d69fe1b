"""`sage-qual gate` and `sage-qual merge`: decisions and a fleet table from certify reports.

Both take their verdicts from `verdict.decide()`, the function report.md and certify's summary
use, so the four always say the same word. gate exits 0 to enable a family on this machine
("enable"; also "safe, no speedup" unless --require-speedup: a profile then serves nothing, so
switching the family on changes nothing), 1 to keep it off (every reason printed), 2 when it
cannot decide: no report, a partial, damaged or edited one, or a stale one (made on another GPU
model, driver, torch, sageattention or other fixtures than this machine has).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from sage_qual.errors import ExitCode, UsageError
from sage_qual.fixtures import fileformat
from sage_qual.qualification import report, verdict
from sage_qual.qualification.certify import check_finite, fixture_dirs
from sage_qual.qualification.families import FAMILIES, Family, normalize
from sage_qual.qualification.report_model import Report
from sage_qual.qualification.verdict import GENERIC, FamilyDecision, Verdict


def counts_for(family: Family, fixture_family: str) -> bool:
    """A fixture counts for the family when it is the family's own or generic."""
    return family.owns(fixture_family) or normalize(fixture_family) == GENERIC


def local_fixtures(directories: list[str] | None, family: Family) -> dict[str, str]:
    """This machine's fixtures that count for the family: name -> sha256."""
    found = {}
    for directory in fixture_dirs(directories):
        try:
            for path in fileformat.list_fixtures(directory):
                fixture = fileformat.load_fixture(path)
                if counts_for(family, fixture.family):
                    check_finite(fixture, path)
                    found[fixture.name] = fixture.sha256
        except fileformat.FixtureError as error:
            raise UsageError(str(error)) from None
    return found


def _model(gpu: dict) -> str:
    return "%s (sm_%d%d)" % (gpu["name"], *gpu["capability"])


def stale(data: Report, family: Family, here: dict, local: dict[str, str]) -> list[str]:
    """How the report's machine differs from this one, for this family; empty when it does not."""
    made, differences = data.environment, []
    for key, label in (("driver", "NVIDIA driver"), ("torch", "torch"), ("sageattention", "sageattention")):
        if getattr(made, key) != here[key]:
            differences.append(f"{label} {getattr(made, key) or 'none'} in the report, {here[key] or 'none'} "
                               "here")
    certified = {"%s (sm_%d%d)" % (d.name, *d.capability) for d in data.devices}
    for model in sorted({_model(g) for g in here["gpus"]} - certified):
        differences.append(f"{model} here is not in the report")
    recorded = {f.name: f.sha256 for f in data.fixtures if counts_for(family, f.family)}
    for name in sorted(set(recorded) | set(local)):
        if name not in local:
            differences.append(f"fixture {name} is in the report but not here")
        elif name not in recorded:
            differences.append(f"fixture {name} is here but not in the report")
        elif recorded[name] != local[name]:
            differences.append(f"fixture {name} changed (sha256 {local[name][:12]} here, "
                               f"{recorded[name][:12]} in the report)")
    return differences


@dataclass
class GateDecision:
    """What gate says for one family on this machine: an exit code and, per GPU model here, the
    verdict of verdict.decide()."""
    family: str
    code: int
    problem: str = ""  # with code 2: why no decision is possible
    gpus: list[tuple[str, FamilyDecision]] = field(default_factory=list)

    def lines(self, require_speedup: bool) -> list[str]:
        if self.problem:
            return [self.problem]
        lines = []
        for model, decision in self.gpus:
            where = f"{self.family} on {model}"
            if decision.verdict == Verdict.ENABLE:
                lines.append(f"{where}: enable ({decision.variant} from {decision.min_query_tokens} query "
                             f"and {decision.min_key_tokens} key tokens, head_dim "
                             f"{'/'.join(map(str, decision.head_dims))})")
                continue
            note = ""
            if decision.verdict == Verdict.NO_SPEEDUP:
                note = (" (passes with " + ", ".join(decision.certified) + "; a profile serves no call"
                        + ("" if require_speedup else "; --require-speedup would keep it off") + ")")
            lines.append(f"{where}: {decision.verdict.value}{note}")
            lines += [f"  - {r.kind.value}: {r.detail}" for r in decision.reasons]
        return lines

    def as_json(self) -> dict:
        return {"family": self.family, "exit_code": self.code, "problem": self.problem,
                "gpus": [{"gpu": model, "verdict": d.verdict.value, "variant": d.variant,
                          "min_query_tokens": d.min_query_tokens, "min_key_tokens": d.min_key_tokens,
                          "head_dims": d.head_dims, "certified": d.certified,
                          "reasons": [{"kind": r.kind.value, "detail": r.detail} for r in d.reasons]}
                         for model, d in self.gpus]}


def decide(data: Report, family: Family, here: dict, local: dict[str, str],
           require_speedup: bool) -> GateDecision:
    if not data.complete:
        line = report.status_line(data.complete, data.started, data.finished, data.stopped)
        return GateDecision(family.name, ExitCode.USAGE, f"the report is partial: {line}")
    if data.predicted:
        return GateDecision(family.name, ExitCode.USAGE,
                            "the report is predicted by the CPU numerics model (certify --emulate), not "
                            "measured: certify on the GPU")
    if family.name not in data.options.families:
        ran = ", ".join(data.options.families)
        return GateDecision(family.name, ExitCode.USAGE,
                            f"the report did not certify {family.name} (it ran: {ran})")
    differences = stale(data, family, here, local)
    if differences:
        return GateDecision(family.name, ExitCode.USAGE, f"stale report: {'; '.join(differences)}. Run "
                                                          "`sage-qual certify` on this machine again")
    models_here = {_model(g) for g in here["gpus"]}
    result = GateDecision(family.name, ExitCode.ENABLE)
    for gpu in verdict.decide(data):
        if gpu.model not in models_here:
            continue
        decision = gpu.family(family.name)
        result.gpus.append((gpu.model, decision))
        no_speedup = decision.verdict == Verdict.NO_SPEEDUP
        if decision.verdict == Verdict.KEEP_OFF or (no_speedup and require_speedup):
            result.code = ExitCode.KEEP_OFF
    return result


# merge -------------------------------------------------------------------------------------------------
def merge_rows(reports: list[tuple[Path, Report]]) -> list[dict]:
    rows = []
    for path, data in reports:
        env = data.environment
        common = {"host": data.host, "report": str(path), "complete": data.complete,
                  "predicted": data.predicted, "target": data.target,
                  "driver": env.driver, "torch": env.torch, "sageattention": env.sageattention}
        if not data.complete:
            for device in data.devices:
                rows.append({**common, "gpu": device.name, "capability": list(device.capability),
                             "devices": [device.index], "families": {}})
            continue
        for gpu in verdict.decide(data):
            rows.append({**common, "gpu": gpu.name, "capability": list(gpu.capability),
                         "devices": gpu.devices,
                         "families": {v.family: {"verdict": v.verdict.value, "variant": v.variant,
                                                 "min_query_tokens": v.min_query_tokens,
                                                 "min_key_tokens": v.min_key_tokens,
                                                 "reasons": sorted({r.kind.value for r in v.reasons})}
                                      for v in gpu.families}})
    return rows


def merge_markdown(rows: list[dict]) -> str:
    names = [f.name for f in FAMILIES if any(f.name in row["families"] for row in rows)]
    targets = any(row["target"] for row in rows)  # certify --target reports: which integration
    header = ["host", "GPU", "sm", "GPUs", "driver", "torch", "sageattention"] + ["target"] * targets + names
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [row["host"], row["gpu"], "%d%d" % tuple(row["capability"]), str(len(row["devices"])),
                 row["driver"] or "-", row["torch"], row["sageattention"] or "-"]
        if targets:
            cells.append(row["target"] or "(variants)")
        for name in names:
            verdict = row["families"].get(name)
            if not row["complete"]:
                cells.append("partial report")
            elif row["predicted"]:
                cells.append("predicted, not measured")
            elif verdict is None:
                cells.append("not run")
            elif verdict["verdict"] == Verdict.ENABLE.value:
                cells.append(f"enable: {verdict['variant']} >= "
                             f"{verdict['min_query_tokens']}/{verdict['min_key_tokens']}")
            else:
                cells.append(f"{verdict['verdict']}: " + ", ".join(verdict["reasons"]))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
