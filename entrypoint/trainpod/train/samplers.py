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

Elastic jobs, whose world size changes at each membership change, use ElasticSampler instead: the
same order and shards, but the padding is never trained (each rank learns from plan() how much
of a batch is real), so no sample is repeated or dropped however often the world changes, and its
state is the number of the epoch's samples the whole world consumed. Ledger records which samples
the committed steps trained on and checks that each epoch was trained exactly once. Both classes'
docstrings say how to use them, how uneven last batches meet DDP, and the batch and LR rule.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence, Sized
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.utils.data import Dataset, DistributedSampler, Sampler

__all__ = ["BATCH_LR_RULE", "BatchPlan", "ElasticSampler", "EpochIndices", "Ledger", "LedgerReport",
           "ResumableDistributedSampler", "WithIds", "epoch_order", "scaled_lr"]


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


def epoch_order(num_samples: int, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """The epoch's order of sample ids: torch.randperm seeded with seed + epoch, as torch's DistributedSampler."""
    if not shuffle:
        return list(range(num_samples))
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(num_samples, generator=g).tolist()


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
        return epoch_order(len(self.dataset), self.seed, self.epoch, self.shuffle)  # type: ignore[arg-type]

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


# --- elastic jobs ----------------------------------------------------------------------------------

BATCH_LR_RULE = (
    "fixed per-process batch (global batch = batch_size x world, the epoch's last step shorter); "
    "each step's loss is the mean over the samples the world trains on in it; "
    "lr = base_lr x world / reference_world (linear scaling), scheduled by samples seen, not by steps"
)


def scaled_lr(base_lr: float, world_size: int, reference_world_size: int) -> float:
    """The linear scaling rule of BATCH_LR_RULE: base_lr is the LR tuned for reference_world_size processes."""
    if world_size < 1 or reference_world_size < 1:
        raise ValueError(f"world sizes must be at least 1, got {world_size} and {reference_world_size}")
    return base_lr * world_size / reference_world_size


class BatchPlan(NamedTuple):
    """What to do with one batch from an ElasticSampler's loader (ElasticSampler.plan)."""

    size: int  # the batch as the loader delivered it: what advance() takes
    real: int  # train on its first `real` samples only (maybe 0); the rest is padding
    world_real: int  # samples the whole world trains on in this step
    loss_scale: float  # num_replicas / world_real: scales the SUM of this rank's per-sample losses


class ElasticSampler(ResumableDistributedSampler):
    """A sampler for elastic jobs: every sample of every epoch trained on exactly once, whatever the world did.

        sampler = ElasticSampler(dataset, seed=0)            # world and rank from the process group
        loader = DataLoader(WithIds(dataset), batch_size=B, sampler=sampler)
        sampler.load_state_dict(state["sampler"])             # on resume, whatever the old world size was
        sampler.set_epoch(epoch)
        for ids, x, y in loader:
            plan = sampler.plan(len(ids))
            ids, x, y = ids[:plan.real], x[:plan.real], y[:plan.real]        # may be empty
            loss = loss_fn(model(x), y, reduction="sum") * plan.loss_scale   # DDP averages it over ranks
            loss.backward(); optimizer.step(); optimizer.zero_grad()
            sampler.advance(plan.size)                        # the batch as delivered, padding included
            ledger.record(epoch, ids)                         # Ledger, below

    Order and sharding are ResumableDistributedSampler's (same permutation per (seed, epoch), rank r
    takes every num_replicas-th sample of what is left of the epoch, drop_last is always False),
    and so is its padding: every rank's shard is as long as rank 0's, so every rank's loader yields
    the same number of equally long batches and DDP's ranks stay in lockstep. The difference is that
    the padding (fewer than num_replicas samples per epoch, at the shards' ends) is never trained:
    plan() says how many samples at the head of a batch are real, and the loop cuts the rest off.
    In the epoch's last step a rank may thus train on a short batch, or on none at all.

    DDP and uneven batches. Every rank runs every step, an empty batch included: the forward and
    backward of zero samples give zero gradients (torch's layers, BatchNorm included, take a batch
    of 0; BatchNorm's running statistics stay as they were), and DDP's all-reduce happens on every
    rank as always, as do the loop's other collectives (logging, checkpoints). The loss of each rank
    is the sum of its per-sample losses times num_replicas / world_real, so DDP's average over the
    ranks is the mean loss over exactly the samples the world trained on in that step: a short last
    step weighs each of its samples as much as a full step does, and a padded sample weighs nothing.
    Chosen over DDP's join() (which shadows only DDP's own all-reduce, so a rank that ran out would
    hang in the loop's other collectives, and which averages over the full world, weighting the
    samples of a short step less) and over carrying the remainder into the next epoch (an epoch
    would never be complete by itself, and the last one never at all).

    State. state_dict() is {"epoch", "consumed"}: how many samples of the epoch's order the whole
    world has trained on (the first `consumed`; a lockstep loop keeps it a prefix). It holds no
    rank and no world size: load_state_dict() on any world shards the rest of the epoch over that
    world, and sharding the rest is what the same world would have done anyway, so a resume is the
    uninterrupted run's continuation when the world did not change. It also loads a
    ResumableDistributedSampler's state (same or other world size).

    Batch and LR across world-size changes (BATCH_LR_RULE): the per-process batch stays fixed, so
    the global batch is batch_size x world and changes with the world; with the loss a mean over
    the step's samples, the linear scaling rule keeps the per-sample step size: lr = base_lr x world
    / reference_world (scaled_lr), base_lr being the LR tuned for reference_world processes. Steps
    per epoch change with the world, so an LR schedule should run on samples seen (epoch + consumed
    / len(dataset)), not on a step count fixed at the start.
    """

    def __init__(self, dataset: Sized, num_replicas: int | None = None, rank: int | None = None, shuffle: bool = True,
                 seed: int = 0) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=False)

    @property
    def consumed(self) -> int:
        """Samples of the epoch's order the whole world has trained on (every rank advanced alike)."""
        n = len(self.dataset)  # type: ignore[arg-type]
        return min(n, self._offset + self._index * self.num_replicas)

    def plan(self, size: int) -> BatchPlan:
        """How to train on the next batch of `size` (as delivered) of this rank: see BatchPlan."""
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"plan() takes a non-negative int, got {size!r}")
        if self._index + size > self._shard_length():
            raise ValueError(f"plan({size}) goes past the {self._shard_length()} samples this rank has in epoch "
                             f"{self.epoch} (already at {self._index}): pass the batch as the loader delivered it")
        remaining = len(self.dataset) - self._offset  # type: ignore[arg-type]
        world = self.num_replicas
        mine = (remaining - self.rank + world - 1) // world if remaining > self.rank else 0  # real samples in my shard
        real = max(0, min(size, mine - self._index))
        world_real = max(0, min(size * world, remaining - self._index * world))
        return BatchPlan(size, real, world_real, world / world_real if world_real else 0.0)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "consumed": self.consumed}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if "consumed" not in state:  # a ResumableDistributedSampler's
            super().load_state_dict(state)
            return
        epoch, consumed = _int_field(state, "epoch"), _int_field(state, "consumed")
        n = len(self.dataset)  # type: ignore[arg-type]
        if consumed > n:
            raise ValueError(f"sampler state {dict(state)} does not fit a dataset of {n} samples: was it saved for another dataset?")
        # "The first `consumed` are done" on this world: a fresh sharding that starts there.
        self._pending = {"epoch": epoch, "index": 0, "num_replicas": self.num_replicas, "offset": consumed}
        self.set_epoch(epoch)


