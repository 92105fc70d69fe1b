#!/bin/bash
# The main job (`sage-qual certify --emulate --quick`) timed as a whole process, alone or with BUSY
# CPU-bound shell loops beside it (started 5 s before). Run from the checkout, after the README's
# install: docs/benchmarks/main_job_busy.sh LABEL BUSY. "before" rows ran the same code with
# OMP_NUM_THREADS=2 (torch's own default on 2 cores, what the main job used before it sized its threads).
cd "$(dirname "$0")/../.."
label=$1; busy=$2
pids=()
for i in $(seq 1 $busy); do (while :; do :; done) & pids+=($!); done
sleep $(( busy > 0 ? 5 : 1 ))
rm -rf /tmp/pred-$label; start=$(date +%s.%N)
.venv/bin/sage-qual certify --emulate --quick --out /tmp/pred-$label > /tmp/pred-$label.log 2>&1
rc=$?
end=$(date +%s.%N)
for p in "${pids[@]}"; do kill $p; done
echo "$label busy=$busy rc=$rc $(echo "$end - $start" | bc) s load=$(cut -d' ' -f1-3 /proc/loadavg)"
