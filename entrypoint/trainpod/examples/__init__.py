"""The bundled examples: ordinary training scripts that torchrun runs as modules.

Each entry says what a job of it needs, so that `trainpod run` launches it right and job files
(OpenPAI, Kubeflow, SLURM) are generated from here. This registry imports nothing heavy, so the
CLI can list and launch examples without torch, and check an example's flags and variables before
anything starts (check_args: the options its ranks will parse, from trainpod.examples.options). A new
example is one module (a Recipe for trainpod.examples.harness) plus its line here (and its own
options, if any, in options.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from trainpod import settings
from trainpod.contract import CHECKPOINT_DIR_VAR, OUTPUT_DIR_VAR, WORKERS_VAR
from trainpod.errors import TrainpodError
from trainpod.examples.options import CIFAR, CIFAR_AMP, COMMON, IMAGENET
from trainpod.settings import Setting


@dataclass(frozen=True)
class Example:
    name: str
    module: str  # run as `torchrun ... -m <module>`
    description: str
    args: tuple[str, ...] = ()
    nproc_per_node: int | None = None  # fixed processes per node (DataParallel: 1); None: one per GPU or rank
    nodes: int = 2  # the job size it is meant for (job files, compose)
    max_nodes: int | None = None  # None: any; DataParallel trains on one node only
    min_nodes: int | None = None  # an elastic example: it trains on min_nodes..max_nodes nodes that leave and join
    gpus: int = 0  # GPUs per node it wants on a GPU cluster (0: any; it runs on the CPU too)
    backend: str | None = None  # None: nccl with GPUs, gloo without
    flavor: str = "cpu"  # the smallest image flavour that runs it (cuda-apex for Apex's kernels)
    shm_mib: int = 512  # /dev/shm it needs with DataLoader workers: they pass batches through it
    loader_workers: bool = False  # whether it starts DataLoader workers unless told --workers 0
    needs: tuple[str, ...] = ("numpy",)  # what it imports besides torch (import names): preflight checks them
    options: tuple[Setting, ...] = ()  # its own flags besides COMMON (trainpod.examples.options); its Recipe's

    def check_args(self, args: Sequence[str], env: Mapping[str, str], warnings: list[str] | None = None) -> None:
        """Its flags and TRAINPOD_* variables, parsed as its ranks will parse them: one line (a flag's 64, a
        variable's 78) before anything starts, not a rank's once the nodes met. Its --help is its own to print.
        A flag given again with another value: a line in `warnings` (settings.parse_args)."""
        if "-h" in args or "--help" in args:
            return
        try:
            settings.parse_args(self.name, self.description, (*COMMON, *self.options), list(args), env, warnings)
        except TrainpodError as error:
            text = str(error)
            error.message = text if text.startswith(f"{self.name}: ") else f"{self.name}: {text}"
            raise

    def check_nodes(self, nodes: int, origin: str) -> None:
        """One line by `origin` (a flag: 64, a variable: 78) when the job asks for more nodes than this example trains on."""
        if self.max_nodes and nodes > self.max_nodes:
            from trainpod.errors import error_for

            why = ("(DataParallel stays in one process); across nodes use cifar10-ddp" if self.max_nodes == 1 else
                   f"(its elastic range is {self.min_nodes}:{self.max_nodes}); more nodes wait as spares: --spares")
            raise error_for(origin)(f"{origin}={nodes}: the example {self.name} trains on at most {self.max_nodes} node(s) {why}")

    def uses_loader_workers(self, args: Sequence[str] = (), env: Mapping[str, str] | None = None) -> bool:
        """Whether a run with these example flags (and TRAINPOD_WORKERS) starts DataLoader workers."""
        workers = flag_value(args, "--workers", env, WORKERS_VAR)
        if workers is None:
            return self.loader_workers
        return workers.strip() not in ("0", "+0")  # a bad value is the example's to report

    def directories(self, args: Sequence[str] = (), env: Mapping[str, str] | None = None) -> tuple[str, str | None]:
        """(output directory, checkpoint directory or None) of a run with these flags and variables:
        what its ranks will write, for preflight to check first (trainpod.examples.harness's defaults)."""
        return (flag_value(args, "--output-dir", env, OUTPUT_DIR_VAR) or "./output",
                flag_value(args, "--checkpoint-dir", env, CHECKPOINT_DIR_VAR))


def flag_value(args: Sequence[str], flag: str, env: Mapping[str, str] | None = None, var: str = "") -> str | None:
    """The last `FLAG VALUE` or `FLAG=VALUE` in an example's arguments, else its variable's non-empty
    value, else None: as the example's own parser will see it (trainpod.settings), without torch."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    if value is None and env and var:
        value = env.get(var, "").strip() or None
    return value


EXAMPLES: dict[str, Example] = {
    example.name: example
    for example in (
        Example(
            "cifar10-ddp",
            "trainpod.examples.cifar10",
            "CIFAR-10 DistributedDataParallel, gloo or nccl; real CIFAR batches from --data-dir, else synthetic",
            options=CIFAR,
        ),
        Example(
            "cifar10-dp",
            "trainpod.examples.cifar10_dp",
            "CIFAR-10 DataParallel: one process per node over every visible GPU (the plain model on CPU)",
            nproc_per_node=1,
            nodes=1,
            max_nodes=1,
            options=CIFAR,
        ),
        Example(
            "cifar10-ddp-amp",
            "trainpod.examples.cifar10_amp",
            "CIFAR-10 DDP in mixed precision (bfloat16 on CPU, float16 on CUDA), Apex's fused kernels where they run",
            flavor="cuda-apex",
            options=CIFAR_AMP,
        ),
        Example(
            "imagenet-ddp",
            "trainpod.examples.imagenet",
            "ImageNet ResNet-50 DDP: JPEGs (ImageFolder) decoded with Pillow in DataLoader workers, else synthetic",
            gpus=8,
            shm_mib=8192,
            loader_workers=True,
            needs=("numpy", "PIL"),
            options=IMAGENET,
        ),
        Example(
            "imagenet-elastic",
            "trainpod.examples.imagenet_elastic",
            "ImageNet ResNet-50 on 2 to 4 nodes that leave and join (etcd): every sample once, by the checkpoint's ledger",
            nodes=3,
            min_nodes=2,
            max_nodes=4,
            gpus=8,
            shm_mib=8192,
            loader_workers=True,
            needs=("numpy", "PIL"),
            options=IMAGENET,
        ),
    )
}
