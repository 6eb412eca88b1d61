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

metrics=$("${compose[@]}" logs --no-color --no-log-prefix node0 | sed -n 's/.*trainpod-metrics: //p' | tail -n 1)
if [ -n "$metrics" ]; then
    echo
    echo "final metrics (node0, rank 0):"
    python3 - "$metrics" <<'PY'
import json, sys
m = json.loads(sys.argv[1])
same = len(set(m["rank_checksums"])) == 1
print(f"  example           {m['example']} ({m['precision']})")
print(f"  world size        {m['world_size']} ({m['nnodes']} nodes, {m['backend']})")
print(f"  dataset           {m['dataset']}, {m['epochs']} epochs, {m['steps']} steps")
print(f"  loss              {m['loss_curve'][0][1]:.4f} -> {m['final_loss']:.4f}")
print(f"  test accuracy     {m['test_accuracy']:.3f}")
print(f"  samples/s         {m['samples_per_sec']:.1f}")
print(f"  weights checksum  {m['checksum'][:16]}... ({'identical on all' if same else 'DIFFERENT across'} {len(m['rank_checksums'])} ranks)")
PY
fi
exit "$status"
