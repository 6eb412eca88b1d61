"""Recovery at several world sizes (issue 27's scale runs): bench/recovery.py's kill, at 2, 4 and 8 ranks on one host.

The same CIFAR-10 job and the same SIGKILL of one rank once a checkpoint is on disk as bench/recovery.py
(whose run_once() does the work), with --nproc-per-node N for each N of --nprocs, every rank with the same
2048 samples (so the steps per epoch stay the same while the world grows), two epochs. Per world size, the
median time from the kill to the end of the next step (bench/recovery.py: rank 0's own record of it) of
`trainpod run --recovery in-process` (the survivors keep their processes; a replacement is forked) and of the
default restart of the worker group. What is
asked of it: the time stays flat as the world grows, not that it beats a figure measured at another size, and
in-process, 0.3 s or less at every size (issue 27).
On a host with fewer cores than ranks every step is slower by the oversubscription, so the step after
the kill is too: the job's steady step time is printed beside each figure, and the recovery less it. And the
recovery itself is slower by the same sharing: the CPU seconds the job's processes used from the kill to that
step, per rank, say whether the work of a recovery grows with the world where its time on such a host cannot say.

    python3 bench/recovery_scale.py [--rounds N] [--nprocs 2,4,8]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys

import recovery
import results_page

SAMPLES_PER_RANK = 2048
EPOCHS = ["--epochs", "2"]
KILL_AFTER = (40, 80)  # checkpoints of the 128 steps (64 an epoch at batch 32)
VARIANTS = ("in-process", "trainpod")  # trainpod: the restart of the worker group (recovery.py's name)


def measure(nprocs: list[int], rounds: int) -> dict:
    recovery.CREATE_TO_MONO = recovery._create_time_offset()
    figures: dict = {}
    for nproc in nprocs:
        recovery.NPROC = nproc
        recovery.ARGS = [*EPOCHS, "--synthetic-samples", str(SAMPLES_PER_RANK * nproc), "--batch-size", "32",
                         "--checkpoint-every", "5", "--log-every", "1"]
        rng = random.Random(recovery.SEED)
        runs: dict[str, list[dict]] = {variant: [] for variant in VARIANTS}
        for round_ in range(rounds):
            after_step, victim = rng.choice(KILL_AFTER), rng.randrange(nproc)
            for variant in VARIANTS if round_ % 2 == 0 else VARIANTS[::-1]:
                result = recovery.run_once(variant, after_step, victim)
                runs[variant].append(result)
                print(f"  {nproc} ranks, round {round_ + 1}, {variant}: "
                      + (result["failure"] or f"{result['recovery_s']:.2f} s"), file=sys.stderr, flush=True)
        figures[nproc] = {}
        for variant, results in runs.items():
            ok = [r for r in results if not r["failure"]]
            figures[nproc][variant] = {
                "recovery_s": statistics.median(r["recovery_s"] for r in ok) if ok else None,
                "runs_s": [r["recovery_s"] for r in ok], "failed": len(results) - len(ok),
                "step_s": statistics.median(r["step_s"] for r in ok) if ok else None,
                "cpu_per_rank_s": statistics.median(r["cpu_s"] for r in ok) / nproc if ok else None,
                "by_line": sum(not r["step_recorded"] for r in ok),  # timed by the line's arrival: no record read
                "checksums": sorted({r["checksum"] for r in ok})}
    return figures


def report(figures: dict) -> str:
    lines = ["recovery from SIGKILL of one rank to the end of the next step as rank 0 recorded it (its progress record, "
             "not its line's arrival), by world size (one host, CIFAR-10 example, 2048 samples per rank; median of the "
             "rounds, failed recoveries counted apart). The recovery includes that "
             "step: its steady time, and the recovery less it, beside; CPU/rank: the CPU seconds the job used from the kill "
             "to that step, per rank",
             f"  {'ranks':>5}{'step':>9}{'in-process':>13}{'less a step':>13}{'CPU/rank':>10}"
             f"{'restart':>11}{'less a step':>13}{'CPU/rank':>10}{'failed':>8}"]
    for nproc, f in figures.items():
        step = f["in-process"]["step_s"] or f["trainpod"]["step_s"] or 0.0
        row = f"  {nproc:>5}{step:>7.2f} s"
        for variant in VARIANTS:
            seconds = f[variant]["recovery_s"]
            cpu = f[variant].get("cpu_per_rank_s")
            row += (f"{seconds:>11.2f} s{seconds - step:>11.2f} s{cpu:>8.2f} s" if seconds is not None
                    else f"{'none':>13}{'':>23}")
        lines.append(row + f"{sum(f[v]['failed'] for v in VARIANTS):>8}")
    by_line = {f"{nproc} ranks, {v}": f[v]["by_line"] for nproc, f in figures.items() for v in VARIANTS if f[v].get("by_line")}
    if by_line:
        lines.append("  timed by the step's line, later than the step (rank 0's record of it not read): "
                     + ", ".join(f"{where}: {count} run(s)" for where, count in by_line.items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--nprocs", default="2,4,8", help="the world sizes, comma-separated")
    args = parser.parse_args(argv)
    figures = measure([int(n) for n in args.nprocs.split(",") if n], args.rounds)
    print(report(figures))
    print("bench-recovery-scale: " + json.dumps(figures), flush=True)
    ok = all(f[v]["recovery_s"] is not None and len(f[v]["checksums"]) <= 1 for f in figures.values() for v in VARIANTS)
    if ok:
        results_page.record("recovery-scale", report(figures))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
