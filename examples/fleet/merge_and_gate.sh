#!/usr/bin/env bash
# The fleet step: merge every host's report into one table, compare each host with its report of
# the last release, and gate each family for the whole fleet.
# Usage: merge_and_gate.sh OUT_DIR REPORTS_DIR [BASELINE_DIR]
#   REPORTS_DIR/<host>/report.json (and gates.jsonl from certify-one.sh), one folder per runner or
#   array task; BASELINE_DIR/<host>/report.json the same hosts at the last release (optional).
# REQUIRED_FAMILIES: comma-separated families the fleet must enable (exit 1 when one is kept off).
# REQUIRE_SPEEDUP=1 (or true, yes, on): "safe, no speedup" counts as kept off (as
# `gate --require-speedup`); 0, false, no, off or unset: it passes.
# Exit codes: 0 every required family is on; 1 a required family is kept off; 2 bad input (no
# reports, a report merge refuses, a gates.jsonl line that is not a gate answer, an unknown
# REQUIRED_FAMILIES name or REQUIRE_SPEEDUP value), each named on stderr with its file and line.
# Writes OUT_DIR/fleet.md, fleet.json, compare-<host>.txt and fleet-gates.txt (an enabled family
# with each GPU model's variant and the range, head sizes and layouts every host verified).
set -uo pipefail
out=${1:?usage: merge_and_gate.sh OUT_DIR REPORTS_DIR [BASELINE_DIR]}
reports=${2:?usage: merge_and_gate.sh OUT_DIR REPORTS_DIR [BASELINE_DIR]}
baseline=${3:-}
python=${PYTHON:-python}
mkdir -p "$out"

shopt -s nullglob
found=("$reports"/*/report.json)
if [ ${#found[@]} -eq 0 ]; then
    echo "no report.json under $reports/*/" >&2
    exit 2
fi
"$python" -m sage_qual merge "${found[@]}" > "$out/fleet.md" || exit 2
"$python" -m sage_qual merge --json "${found[@]}" > "$out/fleet.json" || exit 2
cat "$out/fleet.md"

# A host whose verdicts or thresholds moved since the last release is reported, not failed: a new
# driver or build moves them as well as a regression does, and a person decides which it is.
for current in "${found[@]}"; do
    host=$(basename "$(dirname "$current")")
    previous="$baseline/$host/report.json"
    if [ -n "$baseline" ] && [ -f "$previous" ]; then
        "$python" -m sage_qual compare "$previous" "$current" > "$out/compare-$host.txt"
        case $? in
            0) echo "$host: same as the last release" ;;
            1) echo "$host: differs from the last release (see compare-$host.txt)" ;;
            *) echo "$host: cannot compare with the last release (see compare-$host.txt)" ;;
        esac
    else
        echo "$host: no report of the last release"
    fi
done

# A family is on for the fleet when every host's stored verdict passes it and every host's own
# gate (when it ran) said enable.
"$python" - "$out/fleet.json" "$out/fleet-gates.txt" "${found[@]}" <<'PY'
import json, os, sys
from pathlib import Path

fleet, decisions, reports = json.loads(Path(sys.argv[1]).read_text())["rows"], Path(sys.argv[2]), sys.argv[3:]


def bad_input(message):
    print(f"merge_and_gate.sh: {message}", file=sys.stderr)
    sys.exit(2)


strict = os.environ.get("REQUIRE_SPEEDUP", "").strip().lower()
if strict not in ("1", "true", "yes", "on", "0", "false", "no", "off", ""):
    bad_input(f"REQUIRE_SPEEDUP={strict!r}: give 1 (or true, yes, on) or 0 (or false, no, off)")
passing = {"enable"} if strict in ("1", "true", "yes", "on") else {"enable", "safe, no speedup"}
gates = {}  # (report folder, family) -> the gate's exit code on that host
seen = {}  # (report folder, family) -> the line that answered it
for report in reports:
    lines = Path(report).with_name("gates.jsonl")
    for number, line in enumerate(lines.read_text(errors="replace").splitlines() if lines.exists() else [], 1):
        if not line.strip():
            continue
        try:
            answer = json.loads(line)
        except ValueError as error:  # a gate killed mid-write leaves a torn line
            bad_input(f"{lines} line {number}: not JSON ({error}): a gate answer cut short? run the "
                      "host's gate again, or remove the line")
        code = answer.get("exit_code") if isinstance(answer, dict) else None
        if not isinstance(answer, dict) or not isinstance(answer.get("family"), str) or \
                isinstance(code, bool) or not isinstance(code, int):
            bad_input(f"{lines} line {number}: not a `sage-qual gate --json` answer (it needs a string "
                      "family and an integer exit_code): run the host's gate again, or remove the line")
        key = (str(Path(report).parent), answer["family"])
        if key in seen:  # two answers for one family: which holds would depend on line order
            bad_input(f"{lines} lines {seen[key]} and {number}: both answer {answer['family']}: run the "
                      "host's gates again into an empty gates.jsonl, or remove one line")
        seen[key] = number
        gates[key] = code
