"""Each rank's progress, as its agent sees it: the last step it finished and the last one committed.

    import trainpod.progress
    for step in ...:
        train_one_step()
        trainpod.progress.step(step)          # one call per step, any script

The bundled examples call it, and so does trainpod.checkpoint when a checkpoint is committed
(`committed(step)`), so scripts that use trainpod's checkpoints report without this call. The
agent reads it to tell a stuck job from a slow one, and a restart after progress from a crash loop.

How: torchrun's launch plan sets TRAINPOD_PROGRESS_DIR; each rank overwrites one fixed-width
line in `<dir>/rank<LOCAL_RANK>` (one pwrite, no fsync: only processes on this node read it, and
a lost update after a crash of the host does not matter). Without the variable (a script run
outside trainpod) every call is a no-op.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DIR_VAR", "Record", "committed", "read", "step"]

DIR_VAR = "TRAINPOD_PROGRESS_DIR"
_FORMAT = "{step:20d} {committed:20d} {time:20.3f}\n"  # fixed width: an overwrite never leaves a tail
_RECORD_BYTES = len(_FORMAT.format(step=0, committed=0, time=0.0))


@dataclass(frozen=True)
class Record:
    step: int  # the last step this rank finished (-1: none reported yet)
    committed: int  # the last step whose checkpoint was committed (-1: none)
    time: float  # time.time() of the last report


class _Reporter:
    def __init__(self) -> None:
        self._fd: int | None = None
        self._pid: int | None = None
        self.step = -1
        self.committed = -1

    def report(self) -> None:
        if self._pid != os.getpid():  # first call, or a forked child (a DataLoader worker): its own state
            self._open()
        if self._fd is not None:
            line = _FORMAT.format(step=self.step, committed=self.committed, time=time.time())
            os.pwrite(self._fd, line.encode(), 0)

    def _open(self) -> None:
        self._pid = os.getpid()
        self._fd = None
        directory = os.environ.get(DIR_VAR)
        if not directory:
            return
        try:
            self._fd = os.open(Path(directory) / f"rank{os.environ.get('LOCAL_RANK', '0')}", os.O_WRONLY | os.O_CREAT, 0o644)
        except OSError:
            self._fd = None  # progress is advisory: training must not fail for it


_reporter = _Reporter()


def step(n: int) -> None:
    """This rank finished step `n`. Cheap (one pwrite); call it after every step, on every rank."""
    _reporter.step = int(n)
    _reporter.report()


def committed(n: int) -> None:
    """The checkpoint of step `n` is committed (durable). trainpod.checkpoint calls it for you."""
    _reporter.committed = int(n)
    _reporter.report()


def read(directory: str | os.PathLike) -> dict[int, Record]:
    """Local rank -> its last report, for every rank that reported (the agent's side)."""
    records: dict[int, Record] = {}
    try:
        names = os.listdir(directory)
    except OSError:
        return records
    for name in names:
        if not (name.startswith("rank") and name[4:].isdigit()):
            continue
        try:
            with open(Path(directory) / name, "rb") as f:
                fields = f.read(_RECORD_BYTES).split()
            records[int(name[4:])] = Record(int(fields[0]), int(fields[1]), float(fields[2]))
        except (OSError, ValueError, IndexError):
            continue  # being written for the first time: read it at the next look
    return records
