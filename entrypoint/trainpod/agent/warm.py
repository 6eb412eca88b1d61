"""Warm starts: each rank is a fork of one process per node that has imported torch already.

A rank started the usual way (`python -u -m MODULE`) spends most of its start importing Python,
torch and the example's modules: most of the time from a rank's SIGKILL to the restarted group's
next step (docs/results.md, bench/recovery.py). With warm starts the agent asks
torch's launcher for function entrypoints started by Python's multiprocessing `forkserver`: one
server process per node, started by the agent before its first rendezvous, imports torch and the
example once (while the nodes meet), and every rank of every start and restart is a fork of it,
which imports nothing. That server is a copy of the job's process, whose imports are done by then
(trainpod.agent.zygote), else a new interpreter.

What the rank runs is unchanged: `run_rank` sets sys.argv and runs the module (or script) as
`__main__` with runpy, as `python -m` does; its exit code, its lines (torch's tee and prefixes) and
the hang watch's view of it are those of a rank started by command. Differences a script may see:
- its parent is the fork server, not the agent; it gets SIGKILL when the server exits, which the
  server does when the agent dies (trainpod.supervisor.orphans' rule: no rank outlives its agent); the server
  is in a session of its own, as torch's ranks are, so a signal to the agent's process group
  reaches the ranks only through the agent, with their --term-grace (trainpod.agent.warm_server). A server
  that dies otherwise (the OOM killer's choice in a small container: it holds torch) takes the node's
  ranks with it, and the agent names it (server_death(), trainpod.agent.policy);
- `ps` shows the command it would have run and the name rank<R> (name_process); its environment in
  /proc is the server's;
- it inherits what the server imported: an example module's top level runs in the server, without
  the rank's variables (the bundled examples read them in main(), never at import; a user's code
  is never imported there);
- numpy's global random state is the server's in every rank (Python's `random` reseeds at fork;
  seed numpy yourself: the bundled examples do).

--warm-start (TRAINPOD_WARM_START): `auto` (the default) for the bundled examples, `on` also for a
command that is `python [-u] SCRIPT ARGS` or `python [-u] -m MODULE ARGS`, `off` for neither.
"""

from __future__ import annotations

import atexit
import gc
import logging
import multiprocessing
import os
import runpy
import shutil
import signal
import sys
import time
import traceback
from collections.abc import Sequence

from trainpod import proctitle, python_command
from trainpod.settings import IN_PROCESS, RECOVERY
from trainpod.supervisor import orphans

START_METHOD = "forkserver"  # torchrun's --start-method for function entrypoints
EXAMPLES_PACKAGE = "trainpod.examples."
# Imported by the server for every job: torch, what a DDP rank imports later on (torch.distributed.tensor
# and torch._dynamo: a large share of a rank's CPU at its start), and what the agent's main module imports (each
# forked rank prepares as multiprocessing's children do, running the parent's __main__ module, trainpod.supervisor.job,
# which becomes the agent and must not be imported already: runpy would warn).
PRELOAD = ("trainpod.agent.warm_server", "torch", "torch.distributed", "torch.distributed.tensor", "torch._dynamo", "numpy.random",
           "trainpod.agent.policy", "trainpod.agent.hangwatch", "trainpod.launcher.launch", "trainpod.launcher.preflight",
           "trainpod.supervisor.supervise", "trainpod.launcher.devices")
# What stops a job, which the server ignores (trainpod.agent.warm_server) and run_rank gives back to the ranks.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
_IDLE_FLAGS = frozenset("uB")  # python's options that mean nothing to a forked rank (unbuffered it is)


