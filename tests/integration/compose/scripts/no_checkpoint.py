"""A third-party script with no checkpoint: plain torch.distributed, each attempt trains from step 0."""

import os
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
steps, t = int(os.environ["STEPS"]), torch.ones(1)
for step in range(steps):
    dist.all_reduce(t)
    torch.randn(256, 256) @ torch.randn(256, 256)
    if step % 10 == 0:
        print(f"step {step}", flush=True)
    dist.barrier()
    time.sleep(0.1)
print(f"done {steps} steps", flush=True)
dist.destroy_process_group()
