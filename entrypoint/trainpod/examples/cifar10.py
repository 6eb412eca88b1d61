"""CIFAR-10 with DistributedDataParallel: the example trainpod runs to show a cluster works.

    torchrun --nnodes 1 --nproc-per-node 2 -m trainpod.examples.cifar10 --epochs 2

It trains on the real CIFAR-10 python batches when --data-dir holds them, else on synthetic data
of the same shape, so it runs anywhere without downloads. Rank 0 prints progress and writes
{output_dir}/metrics.json (loss curve, samples/s, a checksum of the final weights, ...), and prints
the same JSON as one `trainpod-metrics: ` line. Every option also reads a TRAINPOD_* variable.
Started without torchrun (plain `python -m`), it trains as a world of one.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Subset

from trainpod import distributed
from trainpod.checkpoint import Checkpointer, rng_state, set_rng_state
from trainpod.examples import reporting
from trainpod.examples.cifar_data import CifarFormatError, find_batches_dir, load_cifar10, synthetic_cifar10
from trainpod.samplers import ResumableDistributedSampler

EXAMPLE = "cifar10-ddp"
SYNTHETIC_TEST_SAMPLES = 1024
WARMUP_STEPS = 5  # left out of samples/s: the first steps allocate memory and warm caches
# SGD at lr 0.05 with momentum 0.9 is brisk for a net this small: without a cap on the gradient
# norm, a rare large step made the loss jump back up late in training.
MAX_GRAD_NORM = 1.0


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
    return value


def backend_name(text: str) -> str:
    name = text.strip().lower()
    if name not in ("gloo", "nccl"):
        raise argparse.ArgumentTypeError(f"expected gloo or nccl, got {text!r}")
    return name


def parse_args(argv: list[str] | None = None, env: dict[str, str] | None = None) -> argparse.Namespace:
    env = os.environ if env is None else env
    p = argparse.ArgumentParser(prog="trainpod.examples.cifar10", description=__doc__.split("\n\n")[0])

    def option(flag: str, var: str, default, help: str, **kwargs) -> None:
        # A job sets variables more easily than it edits a command line; a flag still wins.
        shown = "" if default is None else f", default {default}"
        value = env.get(var, default)
        if var in env and "type" in kwargs:
            try:  # here, or argparse blames the flag that was never given
                kwargs["type"](value)
            except (ValueError, argparse.ArgumentTypeError) as e:
                p.error(f"{var}={value!r}: {e}")
        p.add_argument(flag, default=value, help=f"{help} (env {var}{shown})", **kwargs)

    option("--data-dir", "TRAINPOD_DATA_DIR", None, "directory with cifar-10-batches-py/ or the batch files; else synthetic data")
    option("--output-dir", "TRAINPOD_OUTPUT_DIR", "./output", "where rank 0 writes metrics.json")
    option("--epochs", "TRAINPOD_EPOCHS", "2", "epochs", type=positive_int)
    option("--batch-size", "TRAINPOD_BATCH_SIZE", "64", "batch size per rank", type=positive_int)
    option("--lr", "TRAINPOD_LR", "0.05", "SGD learning rate (momentum 0.9)", type=float)
    option("--seed", "TRAINPOD_SEED", "0", "seed for weights, data order and synthetic data", type=int)
    option("--backend", "TRAINPOD_BACKEND", None, "gloo (CPU) or nccl (GPU LOCAL_RANK); default nccl where CUDA is", type=backend_name)
    option("--synthetic-samples", "TRAINPOD_SYNTHETIC_SAMPLES", "4096", "synthetic training samples", type=positive_int)
    option("--workers", "TRAINPOD_WORKERS", "0", "DataLoader worker processes per rank", type=non_negative_int)
    option("--max-steps", "TRAINPOD_MAX_STEPS", None, "stop after this many steps (benchmarks)", type=positive_int)
    option("--log-every", "TRAINPOD_LOG_EVERY", "10", "steps between loss log points", type=positive_int)
    option("--checkpoint-dir", "TRAINPOD_CHECKPOINT_DIR", None, "save checkpoints here and resume from the newest; "
           "shared by all nodes (rank 0 writes)")
    option("--checkpoint-every", "TRAINPOD_CHECKPOINT_EVERY", "10", "steps between checkpoints", type=positive_int)
    option("--keep", "TRAINPOD_CHECKPOINT_KEEP", "3", "checkpoints kept", type=positive_int)
    args = p.parse_args(argv)
    if args.backend is None:
        args.backend = "nccl" if torch.cuda.is_available() else "gloo"
    return args


def make_model() -> nn.Module:
    # GroupNorm, not BatchNorm: BatchNorm's running statistics differ per rank (each sees its own
    # batches), so the ranks' final weights, and their checksums, would not agree.
    def block(cin: int, cout: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.GroupNorm(4, cout), nn.ReLU(inplace=True)]

    return nn.Sequential(
        *block(3, 16), nn.AvgPool2d(2),  # 16x16
        *block(16, 32), nn.AvgPool2d(2),  # 8x8
        *block(32, 64), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(64, 10),
    )  # fmt: skip


def seed_everything(seed: int, device: torch.device) -> None:
    # The same seed on every rank: identical initial weights, and the same run gives the same
    # weights again (which resuming from a checkpoint will rely on).
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if device.type == "cuda":
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    else:
        torch.use_deterministic_algorithms(True)


def load_data(args: argparse.Namespace, say) -> tuple[str, torch.utils.data.Dataset, torch.utils.data.Dataset]:
    batches = find_batches_dir(args.data_dir)
    if batches is not None:
        train, test = load_cifar10(batches)
        say(f"dataset: CIFAR-10 from {batches} ({len(train)} train, {len(test)} test)")
        return "cifar10", train, test
    if args.data_dir:
        say(f"dataset: no CIFAR-10 python batches in {args.data_dir}; using synthetic data")
    train, test = synthetic_cifar10(args.synthetic_samples, SYNTHETIC_TEST_SAMPLES, args.seed)
    say(f"dataset: synthetic ({len(train)} train, {len(test)} test, seed {args.seed})")
    return "synthetic", train, test


def resume(checkpointer, model, optimizer, sampler, rank: int, say) -> tuple[int, list]:
    """(step, loss curve) of the newest good checkpoint, its state restored; (0, []) without one."""
    resumed = checkpointer.load_latest() if checkpointer else None
    if resumed is None:
        return 0, []
    step, state = resumed
    model.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    sampler.load_state_dict(state["sampler"])
    set_rng_state(state["rng"][rank])
    say(f"{EXAMPLE}: resumed from the checkpoint of step {step} (epoch {state['sampler']['epoch']})")
    return step, state["loss_curve"]


def save_checkpoint(checkpointer, step: int, model, optimizer, sampler, loss_curve: list, rank: int) -> None:
    """Every rank's RNG state goes into rank 0's checkpoint: a collective, so every rank calls this."""
    rngs: list = [None] * dist.get_world_size()
    dist.all_gather_object(rngs, rng_state())
    if rank == 0:
        checkpointer.save(step, {
            "model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
            "sampler": sampler.state_dict(), "rng": rngs, "loss_curve": loss_curve,
        })  # fmt: skip


def init_distributed(backend: str) -> None:
    if "RANK" in os.environ:
        dist.init_process_group(backend)  # env://: torchrun set MASTER_ADDR/PORT, RANK, WORLD_SIZE
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def sync(device: torch.device) -> None:
    # CUDA runs asynchronously: without this, a timestamp says when work was queued, not done.
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def evaluate(model: nn.Module, test_set, device: torch.device, rank: int, world: int) -> float:
    # Every world-th sample, not a DistributedSampler: that one pads the shards with repeats.
    shard = Subset(test_set, range(rank, len(test_set), world))
    counts = torch.zeros(2, dtype=torch.int64, device=device)  # correct, seen
    model.eval()
    for images, labels in DataLoader(shard, batch_size=256):
        predicted = model(images.to(device)).argmax(dim=1)
        counts[0] += (predicted == labels.to(device)).sum()
        counts[1] += len(labels)
    model.train()
    dist.all_reduce(counts)
    return counts[0].item() / max(counts[1].item(), 1)


def main(argv: list[str] | None = None) -> int:
    started = reporting.process_start_time()
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    progress = reporting.Progress(total_steps=0, epochs=args.epochs, enabled=rank == 0)

    if args.backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    seed_everything(args.seed, device)
    try:
        dataset, train_set, test_set = load_data(args, progress.print)
    except CifarFormatError as e:
        print(f"cifar10: {e}", file=sys.stderr)
        return 1

    init_distributed(args.backend)
    try:
        world = dist.get_world_size()
        model = make_model().to(device)
        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        loss_fn = nn.CrossEntropyLoss()
        sampler = ResumableDistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
        # An own generator: the DataLoader draws a seed per epoch, and should not take it from
        # (and so shift) the global stream that the model's initialisation came from.
        loader = DataLoader(
            train_set, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
            pin_memory=device.type == "cuda", generator=torch.Generator().manual_seed(args.seed),
        )  # fmt: skip

        total_steps = args.epochs * math.ceil(sampler.num_samples / args.batch_size)
        if args.max_steps:
            total_steps = min(total_steps, args.max_steps)
        progress.total_steps = total_steps
        progress.print(f"{EXAMPLE}: world {world}, backend {args.backend}, {total_steps} steps of {args.batch_size} per rank")

        checkpointer = Checkpointer(args.checkpoint_dir, keep=args.keep) if args.checkpoint_dir else None
        step, loss_curve = resume(checkpointer, model, optimizer, sampler, rank, progress.print)
        first_epoch = sampler.state_dict()["epoch"] if step else 1
        throughput = reporting.Throughput(warmup_steps=WARMUP_STEPS)
        window = torch.zeros(2, device=device)  # loss sum and steps since the last log point
        loss, rate, first_step_at = None, 0.0, None
        training_started = time.time()
        for epoch in range(first_epoch, args.epochs + 1):
            sampler.set_epoch(epoch)  # a different, still seeded, shuffle each epoch
            for images, labels in loader:
                images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
                optimizer.zero_grad(set_to_none=True)
                batch_loss = loss_fn(model(images), labels)
                batch_loss.backward()
                nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
                optimizer.step()
                sampler.advance(len(labels))  # what this rank trained on (the loader reads ahead)
                step += 1
                window[0] += batch_loss.detach()
                window[1] += 1
                if step in (1, WARMUP_STEPS):
                    sync(device)
                # DDP keeps ranks in step and the sampler gives every rank equal batches.
                throughput.step(len(labels) * world)
                if first_step_at is None:
                    first_step_at = time.time()

                log_point = step == 1 or step % args.log_every == 0 or step == total_steps
                if log_point:  # the same steps on every rank: all_reduce is collective
                    dist.all_reduce(window)
                    loss = (window[0] / window[1]).item()
                    loss_curve.append([step, loss])
                    window.zero_()
                    rate = throughput.window()
                progress.update(epoch, step, loss, rate, log_point)
                if checkpointer and step % args.checkpoint_every == 0:
                    save_checkpoint(checkpointer, step, model, optimizer, sampler, loss_curve, rank)
                if step == total_steps:
                    break
            if step == total_steps:
                break
        sync(device)
        train_s = time.time() - training_started
        if checkpointer:
            checkpointer.close()  # every save durable before the job reports success
        progress.close()

        accuracy = evaluate(model.module, test_set, device, rank, world)
        checksum = reporting.state_dict_checksum(model.module.state_dict())
        rank_checksums: list[str | None] = [None] * world
        dist.all_gather_object(rank_checksums, checksum)

        if rank == 0:
            metrics = {
                "example": EXAMPLE,
                "dataset": dataset,
                "backend": args.backend,
                "device": device.type,
                "world_size": world,
                "nnodes": int(os.environ.get("GROUP_WORLD_SIZE", "1")),
                "epochs": args.epochs,
                "steps": step,
                "batch_size": args.batch_size,
                "global_batch_size": args.batch_size * world,
                "lr": args.lr,
                "seed": args.seed,
                "train_samples": len(train_set),
                "test_samples": len(test_set),
                "loss_curve": loss_curve,
                "final_loss": loss,
                "test_accuracy": accuracy,
                "samples_per_sec": throughput.overall(),
                "time_to_first_step_s": first_step_at - started,
                "first_step_unix": first_step_at,  # wall clock, for timing from outside (bench/)
                "train_s": train_s,
                "elapsed_s": time.time() - started,
                "checksum": checksum,
                "rank_checksums": rank_checksums,
                "torch": torch.__version__,
            }
            path = reporting.write_json_atomic(Path(args.output_dir) / reporting.METRICS_FILE, metrics)
            progress.print(f"{EXAMPLE}: test accuracy {accuracy:.4f}, final loss {loss:.4f}, wrote {path}")
            progress.print(reporting.metrics_line(metrics))
        distributed.shutdown()  # barrier, then a teardown that cannot deadlock in gloo
    finally:
        distributed.shutdown(barrier=False)  # after an error; a no-op after the clean shutdown
    return 0


if __name__ == "__main__":
    sys.exit(main())
