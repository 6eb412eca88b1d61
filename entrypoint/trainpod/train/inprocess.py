"""In-process recovery, the rank's side: after a peer rank died, keep this process and re-form the group.

With --recovery in-process (TRAINPOD_RECOVERY) every rank runs under a keeper (trainpod.agent.keeper): a
small parent process that forks the rank, and when the rank is killed by a signal forks a
replacement at once, with torch already imported, and counts a new *generation* in the workers'
store (which the keeper of global rank 0 hosts, so that it outlives any rank). The ranks that are
still alive see their collective fail; a script that uses this module then does not exit:

    from trainpod.train import inprocess

    inprocess.init_process_group("gloo")           # env:// at first; a replacement joins its generation
    while True:
        try:
            train()                                  # builds DDP, restores the newest checkpoint, trains
            break
        except RuntimeError as error:                # a collective failed: a peer may have died
            inprocess.recover(error)                 # re-raises it unless a replacement is coming

Every rank also watches the store (_watch, a thread): once a keeper has counted the next generation, the
rank shuts down its own connections in its group (_disconnect), so that a collective it waits in fails
now even when no peer's failure reaches it (a send that waits on a live peer which has itself left).
If this rank's main thread then stays where it was, idle, for STUCK_S (a collective that did not end), the
watch ends the rank with SIGKILL and its keeper replaces it, as any dead rank (_recover_or_end). It ends it
sooner, after ORPHAN_S, when a thread of the rank waits in a receive or a send that gloo can no longer end: gloo's
tcp transport fails every operation of a connection that closes, except the two it had begun, a receive whose
message had begun to arrive and a send whose message it had begun to write, which wait for the group's timeout
(30 min by default). A collective's run on a worker thread of gloo's, which py-spy cannot show: its main thread's
wait for the collective (c10d::Work::wait) stands for them. A survivor that was receiving from or sending to the
dead rank, or a live one when the connections were shut down, is then replaced as well.
recover() first shuts down this rank's connections in the broken group, so that every peer's pending
collective with it fails at once, then leaves the group without freeing it (_broken: the group is
held from the moment it formed, so a script that destroyed it already cannot free it either), waits
(RECOVERY_WAIT_S at most) for the keeper of the dead rank to count the next generation, and joins
that generation's group together with the replacement (REFORM_TIMEOUT_S at most). Every rank first
checks in at the generation in the store (_meet): when two ranks died about together, whoever sees the
second count before all arrived moves every rank on to it, so that all form one group. train() then
restores the state: HostCopy keeps the last checkpoint in this process's memory, and the
replacement loads the same checkpoint from disk.
Anything else (no keeper, no new generation because the error was no peer's death, a group that
does not re-form) re-raises the original error: the rank exits, and the agent restarts the whole
worker group from the checkpoint on disk, as without in-process recovery.

A script that never calls init_process_group() here is not replaced in-process: its keeper lets a
killed rank end as it would without one, and the agent restarts the group.
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

from trainpod.contract import INPROCESS_GENERATION_VAR

GENERATION_KEY = "trainpod/inprocess/generation"  # in the workers' store: the newest generation counted
COUNTED_KEY = "trainpod/inprocess/counted/{}"  # set by the keeper once it counted generation N: what the ranks wait for
MEETING_KEY = "trainpod/inprocess/meeting/{}"  # where the ranks check in at generation N (_meet)
RECOVERY_WAIT_S = 3.0  # after a failed collective, how long a new generation may take to be counted
REFORM_TIMEOUT_S = 60.0  # how long the new group may take to form (the replacement starts, loads its data)
STUCK_S = 10.0  # after the watch left this rank's group: how long its main thread may stay where it was, idle
ORPHAN_S = 2.0  # ... and when to look (py-spy, every ORPHAN_S) whether it waits on a receive or send that nothing can end
# The waits of a gloo receive and send (what this rank says of each): once a receive's message began to arrive, or a
# send's began to be written, the connection's failure no longer reaches it. gloo/transport/tcp/pair.cc's
# Pair::signalException fails the pending operations, but not the one being read (the pair's rx_), and of the ones
# being written (its tx_) only those of bound buffers, while every collective's are unbound.
# A collective (all_reduce, broadcast, ...) runs on a worker thread of gloo's, which py-spy does not show (a thread with
# no Python in it): its cut receive or send is seen as the main thread's wait for that collective, which the shut-down
# connections ended at once were it not cut.
ORPHANED = {"gloo::transport::tcp::UnboundBuffer::waitRecv": "a receive",
            "gloo::transport::tcp::UnboundBuffer::waitSend": "a send",
            "c10d::Work::wait": "a collective"}
_SPY_S = 10.0  # how long py-spy may take to read this process's stacks (longer on a loaded machine; not STUCK_S, which tests set low)
_WATCH_WAIT_S = 86400.0  # one wait of the watch for the next generation (then it waits again): a day
_EXPIRY_GRACE_S = 10.0  # a meeting's wait lasts this much past its deadline, for a rank to decide it expired (_meet)

_declared: Any = None  # set by trainpod.agent.keeper in the forked rank: a shared byte the rank sets to say it recovers
_links: list[tuple[int, int]] = []  # (fd, socket inode) of this rank's connections to its group's peers
_links_lock = threading.Lock()  # _links is shut down by the watch's thread too
_watching: threading.Thread | None = None
_counted = threading.Condition()  # notified by the watch when it sees a generation counted
_counted_up_to = 0  # the newest generation the watch saw counted
# This generation's group, held from the moment it formed: a script may destroy it before recover()
# runs (the harness's train() does, in its `finally`), and then the failed step's objects (the DDP
# model's reducer) hold its last reference.
_group: Any = None
# The groups given up on, kept from being freed: freeing a gloo group joins its threads, and one that
# still has a collective's tensors to free needs the GIL, which the freeing thread holds (a hang seen
# under load, trainpod.train.distributed.shutdown). Their connections are shut down (_disconnect); their
# threads stay, idle: two per recovery.
_broken: list[Any] = []


def enabled() -> bool:
    """Whether this rank runs under a keeper (trainpod.agent.keeper), so that a dead peer can be replaced in-process."""
    return INPROCESS_GENERATION_VAR in os.environ


def generation() -> int:
    """The group generation this rank belongs to: 0 at the start, one more after each in-process recovery."""
    return int(os.environ.get(INPROCESS_GENERATION_VAR, "0") or 0)


def init_process_group(backend: str, device_id=None) -> None:
    """torch.distributed.init_process_group for a rank started by torchrun: env:// in generation 0, the
    generation's own group for a replacement. Also tells the keeper that this rank can recover in-process."""
    import torch.distributed as dist

    if not enabled():
        dist.init_process_group(backend, device_id=device_id)
        return
    if _declared is not None:
        _declared[0] = 1
    if generation() == 0:
        with _recording():
            dist.init_process_group(backend, device_id=device_id)  # env://: the keeper made every rank a store client
        _formed()
    else:
        try:
            _join(generation(), backend, device_id)
        except NotFormed as failed:  # a replacement has nothing else to do: the agent restarts the worker group
            print(f"trainpod: rank {os.environ.get('RANK')}: no in-process recovery: {failed}", file=sys.stderr, flush=True)
            raise SystemExit(1) from None
    _watch()


