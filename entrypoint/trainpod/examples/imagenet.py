"""ImageNet ResNet-50 with DistributedDataParallel, reading JPEGs the way real jobs do.

    trainpod run --example imagenet-ddp -- --data-dir /data/imagenet          # train/ and val/ inside
    trainpod run --example imagenet-ddp -- --image-size 64 --synthetic-classes 10   # no data: synthetic

The model is ResNet-50 (trainpod.examples.resnet: torchvision's architecture and names, defined
here since torchvision cannot sit beside CPU torch), or another depth with --arch (resnet18 trains
the same job at about a third of the parameters) and width with --width (8: 1/60 of them, for quick
runs and tests). With --data-dir, an ImageFolder tree of JPEGs is decoded with Pillow in DataLoader
workers with the usual training transforms (random resized crop, flip, normalisation), seeded
per (seed, epoch, sample) so that a resumed run sees the same batches; without it, a learnable
synthetic set of ImageNet-shaped samples held in memory. --image-size keeps CI small. The loop,
checkpoints, SIGTERM stop and metrics are the shared harness's (trainpod.examples.harness).

BatchNorm's running statistics are rank 0's: DDP broadcasts them before every forward, and the
harness once more after training, so every rank ends with the same weights and checksum.
"""

from __future__ import annotations

import sys

from trainpod.examples import harness
from trainpod.examples.imagenet_data import ImageFolder, SyntheticImageNet
from trainpod.examples.options import IMAGENET
from trainpod.examples.resnet import ARCHS

SYNTHETIC_TEST_FRACTION = 4  # a held-out synthetic set a quarter of the training set's size

OPTIONS = IMAGENET


def load_data(args, say) -> harness.Data:
    if args.data_dir:
        train = ImageFolder(args.data_dir, args.image_size, train=True, seed=args.seed)
        test = ImageFolder(args.data_dir, args.image_size, train=False, seed=args.seed)
        say(f"dataset: ImageFolder {train.root} ({len(train)} train, {len(test)} test, {train.num_classes} classes, "
            f"{args.image_size} px)")
        return harness.Data("imagefolder", train, test, train.num_classes)
    train = SyntheticImageNet(args.synthetic_samples, args.image_size, args.synthetic_classes, seed=args.seed)
    test = SyntheticImageNet(max(1, args.synthetic_samples // SYNTHETIC_TEST_FRACTION), args.image_size,
                             args.synthetic_classes, seed=args.seed, train=False)
    say(f"dataset: synthetic ImageNet-shaped ({len(train)} train, {len(test)} test, {args.synthetic_classes} classes, "
        f"{args.image_size} px, {train.nbytes / 2**20:.0f} MiB in memory)")
    return harness.Data("synthetic", train, test, args.synthetic_classes)


RECIPE = harness.Recipe(
    name="imagenet-ddp",
    summary=__doc__.split("\n\n")[0],
    data=load_data,
    # The last BatchNorm of each residual branch starts at zero: every block starts as the
    # identity, which keeps the first steps of a deep net stable (Goyal et al., 2017).
    model=lambda args, data, path: ARCHS[args.arch](num_classes=data.num_classes, zero_init_residual=True, width=args.width),
    options=OPTIONS,
    defaults={"batch_size": 32, "lr": 0.02, "epochs": 1},
    # Decoding JPEGs is the expensive part: one worker per CPU of this process, the process keeps one.
    default_workers=lambda cpus: min(8, max(0, cpus - 1)),
)


def main(argv: list[str] | None = None) -> int:
    return harness.main(RECIPE, argv)


if __name__ == "__main__":
    sys.exit(main())
