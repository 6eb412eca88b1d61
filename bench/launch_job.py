"""The job bench/launch.py launches: import torch.distributed, join the group, a barrier; rank 0 prints
when its interpreter started and when the group was ready (the job's first step could start), in
seconds since the epoch (on one host, or in containers sharing its clock)."""

import time

start = time.time()
import torch.distributed as dist  # noqa: E402 (after the clock: the import is part of the launch)

dist.init_process_group("gloo")
dist.barrier()
if dist.get_rank() == 0:
    print(f"bench-launch: rank-up {start:.6f} ready {time.time():.6f}", flush=True)
dist.destroy_process_group()
