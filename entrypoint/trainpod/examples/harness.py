"""The loop every bundled example shares. An example is a model, a data set and a few defaults:

    RECIPE = Recipe(name="cifar10-ddp", summary="...", data=load_data, model=make_model,
                    options=(DATA_DIR, ...), defaults={"batch_size": 64})
    def main(argv=None) -> int:
        return harness.main(RECIPE, argv)

and the harness does the rest, the same way for each:

- options: trainpod.examples.options' COMMON plus the example's own, each a flag with a TRAINPOD_* twin
  (trainpod.settings); `--help` lists them. A bad value is one line and exit 64 (flag) or 78
  (variable), never restarted; under `trainpod run` the launcher says it first, before anything
  starts (they are declared without torch in trainpod.examples.options).
- the process group: env:// under torchrun (a world of one without it), gloo on the CPU, NCCL
  with one GPU per process (LOCAL_RANK) by default where CUDA is. `parallel="dp"` is one process
  with torch.nn.DataParallel over every visible GPU (the plain model on the CPU).
- data: a ResumableDistributedSampler (its position is checkpointed), DataLoader workers that
  ignore SIGTERM, pinned memory on CUDA, persistent workers with prefetching. A data set that
  wants the epoch (augmentation seeded per sample and epoch) gets (epoch, index) pairs.
- the step: autocast and a GradScaler per the precision path (trainpod.examples.precision),
  gradient clipping, an LR schedule of linear warm-up then cosine decay; each step is reported
  to the agent (trainpod.train.progress).
- checkpoints (--checkpoint-dir, every --checkpoint-every steps): model, optimizer, LR
  schedule, scaler, sampler position, every rank's RNG state; resumed from the newest good one,
  so a resumed run ends with the same weights as one never interrupted. The directory is checked
  before the process group forms (an unusable one is 78 on every rank); a save that fails for lack
  of space or permission stops every rank after the current step with 73 (the Checkpointer's one
  line says which checkpoint a new run resumes from).
- SIGTERM: every rank stops after the same step, saves it and exits 143 (trainpod.train.preemption).
- elastic examples (Recipe(elastic=True), trainpod.examples.elastic): the world may change size at
  each restart; an ElasticSampler re-shards the rest of the epoch over the new world, padding is
  never trained, a ledger in the checkpoint proves every sample of every epoch trained exactly once,
  and the LR follows the batch and LR rule (linear scaling by world, scheduled by samples seen).
  metrics.json adds the ledger's report and the membership timeline.
- every rank resumes from the same checkpoint: ranks that found different newest ones (a
  --checkpoint-dir that is not shared by every node) are one line and 78.
- evaluation (accuracy on the test set, sharded over the ranks) and metrics: `metrics.json` in
  --output-dir and one `trainpod-metrics:` line: the loss curve, samples/s, world size, the
  numeric path, and the checksum of every rank's final weights (equal on every rank); with
  --tensorboard DIR, rank 0's TensorBoard scalars at each log point (trainpod.examples.tensorboard).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import random
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, Subset

from trainpod import failpoints, settings
from trainpod.errors import EXIT_CANTCREAT, ConfigError, TrainpodError, invalid
from trainpod.examples import precision, reporting, tensorboard
from trainpod.examples.elastic import BATCH_LR_RULE, ElasticFeed
from trainpod.examples.options import COMMON
from trainpod.settings import Setting, Values
from trainpod.train import distributed, inprocess, progress
from trainpod.train.checkpoint import Checkpointer, CheckpointError
from trainpod.train.preemption import EXIT_CODE, Preemption, ignore_sigterm, term_grace
from trainpod.train.rng import rng_state, set_rng_state
from trainpod.train.samplers import EpochIndices, ResumableDistributedSampler

WARMUP_STEPS = 5  # left out of samples/s: the first steps allocate memory and warm caches
# SGD with momentum 0.9 peaking at lr 0.1 is brisk for small nets: without a cap on the gradient
# norm, a rare large step made the loss jump back up late in training.
MAX_GRAD_NORM = 1.0
# The LR rises linearly over the first 5% of the steps (large steps from random weights are the
# least reliable), then follows a cosine down to 0 at the last step.
WARMUP_FRACTION = 0.05
EVAL_BATCH = 256



@dataclass(frozen=True)
class Data:
    name: str  # "cifar10", "synthetic", "imagenet", ...: what the metrics call it
    train: Dataset
    test: Dataset
    num_classes: int


@dataclass(frozen=True)
class Recipe:
    """What makes an example: its data, its model, its own options and its defaults."""

    name: str
    summary: str  # one line, the --help description
    data: Callable[[Values, Callable[[str], None]], Data]  # (args, say) -> Data
    model: Callable[[Values, Data, precision.Path], nn.Module]
    options: tuple[Setting, ...] = ()  # the example's own, besides COMMON
    defaults: Mapping[str, Any] = field(default_factory=dict)  # COMMON defaults this example changes
    parallel: str = "ddp"  # "ddp": one process per GPU (or CPU rank); "dp": one process, DataParallel
    default_workers: Callable[[int], int] = lambda cpus: 0  # DataLoader workers from the CPUs per process
    elastic: bool = False  # the world may change size between restarts: trainpod.examples.elastic

    def settings(self) -> tuple[Setting, ...]:
        common = tuple(dataclasses.replace(s, default=self.defaults[s.name]) if s.name in self.defaults else s
                       for s in COMMON)
        return common + self.options


# --- pieces ----------------------------------------------------------------------------------------


def parse_options(recipe: Recipe, argv: list[str] | None = None, env: Mapping[str, str] | None = None) -> Values:
    args = settings.parse_args(f"trainpod.examples ({recipe.name})", recipe.summary, recipe.settings(), argv,
                               os.environ if env is None else env)
    if args.backend is None:
        args.backend = "nccl" if torch.cuda.is_available() and recipe.parallel == "ddp" else "gloo"
    if args.backend == "nccl" and not torch.cuda.is_available():
        origin = args.origins["backend"]
        raise invalid(origin, "nccl", "gloo: NCCL needs CUDA, and torch sees no GPU here")
    return args


def lr_schedule(total_steps: int) -> Callable[[int], float]:
    """LR factor for the step after `done` steps: linear warm-up, then a cosine down to 0 at the end."""
    warmup = max(1, round(WARMUP_FRACTION * total_steps))

    def factor(done: int) -> float:
        if done < warmup:
            return (done + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (done - warmup) / max(1, total_steps - warmup))))

    return factor


def seed_everything(seed: int, device: torch.device) -> None:
    # The same seed on every rank: identical initial weights, and the same run gives the same
    # weights again (which resuming from a checkpoint relies on).
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if device.type == "cuda":
        # cuDNN's autotuner picks kernels by timing them, so two runs could differ; some CUDA ops
        # have no deterministic kernel at all: warn about those rather than refuse to train.
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        torch.use_deterministic_algorithms(True, warn_only=True)
    else:
        torch.use_deterministic_algorithms(True)


def device_for(recipe: Recipe, backend: str) -> torch.device:
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        return device
    if recipe.parallel == "dp" and torch.cuda.is_available():
        return torch.device("cuda", 0)  # DataParallel's output device; the replicas use every GPU
    return torch.device("cpu")


def process_group_device(backend: str, device: torch.device) -> torch.device | None:
    # NCCL is told the rank's GPU: it binds its communicator to it, and barrier() does not warn that
    # it guesses the device.
    return device if backend == "nccl" and device.type == "cuda" else None


def init_distributed(backend: str, device: torch.device) -> None:
    device_id = process_group_device(backend, device)
    if "RANK" in os.environ:
        # env://: torchrun set MASTER_ADDR/PORT, RANK, WORLD_SIZE; under a keeper, a replacement joins its generation.
        inprocess.init_process_group(backend, device_id=device_id)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, device_id=device_id)


def wrap(model: nn.Module, recipe: Recipe, device: torch.device, init_sync: bool = True) -> nn.Module:
    if recipe.parallel == "dp":
        # DataParallel splits each batch over the visible GPUs inside this one process.
        return nn.DataParallel(model) if device.type == "cuda" and torch.cuda.device_count() > 1 else model
    # A resumed run ends with the same bits as an uninterrupted one only if its gradients add up in the same order.
    return distributed.reproducible_ddp(model, device_ids=[device.index] if device.type == "cuda" else None,
                                       init_sync=init_sync)


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, (DistributedDataParallel, nn.DataParallel)) else model


def sync(device: torch.device) -> None:
    # CUDA runs asynchronously: without this, a timestamp says when work was queued, not done.
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    if dist.get_world_size() > 1:
        dist.all_reduce(tensor)
    return tensor


def broadcast_weights(model: nn.Module) -> None:
    """Rank 0's parameters and buffers on every rank: what DDP's construction does unless told not to."""
    if dist.get_world_size() > 1:
        with torch.no_grad():
            for parameter in model.parameters():
                dist.broadcast(parameter, 0)
        sync_buffers(model)


def sync_buffers(model: nn.Module) -> None:
    """Rank 0's buffers (BatchNorm statistics) on every rank. DDP broadcasts them before each
    forward, so each rank's own last update is never used; after training it would still make
    the ranks' checksums differ."""
    if dist.get_world_size() > 1:
        for buffer in model.buffers():
            dist.broadcast(buffer, 0)


