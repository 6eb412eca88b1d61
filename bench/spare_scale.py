"""A spare's takeover at several world sizes (issue 27's scale runs): bench/elastic.py's lost node with a spare waiting.

Two nodes on this host train cifar10-ddp at --nnodes 1:2 with N ranks each (world 2N); a third node of N ranks
starts beyond the maximum and waits as a spare; once the two train, every process of one node gets SIGKILL
(tests/fixtures/elastic_host.scale_down: rank 0's with etcd-v3, with c10d the node that does not host the
store). The time is from the kill to the first completed step at world 2N again: the survivor and the spare.
The same data (512 samples, batch 64 per rank) at every size, so a bigger world has fewer steps per epoch
and the epochs are many (the run outlasts the spare's start). What is asked of it: the time stays flat as the
world grows, not that it beats a figure measured at another size. On a host with fewer cores than ranks every
step, and every rank's start, is slower by the oversubscription: the job's steady step time is printed beside.

    python3 bench/spare_scale.py [--rounds N] [--nprocs 1,2,4,8] [--backends etcd-v3,c10d]
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
import tempfile
from pathlib import Path

import elastic
import results_page

from fixtures.elastic_host import EXAMPLE_ARGS, clean_env, scale_down, trainpod_argv

TIMEOUT_S = 600
SAMPLES = int(EXAMPLE_ARGS[EXAMPLE_ARGS.index("--synthetic-samples") + 1])
BATCH = int(EXAMPLE_ARGS[EXAMPLE_ARGS.index("--batch-size") + 1])
STEPS_AT_2N = 40  # steps of the whole run at world 2N: time for the spare to start and wait before the loss
STEP_LINE = re.compile(r"step (\d+)/\d+ .* ([\d.]+) samples/s")


def argv(backend: str, endpoint: str, workdir: Path, nproc: int) -> list[str]:
    """trainpod run's node of bench/elastic.py with `nproc` ranks, its epochs made STEPS_AT_2N steps at world 2N."""
    made = trainpod_argv(backend, endpoint, workdir)
    made[made.index("--nproc-per-node") + 1] = str(nproc)
    steps_per_epoch = math.ceil(math.ceil(SAMPLES / (2 * nproc)) / BATCH)
    return [*made, "--epochs", str(STEPS_AT_2N // steps_per_epoch)]  # the last --epochs wins


def steady_step(node, world: int) -> float | None:
    """The job's steady step at `world`: the global batch over rank 0's samples/s (each step line's), median."""
    steps = [BATCH * world / float(m.group(2)) for m in STEP_LINE.finditer(node.text()) if float(m.group(2)) > 0]
    return statistics.median(steps) if steps else None


def measure(nprocs: list[int], backends: list[str], rounds: int) -> dict:
    figures: dict = {}
    with tempfile.TemporaryDirectory(prefix="bench-spare-scale-") as tmp:
        for backend in backends:
            server, job_endpoint = elastic.rendezvous(backend, Path(tmp))
            with server:
                for nproc in nprocs:
                    runs: list[float] = []
                    steps: list[float] = []
                    for round_ in range(rounds):
                        endpoint, lose = job_endpoint()
                        workdir = Path(tmp, f"{backend}-{nproc}-{round_}")
                        command = argv(backend, endpoint, workdir, nproc)  # every node's, the same
                        try:
                            result = scale_down(lambda command=command: list(command), clean_env(), workdir, TIMEOUT_S,
                                                lose=lose, spare=True, steps=2 * STEPS_AT_2N)
                        except AssertionError as error:
                            print(f"bench-spare-scale: {backend} {2 * nproc} ranks: {str(error)[-3000:]}", file=sys.stderr)
                            result = {"survivor_code": None, "recovery_s": None}
                        ok = result["survivor_code"] == 0 and result["recovery_s"] is not None
                        if not ok and result.get("survivor") is not None:
                            print(f"bench-spare-scale: {backend} {2 * nproc} ranks: no takeover (exit {result['survivor_code']}):\n"
                                  + result["survivor"].text()[-3000:], file=sys.stderr)
                        runs.append(result["recovery_s"] if ok else float("nan"))
                        if ok and (step := steady_step(result["survivor"], 2 * nproc)) is not None:
                            steps.append(step)
                        print(f"  {backend}, {2 * nproc} ranks, round {round_ + 1}: "
                              + (f"{runs[-1]:.2f} s" if ok else "failed"), file=sys.stderr, flush=True)
                    figures.setdefault(backend, {})[2 * nproc] = {"takeover_s": statistics.median(runs), "runs": runs,
                                                                "step_s": statistics.median(steps) if steps else None}
    return figures


def report(figures: dict) -> str:
    lines = ["a spare's takeover: a lost node (SIGKILL of its every process) to the first step at the same world again, "
             "the survivor and a spare node that waited beyond --nnodes 1:2's maximum, N ranks a node, cifar10-ddp "
             "(median of the rounds; nan: the spare never trained)",
             f"  {'backend':10}{'ranks':>6}{'step':>9}{'takeover':>11}{'less a step':>13}  runs"]
    for backend, sizes in figures.items():
        for world, f in sizes.items():
            step = f["step_s"] or 0.0
            lines.append(f"  {backend:10}{world:>6}{step:>7.2f} s{f['takeover_s']:>9.2f} s{f['takeover_s'] - step:>11.2f} s  "
                         + ", ".join("nan" if math.isnan(r) else f"{r:.2f}" for r in f["runs"]))
    return "\n".join(lines)


def main(argv_: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--nprocs", default="1,2,4,8", help="the ranks of each node, comma-separated (the world is twice)")
    parser.add_argument("--backends", default="etcd-v3,c10d")
    args = parser.parse_args(argv_)
    figures = measure([int(n) for n in args.nprocs.split(",") if n], [b for b in args.backends.split(",") if b],
                      args.rounds)
    print(report(figures))
    print("bench-spare-scale: " + json.dumps(figures), flush=True)
    ok = all(not math.isnan(f["takeover_s"]) for sizes in figures.values() for f in sizes.values())
    if ok:
        results_page.record("spare-scale", report(figures), title="A spare's takeover by world size",
                            about="Written by `bench/spare_scale.py`: bench/elastic.py's lost node with a spare waiting, "
                                  "at several ranks a node. See [Elastic jobs](elastic.md#how-fast).")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