def python_target(command: Sequence[str]) -> tuple[str, str, tuple[str, ...]] | None:
    """("-m", MODULE, argv) or ("script", PATH, argv) when `command` runs Python code with this Python, as
    torch's launcher builds it (`python -u -m MODULE ...`) or a user types it (`python train.py ...`), with
    no option but those that mean nothing to a forked rank; else None. This Python: an interpreter in the
    directory of sys.executable (the image's venv), so a forked rank sees the same packages the command
    would have."""
    parsed = python_command.parse(command)
    if parsed is None or parsed.kind == "-c" or parsed.valued or not parsed.flags <= _IDLE_FLAGS:
        return None
    found = shutil.which(command[0])
    if found is None or os.path.dirname(os.path.abspath(found)) != os.path.dirname(os.path.abspath(sys.executable)):
        return None
    return parsed.kind, parsed.what, parsed.argv


def _bundled(target: tuple[str, str, tuple[str, ...]]) -> bool:
    return target[0] == "-m" and target[1].startswith(EXAMPLES_PACKAGE)


def wanted(mode: str, target: tuple[str, str, tuple[str, ...]] | None) -> bool:
    """Whether a rank that runs `target` starts warm under --warm-start `mode`."""
    if target is None or mode == "off":
        return False
    return mode == "on" or _bundled(target)


def preload(target: tuple[str, str, tuple[str, ...]]) -> tuple[str, ...]:
    """What the server imports: a bundled example's module too (never a user's: its import would run
    without the rank's variables)."""
    return PRELOAD + ((target[1],) if _bundled(target) else ())


def start_server(modules: Sequence[str]) -> None:
    """Start the node's fork server now, importing `modules`, so that the import overlaps the rendezvous: the
    copy of the job's process that waits for it (trainpod.agent.zygote), else a new interpreter. It gets
    this process's environment: set the ranks' common variables first. Call it from the main thread: the
    server dies with the thread that started it (trainpod.agent.warm_server)."""
    from multiprocessing import forkserver

    from trainpod.agent import zygote

    multiprocessing.get_context(START_METHOD).set_forkserver_preload(list(modules))
    copy = zygote.current()
    if copy is None or not copy.serve(modules):  # the job's copy of itself, else a new interpreter
        forkserver.ensure_running()
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_without_traceback)


def server_death(wait_s: float = 0.0) -> tuple[int, int] | None:
    """(pid, exit status as a shell reports it: 128 + N after signal N) of the node's fork server if it has
    died, else None (it runs, or none was started). The server's children are the ranks: when it dies (the
    kernel's OOM killer picks it, the largest process of a container, whose preload holds torch), they die
    with it (SIGKILL, trainpod.agent.warm_server), and what multiprocessing reports of them is 255: the status
    only the server could have sent. The server is the agent's child, which multiprocessing reaps when it
    starts the next one: here it is looked at without reaping it (waitid's WNOWAIT). `wait_s`: how long to wait
    for a death that its closed pipes announced already (the kernel closes a dying process's files before its
    parent can see it exit)."""
    from multiprocessing import forkserver

    pid = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)  # the stdlib's own record
    if not pid:
        return None
    deadline = time.monotonic() + wait_s
    while True:
        try:
            info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except (ChildProcessError, AttributeError):  # reaped already (a new server starts), or not Linux
            return None
        if info is not None:
            break
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.01)
    if info.si_code in (os.CLD_KILLED, os.CLD_DUMPED):
        return pid, 128 + info.si_status
    return pid, info.si_status


def _without_traceback(record: logging.LogRecord) -> bool:
    """torch logs a failed rank of a function entrypoint with the traceback of its own join(), and
    formatting it imports torch._dynamo in the agent (seconds, before the restart): the line stays
    (the agent reports the failure in its own words), the traceback goes."""
    if record.exc_info and record.funcName == "_poll":
        record.exc_info, record.exc_text = None, None
    return True


def name_process(name: str, argv: Sequence[str]) -> None:
    """What `ps` and /proc show of a forked rank, whose command line is its server's: the name `name`
    (/proc/PID/comm, `pgrep -x rank0`) and the command line `argv` (/proc/PID/cmdline, `ps`,
    `pgrep -f`): the command it would have run, cut to the room the server's has (trainpod.proctitle).
    Its environment in /proc stays the server's: RANK is not in it."""
    proctitle.set_name(name)
    proctitle.set_command_line(argv)


