"""gloo all_reduce bus bandwidth for large tensors; run by `trainpod run` on every node (bench/run.py)."""

import json
import os
import time

import torch
import torch.distributed as dist

from trainpod.train import distributed

SIZES_MB = [int(s) for s in os.environ.get("BENCH_SIZES_MB", "16,64,256").split(",")]
ITERATIONS = int(os.environ.get("BENCH_ITERATIONS", "5"))


def main():
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    results = []
    for size_mb in SIZES_MB:
        tensor = torch.ones(size_mb * 2**20 // 4, dtype=torch.float32)
        dist.all_reduce(tensor)  # warm-up: connections, buffers
        dist.barrier()
        started = time.perf_counter()
        for _ in range(ITERATIONS):
            dist.all_reduce(tensor)
        seconds = (time.perf_counter() - started) / ITERATIONS
        nbytes = tensor.numel() * 4
        # Bus bandwidth (as nccl-tests define it): what each link carries for a ring all_reduce.
        busbw = nbytes * 2 * (world - 1) / world / seconds
        results.append({"size_mb": size_mb, "seconds": seconds, "busbw_bytes_per_s": busbw})
    if dist.get_rank() == 0:
        print("bench-allreduce: " + json.dumps({"world_size": world, "results": results}), flush=True)
    distributed.shutdown()


if __name__ == "__main__":
    main()
