#!/usr/bin/env bash
# CI: the Slurm fleet recipe (examples/fleet/certify-model.sbatch) on a real single-node Slurm
# (Debian's slurm-wlm with munge, issue 27), on the CPU: SAGE_QUAL_TEST_WORKER gives certify and
# gate a fake H200 (sage_qual/qualification/run/fault_hooks.py). One node holds the three
# partitions of the recipe's README; the jobs and the dependent merge step are submitted as the
# README says, and what they write is checked. Slurm is started here and stopped on exit.
# Usage: .ci/slurm-fleet.sh PYTHON   (the venv interpreter with sage-qual installed)
set -euo pipefail
cd "$(dirname "$0")/.."
python=${1:?usage: .ci/slurm-fleet.sh PYTHON}
python="$(cd "$(dirname "$python")" && pwd)/$(basename "$python")"  # absolute, the venv's own link kept
partitions=(h200 a100 l40s)

if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q slurm-wlm munge >/dev/null 2>&1 \
        || { apt-get update -q >/dev/null && apt-get install -y -q slurm-wlm munge >/dev/null; }
fi

run=$(mktemp -d /tmp/sage-qual-slurm.XXXXXX)
failed=1  # until the checks below pass
host=$(hostname -s)
mkdir -p "$run"/{state,spool,munge,log}
cleanup() {
    scancel --full --quiet --user root 2>/dev/null || true
    for pid in "$run"/*.pid; do [ -f "$pid" ] && kill "$(cat "$pid")" 2>/dev/null || true; done
    sleep 1
    if [ "$failed" -eq 0 ]; then rm -rf "$run"; fi  # kept on failure: its logs say why
}
trap cleanup EXIT

# munge: its own key and socket in $run, so nothing of the machine's setup is touched
dd if=/dev/urandom of="$run/munge/munge.key" bs=1024 count=1 status=none
chmod 400 "$run/munge/munge.key"
socket="$run/munge/munge.socket"
munged --force --key-file="$run/munge/munge.key" --socket="$socket" \
    --pid-file="$run/munge.pid" --log-file="$run/log/munged.log" --seed-file="$run/munge/seed"

cpus=$(nproc)
memory=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 / 2 ))
# Two ports the kernel has free now, not fixed ones: a second CI run on the same host would find
# fixed ports taken and its slurmctld would not start.
read -r ctld_port slurmd_port < <("$python" -c 'import socket
sockets = [socket.socket() for _ in range(2)]
for s in sockets: s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in sockets))')
cat > "$run/slurm.conf" <<CONF
ClusterName=sage-qual-ci
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$socket
CredType=cred/munge
StateSaveLocation=$run/state
SlurmdSpoolDir=$run/spool
SlurmctldPidFile=$run/slurmctld.pid
SlurmdPidFile=$run/slurmd.pid
SlurmctldLogFile=$run/log/slurmctld.log
SlurmdLogFile=$run/log/slurmd.log
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
GresTypes=gpu
NodeName=$host CPUs=$cpus RealMemory=$memory Gres=gpu:3 State=UNKNOWN
$(for p in "${partitions[@]}"; do echo "PartitionName=$p Nodes=$host MaxTime=INFINITE State=UP"; done)
CONF
# Three fake GPUs: Slurm counts a GPU only with a device file, so three character devices that are
# /dev/null (1:3) stand in; Slurm gives each job one as CUDA_VISIBLE_DEVICES, and the hook's three
# fake H200s below answer to those indices.
mkdir -p "$run/dev"
for i in 0 1 2; do mknod "$run/dev/nvidia$i" c 1 3; done
printf 'AutoDetect=off\nName=gpu File=%s/dev/nvidia[0-2]\n' "$run" > "$run/gres.conf"
export SLURM_CONF="$run/slurm.conf"
slurmctld -i
slurmd
for _ in $(seq 60); do
    sinfo --noheader --states=idle --format=%P 2>/dev/null | grep -q . && break
    sleep 1
done
sinfo

# The recipe, as examples/fleet/certify-model.sbatch's header submits it. The node has $cpus CPUs,
# fewer than the job's --cpus-per-task=8, so the command line lowers it to all of them (it
# overrides #SBATCH): the jobs run one after another, 2 min each on CI's 2 cores, where two at a
# time took 6.3 min (measured here on the CPU, 2026-12-02).
fake='{"name": "NVIDIA H200", "capability": [9, 0]}'
export PYTHON="$python" SAGE_QUAL_TEST_WORKER="{\"gpus\": [$fake, $fake, $fake]}"
rm -rf fleet
mkdir -p fleet/logs
ids=$(for p in "${partitions[@]}"; do
          sbatch --parsable --cpus-per-task="$cpus" --partition="$p" examples/fleet/certify-model.sbatch
      done | paste -sd:)
merge=$(sbatch --parsable --cpus-per-task=1 --partition=h200 --dependency=afterany:"$ids" \
        --export=ALL,REQUIRED_FAMILIES="Wan 2.2" --output=fleet/logs/merge-%j.out \
        --wrap "examples/fleet/merge_and_gate.sh fleet/out fleet/reports fleet/baseline")
echo "submitted certify jobs $ids, merge job $merge"
for _ in $(seq 1800); do
    [ -z "$(squeue --noheader --jobs="${ids//:/,},$merge")" ] && break
    sleep 1
done

failed=0
check() { if ! eval "$1"; then echo "slurm fleet: FAILED: $2" >&2; failed=1; fi; }
for p in "${partitions[@]}"; do
    check "[ -f fleet/reports/$p/report.json ]" "no report of partition $p"
    check "[ \"\$(wc -l < fleet/reports/$p/gates.jsonl)\" = 8 ]" "fleet/reports/$p/gates.jsonl is not 8 lines"
    check "'$python' -c 'import json, sys; [json.loads(line) for line in open(sys.argv[1])]' \
        fleet/reports/$p/gates.jsonl" "fleet/reports/$p/gates.jsonl is not one JSON object per line"
done
check "[ \$(ls fleet/logs/certify-sage-qual-certify-*.out | wc -l) -eq 3 ]" "not three job logs in fleet/logs"
check "[ \"\$(wc -l < fleet/out/fleet-gates.txt)\" = 8 ]" \
    "the merge step wrote no fleet-gates.txt of the 8 families"
check "grep -q '^Wan 2.2: ' fleet/out/fleet-gates.txt" "fleet-gates.txt has no line for Wan 2.2"
# finished jobs stay in scontrol for MinJobAge (300 s): long enough to read the merge step's exit
check "scontrol show job $merge | grep -q 'ExitCode=0:0'" "the merge job did not exit 0"
for log in fleet/logs/*.out; do echo "== $log"; tail -n 12 "$log"; done
[ "$failed" -eq 0 ] || { tail -n 30 "$run"/log/slurm*.log >&2; exit 1; }
echo "slurm fleet: 3 partitions certified, merged and gated"
