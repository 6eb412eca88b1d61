#!/usr/bin/env bash
# make demo-slurm: start the SLURM cluster of compose/slurm (slurmctld, node1, node2; built on
# trainpod:cpu), submit from the controller, as the user trainpod, the sbatch script that
# `trainpod job slurm` renders for cifar10-ddp on 2 nodes x 2 processes, wait for the job and print
# its final metrics. Exits non-zero unless the job COMPLETED with identical weights on every rank.
# Settings (environment): TRAINPOD_EXAMPLE (cifar10-ddp), TRAINPOD_EPOCHS (2), KEEP=1 leaves the cluster up.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
compose=(docker compose -f "$here/slurm/compose.yaml")
example=${TRAINPOD_EXAMPLE:-cifar10-ddp}
epochs=${TRAINPOD_EPOCHS:-2}

cleanup() { [ "${KEEP:-0}" = 1 ] || "${compose[@]}" down -v --remove-orphans -t 5 >/dev/null 2>&1 || true; }
trap cleanup EXIT
"${compose[@]}" down -v --remove-orphans -t 5 >/dev/null 2>&1 || true

start=$SECONDS
"${compose[@]}" build
echo "demo-slurm: cluster image built in $((SECONDS - start)) s"
"${compose[@]}" up -d --wait
ctl() { "${compose[@]}" exec -T "$@"; }
for _ in $(seq 1 60); do
    idle=$(ctl slurmctld sinfo -h -t idle -o '%D' | head -n 1)
    [ "${idle:-0}" = 2 ] && break
    sleep 1
done
ctl slurmctld sinfo
echo "demo-slurm: cluster up in $((SECONDS - start)) s"

ctl -u trainpod slurmctld trainpod job slurm "$example" --nodes 2 --nproc-per-node 2 --cpus 2
submitted=$(ctl -u trainpod slurmctld trainpod job slurm "$example" --nodes 2 --nproc-per-node 2 --cpus 2 --submit \
    -- --epochs "$epochs" --output-dir /shared/output --checkpoint-dir /shared/output/checkpoints)
echo "$submitted"
job=$(sed -n 's/^Submitted batch job \([0-9]*\)$/\1/p' <<<"$submitted")
[ -n "$job" ] || { echo "demo-slurm: sbatch gave no job id" >&2; exit 1; }

state=""
while :; do
    state=$(ctl slurmctld scontrol show job "$job" -o | grep -o 'JobState=[A-Z_]*' | cut -d= -f2)
    case "$state" in
        PENDING|CONFIGURING|RUNNING|COMPLETING) sleep 2 ;;
        *) break ;;
    esac
done
log=$(ctl slurmctld cat "/shared/trainpod-$example-$job.out")
echo "$log"
echo "demo-slurm: job $job $state"
[ "$state" = COMPLETED ] || exit 1
echo
ctl slurmctld cat /shared/output/metrics.json | python3 "$here/print-metrics.py" "job $job, global rank 0"
