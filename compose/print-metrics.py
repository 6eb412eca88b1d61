"""Print a job's final metrics from its metrics.json on stdin (the file global rank 0 writes).

Used by the demos (demo.sh, demo-slurm.sh); exits 1 when the input is no metrics file or the
ranks' final weights differ.
"""

import json
import sys

try:
    m = json.load(sys.stdin)
except ValueError:
    print("print-metrics: no metrics.json on stdin", file=sys.stderr)
    sys.exit(1)
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
