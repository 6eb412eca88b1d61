"""ImageNet ResNet-50 on an elastic job: nodes leave and join, and every sample trains exactly once.

    trainpod run --nnodes 2:4 --rdzv-backend etcd-v3 --rdzv-endpoint etcd:2379 --example imagenet-elastic \\
        -- --checkpoint-dir /shared/checkpoints --image-size 32 --synthetic-classes 10

The model and the data are imagenet-ddp's (trainpod.examples.imagenet: JPEGs in an ImageFolder
tree decoded with Pillow, else synthetic ImageNet-shaped data at --image-size). What differs is
the data's bookkeeping (trainpod.examples.elastic): at each membership change torchrun restarts
the workers, which resume from the last checkpoint in the shared --checkpoint-dir; the rest of
the epoch is re-sharded over the new world with no sample dropped or repeated, and the ledger in
the checkpoint records which samples the committed steps trained on. metrics.json reports
`exactly_once` (every epoch of the run, as far as it went, trained each sample once), the
ledger per epoch, the membership timeline ([step, world, nodes] at each start) and the batch and
LR rule: a fixed per-process batch, lr = --lr x world / the first start's world, scheduled by
samples seen.
"""

from __future__ import annotations

import dataclasses
import sys

from trainpod.examples import harness, imagenet

RECIPE = dataclasses.replace(
    imagenet.RECIPE,
    name="imagenet-elastic",
    summary=__doc__.split("\n\n")[0],
    elastic=True,
    # A checkpoint every 5 steps: what a membership change loses is what was trained since the last one.
    defaults={**imagenet.RECIPE.defaults, "checkpoint_every": 5},
)


def main(argv: list[str] | None = None) -> int:
    return harness.main(RECIPE, argv)


if __name__ == "__main__":
    sys.exit(main())