class WithIds(Dataset):
    """`dataset` whose items come with their index: (i, *item) for a tuple item, else (i, item).

    An index of (epoch, i) (EpochIndices, for a data set with `wants_epoch`) gives id i.
    """

    def __init__(self, dataset: Any):
        self.dataset = dataset
        self.wants_epoch = getattr(dataset, "wants_epoch", False)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: Any) -> tuple:
        item = self.dataset[index]
        sample_id = index[1] if isinstance(index, tuple) else index
        return (sample_id, *item) if isinstance(item, tuple) else (sample_id, item)


def _consumed(sampler_state: Mapping[str, Any], n: int) -> int:
    if "consumed" in sampler_state:
        return _int_field(sampler_state, "consumed")
    old_world = _int_field(sampler_state, "num_replicas", 1)
    return min(n, _int_field(sampler_state, "offset", 0) + _int_field(sampler_state, "index") * old_world)


class LedgerReport(NamedTuple):
    ok: bool  # every epoch the sampler state says is done (or begun) was trained exactly so
    epochs: dict[int, dict[str, int]]  # per epoch: samples (expected), trained (distinct), repeated, missing, extra
    complete: list[int]  # the epochs trained through to their end
    problems: list[str]  # one line each, empty when ok


class Ledger:
    """Exactly-once ledger: which samples of each epoch the committed steps trained on.

        ledger = Ledger(len(dataset), seed=0)              # every rank; load_state_dict() on resume
        ledger.record(epoch, ids[:plan.real])              # every rank, every step: its real samples
        # at a checkpoint, on every rank (a collective, like the RNG states):
        pendings = [None] * world
        dist.all_gather_object(pendings, ledger.take_pending())
        ledger.commit(pendings)                            # every rank: all ledgers stay equal
        save({..., "sampler": sampler.state_dict(), "ledger": ledger.state_dict()})
        # after the run, from the last checkpoint:
        report = Ledger.from_state(state["ledger"]).check(state["sampler"], first_epoch=0)

    The ids are the dataset indices of what was actually trained on (the loader returns them with
    each sample), not what the sampler meant to hand out, so the check proves something about the
    data. record() keeps them as pending, per rank; commit() merges every rank's pending into the
    committed record when a checkpoint is saved. Steps after the last checkpoint stay pending and
    die with a failure: they are not in the committed model, and not in the ledger either.

    Compact: ids are stored as positions in the epoch's order (epoch_order(n, seed, epoch)), where
    what a lockstep world trains on is a prefix: each epoch is a list of [start, end) ranges,
    [[0, n]] once complete, whatever the world sizes were. A position committed again is counted as
    a repeat (the ranges cannot hold it twice). commit() costs O(len(dataset)) per epoch it touches.

    check(sampler_state) proves, from the committed record alone: every epoch before the sampler's
    has each of its samples exactly once, and the sampler's epoch has exactly its first `consumed`
    positions, once each, i.e. the very samples the resumed sampler will not hand out again. With
    the epoch's last step committed (consumed == len(dataset)) that epoch is complete too.
    """

    def __init__(self, num_samples: int, seed: int = 0, shuffle: bool = True):
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 0:
            raise ValueError(f"Ledger needs the data set's size, got {num_samples!r}")
        self.num_samples, self.seed, self.shuffle = num_samples, seed, shuffle
        self._ranges: dict[int, list[list[int]]] = {}  # committed: epoch -> sorted, disjoint [start, end)
        self._repeats: dict[int, int] = {}  # committed trainings of a position the epoch already had
        self._pending: dict[int, list[int]] = {}  # this rank's positions since the last take_pending()
        self._inverse: tuple[int, torch.Tensor] | None = None  # (epoch, each sample id's position)

    def _positions(self, epoch: int, sample_ids: Any) -> list[int]:
        if self._inverse is None or self._inverse[0] != epoch:
            order = torch.tensor(epoch_order(self.num_samples, self.seed, epoch, self.shuffle), dtype=torch.long)
            inverse = torch.empty(self.num_samples, dtype=torch.long)
            inverse[order] = torch.arange(self.num_samples)
            self._inverse = (epoch, inverse)
        ids = torch.as_tensor(sample_ids, dtype=torch.long).flatten()
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_samples):
            raise ValueError(f"Ledger.record: sample ids must be in [0, {self.num_samples}), got {ids.tolist()}")
        return self._inverse[1][ids].tolist()

    def record(self, epoch: int, sample_ids: Any) -> None:
        """This rank trained on `sample_ids` (dataset indices; a list or tensor) in one step of `epoch`."""
        self._pending.setdefault(int(epoch), []).extend(self._positions(int(epoch), sample_ids))

    def take_pending(self) -> dict[int, list[int]]:
        """What record() collected since the last call (epoch -> positions); cleared."""
        pending, self._pending = self._pending, {}
        return pending

    def commit(self, pendings: Iterable[Mapping[int, Sequence[int]]]) -> None:
        """Merge every rank's take_pending() into the committed record (at a checkpoint)."""
        by_epoch: dict[int, list[int]] = {}
        for pending in pendings:
            for epoch, positions in pending.items():
                by_epoch.setdefault(int(epoch), []).extend(positions)
        n = self.num_samples
        for epoch, positions in by_epoch.items():
            if not positions:
                continue
            trained = torch.zeros(n, dtype=torch.bool)
            for start, end in self._ranges.get(epoch, []):
                trained[start:end] = True
            counts = torch.bincount(torch.tensor(positions, dtype=torch.long), minlength=n)
            repeats = int(counts[trained].sum()) + int((counts[~trained] - 1).clamp(min=0).sum())
            if repeats:
                self._repeats[epoch] = self._repeats.get(epoch, 0) + repeats
            trained |= counts > 0
            edges = torch.diff(torch.cat([torch.zeros(1, dtype=torch.int8), trained.to(torch.int8), torch.zeros(1, dtype=torch.int8)]))
            starts, ends = (edges == 1).nonzero().flatten().tolist(), (edges == -1).nonzero().flatten().tolist()
            self._ranges[epoch] = [[s, e] for s, e in zip(starts, ends)]

    def state_dict(self) -> dict[str, Any]:
        """The committed record (plain ints and lists: loads with torch.load(weights_only=True))."""
        return {"num_samples": self.num_samples, "seed": self.seed, "shuffle": self.shuffle,
                "epochs": {e: [list(r) for r in ranges] for e, ranges in sorted(self._ranges.items())},
                "repeats": dict(sorted(self._repeats.items()))}  # fmt: skip

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        saved = (state.get("num_samples"), state.get("seed"), state.get("shuffle"))
        if saved != (self.num_samples, self.seed, self.shuffle):
            raise ValueError(f"ledger of (num_samples, seed, shuffle) = {saved} does not fit this one's "
                             f"{(self.num_samples, self.seed, self.shuffle)}: another data set or seed")
        self._ranges = {int(e): [[int(a), int(b)] for a, b in ranges] for e, ranges in state["epochs"].items()}
        self._repeats = {int(e): int(c) for e, c in state.get("repeats", {}).items()}

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> Ledger:
        ledger = cls(state["num_samples"], state["seed"], state["shuffle"])
        ledger.load_state_dict(state)
        return ledger

    def check(self, sampler_state: Mapping[str, Any], first_epoch: int = 0) -> LedgerReport:
        """Is the committed record exactly once? See the class docstring; `first_epoch` is the run's first."""
        n = self.num_samples
        last, consumed = _int_field(sampler_state, "epoch"), _consumed(sampler_state, n)
        epochs: dict[int, dict[str, int]] = {}
        problems, complete = [], []
        for epoch in range(first_epoch, last + 1):
            expected = n if epoch < last else consumed
            ranges = self._ranges.get(epoch, [])
            inside = sum(max(0, min(b, expected) - a) for a, b in ranges)
            trained = sum(b - a for a, b in ranges)
            row = {"samples": expected, "trained": trained, "repeated": self._repeats.get(epoch, 0),
                   "missing": expected - inside, "extra": trained - inside}  # fmt: skip
            epochs[epoch] = row
            if row["repeated"] or row["missing"] or row["extra"]:
                problems.append(f"epoch {epoch}: {row['missing']} of its first {expected} samples never trained, "
                                f"{row['repeated']} trained again, {row['extra']} trained beyond them")
            elif expected == n:
                complete.append(epoch)
        for epoch in sorted(set(self._ranges) - set(epochs)):
            problems.append(f"epoch {epoch}: trained on, but outside the run's epochs {first_epoch}..{last}")
        return LedgerReport(not problems, epochs, complete, problems)
