"""In-process recovery, the process side: each rank is the child of a keeper that replaces it when it is killed.

With --recovery in-process (TRAINPOD_RECOVERY), trainpod.agent.warm.run_rank does not run the rank itself:
it becomes the rank's keeper (`ps`: keeper<R>), forks the rank (rank<R>) and waits. When the rank is
killed by a signal (SIGKILL, the OOM killer, a segfault), the keeper counts the next generation in
the workers' store and forks a replacement at once: the keeper has torch (and a bundled example's
modules) imported already, so the replacement's start costs a fork, not an interpreter. The other
ranks keep their processes and re-form the group with it (trainpod.train.inprocess).

The keeper lets the rank end as it would have without it (and the agent restarts the whole worker
group, or stops) when:
- the rank exited with a code, 0 or not: only a death by a signal is replaced (a Python error, a bad
  configuration or a lost peer are the agent's to decide, trainpod.agent.policy);
- the signal was a stop request (SIGTERM, SIGINT, SIGHUP, SIGQUIT): the job is being stopped;
- the rank never called trainpod.train.inprocess.init_process_group(): its script cannot re-form a group;
- this rank was already replaced TRAINPOD_INPROCESS_MAX times (the agent's --max-restarts): a rank
  that keeps dying is the agent's restart budget's to judge.

The workers' store (MASTER_ADDR:MASTER_PORT, where env:// ranks meet, and where the keepers count
the generations) must outlive any rank: every rank is its client (TORCHELASTIC_USE_AGENT_STORE). With
torch's dynamic rendezvous (c10d, etcd-v3) the agent of the node with rank 0 hosts it, a new one for
each worker group (trainpod.agent.policy._fresh_workers_store). Where the agent does not (torch's
etcd backend, or TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), a child of global rank 0's keeper hosts it
(`ps`: store0) rather than rank 0 itself. Not the keeper itself: a store serves on a thread of its
own, and a process with a second thread must not fork (the child gets a copy of every lock that
thread held at that moment, and a replacement that needed one would hang for good). The store's
process ignores the stop signals and ends with the keeper. Each worker group the agent starts has
new keepers and a new store.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import signal
import sys
from collections.abc import Callable
from datetime import timedelta

from trainpod import failpoints
from trainpod.contract import INPROCESS_GENERATION_VAR, INPROCESS_MAX_VAR
from trainpod.supervisor import orphans
from trainpod.train import inprocess

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)  # forwarded; a rank they kill is not replaced
STORE_TIMEOUT_S = 60.0  # the store's own timeout for the ranks' requests
CLIENT_TIMEOUT_S = 5.0  # a keeper's connection to rank 0's keeper: gone with its node, then no replacement
AGENT_STORE_VAR = "TORCHELASTIC_USE_AGENT_STORE"  # "True": the agent hosts the workers' store (torch's agent sets it)


def replaces(signalled: int | None, declared: bool, left: int) -> bool:
    """Whether a rank that ended (killed by `signalled`, or None: it exited) is replaced in-process."""
    return signalled is not None and signalled not in STOP_SIGNALS and declared and left > 0


def keep(run: Callable[[], None], rank: int, name: Callable[[str], None]) -> None:
    """Run `run` (the rank) in a forked child, and again in a new child each time `replaces` says so;
    then end as the last child ended (return for 0, SystemExit for a code, the same signal)."""
    keeper = os.getpid()
    if rank == 0 and os.environ.get(AGENT_STORE_VAR) != "True":
        try:
            _fork_store(keeper, name)
        except RuntimeError as error:  # one line, not the launcher's traceback; not deterministic (a port taken
            print(f"trainpod: rank 0: {error}", file=sys.stderr, flush=True)  # meanwhile): the agent may retry
            raise SystemExit(1) from None
    os.environ[AGENT_STORE_VAR] = "True"  # env:// in the ranks: a client of the store, never its host
    declared = mmap.mmap(-1, 1)  # shared with the forked ranks: set by inprocess.init_process_group()
    left = int(os.environ.get(INPROCESS_MAX_VAR, "3") or 0)
    store = None
    child = 0

    def forward(sig, _frame) -> None:
        if os.getpid() == keeper and child:
            os.kill(child, sig)

    for sig in STOP_SIGNALS:
        signal.signal(sig, forward)
    name(f"keeper{rank}")
    generation = 0
    while True:
        child = _fork(run, generation, declared)
        signalled, code = _wait(child)
        if not replaces(signalled, bool(declared[0]), left):
            break
        left -= 1
        try:
            store = store if store is not None else _client()
            generation = int(store.add(inprocess.GENERATION_KEY, 1))
            inprocess.counted(store, generation)  # wakes every rank's watch (trainpod.train.inprocess)
        except (RuntimeError, OSError) as error:  # the store went with rank 0's keeper (its node): nothing to re-form
            print(f"trainpod: rank {rank} (pid {child}) was killed by {signal.Signals(signalled).name}; not replaced "
                  f"in-process: the workers' store at {_address()} does not answer ({type(error).__name__})",
                  file=sys.stderr, flush=True)
            break
        print(f"trainpod: rank {rank} (pid {child}) was killed by {signal.Signals(signalled).name}: its replacement "
              f"joins the other ranks in-process (generation {generation}, {left} replacement(s) left)",
              file=sys.stderr, flush=True)
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    if signalled is not None:
        os.kill(os.getpid(), signalled)  # end as the rank did: the agent reports the signal
    if code:
        raise SystemExit(code)


def rank_pid(pid: int) -> int:
    """The pid of the rank that `pid` keeps, when `pid` is a keeper (by its name keeper<R>); else `pid`."""
    try:
        if not _name(pid).startswith("keeper"):
            return pid
        with open(f"/proc/{pid}/task/{pid}/children") as children:
            found = [int(child) for child in children.read().split()]
    except OSError:
        return pid
    ranks = [child for child in found if not _name(child).startswith("store")]  # rank 0's keeper has its store too
    return ranks[0] if ranks else pid


def _name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as comm:
            return comm.read().strip()
    except OSError:
        return ""


def _fork(run: Callable[[], None], generation: int, declared: mmap.mmap) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_DFL)
        orphans.die_with_parent(orphans.RANK_SIGNAL)  # no rank outlives its keeper
        os.environ[INPROCESS_GENERATION_VAR] = str(generation)
        inprocess._declared = declared
        if generation and failpoints.replacement_fails(generation):
            raise SystemExit(1)
        run()
        code = 0
    except SystemExit as end:
        code = end.code if isinstance(end.code, int) else (0 if end.code is None else 1)
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        os._exit(code)


def _wait(pid: int) -> tuple[int | None, int]:
    """(signal that killed `pid` or None, its exit code)."""
    while True:
        try:
            _, status = os.waitpid(pid, 0)
        except ChildProcessError:
            return None, 1
        if os.WIFSIGNALED(status):
            return os.WTERMSIG(status), 128 + os.WTERMSIG(status)
        if os.WIFEXITED(status):
            return None, os.WEXITSTATUS(status)


def _address() -> str:
    return f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"


def _fork_store(keeper: int, name: Callable[[str], None]) -> int:
    """Fork the process that hosts the workers' store and return its pid once the store listens; raise
    RuntimeError with the store's own error when it could not (the port is taken)."""
    sys.stdout.flush()
    sys.stderr.flush()
    readable, writable = os.pipe()
    pid = os.fork()
    if pid:
        os.close(writable)
        with os.fdopen(readable, "rb") as answer:
            said = answer.read()  # b"" once it listens (the end closed with nothing said), else its error
        if said or not _alive(pid):
            raise RuntimeError(f"the workers' store at {_address()} did not start: {said.decode(errors='replace') or 'it died'}")
        return pid
    os.close(readable)
    try:
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)  # the ranks may use it until they end: it ends with the keeper
        orphans.die_with_parent(signal.SIGKILL, keeper)
        name("store0")
        store = _host_store()  # noqa: F841 (it serves while this process lives)
        os.close(writable)
        while True:
            signal.pause()
    except BaseException as error:  # noqa: BLE001 (any: said to the keeper, which raises it)
        with contextlib.suppress(OSError):
            os.write(writable, f"{type(error).__name__}: {error}".encode()[:2000])
        os._exit(1)


def _alive(pid: int) -> bool:
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return False
    return done == 0


def _host_store():
    import torch.distributed as dist

    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=True,
                         wait_for_workers=False, timeout=timedelta(seconds=STORE_TIMEOUT_S))


def _client():
    import torch.distributed as dist

    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=timedelta(seconds=CLIENT_TIMEOUT_S))
