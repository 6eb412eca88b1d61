"""The bundled examples: ordinary training scripts that torchrun runs as modules.

Each entry says what a job of it needs, so that `trainpod run` launches it right and job files
(OpenPAI, Kubeflow, SLURM) are generated from here. This registry imports nothing heavy, so the
CLI can list and launch examples without torch. A new example is one module (a Recipe for
trainpod.examples.harness) plus its line here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Example:
    name: str
    module: str  # run as `torchrun ... -m <module>`
    description: str
    args: tuple[str, ...] = ()
    nproc_per_node: int | None = None  # fixed processes per node (DataParallel: 1); None: one per GPU or rank
    nodes: int = 2  # the job size it is meant for (job files, compose)
    max_nodes: int | None = None  # None: any; DataParallel trains on one node only
    gpus: int = 0  # GPUs per node it wants on a GPU cluster (0: any; it runs on the CPU too)
    backend: str | None = None  # None: nccl with GPUs, gloo without
    flavor: str = "cpu"  # the smallest image flavour that runs it (cuda-apex for Apex's kernels)
    shm_mib: int = 512  # /dev/shm it needs: DataLoader workers pass batches through it


EXAMPLES: dict[str, Example] = {
    example.name: example
    for example in (
        Example(
            "cifar10-ddp",
            "trainpod.examples.cifar10",
            "CIFAR-10 DistributedDataParallel, gloo or nccl; real CIFAR batches from --data-dir, else synthetic",
        ),
        Example(
            "cifar10-dp",
            "trainpod.examples.cifar10_dp",
            "CIFAR-10 DataParallel: one process per node over every visible GPU (the plain model on CPU)",
            nproc_per_node=1,
            nodes=1,
            max_nodes=1,
        ),
        Example(
            "cifar10-ddp-amp",
            "trainpod.examples.cifar10_amp",
            "CIFAR-10 DDP in mixed precision (bfloat16 on CPU, float16 on CUDA), Apex's fused kernels where they run",
            flavor="cuda-apex",
        ),
        Example(
            "imagenet-ddp",
            "trainpod.examples.imagenet",
            "ImageNet ResNet-50 DDP: JPEGs (ImageFolder) decoded with Pillow in DataLoader workers, else synthetic",
            gpus=8,
            shm_mib=8192,
        ),
    )
}
