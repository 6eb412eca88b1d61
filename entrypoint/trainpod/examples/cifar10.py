"""CIFAR-10 with DistributedDataParallel: the example trainpod runs to show a cluster works.

    torchrun --nnodes 1 --nproc-per-node 2 -m trainpod.examples.cifar10 --epochs 2

It trains on the real CIFAR-10 python batches when --data-dir holds them, else on synthetic data
of the same shape, so it runs anywhere without downloads. Rank 0 prints progress and writes
{output_dir}/metrics.json (loss curve, samples/s, a checksum of the final weights, ...), and prints
the same JSON as one `trainpod-metrics: ` line. Every option also reads a TRAINPOD_* variable.
Started without torchrun (plain `python -m`), it trains as a world of one.

SIGTERM (pre-emption, `docker stop`) stops it after the current step: the ranks agree, save a
checkpoint of that step (with --checkpoint-dir) and exit 143 within TRAINPOD_TERM_GRACE seconds;
the next run resumes from it. A checkpoint holds the model, the optimizer, the LR schedule, the
AMP grad scaler, the sampler's position and every rank's RNG state, so a resumed run ends with
the same weights as one that was never stopped.
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
from trainpod.checkpoint import Checkpointer
from trainpod.errors import ConfigError
from trainpod.examples import reporting
from trainpod.examples.cifar_data import CifarFormatError, find_batches_dir, load_cifar10, synthetic_cifar10
from trainpod.preemption import EXIT_CODE, Preemption, ignore_sigterm, term_grace
from trainpod.rng import rng_state, set_rng_state
from trainpod.samplers import ResumableDistributedSampler

EXAMPLE = "cifar10-ddp"
SYNTHETIC_TEST_SAMPLES = 1024
WARMUP_STEPS = 5  # left out of samples/s: the first steps allocate memory and warm caches
# SGD with momentum 0.9 peaking at lr 0.1 is brisk for a net this small: without a cap on the
# gradient norm, a rare large step made the loss jump back up late in training.
MAX_GRAD_NORM = 1.0
# The LR rises linearly over the first 5% of the steps (large steps from random weights are the
# least reliable), then follows a cosine down to 0 at the last step. With a peak of 0.1 the mean
# LR is about 0.05: even a short run (the compose demo's 32 steps) gets its loss well down.
WARMUP_FRACTION = 0.05
PER_PARAMETER_BUCKET_MB = 1e-6  # a cap below any parameter's size: a bucket closes after one parameter
AMP_DTYPE = {"cpu": torch.bfloat16, "cuda": torch.float16}  # what --amp computes in, by device type


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


def boolean(text: str) -> bool:
    name = text.strip().lower()
    if name not in ("1", "true", "yes", "on", "0", "false", "no", "off", ""):
        raise argparse.ArgumentTypeError(f"expected 1/true/yes/on or 0/false/no/off, got {text!r}")
    return name in ("1", "true", "yes", "on")


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
    option("--lr", "TRAINPOD_LR", "0.1", "peak SGD learning rate (momentum 0.9; linear warm-up, then cosine decay)", type=float)
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
    amp = env.get("TRAINPOD_AMP", "0")
    try:
        amp = boolean(amp)
    except argparse.ArgumentTypeError as e:
        p.error(f"TRAINPOD_AMP={amp!r}: {e}")
    p.add_argument("--amp", action=argparse.BooleanOptionalAction, default=amp,
                   help="mixed precision: autocast to bfloat16 on CPU, float16 with a grad scaler on CUDA (env TRAINPOD_AMP, default off)")
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


def lr_schedule(total_steps: int):
    """LR factor for the step after `done` steps: linear warm-up, then a cosine down to 0 at the end."""
    warmup = max(1, round(WARMUP_FRACTION * total_steps))

    def factor(done: int) -> float:
        if done < warmup:
            return (done + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (done - warmup) / max(1, total_steps - warmup))))

    return factor


def resume(checkpointer, stateful: dict, sampler, rank: int, say) -> tuple[int, list]:
    """(step, loss curve) of the newest good checkpoint, its state restored; (0, []) without one.

    `stateful` names what has a state_dict() besides the sampler: model, optimizer, scheduler, scaler.
    """
    resumed = checkpointer.load_latest() if checkpointer else None
    if resumed is None:
        return 0, []
    step, state = resumed
    for name, obj in stateful.items():
        # A disabled GradScaler saves {}, which an enabled one refuses: --amp turned on at resume
        # (on CUDA) starts the scaler afresh.
        if name != "scaler" or state[name]:
            obj.load_state_dict(state[name])
    sampler.load_state_dict(state["sampler"])
    set_rng_state(state["rng"][rank])
    say(f"{EXAMPLE}: resumed from the checkpoint of step {step} (epoch {state['sampler']['epoch']})")
    return step, state["loss_curve"]


def save_checkpoint(checkpointer, step: int, stateful: dict, sampler, loss_curve: list, rank: int) -> None:
    """Every rank's RNG state goes into rank 0's checkpoint: a collective, so every rank calls this."""
    rngs: list = [None] * dist.get_world_size()
    dist.all_gather_object(rngs, rng_state())
    if rank == 0:
        state = {name: obj.state_dict() for name, obj in stateful.items()}
        checkpointer.save(step, {**state, "sampler": sampler.state_dict(), "rng": rngs, "loss_curve": loss_curve})


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
    try:
        grace = term_grace()  # checked first: a bad value is a configuration error, not a crash later
    except ConfigError as e:
        print(f"cifar10: {e}", file=sys.stderr)
        return e.exit_code
    return train(args, grace, started)


def train(args: argparse.Namespace, grace: float, started: float) -> int:
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
    preemption = None
    try:
        world = dist.get_world_size()
        model = make_model().to(device)
        # One bucket per parameter: with more than 2 ranks the sum of a gradient element depends on
        # where the element sits in its bucket, and DDP lays buckets out differently on the first
        # step of every process (registration order) than later (the order gradients became
        # ready). A resumed run would then add in another order than an uninterrupted one, and
        # its weights would differ in the last bits. Alone in its bucket, a parameter always
        # sits in the same place.
        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                        bucket_cap_mb_list=[PER_PARAMETER_BUCKET_MB])
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        loss_fn = nn.CrossEntropyLoss()
        sampler = ResumableDistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
        # An own generator: the DataLoader draws a seed per epoch, and should not take it from
        # (and so shift) the global stream that the model's initialisation came from. The workers
        # share the rank's process group, so torchrun's SIGTERM reaches them too: they ignore it.
        loader = DataLoader(
            train_set, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
            pin_memory=device.type == "cuda", generator=torch.Generator().manual_seed(args.seed),
            worker_init_fn=ignore_sigterm,
        )  # fmt: skip

        total_steps = args.epochs * math.ceil(sampler.num_samples / args.batch_size)
        if args.max_steps:
            total_steps = min(total_steps, args.max_steps)
        progress.total_steps = total_steps
        precision = f", amp {str(AMP_DTYPE[device.type]).replace('torch.', '')}" if args.amp else ""
        progress.print(f"{EXAMPLE}: world {world}, backend {args.backend}{precision}, {total_steps} steps of {args.batch_size} per rank")

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule(total_steps))
        # float16 needs loss scaling (its gradients underflow); bfloat16 has float32's range.
        scaler = torch.amp.GradScaler(device.type, enabled=args.amp and device.type == "cuda")
        stateful = {"model": model.module, "optimizer": optimizer, "scheduler": scheduler, "scaler": scaler}
        checkpointer = Checkpointer(args.checkpoint_dir, keep=args.keep) if args.checkpoint_dir else None
        step, loss_curve = resume(checkpointer, stateful, sampler, rank, progress.print)
        first_epoch = sampler.state_dict()["epoch"] if step else 1
        throughput = reporting.Throughput(warmup_steps=WARMUP_STEPS)
        window = torch.zeros(2, device=device)  # loss sum and steps since the last log point
        loss, rate, first_step_at = (loss_curve[-1][1] if loss_curve else None), 0.0, None
        # From here on a SIGTERM stops training after a step. Not before: until the loop runs there
        # is nothing to save, and a rank blocked in init_process_group (a restart whose peers are
        # gone) would hold a deferred SIGTERM until torchrun's SIGKILL, --term-grace later.
        preemption = Preemption(grace)
        training_started = time.time()
        for epoch in range(first_epoch, args.epochs + 1):
            if step >= total_steps:  # resumed from the last step's checkpoint
                break
            sampler.set_epoch(epoch)  # a different, still seeded, shuffle each epoch
            for images, labels in loader:
                images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
                optimizer.zero_grad(set_to_none=True)
                with torch.autocast(device.type, dtype=AMP_DTYPE[device.type], enabled=args.amp):
                    batch_loss = loss_fn(model(images), labels)
                scaler.scale(batch_loss).backward()
                scaler.unscale_(optimizer)  # the clipping must see the true gradients, not scaled ones
                nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
                scaler.step(optimizer)  # skips the step if the scaled gradients overflowed
                scaler.update()
                scheduler.step()
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
                checkpoint_step = checkpointer is not None and step % args.checkpoint_every == 0
                if checkpoint_step:
                    save_checkpoint(checkpointer, step, stateful, sampler, loss_curve, rank)
                if preemption.should_stop():  # a collective too: after every step, on every rank
                    if checkpointer:
                        if not checkpoint_step:
                            save_checkpoint(checkpointer, step, stateful, sampler, loss_curve, rank)
                        checkpointer.close()  # durable before any rank exits
                        saved = f"checkpoint of step {step} saved"
                    else:
                        saved = "no --checkpoint-dir: nothing saved"
                    progress.print(f"{EXAMPLE}: stopped by SIGTERM at step {step}; {saved}")
                    distributed.shutdown()
                    return EXIT_CODE
                if step >= total_steps:
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
                "amp": args.amp,
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
                # None when this run trained no step (it resumed from the last step's checkpoint).
                "time_to_first_step_s": None if first_step_at is None else first_step_at - started,
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
        if preemption is not None:
            preemption.close()
        distributed.shutdown(barrier=False)  # after an error; a no-op after the clean shutdown
    return 0


if __name__ == "__main__":
    sys.exit(main())
