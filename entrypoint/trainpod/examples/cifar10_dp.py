"""CIFAR-10 with torch.nn.DataParallel: one process drives every visible GPU (the plain model on the CPU).

    trainpod run --example cifar10-dp         # one process per node, whatever --nproc-per-node says

DataParallel splits each batch over the GPUs inside one process: the simplest multi-GPU
training, and a single-node one. The data, model and harness are cifar10-ddp's.
"""

from __future__ import annotations

import sys

from trainpod.examples import cifar10, harness

RECIPE = harness.Recipe(
    name="cifar10-dp",
    summary=__doc__.split("\n\n")[0],
    data=cifar10.load_data,
    model=lambda args, data, path: cifar10.make_model(),
    options=cifar10.DATA_OPTIONS,
    defaults={"batch_size": 128},  # one process takes the whole batch and splits it over the GPUs
    parallel="dp",
)


def main(argv: list[str] | None = None) -> int:
    return harness.main(RECIPE, argv)


if __name__ == "__main__":
    sys.exit(main())
