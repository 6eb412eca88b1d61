"""Checkpoint costs for a ~100 MB training state, each beside its baseline (run by bench/run.py).

(a) Checkpointer.save() + wait() vs serialising the same state and writing + fsyncing the bytes raw.
(b) the training loop's stall per checkpoint (time inside save()) vs a synchronous torch.save + fsync.
Runs are interleaved so that drifts of a shared host hit both sides alike; medians are reported.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

from trainpod.train.checkpoint import Checkpointer

REPEATS = 5


def main() -> None:
    directory = tempfile.mkdtemp(prefix="trainpod-bench-ckpt-")
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(12)])  # 50 MB of weights
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model(torch.randn(8, 1024)).sum().backward()
        optimizer.step()  # momentum buffers: another 50 MB

        def state():
            return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}

        def raw():
            buffer = io.BytesIO()
            torch.save(state(), buffer)
            with open(os.path.join(directory, f"raw-{time.monotonic_ns()}.pt"), "wb") as f:
                f.write(buffer.getbuffer())
                f.flush()
                os.fsync(f.fileno())
            return buffer.getbuffer().nbytes

        def synchronous():
            path = os.path.join(directory, f"sync-{time.monotonic_ns()}.pt")
            with open(path, "wb") as f:
                torch.save(state(), f)
                f.flush()
                os.fsync(f.fileno())

        # keep is large so that deleting old checkpoints (not part of a save) never runs meanwhile.
        checkpointer = Checkpointer(os.path.join(directory, "ckpt"), keep=10 * REPEATS + 10, log=lambda message: None)
        nbytes = raw()
        checkpointer.save(0, state())  # warm-up: the snapshot buffers are allocated once
        checkpointer.wait()
        synchronous()

        saves, raws, stalls, syncs = [], [], [], []
        for step in range(1, REPEATS + 1):
            started = time.perf_counter()
            raw()
            raws.append(time.perf_counter() - started)

            started = time.perf_counter()
            checkpointer.save(2 * step - 1, state())
            checkpointer.wait()
            saves.append(time.perf_counter() - started)

            started = time.perf_counter()
            synchronous()
            syncs.append(time.perf_counter() - started)

            started = time.perf_counter()
            checkpointer.save(2 * step, state())
            stalls.append(time.perf_counter() - started)
            checkpointer.wait()
        checkpointer.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)

    median = statistics.median
    print("bench-checkpoint: " + json.dumps({
        "state_bytes": nbytes,
        "save_s": median(saves), "raw_s": median(raws),
        "stall_s": median(stalls), "sync_s": median(syncs),
    }), flush=True)


if __name__ == "__main__":
    sys.exit(main())
