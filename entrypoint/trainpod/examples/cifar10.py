"""CIFAR-10 with DistributedDataParallel: the example trainpod runs to show a cluster works.

    trainpod run --example cifar10-ddp -- --epochs 2
    torchrun --nproc-per-node 2 -m trainpod.examples.cifar10 --epochs 2     # the same, by hand

It trains on the real CIFAR-10 python batches when --data-dir holds them, else on a learnable
synthetic set of the same shape, so it runs anywhere without downloads. Everything else
(options, checkpoints and exact resume, the SIGTERM stop, metrics) is the shared harness's:
see trainpod.examples.harness. Started without torchrun (plain `python -m`), it trains as a
world of one. The DataParallel and mixed-precision variants (cifar10_dp, cifar10_amp) reuse
this module's data and model.
"""

from __future__ import annotations

import sys

from torch import nn

from trainpod.errors import ConfigError
from trainpod.examples import harness
from trainpod.examples.cifar_data import CifarFormatError, find_batches_dir, load_cifar10, synthetic_cifar10
from trainpod.examples.options import CIFAR

SYNTHETIC_TEST_SAMPLES = 1024
CLASSES = 10

DATA_OPTIONS = CIFAR


def load_data(args, say) -> harness.Data:
    batches = find_batches_dir(args.data_dir)
    if batches is not None:
        try:
            train, test = load_cifar10(batches)
        except CifarFormatError as exc:
            raise ConfigError(str(exc)) from None  # the same files fail the same way on every retry
        say(f"dataset: CIFAR-10 from {batches} ({len(train)} train, {len(test)} test)")
        return harness.Data("cifar10", train, test, CLASSES)
    if args.data_dir:
        say(f"dataset: no CIFAR-10 python batches in {args.data_dir}; using synthetic data")
    train, test = synthetic_cifar10(args.synthetic_samples, SYNTHETIC_TEST_SAMPLES, args.seed)
    say(f"dataset: synthetic ({len(train)} train, {len(test)} test, seed {args.seed})")
    return harness.Data("synthetic", train, test, CLASSES)


def make_model(head_norm: nn.Module | None = None) -> nn.Module:
    # GroupNorm, not BatchNorm: BatchNorm's running statistics differ per rank (each sees its own
    # batches), so the ranks' final weights, and their checksums, would not agree.
    def block(cin: int, cout: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.GroupNorm(4, cout), nn.ReLU(inplace=True)]

    head = [head_norm] if head_norm is not None else []
    return nn.Sequential(
        *block(3, 16), nn.AvgPool2d(2),  # 16x16
        *block(16, 32), nn.AvgPool2d(2),  # 8x8
        *block(32, 64), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), *head, nn.Linear(64, CLASSES),
    )  # fmt: skip


RECIPE = harness.Recipe(
    name="cifar10-ddp",
    summary=__doc__.split("\n\n")[0],
    data=load_data,
    model=lambda args, data, path: make_model(),
    options=DATA_OPTIONS,
)


def main(argv: list[str] | None = None) -> int:
    return harness.main(RECIPE, argv)


if __name__ == "__main__":
    sys.exit(main())
