"""Where launch time goes: `trainpod run` against bare torchrun, phase by phase, on this host (issue 15).

A trivial 2-process gloo job (bench/launch_job.py: import torch, init_process_group, barrier,
destroy) runs under `trainpod run --nproc-per-node 2 --hang-timeout 0 -- python JOB`, the same with `--warm-start on`
(the ranks forked from a server that imported torch during the rendezvous, trainpod.agent.warm) and
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

`trainpod: ... node 0 of 1` (printed by the job before it becomes the agent) is shown as `preflight`.

    python3 bench/launch.py [--rounds N]

measure_compose() does the same for a 2-node job in bench/compose.yaml's two containers (`make
bench` runs it): `trainpod run --nnodes 2 --node-rank R --master-addr node0 ...` on both against
`torchrun --nnodes 2 --node-rank R --master-addr node0 ...`, as a user writes it for two hosts.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import results_page

JOB = Path(__file__).resolve().parent / "launch_job.py"
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


def host_sides(job: Path) -> dict[str, list[str]]:
    run = [sys.executable, "-m", "trainpod", "run", "--nproc-per-node", "2", "--hang-timeout", "0"]
    return {
        "trainpod run": [*run, "--", sys.executable, str(job)],
        # the ranks forked from a server that imports torch during the rendezvous (trainpod.agent.warm)
        "--warm-start on": [*run, "--warm-start", "on", "--", sys.executable, str(job)],
        "bare torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(job)],
    }


def table(runs: dict[str, list[dict[str, float]]], phases: tuple[str, ...], title: str) -> str:
    """One row per phase, a column per side, then each side's difference from bare torchrun (the last side)."""
    sides = list(runs)
    width = {side: max(16, len(side) + 3) for side in sides}  # a side's name is wider than its figures
    extra = [f"extra, {side.rpartition(' ')[2]}" for side in sides[:-1]]  # "extra, on": that side's minus bare torchrun's
    lines = [title, f"  {'phase':<11}" + "".join(f"{side:>{width[side]}}" for side in sides)
             + "".join(f"{name:>12}" for name in extra)]
    for phase in phases:
        values = {side: [run[phase] for run in runs[side] if phase in run] for side in sides}
        med = {side: statistics.median(v) if v else None for side, v in values.items()}
        bare = med[sides[-1]]
        cells = [f"{v:>{width[side]}.2f}" if v is not None else f"{'-':>{width[side]}}" for side, v in med.items()]
        cells += [f"{med[side] - bare:>+12.2f}" if med[side] is not None and bare is not None else f"{'':>12}" for side in sides[:-1]]
        lines.append(f"  {phase:<11}{''.join(cells)}")
    return "\n".join(lines)


def compose_once(exec_in: Callable[[str, str], subprocess.Popen], finish: Callable[[subprocess.Popen, str], str],
                 side: str, port: int) -> dict[str, float]:
    """One 2-node launch in the compose nodes of bench/compose.yaml (this file at /bench): both nodes'
    commands started together; seconds from node0's start to rank 0's interpreter and to its ready group."""
    job = "/bench/launch_job.py"
    if side == "trainpod run":
        command = (f"trainpod run --nnodes 2 --node-rank {{rank}} --master-addr node0 --master-port {port} --nproc-per-node 2 "
                   f"--hang-timeout 0 -- python3 {job}")
    else:  # as a user writes it for two hosts: node 0 hosts the store
        command = f"torchrun --nnodes 2 --node-rank {{rank}} --master-addr node0 --master-port {port} --nproc-per-node 2 {job}"
    nodes = [exec_in(f"node{rank}", f"date +%s.%N; exec {command.format(rank=rank)}") for rank in (0, 1)]
    outputs = [finish(node, f"{side} node{rank}") for rank, node in enumerate(nodes)]
    started = float(outputs[0].splitlines()[0])
    match = RANK.search("\n".join(outputs))
    if not match:
        sys.exit(f"bench-launch: no rank 0 line from {side}:\n{outputs[0][-2000:]}\n{outputs[1][-2000:]}")
    return {"rank up": float(match.group(1)) - started, "ready": float(match.group(2)) - started}


def measure_compose(exec_in, finish, rounds: int = 3) -> str:
    """The 2-node launch (bench/run.py calls it with its compose nodes up)."""
    runs: dict[str, list[dict[str, float]]] = {"trainpod run": [], "bare torchrun": []}
    for round_ in range(rounds):
        for offset, side in enumerate(runs):  # alternating
            runs[side].append(compose_once(exec_in, finish, side, 29800 + 2 * round_ + offset))
    return table(runs, ("rank up", "ready"), "launch of a 2-node job (2 compose containers x 2 processes, gloo; seconds from "
                 f"node0's command to rank 0, median of {rounds} alternating runs)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINPOD_", "MASTER_", "PET_", "PAI_", "SLURM_"))}
    # the caller's PYTHONPATH stays after trainpod's (on a GPU host, supervisor may be there)
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [ENTRYPOINT, os.environ.get("PYTHONPATH")])), LOGLEVEL="INFO",
               OMP_NUM_THREADS="1")
    # trainpod's bytecode, as an installed package has it (pip and the image compile it; torch's is): a
    # source checkout under PYTHONDONTWRITEBYTECODE would compile every module in every process.
    subprocess.run([sys.executable, "-m", "compileall", "-q", os.path.join(ENTRYPOINT, "trainpod")], check=True,
                   stdout=subprocess.DEVNULL)
    sides = host_sides(JOB)
    runs: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
    for _ in range(args.rounds):
        for side, argv in sides.items():  # alternating: a drifting load hits both alike
            runs[side].append(run_once(argv, env))
    text = table(runs, PHASES, f"launch phases (this host, 2 processes, gloo; seconds from the launch, median of {args.rounds} "
                               "alternating runs)")
    print(text)
    results_page.record("launch", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
