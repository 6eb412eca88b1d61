"""Fault injection for resilience tests: a process kills itself with SIGKILL at a named point.

    TRAINPOD_FAILPOINTS=checkpoint-write@15

Some faults cannot be timed from outside: a checkpoint write of a small model lasts milliseconds.
A failpoint puts the SIGKILL exactly there (as etcd's gofail does), and it is a real SIGKILL of
the real process: nothing is simulated. Each one fires once per checkpoint directory (a marker
file there, created before the kill), so the restarted job runs on past it. Off unless the
variable is set.

Points: `checkpoint-write@STEP`: the temporary file of step STEP's checkpoint holds its bytes,
not yet fsynced, renamed or listed in a manifest. `replacement@GENERATION`: the rank that a keeper
forks for an in-process recovery's generation GENERATION (trainpod.agent.keeper) exits 1 at once, as a
replacement that cannot start would: not a SIGKILL, and no marker (a keeper forks it once).
`crash@STEP`: a bundled example's rank raises at the end of step STEP every time it gets there (no
marker): a node whose ranks always fail the same way, set on that node alone (trainpod.agent.policy
leaves such a node out of an elastic job). `slow@STEP`: from step STEP on, a bundled example's rank
does each step's own work twice as long (it sleeps as long as the step's forward and backward took, before
them): a straggler, set on one node alone (trainpod.agent.stragglers names it). `pace@MS`: each step of a
bundled example's rank lasts at least MS milliseconds (it sleeps the rest before the step's work): a test's job at
one pace on a fast and a slow machine alike, where timers count in seconds and the job's length in steps.
`server-copy@0`: the job's waiting copy of itself (trainpod.agent.zygote) gets SIGKILL as the agent is about to hand it
the server's part, every time (0: no step; no marker), so the node's fork server is a new interpreter, as where no
copy can be made.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from trainpod.contract import FAILPOINTS_VAR
from trainpod.errors import ConfigError

POINTS = ("checkpoint-write", "replacement", "crash", "slow", "pace", "server-copy")


def armed(environ=os.environ) -> dict[str, set[int]]:
    """Point -> the steps it fires at; a malformed variable is a one-line ConfigError."""
    spec = environ.get(FAILPOINTS_VAR, "").strip()
    points: dict[str, set[int]] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, step = item.partition("@")
        if name not in POINTS or not step.isdigit():
            raise ConfigError(f"{FAILPOINTS_VAR}={spec!r}: expected POINT@STEP[,POINT@STEP...] with POINT one of {', '.join(POINTS)}")
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
    """Whether `replacement@GENERATION` is armed for this generation (trainpod.agent.keeper then exits the rank with 1)."""
    if generation not in armed().get("replacement", ()):
        return False
    print(f"trainpod: failpoint replacement@{generation}: the replacement exits 1", file=sys.stderr, flush=True)
    return True


class Crash(RuntimeError):
    """What `crash@STEP` raises: the rank's traceback ends here, the same every time."""


def crash(step: int) -> None:
    """Raise Crash if `crash@STEP` is armed at `step` (every time: no marker)."""
    if step in armed().get("crash", ()):
        raise Crash(f"failpoint crash@{step}")


_paced = [0.0]  # time.monotonic() of this process's last pace() that let a step begin


def pace() -> None:
    """If `pace@MS` is armed: sleep until MS milliseconds have passed since this process's last step began."""
    milliseconds = armed().get("pace")
    if not milliseconds:
        return
    now = time.monotonic()
    wait = _paced[0] + max(milliseconds) / 1000 - now
    if wait > 0:
        time.sleep(wait)
        now += wait
    _paced[0] = now


def slow(step: int, seconds: float) -> None:
    """Sleep `seconds` (the caller's last forward and backward) if `slow@FROM` is armed with FROM <= `step`."""
    if seconds > 0 and any(step >= first for first in armed().get("slow", ())):
        time.sleep(seconds)


def server_copy_killed() -> bool:
    """Whether `server-copy@0` is armed: the agent then kills the job's copy of itself (trainpod.agent.zygote)."""
    if 0 not in armed().get("server-copy", ()):
        return False
    print("trainpod: failpoint server-copy@0: SIGKILL of the job's copy of itself", file=sys.stderr, flush=True)
    return True
