#!/usr/bin/env bash
# Run the 2-node OpenPAI job of compose/pai-2node on this machine (CIFAR-10 DDP, or the example
# TRAINPOD_EXAMPLE names) and print its final metrics. Exits with the job's own result: non-zero
# if either node failed.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
compose=(docker compose -f "$here/pai-2node/compose.yaml")

cleanup() { "${compose[@]}" down -v --remove-orphans -t 5 >/dev/null 2>&1 || true; }
trap cleanup EXIT
cleanup

"${compose[@]}" up -d --no-build
"${compose[@]}" logs -f --no-color &
logs_pid=$!

# `compose up --abort-on-container-exit` races (the first node to finish stops the other);
# waiting on each container gives every node's real exit code.
status=0
for service in node0 node1; do
    code=$(docker wait "$("${compose[@]}" ps -a -q "$service")")
    echo "demo: $service exited with $code"
    [ "$code" = 0 ] || status=1
done
wait "$logs_pid" 2>/dev/null || true

log0=$("${compose[@]}" logs --no-color --no-log-prefix node0)
if grep -q 'trainpod-metrics: ' <<<"$log0"; then
    echo
    python3 "$here/print-metrics.py" "node0, rank 0" <<<"$log0" || status=1
fi
exit "$status"
