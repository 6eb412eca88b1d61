"""Print a job's final metrics from the last `trainpod-metrics: {...}` line of a log on stdin.

Used by the demos (demo.sh, demo-slurm.sh); exits 1 when no metrics line is there.
"""

import json
import sys

lines = [line.split("trainpod-metrics: ", 1)[1] for line in sys.stdin if "trainpod-metrics: " in line]
if not lines:
    print("no trainpod-metrics line in the log", file=sys.stderr)
    sys.exit(1)
m = json.loads(lines[-1])
same = len(set(m["rank_checksums"])) == 1
print(f"final metrics ({sys.argv[1] if len(sys.argv) > 1 else 'rank 0'}):")
print(f"  example           {m['example']} ({m['precision']})")
print(f"  world size        {m['world_size']} ({m['nnodes']} nodes, {m['backend']})")
print(f"  dataset           {m['dataset']}, {m['epochs']} epochs, {m['steps']} steps")
print(f"  loss              {m['loss_curve'][0][1]:.4f} -> {m['final_loss']:.4f}")
print(f"  test accuracy     {m['test_accuracy']:.3f}")
print(f"  samples/s         {m['samples_per_sec']:.1f}")
print(f"  weights checksum  {m['checksum'][:16]}... ({'identical on all' if same else 'DIFFERENT across'} {len(m['rank_checksums'])} ranks)")
sys.exit(0 if same else 1)
