"""What DDP's gradient buckets cost a rank: one bucket per parameter against trainpod's reproducible_ddp().

Both lay the buckets out the same way at every step, so that a resumed run ends with the uninterrupted run's bits
(trainpod.train.distributed.reproducible_ddp says why that needs care). One bucket per parameter sends a collective
per parameter each step; reproducible_ddp() gives a small model one bucket. The bundled CIFAR-10 model (11 parameter
tensors) on gloo, WORLD ranks on this host, one thread each, at the tests' batch of 8 and at 32: each rank's CPU per
step (time.process_time over --steps steps), the variants alternating, medians over --rounds. Each run also trains
once more from a fresh DDP wrap at step --steps/3, as a resumed process does, and says whether its weights have the
uninterrupted run's bits.

    python3 bench/ddp_buckets.py [--rounds 3] [--steps 200] [--worlds 2,4] [--batches 8,32]

Prints one `bench-ddp-buckets: {json}` line, then the table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import results_page

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "tests"), str(HERE.parent / "entrypoint")]

from fixtures import resumed_ddp  # noqa: E402
from fixtures.ports import free_port  # noqa: E402

VARIANTS = ("per-parameter", "reproducible_ddp")


def wrap(module, variant: str):
    from torch.nn.parallel import DistributedDataParallel

    from trainpod.train import distributed

    if variant == "per-parameter":
        return DistributedDataParallel(module, bucket_cap_mb_list=[distributed.PER_PARAMETER_BUCKET_MB])
    return distributed.reproducible_ddp(module)


def rank_main(rank: int, world: int, port: int, variant: str, batch: int, steps: int, resume_at: int, out) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    generator = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(batch, 3, 32, 32, generator=generator), torch.randint(0, 10, (batch,), generator=generator))
               for _ in range(8)]  # made before the clock starts

    def train(resume: int) -> tuple[float, str]:
        return resumed_ddp.train(lambda module: wrap(module, variant), steps, resume, lambda step: batches[step % 8])

    cpu, whole = train(resume=-1)
    _, resumed = train(resume=resume_at)
    dist.destroy_process_group()
    out.put((rank, cpu, whole, resumed))


def run_once(world: int, variant: str, batch: int, steps: int) -> dict:
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    out = context.Queue()
    port = free_port()
    ranks = [context.Process(target=rank_main, args=(rank, world, port, variant, batch, steps, steps // 3, out))
             for rank in range(world)]
    for process in ranks:
        process.start()
    results = [out.get(timeout=600) for _ in ranks]
    for process in ranks:
        process.join(60)
    return {"cpu_ms": 1e3 * statistics.mean(r[1] for r in results),
            "bit_identical": all(r[2] == r[3] for r in results) and len({r[2] for r in results}) == 1}


def measure(worlds: list[int], batches: list[int], rounds: int, steps: int) -> dict:
    figures = {}
    for world in worlds:
        for batch in batches:
            runs = {variant: [] for variant in VARIANTS}
            for _ in range(rounds):
                for variant in VARIANTS:  # alternating: a slower minute slows both
                    runs[variant].append(run_once(world, variant, batch, steps))
            figures[f"{world}x{batch}"] = {
                variant: {"cpu_ms": statistics.median(r["cpu_ms"] for r in done),
                          "bit_identical": all(r["bit_identical"] for r in done)} for variant, done in runs.items()}
    return figures


def report(figures: dict) -> str:
    lines = ["| ranks | batch | per parameter: CPU a step | reproducible_ddp: CPU a step | ratio | resumed bit-identical |",
             "| --- | --- | --- | --- | --- | --- |"]
    for key, variants in figures.items():
        world, batch = key.split("x")
        old, new = variants["per-parameter"], variants["reproducible_ddp"]
        same = "yes" if old["bit_identical"] and new["bit_identical"] else \
            f"no (per parameter {old['bit_identical']}, reproducible_ddp {new['bit_identical']})"
        lines.append(f"| {world} | {batch} | {old['cpu_ms']:.1f} ms | {new['cpu_ms']:.1f} ms | "
                     f"{new['cpu_ms'] / old['cpu_ms']:.2f}x | {same} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--batches", default="8,32")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    figures = measure([int(w) for w in args.worlds.split(",") if w], [int(b) for b in args.batches.split(",") if b],
                      args.rounds, args.steps)
    print(report(figures))
    print("bench-ddp-buckets: " + json.dumps(figures), flush=True)
    ok = all(v["bit_identical"] for variants in figures.values() for v in variants.values())
    if ok:
        results_page.record("ddp-buckets", report(figures), title="DDP's gradient buckets",
                            about="Written by `bench/ddp_buckets.py`: a rank's CPU a step with one bucket per parameter "
                                  "and with `trainpod.train.distributed.reproducible_ddp`, both bit-identical after a "
                                  "resume. See [Checkpoints](checkpoints.md).")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
