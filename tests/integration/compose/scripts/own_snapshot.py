"""A third-party DDP script with snapshots of its own (torch.save to the shared volume, atomically by
rename), resumed at start: nothing from trainpod."""

import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

SNAPSHOT = "/workspace/output/snapshot.pt"

dist.init_process_group("gloo")
rank, steps = dist.get_rank(), int(os.environ["STEPS"])
torch.manual_seed(0)
model = DistributedDataParallel(torch.nn.Linear(64, 8))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
start = 0
if os.path.exists(SNAPSHOT):
    state = torch.load(SNAPSHOT, weights_only=True)
    model.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    start = state["step"]
    print(f"resumed at step {start}", flush=True)
for step in range(start, steps):
    data = torch.Generator().manual_seed(step * 100 + rank)
    loss = model(torch.randn(32, 64, generator=data)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    if (step + 1) % 10 == 0 and rank == 0:
        state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "step": step + 1}
        torch.save(state, SNAPSHOT + ".tmp")
        os.replace(SNAPSHOT + ".tmp", SNAPSHOT)
    if step % 10 == 0:
        print(f"step {step}", flush=True)
    time.sleep(0.1)
dist.barrier()
print(f"done {steps} steps", flush=True)
dist.destroy_process_group()
