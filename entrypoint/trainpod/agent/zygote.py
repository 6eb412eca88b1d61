"""The node's fork server, made from a copy of the job's process: torch imported once per start of a node, not twice.

Warm starts (trainpod.agent.warm) fork every rank from a server process that has imported torch.
multiprocessing starts that server as a new interpreter, which imports torch a second time beside the
agent's own import: about as much CPU again as the agent's start, at every start of a node. So the job's
process (trainpod.supervisor.job), once its imports are done and before it holds a lock, opens a
connection or starts a thread, forks a copy of itself that waits (fork()). When the agent starts its
fork server (warm.start_server), it hands the copy what multiprocessing would give a new server (its
listening socket and the "alive" pipe, as file descriptors over a Unix socket), the modules to preload
and the agent's environment as it is then. The copy takes that environment and runs multiprocessing's
own server loop (multiprocessing.forkserver.main), and the agent records it where
multiprocessing.forkserver.ensure_running() records the server it starts (Zygote.serve). From there on
the server is multiprocessing's: the ranks, their preparation and the server's death (warm.server_death)
are as before, and a server that died is replaced by multiprocessing's own.

What the copy keeps from the job's process: its imports (torch, trainpod's launcher and agent) and their
state. What it does not keep:
- the job's environment: replaced at the hand-over by the agent's, so the ranks see what a new server
  would have inherited. What a library read from the environment at its import stays the job's: OpenMP
  reads OMP_NUM_THREADS when torch loads it, so each warm rank sets torch's threads from the variable
  (warm.run_rank);
- its file descriptors but the standard streams and the channel (each other one is pointed at /dev/null:
  multiprocessing passes a new server only its own two);
- its death signal (a fork does not inherit it): it dies with the job's process, which is the agent,
  as warm_server's server does; then its session and signal dispositions (trainpod.agent.warm_server).

Only the main thread of the job's process runs torch's import (trainpod.supervisor.job). MKL, whose code the import
runs, keeps state per thread, and a copy forked after another thread ran it can inherit MKL's allocator lock
held, even once Python has joined that thread and the kernel has ended it: the copy holds it for good, and so does
every rank forked from it, each spinning at its first matrix product that needs a buffer (seen in the suite: both
ranks of a job at 100 % CPU before their first step, for as long as the test waited). A thread the job's process
joined just before (its checks') is also waited for until the kernel has ended it (ended()): no native code of it
runs as the copy is made.

The copy is not made where it could not be what multiprocessing would have started: another thread runs
in the job's process (a fork copies one thread, and whatever locks the others held), CUDA is initialised
there (a forked child cannot use it), or this Python's forkserver is not the one this module speaks to
(its main() and its records differ; 3.14's add an authentication key). Then, as when the agent does not
start warm or the copy is gone, multiprocessing starts its server as before. A copy the agent never asks
for exits when the job's process closes the channel (discard()) or dies.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import os
import pickle
import signal
import socket
import sys
import threading
import time
from collections.abc import Sequence
from multiprocessing import connection, forkserver, reduction, resource_tracker, util

from trainpod import failpoints, proctitle
from trainpod.supervisor import orphans

NAME = "fork-server"  # the copy's /proc/PID/comm (`pgrep -x fork-server`)
ENDED_S = 5.0  # at most, for the kernel to end a thread that Python has joined (microseconds, unless off the CPU)
_MAIN_PARAMETERS = ("listener_fd", "alive_r", "preload", "main_path", "sys_path")
_RECORDS = ("_forkserver_address", "_forkserver_alive_fd", "_forkserver_pid", "_lock")


class Zygote:
    """The job's process's handle on its waiting copy."""

    def __init__(self, pid: int, channel: socket.socket) -> None:
        self.pid = pid
        self._channel: socket.socket | None = channel

    def serve(self, preload: Sequence[str]) -> bool:
        """Make the copy this process's multiprocessing fork server, preloading `preload`, with this process's
        environment; True when it is, False when it could not be (it is gone: then start one as usual)."""
        channel, self._channel = self._channel, None
        if channel is None:
            return False
        if failpoints.server_copy_killed():  # gone before the hand-over, as if the OOM killer had taken it
            os.kill(self.pid, signal.SIGKILL)
            _reap(self.pid, wait=True)
        server = forkserver._forkserver
        with channel, server._lock:
            if server._forkserver_pid is not None:  # one runs already: it stays, and the copy exits
                return False
            resource_tracker.ensure_running()  # as ensure_running() does first: the ranks get its pipe
            with socket.socket(socket.AF_UNIX) as listener:
                address = connection.arbitrary_address("AF_UNIX")
                listener.bind(address)
                if not util.is_abstract_socket_namespace(address):
                    os.chmod(address, 0o600)
                listener.listen()
                alive_r, alive_w = os.pipe()  # every rank holds the write end; the server ends at its EOF
                try:
                    request = pickle.dumps({"preload": list(preload), "environ": dict(os.environ)})
                    reduction.sendfds(channel, [listener.fileno(), alive_r])
                    channel.sendall(request)  # one pickle: its reader knows where it ends
                except OSError:  # the copy is gone (killed, or it exited): multiprocessing starts a server
                    os.close(alive_w)
                    _reap(self.pid)
                    if not util.is_abstract_socket_namespace(address):
                        os.unlink(address)
                    return False
                finally:
                    os.close(alive_r)
            server._forkserver_address = address
            server._forkserver_alive_fd = alive_w
            server._forkserver_pid = self.pid
        return True

    def discard(self) -> None:
        """No fork server wanted: the copy exits (it reads the channel's end)."""
        channel, self._channel = self._channel, None
        if channel is not None:
            channel.close()
            _reap(self.pid, wait=True)


_current: Zygote | None = None


def current() -> Zygote | None:
    """This process's waiting copy, if fork() made one."""
    return _current


def discard() -> None:
    """No fork server wanted from this process's copy (the ranks are commands): it exits."""
    if _current is not None:
        _current.discard()


def why_not() -> str | None:
    """Why a copy of this process could not serve as multiprocessing's fork server (None: it can)."""
    # Python's threads, whose locks a copy would inherit held. Native pools are not counted: OpenBLAS starts its
    # threads when numpy loads and stops them at every fork (its atfork handler), torch starts its own at the first
    # parallel operation, and multiprocessing's own server has them too when it forks each rank.
    others = [thread.name for thread in threading.enumerate() if thread is not threading.current_thread()]
    if others:
        return f"other threads run in this process ({', '.join(others)})"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA is initialised in this process"
    try:
        parameters = tuple(inspect.signature(forkserver.main).parameters)
    except (TypeError, ValueError):
        parameters = ()
    if parameters != _MAIN_PARAMETERS or not all(hasattr(forkserver._forkserver, name) for name in _RECORDS) \
            or hasattr(forkserver._forkserver, "_forkserver_authkey"):
        return f"multiprocessing's forkserver of Python {sys.version.split()[0]} differs from the one this module speaks to"
    return None


def ended(thread: threading.Thread, timeout: float = ENDED_S) -> bool:
    """Whether the kernel has ended `thread`, a thread this process joined, within `timeout` seconds: no native code
    of it runs any more (the module docstring). Its task leaves /proc/self/task then; a thread's id is only ever
    reused by this process for a thread it starts, and none starts while this waits."""
    task = f"/proc/self/task/{thread.native_id}"
    deadline = time.monotonic() + timeout
    while os.path.exists(task):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.001)
    return True