def _threads_from_the_environment() -> None:
    """torch's intra-op threads as OMP_NUM_THREADS says, as in a new interpreter: OpenMP read the variable when
    torch was loaded, which in a server copied from the job's process (trainpod.agent.zygote) was before the
    launch plan set it. A value that is not a positive count is left to OpenMP, as it was."""
    threads = os.environ.get("OMP_NUM_THREADS", "")
    torch = sys.modules.get("torch")
    if torch is not None and threads.isdigit() and int(threads) > 0 and torch.get_num_threads() != int(threads):
        torch.set_num_threads(int(threads))


def run_rank(kind: str, name: str, *argv: str) -> None:
    """A rank's entrypoint in the forked process: run `name` as `python -u` would, then exit as it would.

    torch's launcher waits for a return value from every rank, so a normal end (exit code 0 or None)
    returns; another exit code leaves as SystemExit, which multiprocessing turns into the exit code.
    With --recovery in-process this process is the rank's keeper, and the rank its child (trainpod.agent.keeper)."""
    orphans.die_with_parent(orphans.RANK_SIGNAL)  # with the server, which dies with the agent (trainpod.agent.warm_server)
    # What the server imported (torch's hundreds of thousands of objects) lives as long as the rank: out of the
    # collector's reach, a collection in the rank (Python's own, or in-process recovery's after a failed step)
    # looks only at what the rank made, and leaves the pages it shares with the server unwritten (Python's
    # documented use of gc.freeze before a fork without exec).
    gc.freeze()
    command = [sys.executable, "-u", *(("-m",) if kind == "-m" else ()), name, *argv]
    rank = os.environ.get("RANK", "")
    if os.environ.get(RECOVERY.var) == IN_PROCESS:
        from trainpod.agent import keeper

        keeper.keep(lambda: _run(kind, name, argv, rank, command), int(rank or 0),
                    lambda title: name_process(title, ["trainpod-keeper", f"RANK={rank}", *command]))
        return
    _run(kind, name, argv, rank, command)


def _run(kind: str, name: str, argv: Sequence[str], rank: str, command: list[str]) -> None:
    for sig in STOP_SIGNALS:  # the server ignores them; a new interpreter would not
        signal.signal(sig, signal.SIG_DFL)
    name_process(f"rank{rank}", command)
    _threads_from_the_environment()
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(write_through=True)  # -u: every line reaches torch's tee at once
    os.environ["PYTHONUNBUFFERED"] = "1"  # and the rank's own child processes
    # multiprocessing's preparation gave this process the agent's start method (forkserver): a DataLoader's
    # workers would be forked by a server of the rank's own that no one stops when the rank is killed.
    multiprocessing.set_start_method(None, force=True)  # the platform's default, as in a new interpreter
    sys.argv = [name, *argv]
    try:
        try:
            if kind == "-m":
                sys.modules.pop(name, None)  # preloaded by the server: run afresh, as `python -m` would
                runpy.run_module(name, run_name="__main__", alter_sys=True)
            else:
                sys.path.insert(0, os.path.dirname(os.path.abspath(name)))  # as `python SCRIPT` does
                runpy.run_path(name, run_name="__main__")
        finally:
            atexit._run_exitfuncs()  # multiprocessing's children skip them; a rank's interpreter would not
    except SystemExit as end:
        if end.code is None or end.code == 0:
            return
        raise
    except KeyboardInterrupt:  # SIGINT: end as Python does, killed by it
        traceback.print_exc()
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:  # noqa: BLE001 - the rank's own traceback on its own stderr, exit 1, as Python does
        traceback.print_exc()
        raise SystemExit(1) from None
