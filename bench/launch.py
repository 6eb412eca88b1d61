"""Where launch time goes: `trainpod run` against bare torchrun, phase by phase, on this host (issue 15).

A trivial 2-process gloo job (import torch, init_process_group, barrier, destroy) runs under
`trainpod run --nproc-per-node 2 --hang-timeout 0 -- python JOB`, the same with `--warm-start on`
(the ranks forked from a server that imported torch during the rendezvous, trainpod.warm) and
under `torchrun --standalone --nproc-per-node 2 JOB`, alternating, both with torch's INFO logs on.
Each line is timestamped as it arrives; the ranks print their own clock. Phases, in seconds from
the launch:

    agent      torch's launcher logs "Starting elastic_operator" (its agent imported torch, parsed args);
               for trainpod this includes the outer CLI, supervisord, the job and its preflight
    workers    the agent starts the worker group (after the rendezvous)
    rank up    rank 0's interpreter is running (its first line of Python)
    ready      rank 0 passed init_process_group and a barrier: the job's first step could start
    finished   the agent logs that the worker group finished
    exit       the launcher's process has exited

`trainpod: ... node 0 of 1` (printed by the job before it execs the agent) is shown as `preflight`.

    python3 bench/launch.py [--rounds N]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

JOB = """
import time
start = time.time()
import torch.distributed as dist
dist.init_process_group("gloo")
dist.barrier()
if dist.get_rank() == 0:
    print(f"bench-launch: rank-up {start:.6f} ready {time.time():.6f}", flush=True)
dist.destroy_process_group()
"""
ENTRYPOINT = str(Path(__file__).resolve().parents[1] / "entrypoint")
MARKS = {  # phase -> what in a line marks it (torch's launcher and agent log at INFO)
    "preflight": re.compile(r"trainpod: \w+: node 0 of 1"),
    "agent": re.compile(r"Starting elastic_operator"),
    "workers": re.compile(r"\[default\] Starting worker group"),
    "finished": re.compile(r"worker group successfully finished"),
}
RANK = re.compile(r"bench-launch: rank-up ([0-9.]+) ready ([0-9.]+)")
PHASES = ("preflight", "agent", "workers", "rank up", "ready", "finished", "exit")


def run_once(argv: list[str], env: dict[str, str]) -> dict[str, float]:
    started = time.time()
    process = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: dict[str, float] = {}
    lines: list[str] = []

    def read() -> None:
        for line in process.stdout:
            now = time.time() - started
            lines.append(line)
            for phase, pattern in MARKS.items():
                if phase not in seen and pattern.search(line):
                    seen[phase] = now
            match = RANK.search(line)
            if match:
                seen["rank up"] = float(match.group(1)) - started
                seen["ready"] = float(match.group(2)) - started

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    code = process.wait(timeout=300)
    seen["exit"] = time.time() - started
    reader.join(timeout=5)
    if code != 0 or "ready" not in seen:
        sys.exit(f"bench-launch: {' '.join(argv)} exited {code}:\n{''.join(lines)[-3000:]}")
    return seen


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="trainpod-bench-launch-") as scratch:
        job = Path(scratch) / "job.py"
        job.write_text(JOB)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINPOD_", "MASTER_", "PET_", "PAI_", "SLURM_"))}
        env.update(PYTHONPATH=ENTRYPOINT, LOGLEVEL="INFO", OMP_NUM_THREADS="1")
        sides = {
            "trainpod run": [sys.executable, "-m", "trainpod", "run", "--nproc-per-node", "2", "--hang-timeout", "0",
                             "--", sys.executable, str(job)],
            # the ranks forked from a server that imports torch during the rendezvous (trainpod.warm)
            "--warm-start on": [sys.executable, "-m", "trainpod", "run", "--nproc-per-node", "2", "--hang-timeout", "0",
                                "--warm-start", "on", "--", sys.executable, str(job)],
            "bare torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(job)],
        }
        runs: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
        for _ in range(args.rounds):
            for side, argv in sides.items():  # alternating: a drifting load hits both alike
                runs[side].append(run_once(argv, env))
    print(f"launch phases (this host, 2 processes, gloo; seconds from the launch, median of {args.rounds} alternating runs)")
    print(f"  {'phase':<11}" + "".join(f"{side:>16}" for side in sides) + "".join(f"{'extra':>8}" for _ in list(sides)[1:]))
    for phase in PHASES:
        values = {side: [run[phase] for run in runs[side] if phase in run] for side in sides}
        med = {side: statistics.median(v) if v else None for side, v in values.items()}
        bare = med["bare torchrun"]
        cells = [f"{v:>16.2f}" if v is not None else f"{'-':>16}" for v in med.values()]
        cells += [f"{med[side] - bare:>+8.2f}" if med[side] is not None and bare is not None else f"{'':>8}"
                  for side in sides if side != "bare torchrun"]
        print(f"  {phase:<11}{''.join(cells)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
