"""The fleet: `sage-qual merge`'s table from the certify reports of many hosts (a row per GPU model and
family, each verdict `verdict.decide()`'s, with the range, layouts, head sizes and contexts it serves),
and the fleet step's gate over those rows (examples/fleet/merge_and_gate.sh), one answer per family.

The gate enables a family for the fleet when every host's report decides and passes it and every
host's own gate (where its `gates.jsonl` exists) exited 0; the enabled line names what every host
verified. `python -m sage_qual.qualification.decide.fleet FLEET_JSON DECISIONS REPORT...` reads `merge
--json`'s rows and each report's `gates.jsonl`, writes one line per family to DECISIONS and prints
them. REQUIRED_FAMILIES and REQUIRE_SPEEDUP come from the environment, as the script documents.
Exit 0: every required family is on; 1: one is kept off; 2: bad input, named with its file and line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from sage_qual import records
from sage_qual.qualification import families
from sage_qual.qualification.decide import checked, verdict
from sage_qual.qualification.decide.verdict import FamilyDecision, Verdict
from sage_qual.qualification.evidence import report_model
from sage_qual.qualification.evidence.report_model import Report
from sage_qual.verdicts.served import SIDE_WORDS, Served


# merge -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FleetVerdict:
    """One family on one GPU model of a report, as the fleet table and `merge --json` give it: the
    verdict, what a profile serves (null: nothing) and the kinds of reason it serves no more."""
    verdict: Verdict
    served: Served | None
    reasons: tuple[report_model.ReasonKind, ...]  # each kind once, sorted: the details are in report.md

    def __post_init__(self):
        records.tuples(self)

    @classmethod
    def of(cls, decision: FamilyDecision) -> FleetVerdict:
        kinds = sorted({r.kind for r in decision.reasons}, key=lambda kind: kind.value)
        return cls(decision.verdict, decision.served, kinds)


@dataclass(frozen=True)
class FleetRow:
    """One GPU model of one report: where it ran and each family's verdict (none for a report that
    decides nothing, `undecidable` saying why)."""
    host: str
    report: str  # the report file
    complete: bool
    predicted: bool
    target: str
    driver: str
    torch: str
    sageattention: str
    sageattention_source: str  # its build fingerprint ("" where the report has none)
    gpu: str
    capability: tuple[int, ...]
    devices: tuple[int, ...]
    families: dict[str, FleetVerdict]
    # The other providers' packages that served certify ("comfy-kitchen 0.2.40 (sha256:...)").
    other_providers: tuple[str, ...] = ()
    # Why the report decides nothing, in the words gate and compare refuse it with
    # (`checked.undecidable`); "" when it decides. A --quick report's "pass" is not a family's.
    undecidable: str = ""

    def __post_init__(self):
        records.tuples(self)


def merge_rows(reports: list[tuple[Path, Report]]) -> list[FleetRow]:
    rows = []
    for path, data in reports:
        env = data.environment
        common = dict(host=data.host, report=str(path), complete=data.complete, predicted=data.predicted,
                      target=data.target, driver=env.driver, torch=env.torch, sageattention=env.sageattention,
                      sageattention_source=env.sageattention_source,
                      other_providers=[f"{o.provider} {o.version}" + (f" ({o.source})" if o.source else "")
                                       for o in env.other_providers if o.version])
        problem = checked.undecidable(data, str(path))
        if problem:  # no verdict: one row per GPU model the run saw
            models: dict[tuple, list[int]] = {}
            for device in data.devices:
                models.setdefault(device.model, []).append(device.index)
            rows += [FleetRow(**common, gpu=name, capability=capability, devices=indices, families={},
                              undecidable=problem) for (name, capability), indices in models.items()]
            continue
        rows += [FleetRow(**common, gpu=gpu.name, capability=gpu.capability, devices=gpu.devices,
                          families={v.family: FleetVerdict.of(v) for v in gpu.families})
                 for gpu in verdict.decide(data)]
    return rows


# the fleet step's gate ---------------------------------------------------------------------------------
YES = ("1", "true", "yes", "on")
NO = ("0", "false", "no", "off", "")


class BadInput(Exception):
    """Input the step cannot decide on; the message names the file, line or variable and the fix."""


def passing_verdicts(require_speedup: str) -> set[str]:
    """The stored verdicts that let a family on: "safe, no speedup" counts unless REQUIRE_SPEEDUP is set,
    as with `gate --require-speedup`."""
    value = require_speedup.strip().lower()
    if value not in YES + NO:
        raise BadInput(f"REQUIRE_SPEEDUP={value!r}: give 1 (or true, yes, on) or 0 (or false, no, off)")
    return {"enable"} if value in YES else {"enable", "safe, no speedup"}


def gate_answers(reports: list[str]) -> dict[str, dict[str, int]]:
    """Report folder -> family -> the exit code of that host's own gate, from the `gates.jsonl` beside
    each report (certify-one.sh writes one `gate --json` answer per line). A folder is there exactly
    when its `gates.jsonl` is, so a family its gate did not answer reads as missing."""
    codes: dict[str, dict[str, int]] = {}
    for report in reports:
        answers = Path(report).with_name("gates.jsonl")
        if not answers.exists():
            continue
        answered = codes.setdefault(str(answers.parent), {})
        line_of: dict[str, int] = {}
        for number, line in enumerate(answers.read_text(errors="replace").splitlines(), 1):
            if not line.strip():
                continue
            try:
                answer = json.loads(line)
            except ValueError as error:  # a gate killed mid-write leaves a torn line
                raise BadInput(f"{answers} line {number}: not JSON ({error}): a gate answer cut short? run "
                               "the host's gate again, or remove the line") from None
            code = answer.get("exit_code") if isinstance(answer, dict) else None
            family = answer.get("family") if isinstance(answer, dict) else None
            if not isinstance(family, str) or not family.strip() or isinstance(code, bool) or \
                    not isinstance(code, int):
                raise BadInput(f"{answers} line {number}: not a `sage-qual gate --json` answer (it needs a "
                               "family name and an integer exit_code): run the host's gate again, or "
                               "remove the line")
            family = _known(family, f"{answers} line {number}")
            if family in line_of:  # two answers for one family: which holds would depend on line order
                raise BadInput(f"{answers} lines {line_of[family]} and {number}: both answer {family}: run "
                               "the host's gates again into an empty gates.jsonl, or remove one line")
            line_of[family] = number
            answered[family] = code
    return codes


def _known(name: str, where: str) -> str:
    """The family's one name ("flux.1" and "FLUX.1 " are FLUX.1), or BadInput naming `where`."""
    try:
        return families.find(name).name
    except KeyError as error:
        raise BadInput(f"{where}: {error.args[0]}: give a family by one of those names") from None


