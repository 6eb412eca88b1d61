"""Print a job's final metrics from its metrics.json on stdin (the file global rank 0 writes).

Used by the demos (demo.sh, demo-slurm.sh, demo-elastic.sh); exits 1 when the input is no metrics
file, the ranks' final weights differ, or an elastic example's ledger is not exactly once.
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
agree = "identical on all" if same else "DIFFERENT across"
print(f"  weights checksum  {m['checksum'][:16]}... ({agree} {len(m['rank_checksums'])} ranks)")
exact = m.get("exactly_once", True)
if "exactly_once" in m:  # an elastic example: its ledger and the worlds it trained on
    worlds = " -> ".join(f"{world} from step {step}" for step, world, _ in m["membership"])
    print(f"  membership        {worlds}")
    print(f"  exactly once      {'yes' if exact else 'NO'}: epochs {m['ledger']['complete']} complete by the ledger"
          + "".join(f"; {problem}" for problem in m["ledger"]["problems"]))
sys.exit(0 if same and exact else 1)
