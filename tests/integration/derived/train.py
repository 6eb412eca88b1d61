"""A user's training script: plain torch.distributed, nothing from trainpod, and a package its image added."""

import hashlib
import os
import time

import mypkg
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1000 + rank)
    for _ in range(20):
        x = torch.randn(32, 16, generator=generator)
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    # The package the image added imports, and the job (uid 1000) cannot change it.
    owner, writable = os.stat(mypkg.__file__).st_uid, os.access(mypkg.__file__, os.W_OK)
    package = f"mypkg={mypkg.__version__} uid={os.getuid()} owner={owner} writable={writable}"
    print(f"user-script rank={rank} world={world} node={os.environ.get('GROUP_RANK')} weights={digest} {package}", flush=True)
    # Every rank done; then give gloo's thread the GIL to free the last collective before teardown.
    dist.barrier()
    time.sleep(0.2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