def make_loader(train_set: Dataset, sampler: ResumableDistributedSampler, args: Values, workers: int,
                device: torch.device) -> DataLoader:
    # A data set that seeds its augmentation per (epoch, index) gets the epoch with every index.
    indices = EpochIndices(sampler) if getattr(train_set, "wants_epoch", False) else sampler
    # An own generator: the DataLoader draws a seed per epoch, and should not take it from (and so
    # shift) the global stream that the model's initialisation came from. The workers share the
    # rank's process group, so torchrun's SIGTERM reaches them too: they ignore it.
    return DataLoader(
        train_set, batch_size=args.batch_size, sampler=indices, num_workers=workers, pin_memory=device.type == "cuda",
        generator=torch.Generator().manual_seed(args.seed), worker_init_fn=ignore_sigterm,
        persistent_workers=workers > 0, prefetch_factor=4 if workers > 0 else None,
    )  # fmt: skip


def gpus_used(recipe: Recipe, device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    return torch.cuda.device_count() if recipe.parallel == "dp" else 1


def cpus_per_process() -> int:
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 1
    return max(1, cpus // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


class TrainState:
    """What a checkpoint holds, and the checkpoint calls every rank makes together."""

    def __init__(self, recipe: Recipe, checkpointer: Checkpointer | None, stateful: dict, sampler, rank: int,
                 feed: ElasticFeed | None = None, host_copy: inprocess.HostCopy | None = None,
                 device: torch.device | None = None):
        self.recipe, self.checkpointer, self.stateful = recipe, checkpointer, stateful
        self.sampler, self.rank, self.feed = sampler, rank, feed
        self.device = device or torch.device("cpu")  # where the process group's collectives take their tensors
        self.host_copy = host_copy if checkpointer is not None else None  # every rank's, with in-process recovery
        self.fatal: CheckpointError | None = None  # rank 0: a save that no retry can fix, raised by the Checkpointer
        self.resumed: str | None = None  # the line that says which checkpoint resume() loaded

    def failed(self) -> int:
        """Rank 0: the exit code (73) of a save that cannot succeed, as soon as it failed; else 0.
        Every rank passes it to the per-step stop vote, so all stop after the same step."""
        if self.fatal is None and self.checkpointer is not None:
            self.fatal = self.checkpointer.fatal
        return self.fatal.exit_code if self.fatal is not None else 0

    def _keep_fatal(self, call) -> None:
        try:
            call()
        except CheckpointError as error:
            if error.exit_code != EXIT_CANTCREAT:
                raise
            self.fatal = error  # already said in one line by the Checkpointer; the vote stops every rank

    def close(self) -> None:
        """Every save durable (rank 0); a save that cannot succeed is kept for failed(), not raised."""
        if self.checkpointer is not None:
            self._keep_fatal(self.checkpointer.close)

    def resume(self) -> tuple[int, list]:
        """(step, loss curve) of the newest good checkpoint, its state restored; (0, []) without one."""
        resumed, where = self._from_host_copy(), " (from this process's memory)"
        if resumed is None:
            resumed, where = (self.checkpointer.load_latest() if self.checkpointer else None), ""
        same = self._same_everywhere(resumed)
        if not same and self.host_copy is not None:  # (every rank knows the same: all of them check again)
            if where:  # the replacement found another checkpoint than this survivor's copy: the disk decides
                resumed, where = self.checkpointer.load_latest(), ""
            same = self._same_everywhere(resumed)
        if not same:
            raise self._different(resumed)
        if resumed is None:
            return 0, []
        step, state = resumed
        try:
            for name, obj in self.stateful.items():
                # A disabled GradScaler saves {}, which an enabled one refuses: --amp turned on at
                # resume (on CUDA) starts the scaler afresh.
                if name != "scaler" or state[name]:
                    obj.load_state_dict(state[name])
            self.sampler.load_state_dict(state["sampler"])
            if self.feed is not None:
                self.feed.load_state_dict(state["elastic"])
            # An elastic job may resume on more ranks than saved their RNG states: a new rank takes
            # rank 0's. The data's randomness is seeded per sample and epoch, so this reaches only
            # ops that draw at random (dropout); on the same world every rank gets its own back.
            rngs = state["rng"]
            set_rng_state(rngs[self.rank] if self.rank < len(rngs) else rngs[0])
        except (KeyError, IndexError, ValueError, RuntimeError, TypeError) as exc:
            # Another model, optimizer or world: retrying would fail the same way.
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ConfigError(
                f"the checkpoint of step {step} in {self.checkpointer.directory} does not fit this {self.recipe.name} job "
                f"({type(exc).__name__}: {first}): point --checkpoint-dir at this job's own directory"
            ) from None
        # Said by the caller after its `world N` line: a log reader (compose/timeline.py) starts a
        # world's part of the log at that line, and this line belongs to it.
        self.resumed = f"{self.recipe.name}: resumed from the checkpoint of step {step} (epoch {state['sampler']['epoch']}){where}"
        return step, state["loss_curve"]

    def _from_host_copy(self) -> tuple[int, Any] | None:
        """A survivor of an in-process recovery: the checkpoint it kept in memory, if it is the newest on disk
        (a save that failed, or was lost with rank 0, is not); else None."""
        copy = self.host_copy
        if copy is None or copy.step is None or self.checkpointer.newest_step() != copy.step:
            return None
        progress.committed(copy.step)  # what this attempt starts from, as load_latest() reports it
        return copy.step, copy.restore()

    def _same_everywhere(self, resumed: tuple[int, Any] | None) -> bool:
        """Whether every rank found the newest checkpoint at the same step (`resumed`'s; none: 0). Ranks that resumed from different
        checkpoints would train on diverging weights, or one would start over: a checkpoint directory that each
        node has for itself, not shared. One all_reduce, of the greatest step and of the least (an in-process
        recovery's time grows with each collective it makes, on a host with fewer cores than ranks)."""
        if self.checkpointer is None or not dist.is_initialized() or dist.get_world_size() == 1:
            return True
        step = resumed[0] if resumed else 0
        bounds = torch.tensor([step, -step], dtype=torch.int64, device=self.device)
        dist.all_reduce(bounds, op=dist.ReduceOp.MAX)
        return int(bounds[0]) == -int(bounds[1])

    def _different(self, resumed: tuple[int, Any] | None) -> ConfigError:
        """The error of ranks that found different newest checkpoints, naming each one's (every rank calls this)."""
        steps: list = [None] * dist.get_world_size()
        dist.all_gather_object(steps, resumed[0] if resumed else 0)
        found = ", ".join(f"rank {r}: {s or 'none'}" for r, s in enumerate(steps))
        return ConfigError(f"the ranks found different newest checkpoints in {self.checkpointer.directory} ({found}): "
                           "--checkpoint-dir must be one directory shared by every node (a shared volume or "
                           "file system), or a local one per node with each checkpoint in the nodes' memory too "
                           "(trainpod run --peer-copies)")

    def save(self, step: int, loss_curve: list) -> None:
        """Every rank's RNG state goes into rank 0's checkpoint: a collective, so every rank calls this."""
        gathered: list = [None] * dist.get_world_size()
        pending = self.feed.ledger.take_pending() if self.feed is not None else None
        dist.all_gather_object(gathered, (rng_state(), pending))
        rngs = [rng for rng, _ in gathered]
        extra = {}
        if self.feed is not None:
            self.feed.commit([p for _, p in gathered])  # every rank: the ledgers stay equal
            extra["elastic"] = self.feed.state_dict()
        if self.checkpointer is None or self.fatal is not None or (self.rank != 0 and self.host_copy is None):
            return
        state = {name: obj.state_dict() for name, obj in self.stateful.items()}
        state.update({"sampler": self.sampler.state_dict(), "rng": rngs, "loss_curve": loss_curve, **extra})
        if self.rank == 0:
            self._keep_fatal(lambda: self.checkpointer.save(step, state))
        if self.host_copy is not None:
            self.host_copy.keep(step, state)


@torch.no_grad()
def evaluate(model: nn.Module, test_set: Dataset, device: torch.device, rank: int, world: int, path: precision.Path) -> float:
    # Every world-th sample, not a DistributedSampler: that one pads the shards with repeats.
    shard = Subset(test_set, range(rank, len(test_set), world))
    counts = torch.zeros(2, dtype=torch.int64, device=device)  # correct, seen
    model.eval()
    for images, labels in DataLoader(shard, batch_size=EVAL_BATCH):
        with path.autocast():
            predicted = model(images.to(device)).argmax(dim=1)
        counts[0] += (predicted == labels.to(device)).sum()
        counts[1] += len(labels)
    model.train()
    all_reduce(counts)
    return counts[0].item() / max(counts[1].item(), 1)


# --- the run ---------------------------------------------------------------------------------------


def main(recipe: Recipe, argv: list[str] | None = None) -> int:
    """Run `recipe` as a training script; its exit code (0, 143 after SIGTERM, 64/78 for bad input)."""
    started = reporting.process_start_time()
    try:
        args = parse_options(recipe, argv)
        grace = term_grace()  # checked first: a bad value is a configuration error, not a crash later
        return train_rank(recipe, args, grace, started)
    except TrainpodError as error:
        print(f"{recipe.name}: error: {error}", file=sys.stderr, flush=True)
        return error.exit_code


def train_rank(recipe: Recipe, args: Values, grace: float, started: float) -> int:
    """This rank's whole run: what it makes once, then train() in every process group it belongs to."""
    rank = int(os.environ.get("RANK", "0"))
    bar = reporting.Progress(total_steps=0, epochs=args.epochs, enabled=rank == 0)
    checkpointer = Checkpointer(args.checkpoint_dir, keep=args.keep) if args.checkpoint_dir else None
    if checkpointer:
        # First, before the data and the process group: an unusable directory (78) or a full disk
        # (73) ends every rank here, and none is left waiting in init_process_group for a peer.
        checkpointer.check(write=rank == 0)
    tensorboard.check(args.tensorboard, rank)  # the same: an unusable directory ends rank 0 before any rank waits
    device = device_for(recipe, args.backend)
    path = precision.choose(args.amp, getattr(args, "apex", None), device, dtype=args.amp_dtype,
                            origin=args.origins.get("apex", ""))
    seed_everything(args.seed, device)
    data = recipe.data(args, bar.print)
    workers = args.workers if args.workers is not None else recipe.default_workers(cpus_per_process())
    run = Process(rank, bar, checkpointer, device, path, data, workers,
                  inprocess.HostCopy() if inprocess.enabled() else None, rng_state())

    init_distributed(args.backend, device)
    while True:
        try:
            return train(recipe, args, grace, started, run)
        except RuntimeError as error:  # a collective failed: with in-process recovery, a peer may have died
            if not inprocess.enabled():
                return peer_lost(recipe, rank, error)
            if checkpointer is not None and rank == 0:
                with contextlib.suppress(CheckpointError):
                    checkpointer.wait()  # on disk before any rank looks for the newest checkpoint
            try:
                generation = inprocess.recover(error, args.backend, process_group_device(args.backend, device))
            except RuntimeError as unrecovered:  # no replacement came: the agent restarts the group, or stops
                return peer_lost(recipe, rank, unrecovered)
            print(f"{recipe.name}: rank {rank}: {inprocess.gist(error)}: a rank was replaced, the group re-formed "
                  f"in-process (generation {generation})", file=sys.stderr, flush=True)
            set_rng_state(run.rng_after_data)  # where a replacement stands when it builds its model


def peer_lost(recipe: Recipe, rank: int, error: RuntimeError) -> int:
    """A collective that failed because a peer went away: one line and exit 1 (what the traceback's exit would be),
    and the agent of the rank that ended says why (a signal, the OOM killer, its exit code), on whichever node. Any
    other error goes on up, with its traceback."""
    if not distributed.peer_lost(error):
        raise error
    print(f"{recipe.name}: rank {rank}: {inprocess.gist(error)}: a peer rank went away (its agent says why)",
          file=sys.stderr, flush=True)
    return 1


@dataclass
class Process:
    """What a rank makes once, before its process group: every session of in-process recovery reuses it."""

    rank: int
    bar: reporting.Progress
    checkpointer: Checkpointer | None
    device: torch.device
    path: precision.Path
    data: Data
    workers: int
    host_copy: inprocess.HostCopy | None  # the last checkpoint in memory (in-process recovery only)
    rng_after_data: dict  # the RNG states after the data set was made: a new session's model starts from them


def train(recipe: Recipe, args: Values, grace: float, started: float, run: Process) -> int:
    """From a formed process group to the end: the model, the newest checkpoint, the loop, the metrics.
    (Its name is what the hang watch's lines show: `stopped at examples/harness.py:N in train`.)"""
    rank, bar, checkpointer, device, path, data, workers = (run.rank, run.bar, run.checkpointer, run.device, run.path,
                                                             run.data, run.workers)
    preemption = scalars = None
    try:
        world = dist.get_world_size()
        if recipe.parallel == "dp" and world > 1:
            # DataParallel syncs nothing between processes: a bigger world would train diverging copies.
            raise ConfigError(f"{recipe.name} runs as one process (DataParallel), but the world has {world}: "
                              "launch it with --nproc-per-node 1 on one node, or use cifar10-ddp")
        # A group re-formed in-process (generation 1 on: the same on every rank of it) restores a checkpoint right
        # after, on every rank the same (resume() checks): DDP's own check and broadcast of the weights as it is
        # made would be overwritten at once, and each collective of a recovery costs it time on a host with fewer
        # cores than ranks. With no checkpoint to restore, rank 0's weights are broadcast after resume() instead.
        reformed = inprocess.generation() > 0
        model = wrap(recipe.model(args, data, path).to(device), recipe, device, init_sync=not reformed)
        progress.measure(model)  # each step's own work, for the agent's straggler watch
        optimizer = path.optimizer(args.optimizer, model.parameters(), args.lr)
        loss_fn = nn.CrossEntropyLoss()
        feed = ElasticFeed(data.train, world, rank, args.seed) if recipe.elastic else None
        if feed is not None:
            sampler = feed.sampler
            loss_fn = nn.CrossEntropyLoss(reduction="sum")  # times the plan's loss_scale: the step's mean
            # The schedule runs on samples seen: steps per epoch change with the world.
            scheduler = feed.use_schedule(optimizer, args.lr, lr_schedule(args.epochs * len(data.train)))
        else:
            sampler = ResumableDistributedSampler(data.train, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
        loader = make_loader(feed.dataset if feed else data.train, sampler, args, workers, device)

        total_steps = args.epochs * math.ceil(sampler.num_samples / args.batch_size)
        if feed is None:
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule(total_steps))
        scaler = path.grad_scaler()
        stateful = {"model": unwrap(model), "optimizer": optimizer, "scheduler": scheduler, "scaler": scaler}
        state = TrainState(recipe, checkpointer, stateful, sampler, rank, feed, run.host_copy, device)
        step, loss_curve = state.resume()
        if reformed and not step:
            broadcast_weights(unwrap(model))
        first_epoch = sampler.state_dict()["epoch"] if step else 1
        if feed is not None:
            total_steps = step + feed.remaining_steps(args.epochs, args.batch_size)  # at this world
            feed.started(step)
            if checkpointer is None:
                bar.print(f"{recipe.name}: no --checkpoint-dir: a membership change restarts training from the start")
        if args.max_steps:
            total_steps = min(total_steps, args.max_steps)
        bar.total_steps = total_steps
        bar.print(f"{recipe.name}: world {world}, backend {args.backend}, {path.name} (apex: {path.apex_note}), "
                  f"{total_steps} steps of {args.batch_size} per process, {workers} loader worker(s)")
        if state.resumed:
            bar.print(state.resumed)
        throughput = reporting.Throughput(warmup_steps=WARMUP_STEPS)
        window = torch.zeros(2, device=device)  # loss sum and steps since the last log point
        loss, rate, first_step_at = (loss_curve[-1][1] if loss_curve else None), 0.0, None
        # From here on a SIGTERM stops training after a step. Not before: until the loop runs there
        # is nothing to save, and a rank blocked in init_process_group (a restart whose peers are
        # gone) would hold a deferred SIGTERM until torchrun's SIGKILL, --term-grace later.
        preemption = Preemption(grace)
        scalars = tensorboard.Scalars(args.tensorboard, rank, step)
        training_started = time.time()
        saved_step = step  # the last step whose state is checkpointed (and whose ledger is committed)
        own_work = 0.0  # seconds of the last forward and backward (failpoints.slow doubles them)
        for epoch in range(first_epoch, args.epochs + 1):
            if step >= total_steps:  # resumed from the last step's checkpoint
                break
            sampler.set_epoch(epoch)  # a different, still seeded, shuffle each epoch
            for batch in loader:
                if feed is not None:  # the padding cut off: this rank may train on fewer samples, or none
                    ids, images, labels, loss_scale, delivered, trained = feed.cut(batch)
                else:
                    (images, labels), loss_scale = batch, 1.0
                    delivered = len(labels)
                    trained = delivered * world  # DDP keeps ranks in step and the sampler gives every rank equal batches
                images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
                failpoints.slow(step + 1, own_work)  # a test's straggler (TRAINPOD_FAILPOINTS=slow@STEP)
                failpoints.pace()  # a test's job at one pace on any machine (TRAINPOD_FAILPOINTS=pace@MS)
                began = time.perf_counter()
                # No keyword: Apex's fused optimizers take none (both set the gradients to None).
                optimizer.zero_grad()
                with path.autocast():
                    batch_loss = loss_fn(model(images), labels) * loss_scale
                scaler.scale(batch_loss).backward()
                own_work = time.perf_counter() - began
                scaler.unscale_(optimizer)  # the clipping must see the true gradients, not scaled ones
                nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
                scaler.step(optimizer)  # skips the step if the scaled gradients overflowed
                scaler.update()
                if feed is not None:
                    feed.after_step(epoch, ids, delivered)  # sampler position, ledger, the next step's LR
                else:
                    scheduler.step()
                    sampler.advance(delivered)  # what this rank trained on (the loader reads ahead)
                step += 1
                progress.step(step, samples=delivered)
                failpoints.crash(step)
                window[0] += batch_loss.detach().float()
                window[1] += 1
                if step in (1, WARMUP_STEPS):
                    sync(device)
                throughput.step(trained)
                if first_step_at is None:
                    first_step_at = time.time()

                log_point = step == 1 or step % args.log_every == 0 or step == total_steps
                if log_point:  # the same steps on every rank: all_reduce is collective
                    all_reduce(window)
                    loss = (window[0] / window[1]).item()
                    loss_curve.append([step, loss])
                    window.zero_()
                    rate = throughput.window()
                    scalars.add(step, train_loss=loss, train_samples_per_sec=rate or None,
                                train_lr=optimizer.param_groups[0]["lr"], train_world_size=world)
                bar.update(epoch, step, loss, rate, log_point)
                checkpoint_step = checkpointer is not None and step % args.checkpoint_every == 0
                if checkpoint_step:
                    state.save(step, loss_curve)
                    saved_step = step
                # A collective too, after every step on every rank: a SIGTERM anywhere, or a checkpoint
                # that cannot be saved (rank 0), stops every rank after this same step.
                if preemption.should_stop(error=state.failed()):
                    if preemption.error:  # the Checkpointer's line said why and what a new run resumes from
                        distributed.shutdown()
                        return preemption.error
                    if checkpointer:
                        if not checkpoint_step:
                            state.save(step, loss_curve)
                        state.close()  # durable before any rank exits
                        saved = f"checkpoint of step {step} saved"
                    else:
                        saved = "no --checkpoint-dir: nothing saved"
                    bar.print(f"{recipe.name}: stopped by SIGTERM at step {step}; {saved}")
                    distributed.shutdown()
                    return state.failed() or EXIT_CODE
                if step >= total_steps:
                    break
        sync(device)
        train_s = time.time() - training_started
        if feed is not None and step != saved_step:
            # The ledger committed up to the last step (and checkpointed, with a --checkpoint-dir), so
            # that the report below and a later resume both see the whole run.
            state.save(step, loss_curve)
        state.close()  # every save durable before the job reports success
        if preemption.should_stop(error=state.failed()) and preemption.error:  # the last save failed: every rank stops
            distributed.shutdown()
            return preemption.error
        bar.close()

        sync_buffers(unwrap(model))
        accuracy = evaluate(model, data.test, device, rank, world, path)
        checksum = reporting.state_dict_checksum(unwrap(model).state_dict())
        rank_checksums: list[str | None] = [None] * world
        dist.all_gather_object(rank_checksums, checksum)

        scalars.add(step, test_accuracy=accuracy)
        scalars.close()
        if rank == 0:
            metrics = {
                "example": recipe.name,
                "dataset": data.name,
                "backend": args.backend,
                "device": device.type,
                "parallel": recipe.parallel,
                "gpus_per_process": gpus_used(recipe, device),
                "amp": args.amp,
                "precision": path.name,
                "apex": path.apex_note,
                "optimizer": type(optimizer).__name__,
                "world_size": world,
                "nnodes": int(os.environ.get("GROUP_WORLD_SIZE", "1")),
                "epochs": args.epochs,
                "steps": step,
                "batch_size": args.batch_size,
                "global_batch_size": args.batch_size * world,
                "lr": args.lr,
                "seed": args.seed,
                "workers": workers,
                "train_samples": len(data.train),
                "test_samples": len(data.test),
                "loss_curve": loss_curve,
                "final_loss": loss,
                "test_accuracy": accuracy,
                "samples_per_sec": throughput.overall(),
                # None when this run trained no step (it resumed from the last step's checkpoint).
                "time_to_first_step_s": None if first_step_at is None else first_step_at - started,
                "first_step_unix": first_step_at,  # wall clock, for timing from outside (bench/)
                "train_s": train_s,
                "elapsed_s": time.time() - started,
                "checksum": checksum,
                "rank_checksums": rank_checksums,
                "torch": torch.__version__,
                "in_process_generation": inprocess.generation(),  # ranks replaced in-process so far (trainpod.agent.keeper)
            }
            if feed is not None:
                report = feed.report()
                metrics.update({
                    "exactly_once": report.ok,
                    "ledger": {"epochs": report.epochs, "complete": report.complete, "problems": report.problems},
                    "membership": feed.membership,
                    "batch_lr_rule": BATCH_LR_RULE,
                    "reference_world": feed.schedule.reference_world,
                })
            written = reporting.write_json_atomic(Path(args.output_dir) / reporting.METRICS_FILE, metrics)
            bar.print(f"{recipe.name}: test accuracy {accuracy:.4f}, final loss {loss:.4f}, wrote {written}")
            bar.print(reporting.metrics_line(reporting.summary(metrics, written)))
        distributed.shutdown()  # barrier, then a teardown that cannot deadlock in gloo
    finally:
        if preemption is not None:
            preemption.close()
        if scalars is not None:
            scalars.close()
        distributed.shutdown(barrier=False)  # after an error; a no-op after the clean shutdown
    return 0
