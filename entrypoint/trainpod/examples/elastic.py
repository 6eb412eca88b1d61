"""What the harness does differently for an elastic example (Recipe(elastic=True)): the world may
change size at every restart, and every sample of every epoch must still train exactly once.

    feed = ElasticFeed(train_set, world, rank, seed, base_lr, total_samples)
    loader = DataLoader(feed.dataset, sampler=feed.sampler, ...)   # batches come as (ids, inputs, labels)
    ids, inputs, labels, loss_scale = feed.cut(batch)              # the padding cut off (maybe all of it)
    loss = loss_fn_sum(model(inputs), labels) * loss_scale         # DDP's average: the step's mean loss
    feed.after_step(epoch, ids, delivered)                         # sampler position, ledger, next LR

The pieces are trainpod.train.samplers': ElasticSampler (the rest of an epoch re-sharded over whatever
world resumes it; padding never trained), Ledger (which samples the committed steps trained on),
and the batch and learning-rate rule BATCH_LR_RULE: a fixed per-process batch, the loss a mean over
the samples the world trained on in a step, lr = --lr x world / reference_world, scheduled by
samples seen. The reference world is the world of the job's first start (saved in the
checkpoint), so a job that never changes size trains exactly like the static examples' rule.

The checkpoint holds, besides the static examples' state: the ledger (committed at each
checkpoint, a collective: every rank's pending sample ids are gathered), the reference world, and
the membership timeline: [step, world, nodes] each time training (re)started from a checkpoint.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
from torch.optim import Optimizer

from trainpod.train.samplers import BATCH_LR_RULE, ElasticSampler, Ledger, LedgerReport, WithIds, scaled_lr

__all__ = ["BATCH_LR_RULE", "ElasticFeed", "ElasticSchedule"]


class ElasticSchedule:
    """The LR of BATCH_LR_RULE: linear scaling by world, warm-up then cosine by samples seen.

    `factor` is the harness's lr_schedule over the run's total samples; step() sets every param
    group's LR for the next step from the sampler's position, so a resumed run sets the same LR
    as an uninterrupted one at the same sample. Its state is the reference world.
    """

    def __init__(self, optimizer: Optimizer, sampler: ElasticSampler, base_lr: float, world: int, factor,
                 samples_per_epoch: int):
        self.optimizer, self.sampler, self.base_lr, self.world = optimizer, sampler, base_lr, world
        self.factor, self.samples_per_epoch = factor, samples_per_epoch
        self.reference_world = world
        self.step()

    def samples_seen(self) -> int:
        # Epochs count from 1 in the harness; before the first set_epoch the sampler's epoch is 0.
        return max(0, self.sampler.epoch - 1) * self.samples_per_epoch + self.sampler.consumed

    def lr(self) -> float:
        return scaled_lr(self.base_lr, self.world, self.reference_world) * self.factor(self.samples_seen())

    def step(self) -> None:
        lr = self.lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def state_dict(self) -> dict[str, int]:
        return {"reference_world": self.reference_world}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        reference = state["reference_world"]
        if isinstance(reference, bool) or not isinstance(reference, int) or reference < 1:
            raise ValueError(f"'reference_world' must be a positive int, got {reference!r}")
        self.reference_world = reference  # the LR follows once the sampler's position is loaded (ElasticFeed)


class ElasticFeed:
    """The elastic example's data: sampler, ids with every sample, ledger, LR rule, membership."""

    def __init__(self, train_set: Any, world: int, rank: int, seed: int):
        self.world = world
        self.dataset = WithIds(train_set)
        self.sampler = ElasticSampler(train_set, num_replicas=world, rank=rank, shuffle=True, seed=seed)
        self.ledger = Ledger(len(train_set), seed=seed)
        self.membership: list[list[int]] = []  # [step, world, nodes] at each (re)start that was committed
        self.schedule: ElasticSchedule | None = None

    def use_schedule(self, optimizer: Optimizer, base_lr: float, factor) -> ElasticSchedule:
        self.schedule = ElasticSchedule(optimizer, self.sampler, base_lr, self.world, factor, len(self.dataset))
        return self.schedule

    def remaining_steps(self, epochs: int, batch_size: int) -> int:
        """Steps left at this world: the rest of the sampler's epoch, then whole epochs up to `epochs`."""
        per_step = batch_size * self.world
        n, epoch = len(self.dataset), max(1, self.sampler.epoch)
        return -(-(n - self.sampler.consumed) // per_step) + (epochs - epoch) * -(-n // per_step)

    def started(self, step: int) -> None:
        """Training (re)starts at `step` on this world: a point of the membership timeline."""
        nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
        self.membership.append([step, self.world, nodes])

    def cut(self, batch: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float, int, int]:
        """(ids, inputs, labels, loss_scale, delivered, world_real) of a loader batch, its padding cut off."""
        ids, inputs, labels = batch
        plan = self.sampler.plan(len(ids))
        real = plan.real
        return ids[:real], inputs[:real], labels[:real], plan.loss_scale, plan.size, plan.world_real

    def after_step(self, epoch: int, ids: torch.Tensor, delivered: int) -> None:
        self.sampler.advance(delivered)
        self.ledger.record(epoch, ids)
        if self.schedule is not None:
            self.schedule.step()

    # --- the checkpoint -------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"ledger": self.ledger.state_dict(), "membership": [list(point) for point in self.membership]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """After the sampler's and the schedule's own states: the LR is set from them here."""
        self.ledger.load_state_dict(state["ledger"])
        self.membership = [[int(v) for v in point] for point in state["membership"]]
        if self.schedule is not None:
            self.schedule.step()

    def commit(self, pendings: list) -> None:
        """Every rank's take_pending(), gathered at a checkpoint: into the committed ledger (every rank)."""
        self.ledger.commit(pendings)

    def report(self) -> LedgerReport:
        """Was each epoch of this run trained exactly once, by the committed ledger? (epochs count from 1)"""
        return self.ledger.check(self.sampler.state_dict(), first_epoch=1)