def common_range(rows: list[dict], family: str) -> str:
    """What every host serves of an enabled family (each row's `served`, as `merge --json` gives it):
    each GPU model's variant, and the intersection of the hosts' ranges, head sizes, layouts and
    contexts, every host's bounds, and masked calls where every host serves them ('' when they share
    no range)."""
    entries = [row["families"][family]["served"] for row in rows]
    variants = ", ".join(sorted({f"{e['variant']} on {row['gpu']}"
                                 for row, e in zip(rows, entries, strict=True)}))
    low_q, low_k = max(e["min_query_tokens"] for e in entries), max(e["min_key_tokens"] for e in entries)
    dims = sorted(set.intersection(*(set(e["head_dims"]) for e in entries)))
    if not dims:
        return ""
    dims_text = f"head_dim {'/'.join(map(str, dims))}"
    below: dict[str, int] = {}  # a host's bound holds for the fleet: per side, the highest
    for e in entries:
        for bound in e["bounds"]:
            below[bound["side"]] = max(below.get(bound["side"], 0), bound["below"])
    kept = "".join(f"; calls with fewer than {n:,} {SIDE_WORDS[side]} stay on torch"
                   for side, n in sorted(below.items()))
    # masked calls are served only where every host serves them (as Served.text says it)
    masks = "; masked calls too" if all(e["masks"] for e in entries) else ""
    if any(e["max_query_tokens"] is None for e in entries):
        return (f"{variants}; every host: from {low_q:,} query / {low_k:,} key tokens, {dims_text}, no upper "
                f"bound verified (a report without long checks{masks}){kept}")
    high_q = min(e["max_query_tokens"] for e in entries)
    high_k = min(e["max_key_tokens"] or e["max_query_tokens"] for e in entries)
    layouts = [name for name in entries[0]["layouts"] if all(name in e["layouts"] for e in entries)]
    if low_q > high_q or low_k > high_k or not layouts:
        return ""
    tokens = (f"from {low_q:,} to {high_q:,} tokens" if (low_q, high_q) == (low_k, high_k) else
              f"from {low_q:,} to {high_q:,} query / {low_k:,} to {high_k:,} key tokens")
    # the contexts every host certified (a host that checked none keeps the variant's built-in rule)
    checked = [e["contexts"] for e in entries if e["contexts"] is not None]
    contexts = ("" if not checked else "; contexts: " + (", ".join(
        name for name in checked[0] if all(name in c for c in checked)) or "none")
                + ("" if len(checked) == len(entries) else " (a host without context checks: built-in rule)"))
    return (f"{variants}; every host: {tokens}, {dims_text} (layouts: {', '.join(layouts)}{contexts}{masks})"
            f"{kept}")