def recover(error: BaseException, backend: str | None = None, device_id=None) -> int:
    """After `error` in a collective: re-form the group with the replacement of a dead rank and return
    the new generation; re-raise `error` if this rank cannot (see the module docstring)."""
    import torch.distributed as dist

    from trainpod.train import distributed

    if not enabled():
        raise error
    backend = backend or (dist.get_backend() if dist.is_initialized() else "gloo")
    _disconnect()
    _give_up()
    distributed.shutdown(barrier=False)
    _release(error)
    current = generation()
    try:
        store = _store(RECOVERY_WAIT_S)
        newest = int(store.add(GENERATION_KEY, 0))
        if newest <= current:  # not counted yet (the dead peer's connection told this rank first): the watch says when
            with _counted:  # (a wait, not polls of the store: each poll is a round trip that the store's host
                # answers, on the cores that the recovery needs)
                _counted.wait_for(lambda: _counted_up_to > current, RECOVERY_WAIT_S)
            newest = int(store.add(GENERATION_KEY, 0))
    except (RuntimeError, OSError):
        raise error from None  # the store went with rank 0's keeper (its node): the agent decides
    if newest <= current:
        raise error  # no rank died (or none could be replaced): the agent restarts the group
    os.environ[INPROCESS_GENERATION_VAR] = str(newest)
    try:
        return _join(newest, backend, device_id, store)
    except Exception as failed:  # the replacement did not come (or another rank died meanwhile)
        print(f"trainpod: rank {os.environ.get('RANK')}: no in-process recovery: {failed}", file=sys.stderr, flush=True)
        distributed.shutdown(barrier=False)
        raise error from None


