"""Children die with their parent: no rank is left holding a GPU and a port after its launcher died.

Inside a container tini is PID 1, and when the container stops everything in it stops. On a host
nothing of the kind happens: SIGKILL the outer `trainpod run` and supervisord, the agent and the
ranks run on, reparented to init. Linux's PR_SET_PDEATHSIG makes the kernel send a signal to a
process when its parent dies; each level asks for it (prctl through ctypes: no dependency):

    trainpod run (outer)
      supervisord         SIGTERM: it stops the job as it does on `docker stop`   (run_supervised)
        job = agent       SIGTERM: the agent stops the ranks (grace, then SIGKILL) (trainpod.supervisor.job,
                                   which becomes the agent in the same process)
        policy listener   SIGTERM                                                   (trainpod.supervisor.supervise)
          ranks           SIGKILL: only fires if the agent died without stopping them, and then
                                   nothing else would ever stop them          (`python -m trainpod.supervisor.orphans`)

Two details of the kernel's: the signal is sent when the *thread* that forked the child exits (each
parent above forks from its main thread), and the setting survives execve (but not fork, nor the
exec of a set-user-ID program). A parent can die before its child asks: each child checks that
its parent is still the one that started it, right after asking.

The ranks are started by torch's agent, which takes no pre-exec hook: the agent runs them through
`python -I -S -c 'from trainpod.supervisor.orphans import main...' SIGNAL PARENT_PID -- COMMAND...` (wrap()), which
asks, checks, and execs the command (same pid, same command line afterwards). `-I -S` skip the site
packages' start-up hooks (.pth files), a third to two thirds of the wrapper's time against
`python -m trainpod.supervisor.orphans`. Both forms take the same arguments.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

import trainpod

PR_SET_PDEATHSIG = 1
PARENT_SIGNAL = signal.SIGTERM  # supervisord, the job/agent, the listener: each stops what it started
RANK_SIGNAL = signal.SIGKILL  # the ranks: their agent is gone, nothing would stop them later


def die_with_parent(sig: int = PARENT_SIGNAL, parent: int | None = None) -> bool:
    """Ask the kernel for `sig` when this process's parent dies. If `parent` (its pid) is given and
    is no longer this process's parent, it died already: `sig` now. False where Linux's prctl is not."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):  # not Linux
        return False
    if parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), sig)
    return True


def wrap(entrypoint: str, args: tuple, parent: int, sig: int = RANK_SIGNAL) -> tuple[str, tuple]:
    """(entrypoint, args) that run `entrypoint args` as a child that dies with `parent`. The wrapper's
    Python finds this package by its directory alone (-I -S: no site packages, no environment)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(trainpod.__file__)))  # the directory that holds trainpod/
    code = f"import sys; sys.path.insert(0, {root!r}); from trainpod.supervisor.orphans import main; sys.exit(main(sys.argv[1:]))"
    return sys.executable, ("-I", "-S", "-c", code, signal.Signals(sig).name, str(parent), "--", entrypoint, *args)


def main(argv: list[str]) -> int:
    """`python -m trainpod.supervisor.orphans SIGNAL PARENT_PID -- COMMAND ARGS...`: ask, check, exec."""
    try:
        name, parent, dashes, command, *args = argv
        sig = signal.Signals[name if name.startswith("SIG") else "SIG" + name]  # SIGKILL or KILL
        if dashes != "--":
            raise ValueError(dashes)
    except (ValueError, KeyError):
        print("usage: python -m trainpod.supervisor.orphans SIGNAL PARENT_PID -- COMMAND [ARGS...]", file=sys.stderr)
        return 64
    die_with_parent(sig, int(parent))
    try:
        os.execvp(command, [command, *args])
    except OSError as exc:
        print(f"trainpod: error: cannot run {command!r}: {exc.strerror}", file=sys.stderr, flush=True)
        return 127 if isinstance(exc, FileNotFoundError) else 126
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