# the families a report decided, or a host's gate answered (a --quick report decides none)
families = list(dict.fromkeys([name for row in fleet for name in row["families"]] + [f for _, f in gates]))


def common_range(rows, family):
    """What every host serves of an enabled family (each entry's `served`, as `sage-qual merge --json`
    gives it): each GPU model's variant, and the intersection of the hosts' ranges, head sizes,
    layouts and contexts, and every host's bounds ('' when they share no range)."""
    entries = [row["families"][family]["served"] for row in rows]
    variants = ", ".join(sorted({f"{e['variant']} on {row['gpu']}" for row, e in zip(rows, entries)}))
    low_q, low_k = max(e["min_query_tokens"] for e in entries), max(e["min_key_tokens"] for e in entries)
    dims = sorted(set.intersection(*(set(e["head_dims"]) for e in entries)))
    if not dims:
        return ""
    dims_text = f"head_dim {'/'.join(map(str, dims))}"
    below = {}  # a host's bound holds for the fleet: per side, the highest
    for e in entries:
        for bound in e["bounds"]:
            below[bound["side"]] = max(below.get(bound["side"], 0), bound["below"])
    words = {"key": "keys", "query": "query tokens"}  # as sage_qual.serving.config.SIDE_WORDS
    kept = "".join(f"; calls with fewer than {n:,} {words[side]} stay on torch"
                   for side, n in sorted(below.items()))
    if any(e["max_query_tokens"] is None for e in entries):
        return (f"{variants}; every host: from {low_q:,} query / {low_k:,} key tokens, {dims_text}, no upper "
                f"bound verified (a report without long checks){kept}")
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
    return f"{variants}; every host: {tokens}, {dims_text} (layouts: {', '.join(layouts)}{contexts}){kept}"


out, off = [], []
for family in families:
    why, verdicts = [], set()
    for row in fleet:
        where = f"{row['host']} {row['gpu']} ({Path(row['report']).parent.name})"
        entry = row["families"].get(family)
        if row["undecidable"]:  # partial, predicted or --quick, in sage-qual's words
            why.append(f"{where}: {row['undecidable']}")
        elif entry is None or entry["verdict"] not in passing:
            why.append(f"{where}: {entry['verdict'] if entry else 'not run'}")
        else:
            verdicts.add(entry["verdict"])
        code = gates.get((str(Path(row["report"]).parent), family))
        if (Path(row["report"]).with_name("gates.jsonl")).exists() and code != 0:
            why.append(f"{where}: gate exit {code if code is not None else 'missing'}")
    # "safe, no speedup" anywhere: the family may be enabled, but serves nothing there
    verdict = "keep off" if why else "enable" if verdicts == {"enable"} else "safe, no speedup"
    if verdict == "enable":
        served = common_range(fleet, family)
        why = [] if served else ["no range of tokens, head sizes and layouts every host verified"]
        verdict = f"enable ({served})" if served else "keep off"
    out.append(f"{family}: {verdict}" + (f" ({'; '.join(why)})" if why else ""))
    if why:
        off.append(family)
required = [f.strip() for f in os.environ.get("REQUIRED_FAMILIES", "").split(",") if f.strip()]
unknown = [f for f in required if f not in families]
refused = [row for row in fleet if row["undecidable"]]
if unknown and refused:  # perhaps run there, but decided nowhere: kept off, not a typo
    out += [f"{family}: keep off (no report that decides ran it; {refused[0]['undecidable']})"
            for family in unknown]
    off += unknown
    unknown = []
decisions.write_text("\n".join(out) + "\n")
print("\n".join(out))
if unknown:
    print(f"REQUIRED_FAMILIES names families no report ran: {', '.join(unknown)}", file=sys.stderr)
    sys.exit(2)
sys.exit(1 if any(f in off for f in required) else 0)
PY
