"""Fault injection for resilience tests: a process kills itself with SIGKILL at a named point.

    TRAINPOD_FAILPOINTS=checkpoint-write@15

Some faults cannot be timed from outside: a checkpoint write of a small model lasts milliseconds.
A failpoint puts the SIGKILL exactly there (as etcd's gofail does), and it is a real SIGKILL of
the real process: nothing is simulated. Each one fires once per checkpoint directory (a marker
file there, created before the kill), so the restarted job runs on past it. Off unless the
variable is set.

Points: `checkpoint-write@STEP`: the temporary file of step STEP's checkpoint holds its bytes,
not yet fsynced, renamed or listed in a manifest. `replacement@GENERATION`: the rank that a keeper
forks for an in-process recovery's generation GENERATION (trainpod.keeper) exits 1 at once, as a
replacement that cannot start would: not a SIGKILL, and no marker (a keeper forks it once).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from trainpod.errors import ConfigError

VARIABLE = "TRAINPOD_FAILPOINTS"
POINTS = ("checkpoint-write", "replacement")


def armed(environ=os.environ) -> dict[str, set[int]]:
    """Point -> the steps it fires at; a malformed variable is a one-line ConfigError."""
    spec = environ.get(VARIABLE, "").strip()
    points: dict[str, set[int]] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, step = item.partition("@")
        if name not in POINTS or not step.isdigit():
            raise ConfigError(f"{VARIABLE}={spec!r}: expected POINT@STEP[,POINT@STEP...] with POINT one of {', '.join(POINTS)}")
        points.setdefault(name, set()).add(int(step))
    return points


def hit(point: str, step: int, marker_dir: Path) -> None:
    """SIGKILL this process if `point` is armed at `step` and has not fired for `marker_dir` yet."""
    if step not in armed().get(point, ()):
        return
    marker = marker_dir / f".failpoint-{point}-{step}"
    try:
        # No fsync needed: a killed process loses nothing of what it wrote, only a crashed host does.
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    except FileExistsError:
        return
    print(f"trainpod: failpoint {point}@{step}: SIGKILL of pid {os.getpid()}", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def replacement_fails(generation: int) -> bool:
    """Whether `replacement@GENERATION` is armed for this generation (trainpod.keeper then exits the rank with 1)."""
    if generation not in armed().get("replacement", ()):
        return False
    print(f"trainpod: failpoint replacement@{generation}: the replacement exits 1", file=sys.stderr, flush=True)
    return True
