#!/usr/bin/env bash
# One GPU host of the fleet: certify every GPU here, then ask the gate for every family on this
# machine (it re-derives the budgets and checks the report against this GPU, driver and software).
# Usage: certify-one.sh OUT_DIR   (OUT_DIR gets report.json, profile.json, the logs and gates.jsonl)
# PYTHON: the interpreter of the venv holding sage-qual, torch and SageAttention (default: python).
# CERTIFY_ARGS: more certify arguments, split on spaces (e.g. "--timeout 300 --devices 0,1").
set -uo pipefail
out=${1:?usage: certify-one.sh OUT_DIR}
python=${PYTHON:-python}
read -r -a certify_args <<< "${CERTIFY_ARGS:-}"
families=("FLUX.1" "FLUX.2" "Z-Image" "Qwen-Image" "Krea-2" "SDXL" "LTX-2" "Wan 2.2")

"$python" -m sage_qual env
# --force: this folder is the recipe's own, and a rerun replaces its report (certify refuses that
# otherwise); a refusal (exit 2) stops here, so no gate reads an older report.
"$python" -m sage_qual certify --force --out "$out" "${certify_args[@]}"
certified=$?
if [ "$certified" -eq 2 ] || [ ! -f "$out/report.json" ]; then
    echo "certify wrote no report (exit $certified)" >&2
    exit 2
fi
: > "$out/gates.jsonl"
for family in "${families[@]}"; do
    # exit 0 enable, 1 keep off, 2 cannot decide: each answer is one JSON line; the merge step
    # reads a missing line as "not decided here", which keeps the family off.
    "$python" -m sage_qual gate --family "$family" --report "$out/report.json" --json >> "$out/gates.jsonl"
done
exit "$certified"
