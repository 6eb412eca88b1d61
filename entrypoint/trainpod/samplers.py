"""A DistributedSampler that lets a DDP job resume mid-epoch, repeating and skipping no sample.

The API:

    sampler = ResumableDistributedSampler(dataset, shuffle=True, seed=0, drop_last=False)
    loader = DataLoader(dataset, batch_size=B, sampler=sampler, num_workers=4)
    sampler.load_state_dict(state["sampler"])   # on resume, before the epoch loop
    for epoch in range(state["sampler"]["epoch"] if resumed else 0, epochs):
        sampler.set_epoch(epoch)                # a loaded state applies to its own epoch only
        for batch in loader:
            train_step(batch)
            sampler.advance(len(batch))          # samples this rank actually trained on
            if time_to_checkpoint:
                save({..., "sampler": sampler.state_dict()})

Without load_state_dict() and advance() it yields exactly what torch.utils.data.DistributedSampler
yields (it is a subclass and keeps its index math, padding included), except that num_replicas
and rank default to 1 and 0 when torch.distributed is not initialized instead of raising.

Why advance() and not a count kept by __iter__: DataLoader workers and prefetching pull indices
from the sampler well ahead of the batch being trained on (num_workers * prefetch_factor batches,
plus the ones in pin_memory), so how far the iterator has run says nothing about what is in the
model. Only the training loop knows, so it says so after each step.

Order. The epoch's order depends only on (seed, epoch): torch.randperm with a generator seeded
with seed + epoch, as torch does. Every rank computes the same order and takes every
num_replicas-th sample of it, so rank r's i-th sample is order[i * num_replicas + r] and after
every rank has consumed i samples exactly the first i * num_replicas of the epoch are done.

state_dict() is {"epoch", "index", "num_replicas", "offset"}: index is how many of this rank's
samples of the epoch were advance()d; offset is the number of the epoch's samples that were done
before the current sharding began (0 unless this epoch was resumed on another world size, below).
In a DDP loop every rank advances by the same batch size each step, so every rank's state is the
same and the one rank 0 saves serves all of them.

load_state_dict(state) makes the next pass over that epoch (set_epoch with that epoch, or no
set_epoch at all) start after `index` samples of the same shard; set_epoch to any other epoch
starts that one from the beginning. __len__ is the number of samples the next (or current) pass
yields, i.e. what is left of the epoch, not the epoch's full size (num_samples still is that):
DataLoader takes its length, and with it len(loader), progress bars and schedulers that count
steps per epoch, from len(sampler), and a length that promised samples __iter__ never yields
would be wrong for all of them. Iterating again in the same epoch without set_epoch (an
evaluation loader, a script that forgot set_epoch) is a full pass over the epoch, as with torch.

Elastic resume (a different world size). The state is turned into a global position: the first
offset + index * old_world samples of the epoch's order are done (fewer if some were padding).
The rest of the order is sharded over the new world the way torch shards a whole epoch (padded
with its own first samples to a multiple of the world size, or its tail of fewer than world size
samples dropped with drop_last), and the new state's offset records where that sharding began.
So no sample of the epoch is skipped and at most num_replicas - 1 are repeated as padding, as
within any epoch; with drop_last the dropped tail may differ from the one the old world would
have dropped. This assumes what a lockstep DDP loop guarantees: every old rank consumed `index`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sized
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler, Sampler

__all__ = ["ResumableDistributedSampler"]


def _default_world() -> tuple[int, int]:
    # torch raises here when no process group exists; a single-process run is a world of one.
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def _per_rank(length: int, world: int, drop_last: bool) -> int:
    # torch's num_samples, for any stretch of an epoch's order.
    if drop_last and length % world != 0:
        return math.ceil((length - world) / world)
    return math.ceil(length / world)


def _shard(order: list[int], world: int, rank: int, drop_last: bool) -> list[int]:
    # torch's padding and subsampling, applied to `order` (the whole epoch or what is left of it).
    total = _per_rank(len(order), world, drop_last) * world
    if drop_last:
        order = order[:total]
    elif order:
        padding = total - len(order)
        order = order + (order * math.ceil(padding / len(order)))[:padding]
    return order[rank:total:world]


def _int_field(state: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = state.get(key, default)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()  # a state that went through a tensor-only serializer
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"sampler state: {key!r} must be a non-negative int, got {value!r}")
    return value


class ResumableDistributedSampler(DistributedSampler):
    """DistributedSampler plus state_dict()/load_state_dict()/advance(); see the module docstring."""

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        world, own_rank = _default_world()
        super().__init__(
            dataset,
            num_replicas=world if num_replicas is None else num_replicas,
            rank=own_rank if rank is None else rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
        self._pending: dict[str, int] | None = None  # a loaded state no pass has started from yet
        self._offset = 0  # samples of the epoch's order done before the current sharding
        self._start = 0  # where in this rank's shard the next (or current) pass starts
        self._index = 0  # samples of this rank's shard consumed, as told by advance()
        self._started = False  # a pass over this epoch has begun

    def _order(self) -> list[int]:
        n = len(self.dataset)  # type: ignore[arg-type]
        if not self.shuffle:
            return list(range(n))
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        return torch.randperm(n, generator=g).tolist()

    def _remaining_order_length(self) -> int:
        return len(self.dataset) - self._offset  # type: ignore[arg-type]

    def _shard_length(self) -> int:
        return _per_rank(self._remaining_order_length(), self.num_replicas, self.drop_last)

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self._offset = self._start = 0
        if self._pending is not None and self._pending["epoch"] == epoch:
            self._apply(self._pending)
        self._index = self._start
        self._started = False

    def _check(self, state: dict[str, int]) -> None:
        # Catches a state from another dataset (or a global batch passed to advance) at load, not mid-epoch.
        old_world, offset, index = state["num_replicas"], state["offset"], state["index"]
        n = len(self.dataset)  # type: ignore[arg-type]
        if old_world == 0:
            raise ValueError("sampler state: 'num_replicas' must be at least 1")
        if offset > n or index > _per_rank(n - offset, old_world, self.drop_last):
            raise ValueError(
                f"sampler state {state} does not fit a dataset of {n} samples on {old_world} ranks "
                f"(drop_last={self.drop_last}): was it saved for another dataset?"
            )

    def _apply(self, state: dict[str, int]) -> None:
        old_world, offset, index = state["num_replicas"], state["offset"], state["index"]
        if old_world == self.num_replicas:
            self._offset, self._start = offset, index
        else:
            # Whatever of old_world's padding was consumed counts as done; min() keeps it in range.
            self._offset, self._start = min(offset + index * old_world, len(self.dataset)), 0  # type: ignore[arg-type]

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        parsed = {
            "epoch": _int_field(state, "epoch"),
            "index": _int_field(state, "index"),
            # States saved without these are from this world size, starting from the epoch's start.
            "num_replicas": _int_field(state, "num_replicas", self.num_replicas),
            "offset": _int_field(state, "offset", 0),
        }
        self._check(parsed)
        self._pending = parsed
        self.set_epoch(parsed["epoch"])

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self._index, "num_replicas": self.num_replicas, "offset": self._offset}

    def advance(self, n: int) -> None:
        """Count `n` more of this rank's samples as trained on (the per-rank batch, not the global one)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"advance() takes a non-negative int, got {n!r}")
        if self._index + n > self._shard_length():
            raise ValueError(
                f"advance({n}) goes past the {self._shard_length()} samples this rank has in epoch {self.epoch} "
                f"(already at {self._index}): pass this rank's batch size, and call set_epoch() each epoch"
            )
        self._index += n

    def __iter__(self) -> Iterator[int]:
        if self._started:
            # A second pass over the same epoch: torch would repeat the whole epoch, so do that.
            self._offset = self._start = 0
        self._started = True
        self._pending = None
        self._index = self._start
        order = self._order()[self._offset :]
        return iter(_shard(order, self.num_replicas, self.rank, self.drop_last)[self._start :])

    def __len__(self) -> int:
        return self._shard_length() - self._start


class EpochIndices(Sampler):
    """Yields (sampler.epoch, i) for each i of `sampler`; len() and set_epoch() are the sampler's.

    The epoch is read as each pass begins, so call set_epoch on either object before iterating.
    """

    def __init__(self, sampler: Any):
        if not hasattr(sampler, "epoch"):
            raise TypeError(f"EpochIndices needs a sampler with an `epoch` attribute (a DistributedSampler), got {type(sampler).__name__}")
        self.sampler = sampler

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        epoch = self.sampler.epoch
        return ((epoch, i) for i in self.sampler)

    def __len__(self) -> int:
        return len(self.sampler)
