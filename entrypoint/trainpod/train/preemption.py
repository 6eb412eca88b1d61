"""SIGTERM as a request to stop after the current step, with every rank agreeing on which step.

On pre-emption, `docker stop` or a Kubernetes delete, torchrun's agent sends SIGTERM to every
worker and SIGKILLs the ones still alive after its --shutdown-timeout. With this, a rank that
gets SIGTERM finishes its step; the ranks agree to stop (a rank whose node got no SIGTERM stops
too), checkpoint that step and exit 143 (128 + SIGTERM, what the agent reports for a stop):

    with Preemption() as preemption:                 # every rank, before the training loop
        for step in ...:
            train_one_step()
            if preemption.should_stop():             # a collective: every rank, same point
                save_checkpoint(step); checkpointer.close()   # close(): the save is durable
                trainpod.train.distributed.shutdown()
                return EXIT_CODE

The same vote stops every rank for a reason of one rank's own: `should_stop(error=73)` (the
bundled examples pass a checkpoint save that cannot succeed, trainpod.train.checkpoint's `fatal`); every
rank then stops after the same step and `preemption.error` says with which code, so no rank is
left blocked in a collective with a peer that exited.

The grace is TRAINPOD_TERM_GRACE seconds (default 25; `trainpod run --term-grace` sets it and a
matching torchrun --shutdown-timeout). A rank that has not finished stopping by then prints one
line and exits 143 at once: the checkpoint being written is lost, the previous one stays. (Python
runs signal handlers between bytecodes, so a rank stuck inside one C call, a collective whose
peer died, never starts that clock; torchrun's SIGKILL after --shutdown-timeout ends it.)
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping

from trainpod.settings import TERM_GRACE

__all__ = ["DEFAULT_GRACE_S", "EXIT_CODE", "GRACE_VAR", "Preemption", "ignore_sigterm", "term_grace"]

EXIT_CODE = 128 + signal.SIGTERM  # 143, what a shell and trainpod's agent report for a SIGTERM
GRACE_VAR = TERM_GRACE.var
DEFAULT_GRACE_S = TERM_GRACE.default


def term_grace(env: Mapping[str, str] | None = None) -> float:
    """Seconds from TRAINPOD_TERM_GRACE (default 25); ConfigError (one line) unless a number above 0."""
    return TERM_GRACE.from_env(os.environ if env is None else env)[0]


def ignore_sigterm(worker_id: int = 0) -> None:
    """A DataLoader worker_init_fn. The workers share their rank's process group, so torchrun's
    SIGTERM reaches them too; dying of it would fail the rank's next batch before it can stop."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _write_line(text: str) -> None:
    # os.write, not print: takes no lock of sys.stderr's buffer, which the main thread may hold.
    os.write(2, (text + "\n").encode())


class Preemption:
    """Turns SIGTERM into an agreed stop after a step, bounded by a grace period (module docstring)."""

    def __init__(self, grace: float | None = None, *, device=None, env: Mapping[str, str] | None = None):
        """`grace` overrides TRAINPOD_TERM_GRACE (read from `env`, default os.environ); `device` (a
        torch.device or its name) is where should_stop() reduces: default the current CUDA device
        under nccl, else the CPU."""
        if grace is not None and not (math.isfinite(grace) and grace > 0):
            raise ValueError(f"grace must be a number of seconds above 0, got {grace!r}")
        self.grace = term_grace(env) if grace is None else float(grace)
        self.requested_at: float | None = None  # time.monotonic() of this process's first SIGTERM
        self.error = 0  # the exit code a rank asked every rank to stop with (should_stop(error=...)); 0: none
        self._device = device
        self._pid = os.getpid()
        self._stopping = False
        self._why = "received SIGTERM: stopping after this step"
        self._triggered = threading.Event()  # a stop began: the grace runs from now
        self._done = threading.Event()  # close(): the stop is over, the watchdog stands down
        self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)  # raises off the main thread
        # Started now, not by the handler: starting a thread there could deadlock on threading's
        # own lock if the signal interrupted the main thread inside Thread.start() (a checkpoint save).
        threading.Thread(target=self._watch, name="trainpod-preemption-watchdog", daemon=True).start()

    @property
    def requested(self) -> bool:
        """This process got SIGTERM (should_stop() says whether any rank did)."""
        return self.requested_at is not None

    def _on_sigterm(self, signum, frame) -> None:
        # Runs in the main thread between two bytecodes, maybe inside a save or a print: record the
        # request and wake the watchdog, nothing more. A forked DataLoader worker inherits this
        # handler: it ignores the signal and serves batches until its main process stops.
        if os.getpid() != self._pid or self.requested_at is not None:
            return
        self.requested_at = time.monotonic()
        self._triggered.set()

    def should_stop(self, error: int = 0) -> bool:
        """Whether any rank got SIGTERM, or asked to stop with an `error` exit code (this rank's: a
        checkpoint that cannot be saved). An all_reduce(MAX), so every rank calls it at the same point;
        afterwards `error` holds the highest code any rank asked for (0: a SIGTERM stop)."""
        if self._stopping:
            return True  # agreed before: every rank knows, no collective needed
        stop = self.requested
        errors = int(error)
        # Not imported at the top: a process that never imported torch.distributed has no process
        # group to agree with, and this module then loads (and its tests run) without torch.
        dist = sys.modules.get("torch.distributed")
        if dist is not None and dist.is_available() and dist.is_initialized():
            import torch

            device = self._device
            if device is None:
                device = f"cuda:{torch.cuda.current_device()}" if dist.get_backend() == "nccl" else "cpu"
            flag = torch.tensor([int(stop), errors], dtype=torch.int32, device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            agreed = flag.tolist()  # one device-to-host copy
            stop, errors = bool(agreed[0]), int(agreed[1])
        if errors:
            # Not a pre-emption: nothing to save, no grace to watch; the caller exits with the code.
            self.error = errors
            self._stopping = True
            return True
        if stop and not self.requested:
            # A peer was told to stop; this rank's agent may not know, but the same bound holds here.
            self._why = "stops with the others: another rank received SIGTERM"
            self._triggered.set()
        self._stopping = stop
        return stop

    def _watch(self) -> None:
        self._triggered.wait()
        if self._done.is_set():
            return
        rank = os.environ.get("RANK", "0")
        _write_line(f"trainpod: rank {rank} {self._why} (grace {self.grace:g}s, {GRACE_VAR})")
        if not self._done.wait(self.grace):
            _write_line(
                f"trainpod: rank {rank} did not stop within the {self.grace:g}s grace after SIGTERM ({GRACE_VAR}): "
                f"exiting {EXIT_CODE} now; a checkpoint not yet committed is lost, the previous one stays"
            )
            os._exit(EXIT_CODE)

    def close(self) -> None:
        """Restore the previous SIGTERM handler and stand the watchdog down: the stop is done."""
        if self._done.is_set():
            return
        self._done.set()
        self._triggered.set()
        signal.signal(signal.SIGTERM, signal.SIG_DFL if self._previous is None else self._previous)

    def __enter__(self) -> Preemption:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