def _formed() -> None:
    global _group
    import torch.distributed as dist

    from trainpod.train import distributed

    _group = dist.group.WORLD
    distributed.kept(_group)  # never freed here: its shutdown after a failed step need not wait for gloo's threads


def _give_up() -> None:
    """Keep this generation's group from ever being freed (see _broken), whether or not the script destroyed it."""
    global _group
    if _group is not None:
        _broken.append(_group)
        _group = None


def _disconnect(of: int | None = None) -> None:
    """Shut down this rank's connections in its group (only while it is generation `of`, when given). A
    peer's collective that waits on this rank then fails at once, as does any of this rank's own still
    running on gloo's threads: no rank waits for the group's timeout (30 min in generation 0) to learn
    that the group is given up."""
    with _links_lock:
        if of is not None and generation() != of:
            return  # this rank recovered meanwhile: _links are its new group's
        current = _sockets()
        for fd, inode in _links:
            if current.get(fd) != inode:
                continue  # closed already (the number may be another socket's now)
            with contextlib.suppress(OSError), socket.socket(fileno=os.dup(fd)) as link:
                link.shutdown(socket.SHUT_RDWR)  # the socket, not this descriptor: gloo's own one sees it too
        _links.clear()


def _watch() -> None:
    """Start (once per process) the thread that leaves each generation's group as soon as a keeper counted
    the next one: a rank blocked in a collective then fails it and recovers (see the module docstring)."""
    global _watching
    if _watching is None:
        _watching = threading.Thread(target=_watch_generations, name="trainpod-inprocess-watch", daemon=True)
        _watching.start()


def _watch_generations() -> None:
    try:
        store = _store(_WATCH_WAIT_S)  # its own client: a store client serves one thread at a time
    except (RuntimeError, OSError):
        return  # no store (it went with rank 0's keeper): the ranks' own errors decide
    while True:
        watched, began = generation(), time.monotonic()
        try:
            store.wait([COUNTED_KEY.format(watched + 1)], timedelta(seconds=_WATCH_WAIT_S))
        except (RuntimeError, OSError):
            if time.monotonic() - began < _WATCH_WAIT_S:
                return  # the store is gone, not a wait that timed out
            continue
        _saw_counted(watched + 1)
        _disconnect(of=watched)
        _recover_or_end(watched)


def _saw_counted(number: int) -> None:
    global _counted_up_to
    with _counted:
        _counted_up_to = max(_counted_up_to, number)
        _counted.notify_all()


