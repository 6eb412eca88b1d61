"""The straggler watch (run by bench/run.py): how soon a slow rank is named, and what measuring costs a step.

1. Time from a rank turning slow to its agent's line, `trainpod run` on this host with the default
   --straggler-window: a 2-node CIFAR-10 job (one process each), node 1's rank doing each step's own
   work twice as long from step 1 (TRAINPOD_FAILPOINTS=slow@1), timed from the first step. Goal: within
   60 s. Node 0 must name nobody.
2. The cost of trainpod.train.progress.measure() on a step, side by side in one run: a 2-rank DDP job
   (gloo, a small CNN on 32x32 images, batches of 64) under bare torchrun alternates blocks of 5 steps
   with the hooks and blocks without them (progress.step() after every step in both); each block's
   time against the mean of its two neighbours. Goal: within 1 %.

    python3 bench/stragglers.py [--rounds N]
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import statistics
import sys
import tempfile
from pathlib import Path

import results_page
from hangs import Run, environment, free_port, neighbour_ratios, paired_blocks

NAMED = re.compile(r"\] trainpod: straggler: rank 1 \(node 1\)")
FIRST_STEP = re.compile(r"cifar10-ddp: world 2, ")
# Long enough that the slow rank is named (about a minute) before the job ends; the run is stopped once it is.
JOB = ["--example", "cifar10-ddp", "--", "--epochs", "1", "--batch-size", "16", "--synthetic-samples", "200000",
       "--workers", "0"]


def detect_once() -> tuple[float, bool]:
    """(seconds from the job's first step to the line naming node 1's rank, whether node 0 named anybody)."""
    out = Path(tempfile.mkdtemp(prefix="trainpod-bench-straggler-"))
    port = str(free_port())
    runs = []
    for rank in (0, 1):
        command = [sys.executable, "-m", "trainpod", "run", "--nnodes", "2", "--node-rank", str(rank), "--nproc-per-node", "1",
                   "--master-addr", "127.0.0.1", "--master-port", port, "--max-restarts", "0", *JOB[:3],
                   "--output-dir", str(out / f"out{rank}"), *JOB[3:]]
        runs.append(Run(command, environment(**({"TRAINPOD_FAILPOINTS": "slow@1"} if rank else {})), out))
    try:
        started = runs[0].wait_for(FIRST_STEP, 300)
        named = runs[1].wait_for(NAMED, 300)
        if started is None or named is None:
            sys.exit(f"bench-stragglers: no straggler named:\n{''.join(line for _, line in runs[1].lines)[-3000:]}")
        wrong = any("trainpod: straggler:" in line for _, line in runs[0].lines)
        return named[0] - started[0], wrong
    finally:
        for run in runs:  # a SIGTERM stops a trainpod job, its agent and its ranks with it
            run.process.send_signal(signal.SIGTERM)
        for run in runs:
            run.finish(60)


PAIRS_WORKER = """
import sys, time, json, torch, torch.distributed as dist
from torch import nn
from trainpod.train import progress
blocks, block = int(sys.argv[1]), int(sys.argv[2])
torch.manual_seed(0)
dist.init_process_group("gloo")
model = nn.parallel.DistributedDataParallel(nn.Sequential(
    nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
    nn.MaxPool2d(2), nn.Flatten(), nn.Linear(64 * 8 * 8, 10)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(64, 3, 32, 32), torch.randint(0, 10, (64,))
times = {"on": [], "off": []}
n = 0
for b in range(blocks + 2):
    on = b % 2 == 0
    if on:
        progress.measure(model)
    else:
        for handle in progress._compute.handles:
            handle.remove()
        progress._compute.handles = []
    t = time.perf_counter()
    for _ in range(block):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        n += 1
        progress.step(n)
    if b >= 2:  # the first two blocks warm up
        times["on" if on else "off"].append(time.perf_counter() - t)
if dist.get_rank() == 0:
    print("bench-pairs: " + json.dumps(times), flush=True)
dist.destroy_process_group()
"""


def bench(rounds: int) -> dict:
    detection = []
    for _ in range(rounds):
        detection.append(detect_once())
        print(f"  named after {detection[-1][0]:.1f} s", file=sys.stderr, flush=True)
    return {"rounds": rounds, "detection": detection, "pairs": paired_blocks(worker=PAIRS_WORKER, bench="bench-stragglers")}


def report(result: dict) -> str:
    seconds = [s for s, _ in result["detection"]]
    wrong = sum(w for _, w in result["detection"])
    lines = [f"stragglers (this host, 2 nodes of the CIFAR-10 example, node 1's own work doubled from step 1, default "
             f"--straggler-window, {result['rounds']} runs; goal <= 60 s)",
             f"  from the first step to the line: median {statistics.median(seconds):.1f} s, max {max(seconds):.1f} s "
             f"({', '.join(f'{s:.1f}' for s in seconds)}); the other node named a rank in {wrong} of them"]
    pairs = result["pairs"]
    q1, median, q3 = statistics.quantiles(neighbour_ratios(pairs["on_s"], pairs["off_s"]), n=4)
    lines.append(f"measure()'s hooks, one 2-rank DDP job, {len(pairs['on_s'])} blocks of {pairs['block_steps']} steps each "
                 f"way, alternating: median block {statistics.median(pairs['on_s']) * 1e3:.1f} ms with them, "
                 f"{statistics.median(pairs['off_s']) * 1e3:.1f} ms without")
    lines.append(f"  samples/s with/without, each block against the mean of its two neighbours: median {median:.4f} "
                 f"(quartiles {q1:.4f}, {q3:.4f}; goal >= 0.99)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    result = bench(args.rounds)
    print(report(result))
    print("bench-stragglers: " + json.dumps(result), flush=True)
    results_page.record("stragglers", report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
