"""TensorBoard scalars from the bundled examples (--tensorboard DIR, TRAINPOD_TENSORBOARD).

    trainpod run --example cifar10-ddp -- --tensorboard /workspace/output/tb
    tensorboard --logdir /workspace/output/tb

Global rank 0 writes, at each log point (--log-every): `train/loss` (the mean over every rank's
steps since the last point), `train/samples_per_sec` (the job's), `train/lr`, `train/world_size`;
at the end `test/accuracy`. The x axis is the global step. The events are written by tensorboardX
(a small, well-kept writer of TensorBoard's event files; TensorBoard itself is not needed in the image).

A restart resumes from a checkpoint of step S and trains steps S+1... again: each attempt opens a new
event file in DIR with purge_step S+1, so TensorBoard hides what earlier attempts logged past S and
every curve shows each step once, as trained by the run that went on. A DIR that cannot be created
or written is one line and 78 before training starts.
"""

from __future__ import annotations

import os
from pathlib import Path

from trainpod.errors import ConfigError


def check(directory: str | None, rank: int) -> None:
    """Rank 0, before the process group forms: DIR created and writable, else one line (78) and no rank waits for it."""
    if not directory or rank != 0:
        return
    try:
        import tensorboardX  # noqa: F401 - in the images; outside them, trainpod[train] brings it
    except ImportError:
        raise ConfigError(f"--tensorboard {directory}: the tensorboardX package is not installed here: "
                          "pip install tensorboardX (or trainpod[train])") from None
    path = Path(directory)
    try:
        path.mkdir(parents=True, exist_ok=True)
        if not os.access(path, os.W_OK | os.X_OK):
            raise PermissionError(13, "Permission denied")
    except OSError as error:
        raise ConfigError(f"--tensorboard {directory}: cannot write there ({error.strerror or error}): "
                          "give a writable directory (a volume, in a container with a read-only root)") from None


class Scalars:
    """Rank 0's TensorBoard writer; on every other rank, or without a directory, every call does nothing."""

    def __init__(self, directory: str | None, rank: int, resumed_step: int):
        self._writer = None
        if not directory or rank != 0:
            return
        from tensorboardX import SummaryWriter  # check() ran before the process group (harness.train_rank)

        # purge_step: TensorBoard hides the earlier attempts' events from this step on (the module docstring).
        self._writer = SummaryWriter(logdir=str(directory), purge_step=resumed_step + 1 if resumed_step else None,
                                     flush_secs=10)

    def add(self, step: int, **values: float | None) -> None:
        """`values` as scalars at `step`: `train_loss=` becomes the tag `train/loss`; None is left out."""
        if self._writer is None:
            return
        for name, value in values.items():
            if value is not None:
                section, _, tag = name.partition("_")
                self._writer.add_scalar(f"{section}/{tag}", float(value), step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
