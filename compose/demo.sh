#!/usr/bin/env bash
# Run the 2-node OpenPAI job of compose/pai-2node on this machine (CIFAR-10 DDP, or the example
# TRAINPOD_EXAMPLE names), print its final metrics and draw its report (build/demo/output/report.html).
# Exits with the job's own result: non-zero if either node failed.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
compose=(docker compose -f "$here/pai-2node/compose.yaml")

cleanup() { "${compose[@]}" down -v --remove-orphans -t 5 >/dev/null 2>&1 || true; }
trap cleanup EXIT
cleanup

echo "==> the 2-node job (compose/pai-2node: 2 containers x 2 processes, gloo)"
"${compose[@]}" --progress quiet up -d --no-build
# docker logs, not compose logs: no escape codes in a log file, and every line already says
# which node and rank it comes from.
logs=()
for service in node0 node1; do
    docker logs -f "$("${compose[@]}" ps -a -q "$service")" 2>&1 &
    logs+=($!)
done

# `compose up --abort-on-container-exit` races (the first node to finish stops the other);
# waiting on each container gives every node's real exit code.
status=0
for service in node0 node1; do
    code=$(docker wait "$("${compose[@]}" ps -a -q "$service")")
    echo "demo: $service exited with $code"
    [ "$code" = 0 ] || status=1
done
wait "${logs[@]}" 2>/dev/null || true

# Global rank 0 wrote metrics.json to the volume both nodes share (docker cp reads stopped containers).
if metrics=$(docker cp "$("${compose[@]}" ps -a -q node0)":/workspace/output/metrics.json - 2>/dev/null | tar -xO); then
    echo
    python3 "$here/print-metrics.py" "global rank 0" <<<"$metrics" || status=1
else
    echo "demo: no metrics.json on the shared volume" >&2
    status=1
fi

# The run's report (trainpod report): the shared output directory (every node's records, metrics.json) copied out
# and drawn into one HTML file. It is said in one line either way, and never changes the demo's result.
output="$(cd "$here/.." && pwd)/build/demo/output"
rm -rf "$output" && mkdir -p "$(dirname "$output")"
if ! docker cp "$("${compose[@]}" ps -a -q node0)":/workspace/output "$output" >/dev/null 2>&1; then
    echo "demo: no report: the shared output directory could not be copied out of node0" >&2
elif report=$("${PYTHON:-python3}" -m trainpod report "$output"); then
    echo "report: $report"
else
    echo "demo: no report: trainpod report failed on $output (its line above)" >&2
fi
exit "$status"
