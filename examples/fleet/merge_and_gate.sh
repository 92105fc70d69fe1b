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
# reports, a report merge refuses, a gates.jsonl line that is not a gate answer or answers a family
# twice, an unknown REQUIRED_FAMILIES name or REQUIRE_SPEEDUP value), each named on stderr with its
# file and line.
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
# gate (when it ran) said enable (sage_qual.qualification.decide.fleet.py).
"$python" -m sage_qual.qualification.decide.fleet "$out/fleet.json" "$out/fleet-gates.txt" "${found[@]}"
