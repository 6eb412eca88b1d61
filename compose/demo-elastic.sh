#!/usr/bin/env bash
# make demo-elastic: the elastic job of compose/elastic (3 etcd members, 3 trainer nodes with
# `trainpod run --nnodes 2:4 --rdzv-backend etcd-v3`). Once rank 0 is a third of the way through,
# the node holding rank 0 is killed (docker kill: a lost node, no signal to trap); the other two
# meet again without it and finish from the last checkpoint. Prints the membership timeline (world
# size by step, from rank 0's lines), the final metrics and the run's report
# (build/demo-elastic/output/report.html). Exits non-zero if the job failed.
# Settings (environment): TRAINPOD_EXAMPLE and TRAINPOD_EXAMPLE_ARGS (below), TRAINPOD_IMAGE,
# TRAINPOD_SUBNET_PREFIX, TRAINPOD_RDZV_BACKEND (etcd-v3; `etcd` needs TRAINPOD_ETCD_ENABLE_V2=true),
# KEEP=1 leaves the cluster up.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
compose=(docker compose -f "$here/elastic/compose.yaml")

# The example, and its flags: the elastic example (its ledger proves every sample trained once across
# the membership change), small: about a minute of training on a 2-core machine.
export TRAINPOD_EXAMPLE=${TRAINPOD_EXAMPLE:-imagenet-elastic}
export TRAINPOD_EXAMPLE_ARGS=${TRAINPOD_EXAMPLE_ARGS:---image-size 16 --synthetic-samples 960 --synthetic-classes 4 --batch-size 16 --epochs 2 --workers 0 --log-every 4 --checkpoint-every 4}
export TRAINPOD_RDZV_ID=${TRAINPOD_RDZV_ID:-trainpod-elastic}
trainers=(trainer0 trainer1 trainer2)

logs=()
scratch=$(mktemp -d)
cleanup() {
    [ "${#logs[@]}" = 0 ] || kill "${logs[@]}" 2>/dev/null || true
    [ "${KEEP:-0}" = 1 ] || "${compose[@]}" down -v --remove-orphans -t 5 >/dev/null 2>&1 || true
    rm -rf "$scratch"
}
trap cleanup EXIT
"${compose[@]}" down -v --remove-orphans -t 5 >/dev/null 2>&1 || true

start=$SECONDS
# Only etcd's image is built here (one image for the three members); the trainers run trainpod:cpu.
"${compose[@]}" --progress quiet build etcd0
"${compose[@]}" --progress quiet up -d --no-build
echo "demo-elastic: etcd healthy and 3 trainers started in $((SECONDS - start)) s ($TRAINPOD_EXAMPLE $TRAINPOD_EXAMPLE_ARGS)"
declare -A container
for service in "${trainers[@]}"; do
    container[$service]=$("${compose[@]}" ps -a -q "$service")
    # docker logs, not compose logs: no escape codes, and every line already says its node and rank.
    docker logs -f "${container[$service]}" 2>&1 &
    logs+=($!)
done

# Rank 0's last step line, "STEP TOTAL", on whichever node holds it (the rendezvous decides).
rank0_progress() {
    docker logs "${container[$1]}" 2>&1 | sed -n 's/^\[node[^] ]* rank0\] epoch [0-9]*\/[0-9]* step \([0-9]*\)\/\([0-9]*\) .*/\1 \2/p' | tail -n 1
}
victim=""
deadline=$((SECONDS + 600))
while [ -z "$victim" ]; do
    for service in "${trainers[@]}"; do
        read -r step total < <(rank0_progress "$service"; echo) || true
        if [ -n "${step:-}" ] && [ $((step * 3)) -ge "$total" ]; then victim=$service; break; fi
    done
    for service in "${trainers[@]}"; do
        [ "$(docker inspect -f '{{.State.Running}}' "${container[$service]}")" = true ] \
            || { echo "demo-elastic: $service ended before the kill" >&2; exit 1; }
    done
    [ "$SECONDS" -lt "$deadline" ] || { echo "demo-elastic: rank 0 never got a third of the way in 600 s" >&2; exit 1; }
    [ -n "$victim" ] || sleep 1
done
killed_at=$(date +%s.%N)
docker kill "${container[$victim]}" >/dev/null
echo "demo-elastic: killed $victim (it held rank 0, at step $step of $total): the others go on without it"

status=0
survivors=()
for service in "${trainers[@]}"; do
    [ "$service" = "$victim" ] || survivors+=("$service")
done
for service in "${survivors[@]}"; do
    code=$(docker wait "${container[$service]}")
    echo "demo-elastic: $service exited with $code"
    [ "$code" = 0 ] || status=1
done
kill "${logs[@]}" 2>/dev/null || true
wait "${logs[@]}" 2>/dev/null || true
logs=()

echo
files=()
for service in "${trainers[@]}"; do
    docker logs -t "${container[$service]}" > "$scratch/$service.log" 2>&1
    files+=("$service=$scratch/$service.log")
done
python3 "$here/timeline.py" "${files[@]}" --event "$victim killed (docker kill)@$killed_at" || status=1

# Global rank 0 of the last world wrote metrics.json to the volume every node shares (docker cp
# reads stopped containers).
echo
if metrics=$(docker cp "${container[${survivors[0]}]}:/workspace/output/$TRAINPOD_RDZV_ID/metrics.json" - 2>/dev/null | tar -xO); then
    python3 "$here/print-metrics.py" "global rank 0 of the last world" <<<"$metrics" || status=1
else
    echo "demo-elastic: no metrics.json on the shared volume" >&2
    status=1
fi

# The run's report (trainpod report): the job's output directory (every node's records, metrics.json) copied out
# and drawn into one HTML file. It is said in one line either way, and never changes the demo's result.
output="$(cd "$here/.." && pwd)/build/demo-elastic/output"
rm -rf "$output" && mkdir -p "$(dirname "$output")"
if ! docker cp "${container[${survivors[0]}]}:/workspace/output/$TRAINPOD_RDZV_ID" "$output" >/dev/null 2>&1; then
    echo "demo-elastic: no report: the job's output directory could not be copied out of ${survivors[0]}" >&2
elif report=$("${PYTHON:-python3}" -m trainpod report "$output"); then
    echo "report: $report"
else
    echo "demo-elastic: no report: trainpod report failed on $output (its line above)" >&2
fi
exit "$status"