def _recover_or_end(watched: int) -> None:
    """Wait until this rank has recovered (or ended); end it (SIGKILL, so that its keeper replaces it) if its
    main thread stays where it was when the group was given up, idle, for STUCK_S: in a collective that the
    connections shut down did not end. (Seen under load: DDP's finalize_backward waiting for a bucket's
    allreduce, while every other rank waited at the next generation.) Every ORPHAN_S of that, it looks at the
    rank's native stacks, and ends it at once when a thread waits in a receive or send that gloo no longer ends
    (ORPHANED). A main thread that computes there (a long backward pass) is let be; one that moves is
    watched from where it went (to recover(), which ends the watch, or into another wait)."""
    main = threading.main_thread()
    stuck_at, cpu, since = _where(main), _cpu_s(main.native_id), time.monotonic()
    look_at = since + ORPHAN_S
    while generation() == watched:  # until this rank recovered (or ended)
        time.sleep(0.05)
        where = _where(main)
        if where is None or where != stuck_at:
            # It moved: watched from where it is now. To recover(), which ends this loop once it counted the next
            # generation; or into a wait on an operation posted before the group was given up (a receive cut
            # mid-message): a watch that let a main thread go once it moved never ended a rank that was still on
            # its way into that wait when the group was given up.
            stuck_at, cpu, since = where, _cpu_s(main.native_id), time.monotonic()
            look_at = since + ORPHAN_S
            continue
        now = time.monotonic()
        looking, stuck = now >= look_at, now - since >= STUCK_S
        if looking:
            look_at = now + ORPHAN_S
        idle = _cpu_s(main.native_id) - cpu < 0.05 * (now - since) and generation() == watched
        stacks = _native_stacks() if idle and (looking or stuck) else ""  # once a turn, for both rules
        if stacks and _where(main) != stuck_at:
            continue  # it moved while py-spy read it (seconds on a busy machine): watched from where it is now
        orphaned = next((wait for wait in ORPHANED if wait in stacks), None) if looking else None
        if orphaned:
            _end(f"{ORPHANED[orphaned]} in progress when its group was given up ({orphaned}), which gloo ends only "
                 f"at the group's timeout, after {now - since:.1f}s idle in {stuck_at[2]}{_kept(stacks)}")
        if stuck:
            if idle:
                _end(f"still idle in {stuck_at[2]} {STUCK_S:g}s after its group was given up{_main_wait(stacks)}"
                     f"{_kept(stacks)}")
            cpu, since = _cpu_s(main.native_id), now


