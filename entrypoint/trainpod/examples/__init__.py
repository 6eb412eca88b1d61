"""The bundled examples: ordinary training scripts that torchrun runs as modules.

This registry imports nothing heavy, so the CLI can list and launch examples without torch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Example:
    name: str
    module: str  # run as `torchrun ... -m <module>`
    description: str
    args: tuple[str, ...] = ()


EXAMPLES: dict[str, Example] = {
    example.name: example
    for example in (
        Example(
            "cifar10-ddp",
            "trainpod.examples.cifar10",
            "CIFAR-10 DistributedDataParallel, gloo or nccl; real CIFAR batches from --data-dir, else synthetic",
        ),
    )
}
