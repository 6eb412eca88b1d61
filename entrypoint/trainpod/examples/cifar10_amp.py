"""CIFAR-10 DDP in mixed precision, with NVIDIA Apex's fused kernels where Apex can run.

    trainpod run --example cifar10-ddp-amp -- --optimizer adam

Mixed precision is torch's: autocast to bfloat16 on the CPU, float16 with a GradScaler on CUDA.
Where Apex is importable and the ranks run on CUDA (`--apex auto`, the default), the optimizer
is Apex's FusedSGD/FusedAdam and the head's LayerNorm is Apex's FusedLayerNorm; `--apex off`
uses torch's own. Apex's absence is never an error. The metrics say which path ran
("precision": torch-bf16, torch-fp16, torch-fp16+apex-fused; "apex": what became of it).
"""

from __future__ import annotations

import sys

from trainpod.examples import cifar10, harness
from trainpod.examples.options import CIFAR_AMP

RECIPE = harness.Recipe(
    name="cifar10-ddp-amp",
    summary=__doc__.split("\n\n")[0],
    data=cifar10.load_data,
    # A LayerNorm before the classifier: the norm Apex fuses (the convolutions' GroupNorm it does not).
    model=lambda args, data, path: cifar10.make_model(head_norm=path.layer_norm(64)),
    options=CIFAR_AMP,
    defaults={"amp": True},
)


def main(argv: list[str] | None = None) -> int:
    return harness.main(RECIPE, argv)


if __name__ == "__main__":
    sys.exit(main())