def fork(joined: Sequence[threading.Thread] = ()) -> Zygote | None:
    """Fork the waiting copy of this process (see the module docstring), unless why_not() says it could not
    serve or a thread of `joined` (threads this process joined just before) has not ended yet; returns the handle
    (also current()). Call it in the main thread, where nothing else runs."""
    global _current
    if _current is not None or why_not() is not None or not all(ended(thread) for thread in joined):
        return _current
    parent = os.getpid()
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the copy: never returns
        code = 1
        try:
            ours.close()
            code = _wait(theirs, parent)
        finally:
            os._exit(code)
    theirs.close()
    _current = Zygote(pid, ours)
    return _current


def _wait(channel: socket.socket, parent: int) -> int:
    """The copy: wait for the agent's request, then be the fork server it asks for; 0 when none is asked for."""
    orphans.die_with_parent(orphans.RANK_SIGNAL, parent)
    proctitle.set_name(NAME)
    proctitle.set_command_line(["trainpod-fork-server", f"agent={parent}"])
    gc.freeze()  # the job's objects stay as they are, in pages shared with it: none is collected here
    _leave_only(0, 1, 2, channel.fileno())
    try:
        listener_fd, alive_r = reduction.recvfds(channel, 2)
        with channel.makefile("rb") as stream:
            request = pickle.load(stream)
    except (OSError, EOFError, RuntimeError, pickle.UnpicklingError):  # the job's process closed the channel, or died
        return 0
    channel.close()
    os.environ.clear()
    os.environ.update(request["environ"])  # the ranks' environment: the agent's now, as a new server's would be
    server = sys.modules.get("trainpod.agent.warm_server")
    if server is not None:  # imported already: its import, the first of the preload, would not run again
        server.become_server()
    try:
        forkserver.main(listener_fd, alive_r, request["preload"])
    except SystemExit as end:  # how multiprocessing's server ends, once the agent is gone
        return end.code if isinstance(end.code, int) else 0
    return 0


def _leave_only(*keep: int) -> None:
    """Point every other file descriptor of this process at /dev/null: what it held is let go, and its number
    stays taken, so that a Python object of the job's that still names it can never close a descriptor that
    the server opens later under the same number."""
    try:
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:
        return
    null = os.open(os.devnull, os.O_RDWR)
    for fd in fds:
        if fd not in keep and fd != null:
            with contextlib.suppress(OSError):  # the listing's own descriptor, closed with it
                os.dup2(null, fd, inheritable=False)
    os.close(null)


def _reap(pid: int, wait: bool = False) -> None:
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0 if wait else os.WNOHANG)
