"""Helpers for training scripts that use torch.distributed; imported by the examples, usable by yours."""

from __future__ import annotations

import re
import time

# How long the main thread gives up the GIL before tearing the process group down (see shutdown()).
DRAIN_S = 0.2
_kept: list = []  # groups whose owner never frees them (kept())
# Models up to this many MB of parameters get one gradient bucket from reproducible_ddp() (DDP's own default cap).
ONE_BUCKET_MB = 25
PER_PARAMETER_BUCKET_MB = 1e-6  # a cap below any parameter's size: a bucket closes after one parameter
# What a collective's error says when a peer it shared the collective with went away (gloo, NCCL, the c10d store)
PEER_LOST = re.compile(r"Connection (closed|reset) by peer|remote worker crash|Broken pipe|ProcessGroupNCCL.*(Watchdog|timed? ?out)")


def kept(group) -> None:
    """Say that `group` is never freed (trainpod.train.inprocess holds every group it forms): shutdown() after an
    error then destroys it without the pause, as destroying it frees nothing."""
    _kept.append(group)


def reproducible_ddp(module, **kwargs):
    """DistributedDataParallel(module, **kwargs) whose gradients add up in the same order at every step of every
    process, so that a run resumed from a checkpoint ends with the same bits as one never interrupted. `kwargs` are
    DDP's options but its bucket sizes, which this chooses.

    With three or more ranks the sum of a gradient element depends on its place in its bucket (gloo's and NCCL's
    rings add a buffer's chunks starting from different ranks), and DDP lays its buckets out in one order on a
    process's first backward (the parameters' registration order, reversed by bucket) and rebuilds them after it in
    the order the gradients became ready: a resumed run's first step would add in another order than the
    uninterrupted run's step did. A model of at most ONE_BUCKET_MB gets its rebuilt layout fixed before its first
    step, in registration order (the rebuild DDP's own Join hook uses): one bucket (bucket_cap_mb given, DDP makes
    no smaller first one), one collective a step, where one bucket per parameter cost a collective each (what that
    saves a rank: bench/ddp_buckets.py). A bigger model keeps one bucket per parameter: each of its gradients is
    sent as soon as it is ready, overlapping the backward pass, where one bucket would wait for all of them."""
    from torch.nn.parallel import DistributedDataParallel

    size_mb = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad) / 2**20
    if size_mb <= ONE_BUCKET_MB:
        model = DistributedDataParallel(module, bucket_cap_mb=ONE_BUCKET_MB, **kwargs)
        if hasattr(model.reducer, "_push_all_rebuilt_params"):  # a private method: a later torch may lack it
            model.reducer._push_all_rebuilt_params()  # the first forward rebuilds to this layout, before any backward
            return model
    return DistributedDataParallel(module, bucket_cap_mb_list=[PER_PARAMETER_BUCKET_MB], **kwargs)


def shutdown(barrier: bool = True) -> None:
    """Synchronise the ranks and tear down the default process group without hanging at exit.

    gloo frees a finished collective on its own thread, and freeing tensors that Python owns
    needs the GIL. If the main thread destroys the process group (directly, or by dropping the
    DDP model that holds it) while still holding the GIL, the two wait for each other forever:
    seen with torch 2.13 after all_gather_object. So: a barrier (every rank is done), a short
    sleep (the GIL is free, gloo's thread finishes freeing), then destroy_process_group().
    After an error pass barrier=False: the other ranks may never arrive. Then, for a group that is never freed
    (kept(): in-process recovery's), there is nothing to wait for, and this rank goes on to recover at once: the
    sleep was on the path from a peer's death to the re-formed group. A no-op once shut down.
    Past the barrier every rank is done: the agent is told (trainpod.train.progress.finished), so a
    node that arrives to join the job now waits for the next run instead of restarting this one.
    """
    import torch.distributed as dist

    from trainpod.train import progress

    if not dist.is_initialized():
        return
    if barrier:
        dist.barrier()
        progress.finished()
    world = dist.group.WORLD
    if barrier or not any(group is world for group in _kept):
        time.sleep(DRAIN_S)
    dist.destroy_process_group()


def peer_lost(error: BaseException) -> bool:
    """Whether `error`, from a collective, says that a peer went away (its process ended, its connection closed):
    then its rank's agent says why (a signal, the OOM killer, its exit code), and this rank's traceback adds nothing."""
    return PEER_LOST.search(str(error)) is not None
