"""A plain torch.distributed script that hangs on purpose, for trainpod's hang watch (tests, bench).

    python hang_job.py sleep-before-init --rank 1   # rank 1 sleeps before init_process_group
    python hang_job.py skip --rank 1 --at 3          # rank 1 skips step 3's all_reduce, then all meet in barrier()
    python hang_job.py slow --seconds 15             # long compute and data phases, no hang: exits 0
    python hang_job.py run --steps 1000              # steps of all_reduce, nothing wrong (stop a rank from outside)

Each rank prints `hang-job: rank R hang starts at <unix time>` at the moment its hang begins
(the benchmark times the report from there). Steps go to trainpod.train.progress where it is importable.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist

try:
    from trainpod.train import progress
except ImportError:  # run without trainpod: no step reports
    progress = None


def mark(rank: int, what: str) -> None:
    print(f"hang-job: rank {rank} {what} at {time.time():.3f}", flush=True)


def step(n: int) -> None:
    if progress is not None:
        progress.step(n)


def compute(seconds: float) -> None:
    deadline = time.monotonic() + seconds
    x = torch.randn(256, 256)
    while time.monotonic() < deadline:
        x = torch.tanh(x @ x)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("sleep-before-init", "skip", "slow", "run"))
    parser.add_argument("--rank", type=int, default=1, help="the rank that misbehaves")
    parser.add_argument("--at", type=int, default=3, help="skip: the step whose all_reduce it skips")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seconds", type=float, default=15, help="slow: the length of each phase")
    args = parser.parse_args()
    rank = int(os.environ["RANK"])

    if args.mode == "sleep-before-init" and rank == args.rank:
        mark(rank, "hang starts")
        time.sleep(3600)
    dist.init_process_group("gloo")
    if args.mode == "sleep-before-init":
        mark(rank, "hang starts")  # the others wait in init_process_group for the sleeper
    tensor = torch.ones(1000)
    if args.mode == "slow":
        dist.all_reduce(tensor)
        # A data phase: rank 0 computes, the others read (sleep); nobody waits in a collective.
        compute(args.seconds) if rank == 0 else time.sleep(args.seconds)
        step(1)
        # A compute phase: rank 0 computes on, the others wait for it in all_reduce.
        if rank == 0:
            compute(args.seconds)
        dist.all_reduce(tensor)
        step(2)
        dist.barrier()
        print(f"hang-job: rank {rank} done", flush=True)
        # What trainpod.train.distributed.shutdown() does: without it a rank may abort at exit (134), as
        # gloo's thread and the interpreter's teardown race for the process group.
        time.sleep(0.2)
        dist.destroy_process_group()
        return 0
    for n in range(1, args.steps + 1):
        time.sleep(0.2)
        if args.mode == "skip" and rank == args.rank and n == args.at:
            mark(rank, "hang starts (skips this all_reduce)")
        else:
            dist.all_reduce(tensor)
        step(n)
        if args.mode == "run" and n == 1:
            mark(rank, "runs its steps")
    dist.barrier()  # the skipper's barrier meets the others' last all_reduce: they disagree, nothing completes
    print(f"hang-job: rank {rank} done", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
