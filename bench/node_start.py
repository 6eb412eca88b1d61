"""What a node's start costs with its fork server as a copy of the job's process (trainpod.agent.zygote), against the
fork server as a new interpreter (multiprocessing's own, as where no copy can be made), side by side.

    python3 bench/node_start.py [--runs 5] [--samples 256]

Each run is one short warm job on this host: `trainpod run --nproc-per-node 2 --example cifar10-ddp` under
supervisord, 1 epoch of --samples synthetic samples at a batch of 8. The two kinds alternate; the fork server is a
new interpreter where the copy is killed before it serves (the failpoint server-copy@0, TRAINPOD_FAILPOINTS). For
each: the machine's CPU seconds from the launch to the job's end (/proc/stat, so run it on an otherwise idle
machine), the seconds from the launch to the first step (the metrics' first_step_unix), and the most memory the
node's processes held (the sum of their PSS, sampled every 0.5 s: a page shared by the agent, the server and the ranks
counted once). Medians of --runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "entrypoint"))

import results_page  # noqa: E402

from trainpod.contract import FAILPOINTS_VAR  # noqa: E402

ENTRYPOINT = str(Path(__file__).resolve().parents[1] / "entrypoint")
KINDS = {"a copy of the job's process": "", "a new interpreter": "server-copy@0"}


def busy_ticks() -> int:
    """The machine's non-idle CPU time so far, in clock ticks (/proc/stat's first line)."""
    with open("/proc/stat") as stat:
        fields = [int(value) for value in stat.readline().split()[1:]]
    return sum(fields) - fields[3] - fields[4]  # all but idle and iowait


def node_memory(job: psutil.Process) -> float:
    """The node's processes' memory (the sum of their PSS, MiB: each shared page counted once in all), or 0.0."""
    total = 0.0
    with contextlib.suppress(psutil.Error):
        for process in [job, *job.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                total += process.memory_full_info().pss / 2**20
    return total


def one_run(failpoints: str, samples: int) -> tuple[float, float, float]:
    """(CPU seconds of the machine, seconds to the first step, the node's most memory in MiB) of one job."""
    with tempfile.TemporaryDirectory() as scratch:
        env = {**os.environ, "PYTHONPATH": ENTRYPOINT, FAILPOINTS_VAR: failpoints, "TRAINPOD_OUTPUT_DIR": scratch}
        command = [sys.executable, "-m", "trainpod", "run", "--nproc-per-node", "2", "--example", "cifar10-ddp", "--",
                   "--epochs", "1", "--synthetic-samples", str(samples), "--batch-size", "8"]
        ticks, start = busy_ticks(), time.time()
        with subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              cwd=scratch) as job:
            memory = 0.0
            while job.poll() is None:
                memory = max(memory, node_memory(psutil.Process(job.pid)))
                time.sleep(0.5)
            _, stderr = job.communicate(timeout=600)
        cpu = (busy_ticks() - ticks) / os.sysconf("SC_CLK_TCK")
        if job.returncode != 0:
            raise SystemExit(f"node_start: the job exited {job.returncode}: {stderr[-2000:]}")
        first_step = json.loads(Path(scratch, "metrics.json").read_text())["first_step_unix"]
    return cpu, first_step - start, memory


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--samples", type=int, default=256)
    args = parser.parse_args()
    figures: dict[str, list[tuple[float, float, float]]] = {kind: [] for kind in KINDS}
    for _ in range(args.runs):
        for kind, failpoints in KINDS.items():
            figures[kind].append(one_run(failpoints, args.samples))
    medians = {kind: [statistics.median(run[i] for run in runs) for i in range(3)] for kind, runs in figures.items()}
    lines = [f"fork server as {kind}: {cpu:.2f} CPU s for the job, {first:.2f} s to the first step, the node's "
             f"processes at most {pss:.0f} MiB (PSS) (medians of {args.runs})" for kind, (cpu, first, pss) in medians.items()]
    (copy_cpu, copy_first, copy_pss), (new_cpu, new_first, new_pss) = medians.values()
    lines.append(f"the copy against a new interpreter: {copy_cpu / new_cpu:.2f}x the CPU ({new_cpu - copy_cpu:+.2f} s saved "
                 f"per node start), {copy_first / new_first:.2f}x the time to the first step, {copy_pss / new_pss:.2f}x "
                 f"the node's memory")
    text = "\n".join(lines)
    print(text)
    results_page.record("node-start", text, title="A node's start: the fork server as a copy of the job's process",
                        about="Written by `bench/node_start.py`: one short warm job (cifar10-ddp, 2 ranks, one node) with "
                              "its fork server as a copy of the job's process and as a new interpreter, alternating. See "
                              "[Warm starts](recovery.md#warm-starts-a-restart-without-the-imports).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