def _family_line(rows: list[dict], gates: dict[str, dict[str, int]], family: str,
                 passing: set[str]) -> tuple[str, bool]:
    """The family's line, and whether it is kept off."""
    why, verdicts = [], set()
    for row in rows:
        folder = Path(row["report"]).parent
        where = f"{row['host']} {row['gpu']} ({folder.name})"
        entry = row["families"].get(family)
        if row["undecidable"]:  # partial, predicted or --quick, in sage-qual's words
            why.append(f"{where}: {row['undecidable']}")
        elif entry is None or entry["verdict"] not in passing:
            why.append(f"{where}: {entry['verdict'] if entry else 'not run'}")
        else:
            verdicts.add(entry["verdict"])
        answered = gates.get(str(folder))
        if answered is not None and answered.get(family) != 0:
            code = answered.get(family)
            why.append(f"{where}: gate exit {code if code is not None else 'missing'}")
    # "safe, no speedup" anywhere: the family may be enabled, but serves nothing there
    verdict = "keep off" if why else "enable" if verdicts == {"enable"} else "safe, no speedup"
    if verdict == "enable":
        served = common_range(rows, family)
        why = [] if served else ["no range of tokens, head sizes and layouts every host verified"]
        verdict = f"enable ({served})" if served else "keep off"
    return f"{family}: {verdict}" + (f" ({'; '.join(why)})" if why else ""), bool(why)


@dataclass(frozen=True)
class FleetGate:
    """The step's answer: one line per family, and what the exit code is decided from."""
    lines: tuple[str, ...]
    kept_off: tuple[str, ...]
    unknown: tuple[str, ...]  # required families no report ran: bad input, a typo most likely

    def exit_code(self, required: list[str]) -> int:
        return 2 if self.unknown else 1 if any(f in self.kept_off for f in required) else 0


def decide(rows: list[dict], gates: dict[str, dict[str, int]], required: list[str],
           passing: set[str]) -> FleetGate:
    """One line per family that a report decided or a host's gate answered (a --quick report decides
    none). A required family no report ran is unknown, unless an undecidable report might have run it:
    then it is kept off, with that report's refusal."""
    families = list(dict.fromkeys([name for row in rows for name in row["families"]] +
                                  [name for answered in gates.values() for name in answered]))
    lines, off = [], []
    for family in families:
        line, kept_off = _family_line(rows, gates, family, passing)
        lines.append(line)
        if kept_off:
            off.append(family)
    unknown = [f for f in required if f not in families]
    refused = [row for row in rows if row["undecidable"]]
    if unknown and refused:  # perhaps run there, but decided nowhere: kept off, not a typo
        lines += [f"{family}: keep off (no report that decides ran it; {refused[0]['undecidable']})"
                  for family in unknown]
        off += unknown
        unknown = []
    return FleetGate(tuple(lines), tuple(off), tuple(unknown))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sage_qual.qualification.decide.fleet",
        description="The fleet step's gate (examples/fleet/merge_and_gate.sh): one line per family from "
                    "`sage-qual merge --json`'s rows and each report folder's gates.jsonl. Environment: "
                    "REQUIRED_FAMILIES (comma-separated), REQUIRE_SPEEDUP. Exit 0: every required family "
                    "on; 1: one kept off; 2: bad input.")
    parser.add_argument("fleet_json", help="the output of `sage-qual merge --json`")
    parser.add_argument("decisions", help="the file to write one line per family to")
    parser.add_argument("reports", nargs="*",
                        help="each host's report.json (its folder's gates.jsonl is read)")
    try:
        args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as stop:  # --help (0) or a usage error (2), said by argparse
        return int(stop.code or 0)
    try:
        required = [_known(f, "REQUIRED_FAMILIES")
                    for f in os.environ.get("REQUIRED_FAMILIES", "").split(",") if f.strip()]
        passing = passing_verdicts(os.environ.get("REQUIRE_SPEEDUP", ""))
        answer = decide(_rows(Path(args.fleet_json)), gate_answers(args.reports), required, passing)
        Path(args.decisions).write_text("\n".join(answer.lines) + "\n")
    except (BadInput, OSError) as error:
        print(f"merge_and_gate.sh: {error}", file=sys.stderr)
        return 2
    print("\n".join(answer.lines))
    if answer.unknown:
        print(f"REQUIRED_FAMILIES names families no report ran: {', '.join(answer.unknown)}", file=sys.stderr)
    return answer.exit_code(required)


def _rows(path: Path) -> list[dict]:
    """`merge --json`'s rows, or BadInput naming the file and the fix."""
    try:
        rows = json.loads(path.read_text())["rows"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise BadInput(f"{path}: not the output of `sage-qual merge --json` ({type(error).__name__}: "
                       f"{error}): run merge --json again") from None
    needed = ("families", "undecidable")
    if not isinstance(rows, list) or not all(isinstance(r, dict) and all(k in r for k in needed)
                                             for r in rows):
        raise BadInput(f"{path}: rows: not the rows of `sage-qual merge --json` (each needs "
                       f"{', '.join(needed)}): run merge --json again")
    return rows


if __name__ == "__main__":
    sys.exit(main())
