"""After a rank crashed, the node's other ranks are stopped within seconds, not torch's fixed 30.

torch's process contexts stop the survivors of a failed rank themselves, inside their poll: SIGTERM,
then a fixed 30 s (torch.multiprocessing's ProcessContext.join for --warm-start ranks,
SubprocessContext.close for ranks started by command), then SIGKILL. A survivor blocked in a
collective with the dead rank (gloo waits for a peer that is not coming, NCCL too) runs no Python
signal handler, trainpod.train.preemption's included (Python runs handlers between bytecodes), so
such a restart waited the whole 30 s.

After a crash the survivors have nothing to finish: their step cannot complete without the dead
rank, and the job resumes from the last committed checkpoint (a write cut short leaves only a
temporary file, which the next save removes). So when a rank has crashed, the others get
CRASH_GRACE_S after SIGTERM, then SIGKILL (warm ranks as long again before the SIGTERM: torch's join
lets them end on their own first, and a peer's crash ends most of them at once). An orderly stop
keeps torch's bound: a rank that exited 143 (every rank voted to stop after a checkpoint,
trainpod.train.preemption) or was ended by SIGTERM leaves rank 0 perhaps still writing that
checkpoint. A stop of the whole agent (`docker stop`) passes its own bound (--shutdown-timeout) and
is left alone.
"""

from __future__ import annotations

import signal
from collections.abc import Iterable

from trainpod.supervisor.restarts import EXIT_STOPPED

__all__ = ["CRASH_GRACE_S", "bound", "crashed"]

CRASH_GRACE_S = 2.0
TORCH_STOP_S = 30  # torch's own bound, kept for an orderly stop
ORDERLY = (EXIT_STOPPED, -signal.SIGTERM)  # exit codes as Popen and multiprocessing report them (-N: signal N)


def crashed(codes: Iterable[int | None]) -> bool:
    """Whether any of these exit codes (None: still running) is a crash, not an end or an orderly stop."""
    return any(code not in (None, 0) and code not in ORDERLY for code in codes)


def bound(pcontext, grace_s: float = CRASH_GRACE_S) -> None:
    """Make torch's process context `pcontext` (started) stop a crashed rank's peers within 2 x `grace_s`.
    torch's private API, as trainpod.agent.policy reads it: a MultiprocessContext's ProcessContext (`_pc`),
    a SubprocessContext's handlers. The codes are read before torch's own look: a crash that lands between
    the two gets torch's bound, as before."""
    processes = getattr(getattr(pcontext, "_pc", None), "processes", None)
    if processes is not None:
        context = pcontext._pc
        join = context.join

        def bounded_join(timeout=None, grace_period=None):
            # Process.exitcode polls without blocking; the status it reads stays for torch's join.
            if grace_period is None and crashed(process.exitcode for process in processes):
                grace_period = grace_s
            return join(timeout, grace_period)

        context.join = bounded_join
        return
    handlers = getattr(pcontext, "subprocess_handlers", None)
    if handlers is not None:
        close = pcontext.close

        def bounded_close(death_sig=None, timeout=None):
            # torch's poll calls close() with no bound once a rank failed; its shutdown passes its own.
            if timeout is None:
                codes = (handler.proc.poll() for handler in handlers.values())
                timeout = grace_s if crashed(codes) else TORCH_STOP_S
            return close(death_sig, timeout)

        pcontext.close = bounded_close