def _end(why: str) -> None:
    """End this rank with SIGKILL, saying why: its keeper replaces it, as any rank that died."""
    print(f"trainpod: rank {os.environ.get('RANK')}: {why}: the rank ends, and its keeper replaces it", file=sys.stderr,
          flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def _native_stacks() -> str:
    """Every thread's stack of this process, below Python too (py-spy --native, which reads this process from a child
    of it); empty where py-spy is missing or may not read this process."""
    spy = os.path.join(os.path.dirname(sys.executable), "py-spy")
    spy = spy if os.path.exists(spy) else shutil.which("py-spy")
    if not spy:
        return ""
    try:
        return subprocess.run([spy, "dump", "--native", "--pid", str(os.getpid())], capture_output=True, text=True,
                              timeout=_SPY_S).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def _main_wait(stacks: str) -> str:
    """Where the main thread waits below Python, as a clause of the stuck line: the C++ wait that the shut-down
    connections did not end is what tells its cause."""
    main = re.search(rf'^Thread {os.getpid()} .*\n((?:[ \t]+.*\n?)*)', stacks, re.M)
    if not main:
        return ""
    native = [line.strip().rsplit(" (", 1)[0] for line in main.group(1).splitlines() if re.search(r"\(lib(torch|gloo|c10)", line)]
    names = [re.sub(r"\(.*", "", name)[:100] for name in native if "pybind11" not in name][:4]
    return f", waiting in {', called from '.join(names)}" if names else ""


def _kept(stacks: str) -> str:
    """Write `stacks` to <output>/hangs/<time>-rank<R>-stuck.txt; where they went, as a clause of the line."""
    from trainpod.contract import HANGS_DIR, OUTPUT_DIR_VAR

    output = os.environ.get(OUTPUT_DIR_VAR, "").strip()
    if not output or not stacks:
        return ""
    path = os.path.join(output, HANGS_DIR, f"{time.strftime('%Y%m%dT%H%M%S')}-rank{os.environ.get('RANK')}-stuck.txt")
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as handle:
            handle.write(stacks)
    except OSError:
        return ""
    return f" (every thread's stack: {path})"


def _where(thread: threading.Thread) -> tuple[int, int, str] | None:
    """Where `thread` is: its innermost Python frame (identity, instruction, and `function (file:line)`)."""
    frame = sys._current_frames().get(thread.ident)
    if frame is None:
        return None
    return id(frame), frame.f_lasti, f"{frame.f_code.co_name} ({frame.f_code.co_filename}:{frame.f_lineno})"


def _cpu_s(tid: int | None) -> float:
    """The CPU seconds thread `tid` of this process has used (0.0 if unknown)."""
    try:
        with open(f"/proc/self/task/{tid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


@contextlib.contextmanager
def _recording() -> Iterator[None]:
    """Keep the TCP connections that the group made while this block ran (not the store's: MASTER_PORT)."""
    before = set(_sockets().values())
    yield
    store_port = int(os.environ.get("MASTER_PORT", "0") or 0)
    with _links_lock:
        _links[:] = [(fd, inode) for fd, inode in _sockets().items() if inode not in before and _is_link(fd, store_port)]


def _sockets() -> dict[int, int]:
    """This process's sockets: fd -> inode."""
    found = {}
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError, ValueError):
                target = os.readlink(f"/proc/self/fd/{name}")
                if target.startswith("socket:["):
                    found[int(name)] = int(target[len("socket:["):-1])
    return found


def _is_link(fd: int, store_port: int) -> bool:
    """Whether `fd` is a connected TCP socket that is neither end of a store connection (a listener, a
    Unix socket, the store are not)."""
    try:
        with socket.socket(fileno=os.dup(fd)) as link:
            if link.family not in (socket.AF_INET, socket.AF_INET6) or link.type != socket.SOCK_STREAM:
                return False
            return store_port not in (link.getpeername()[1], link.getsockname()[1])
    except OSError:
        return False


def _release(error: BaseException) -> None:
    """Free what the failed step held: clear its frames (a DDP model, the collective's work) and collect
    them. (Neither destroying nor aborting a gloo group closes its connections in torch 2.13, and freeing
    it would: _disconnect shuts them down instead, and the group itself is kept, _broken.)"""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__
    gc.collect()


def gist(error: BaseException) -> str:
    """The first sentence of a collective's error, without gloo's source location: "Read error [10.0.0.2]:4711:
    Connection reset by peer"."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    text = re.sub(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*", "", text)
    return text.split(". ")[0][:200]


def _store(timeout_s: float):
    import torch.distributed as dist

    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=timedelta(seconds=timeout_s))


def _join(number: int, backend: str, device_id, store=None) -> int:
    """Form the group of generation `number`, or of a newer one that every rank meets at (_meet); return it."""
    import torch.distributed as dist

    store = store if store is not None else _store(REFORM_TIMEOUT_S)
    store.set_timeout(timedelta(seconds=REFORM_TIMEOUT_S))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    number = _meet(store, number, rank, world, time.monotonic() + REFORM_TIMEOUT_S)
    os.environ[INPROCESS_GENERATION_VAR] = str(number)
    with _recording():
        dist.init_process_group(backend, store=dist.PrefixStore(f"trainpod/inprocess/{number}", store), rank=rank,
                                world_size=world, timeout=timedelta(seconds=REFORM_TIMEOUT_S), device_id=device_id)
    # Formed: from now on its collectives wait as long as generation 0's (torch's default for the backend, as
    # env:// gave it), not REFORM_TIMEOUT_S, which bounds only the forming. A re-formed group whose collectives
    # timed out after 60 s ended a recovered job at the first longer wait (a slow checkpoint or evaluation on
    # one rank): a timer that the recovery started (issue 29).
    c10d = dist.distributed_c10d
    c10d._set_pg_timeout(c10d._get_default_timeout(backend))
    _formed()
    return number


def _meet(store, number: int, rank: int, world: int, deadline: float) -> int:
    """Check in at generation `number` and wait until all `world` ranks have; return the generation they meet at.

    Two ranks that die about together are counted as two generations, and their replacements and the
    survivors may each have seen either first: a meeting that a newer generation was counted before its
    last rank arrived is left, and every rank moves on to the newest. Which of the two happened first (the
    last arrival, or the count) is decided once, in the store (compare_set on the meeting's outcome, by the
    last rank to arrive or by the keeper that counts the next generation: counted()), so that no rank forms
    a group that the others left; every rank waits for that outcome, and polls nothing. A meeting that is not
    whole by the deadline is decided the same way, as expired, by the first rank whose deadline passes
    (_expire_at): every rank's wait ends with that outcome, rather than timing out in c10d, which says so in
    two warning lines of its own before this rank's one line."""
    from torch.distributed import DistStoreError

    while True:
        # This rank's generation from here on: the watch of the generation it leaves ends (a main thread that waits
        # in a meeting is not stuck in the group it left), and the next count is what it watches for.
        os.environ[INPROCESS_GENERATION_VAR] = str(number)
        meeting = MEETING_KEY.format(number)
        store.set(f"{meeting}/rank{rank}", "")
        if int(store.add(f"{meeting}/arrived", 1)) >= world:  # the last to arrive (one that arrived may have died since)
            newer = int(store.add(GENERATION_KEY, 0)) > number
            store.compare_set(f"{meeting}/outcome", "", "left" if newer else "formed")
        expiry = _expire_at(store, f"{meeting}/outcome", deadline)
        try:
            store.wait([f"{meeting}/outcome"], timedelta(seconds=max(deadline - time.monotonic(), 0) + _EXPIRY_GRACE_S))
            outcome = store.get(f"{meeting}/outcome")
        except DistStoreError:  # no rank could expire it (a store that went away is a DistNetworkError, and goes up)
            outcome = b"expired"
        finally:
            expiry.cancel()
        if outcome == b"formed":
            return number
        if outcome == b"expired":
            missing = [r for r in range(world) if not store.check([f"{meeting}/rank{r}"])]
            raise NotFormed(f"generation {number} did not form within {REFORM_TIMEOUT_S:g}s: rank(s) "
                            f"{', '.join(map(str, missing[:8]))}{' ...' if len(missing) > 8 else ''} did not come")
        number = max(int(store.add(GENERATION_KEY, 0)), number + 1)  # left: a newer generation was counted


def _expire_at(store, outcome: str, deadline: float) -> threading.Timer:
    """At `deadline`, decide the meeting's `outcome` as expired unless it was decided: from a timer with a client
    of its own (Store.clone()), since the rank waits on the one it was given."""
    def expire() -> None:
        with contextlib.suppress(Exception):  # the store went away: the rank's wait fails on its own, or times out
            store.clone().compare_set(outcome, "", "expired")

    timer = threading.Timer(max(deadline - time.monotonic(), 0), expire)
    timer.daemon = True
    timer.start()
    return timer


def counted(store, number: int) -> None:
    """What the keeper of a dead rank does once it counted generation `number`: wake every rank's watch, and
    leave the meeting at the generation before it if that did not form yet (_meet: its ranks move on to this one)."""
    store.set(COUNTED_KEY.format(number), "1")
    if number > 1:  # generation 0 formed through env://, not a meeting
        store.compare_set(f"{MEETING_KEY.format(number - 1)}/outcome", "", "left")


class NotFormed(RuntimeError):
    """A generation's group did not form in time (a rank did not come): the agent restarts the worker group."""


class HostCopy:
    """The last checkpoint's state, kept in this process's memory (tensors on the CPU), so that a survivor
    of an in-process recovery restores it without reading the disk. The disk stays the source of truth:
    use the copy only when its step is the newest checkpoint there (trainpod.examples.harness)."""

    def __init__(self):
        self.step: int | None = None
        self.state: Any = None

    def keep(self, step: int, state: Any) -> None:
        from trainpod.train.checkpoint.snapshot import Snapshot

        self.state = Snapshot(self.state).take(state)  # the previous copy's buffers are reused
        self.step = step

    def restore(self) -> Any:
        """A fresh copy of the kept state: load_state_dict may keep the tensors it is given (an optimizer's
        state on the same device is not copied), and training would then change the kept copy."""
        from trainpod.train.checkpoint.snapshot import Snapshot

        return Snapshot().take(self.state)
