"""One job per checkpoint and output directory: a lock file with a heartbeat.

Two jobs given the same directory used to both run: each overwrote the other's checkpoints and
metrics, and a later resume loaded the other job's weights. Now a job holds its directories for as
long as it runs, in a file `.trainpod-job.lock` in each:

    {"job": "team-a", "host": "node3", "pid": 4121, "node": "1", "beat": 17, "time": 1795700000.5, "ended": false}

- **The same job** (the same job key on every node, across restarts of the agent, elastic rounds and a
  replaced node) shares it: each node's job process writes the heartbeat, every --lock-timeout / 3 s.
- **Another job** finds the file and watches it: a heartbeat that moves within --lock-timeout means a
  live holder, and the job is refused at preflight with one line naming it (78). A heartbeat that does
  not move for --lock-timeout means a holder that died: the directory is taken over, said in one line.
  A job that ended marks the file, and the next job takes it at once.

The job key is the rendezvous id (--rdzv-id, the cluster's job identity, or the digest trainpod makes
for an etcd job); a c10d job without one is keyed by its store's address (and this host's name when the
master is on loopback): only one job at a time can listen there.

Why a heartbeat that moves, and not a time stamp compared with this host's clock: the nodes of a
cluster do not share a clock, and a skewed clock would hand a live job's directory to another. Only
a very old time stamp (max(10 x --lock-timeout, 5 min) by this host's clock) is taken as dead at once.

Which filesystems: the file is created with link(2) of a complete temporary file (atomic, and the
classic lock that works on NFS, as open(2) documents for O_EXCL on old NFS), and every read opens the
file again, so NFS v3/v4's close-to-open consistency shows the newest heartbeat (default mounts; not
with `nocto`). Local disks, NFS, CephFS and Lustre qualify; object-store FUSE mounts without link(2)
are refused with one line (78). A heartbeat is written in place, padded to a fixed size: a reader that
catches it half written sees text that differs, which counts as a live holder, never as a dead one.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace

from trainpod.contract import LOCK_FILE
from trainpod.errors import ConfigError

RECORD_BYTES = 1024  # a heartbeat overwrites the whole record in place (the padding keeps its size)
POLL_S = 0.25  # how often a watcher opens the file again
BEATS_PER_TIMEOUT = 3

Say = Callable[[str], None]


@dataclass(frozen=True)
class Holder:
    """Who holds a directory, as its lock file says."""

    job: str
    host: str
    pid: int
    node: str
    beat: int = 0
    time: float = 0.0  # the writer's clock at the beat (shown, and only a very old one trusted)
    ended: bool = False

    def describe(self) -> str:
        return f"job {self.job!r} (node {self.node} on {self.host}, pid {self.pid})"

    def encode(self) -> bytes:
        text = json.dumps(asdict(self)).encode()
        if len(text) >= RECORD_BYTES:  # a job key is at most a few hundred characters (rendezvous.ids)
            raise ConfigError(f"the job key {self.job[:60]!r}...: too long for a lock file ({len(text)} bytes)")
        return text.ljust(RECORD_BYTES, b" ")


def job_key(rdzv_id: str, backend: str, master_addr: str, master_port: int, default_id: str) -> str:
    """The key the nodes of one job share (the module docstring)."""
    if backend != "c10d" or rdzv_id != default_id:
        return rdzv_id
    where = f"c10d@{master_addr}:{master_port}"
    if master_addr in ("127.0.0.1", "::1", "localhost") or master_addr.startswith("127."):
        where += "@" + socket.gethostname()  # a one-host job: two hosts' loopbacks are different stores
    return where


def read(path: str) -> Holder | None | bytes:
    """The holder in lock file `path`: None if there is none, the raw bytes if they do not parse (a
    heartbeat caught half written, or not a trainpod lock)."""
    try:
        with open(path, "rb") as lock:  # opened each time: NFS's close-to-open shows the newest content
            data = lock.read(RECORD_BYTES * 2)
    except FileNotFoundError:
        return None
    try:
        fields = json.loads(data.decode())
        return Holder(job=str(fields["job"]), host=str(fields["host"]), pid=int(fields["pid"]), node=str(fields["node"]),
                      beat=int(fields["beat"]), time=float(fields["time"]), ended=bool(fields["ended"]))
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return data


def _create(path: str, holder: Holder) -> bool:
    """Make `path` hold `holder`, only if no lock file is there: link(2) of a complete file. False: one is."""
    temporary = f"{path}.{uuid.uuid4().hex}"
    with open(temporary, "wb") as staged:
        staged.write(holder.encode())
        staged.flush()
        os.fsync(staged.fileno())
    try:
        os.link(temporary, path)
    except FileExistsError:
        return False
    except OSError as error:
        if error.errno in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS):
            raise ConfigError(f"{os.path.dirname(path)}: this filesystem has no hard links (link(2): {error.strerror}), "
                              "which the directory lock needs; use a POSIX filesystem (local, NFS, CephFS, Lustre) "
                              "or --lock-timeout 0 to run without the lock") from None
        raise
    finally:
        os.unlink(temporary)
    return True


def _overwrite(path: str, holder: Holder) -> None:
    """A heartbeat: the record written in place (the file stays the same one, for every reader)."""
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, holder.encode(), 0)
        os.fsync(fd)
    finally:
        os.close(fd)


def _take_over(path: str, dead: Holder | bytes, holder: Holder) -> bool:
    """Replace a dead holder's file with ours. The file is renamed aside first and checked to be the dead
    one: a racing job that took it over an instant before keeps it (ours is put back), and False."""
    aside = f"{path}.dead-{uuid.uuid4().hex}"
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return _create(path, holder)
    moved = read(aside)
    if moved != dead:  # not what was seen dead: someone's fresh lock; give it back
        with contextlib.suppress(FileExistsError):
            os.link(aside, path)
        os.unlink(aside)
        return False
    os.unlink(aside)
    return _create(path, holder)


class Hold:
    """This job's hold on its directories: acquire() at preflight, start() the heartbeat, release() at the end."""

    def __init__(self, directories: Sequence[tuple[str, str]], holder: Holder, timeout: float, say: Say):
        self.directories = list(directories)  # (absolute path, what: "checkpoint directory ... (--flag, VAR)")
        self.holder = holder
        self.timeout = timeout
        self._say = say
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lost: str | None = None  # the line, once another job took a directory over

    def _path(self, directory: str) -> str:
        return os.path.join(directory, LOCK_FILE)

    def acquire(self, clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        """Hold every directory, or raise the one line (78) naming the job that holds one."""
        for directory, what in self.directories:
            self._acquire(directory, what, clock, wall)

    def _acquire(self, directory: str, what: str, clock, wall) -> None:
        path = self._path(directory)
        while True:
            seen = read(path)
            if seen is None:
                if _create(path, self.holder):
                    return
                continue  # another job created it an instant ago: look at it
            if isinstance(seen, Holder) and seen.job == self.holder.job:
                self._beat(path)  # this job's own: another node, or this node before a restart
                return
            if isinstance(seen, Holder) and seen.ended:
                if _take_over(path, seen, self.holder):
                    self._say(f"the {what} was {seen.describe()}'s, which ended: this job holds it now")
                    return
                continue
            if isinstance(seen, Holder) and wall() - seen.time > max(10 * self.timeout, 300.0):
                dead_for = wall() - seen.time
            else:
                dead_for = self._watch(path, seen, what, clock)
                if dead_for is None:
                    continue  # released meanwhile, or taken by this job's other node: look again
            if _take_over(path, seen, self.holder):
                who = seen.describe() if isinstance(seen, Holder) else "an unreadable lock file"
                self._say(f"the {what} was held by {who}, whose heartbeat stopped {dead_for:.0f}s ago "
                          f"(--lock-timeout {self.timeout:g}): this job takes it over")
                return

    def _watch(self, path: str, seen: Holder | bytes, what: str, clock) -> float | None:
        """Wait up to the timeout for `seen` to change: a change is a live holder (raise); none, a dead one
        (the seconds watched); None: the directory was released, or this job's other node holds it now."""
        began = clock()
        while clock() - began < self.timeout:
            time.sleep(POLL_S)
            now = read(path)
            if now == seen:
                continue
            if now is None or (isinstance(now, Holder) and (now.ended or now.job == self.holder.job)):
                return None
            who = now.describe() if isinstance(now, Holder) else (seen.describe() if isinstance(seen, Holder) else "a job")
            raise ConfigError(
                f"the {what} is in use by {who}, which is running (its heartbeat in {path} moves): two jobs in one "
                "directory overwrite each other's checkpoints; give this job its own directory, or stop that job "
                f"(a job that died is taken over {self.timeout:g}s after its last heartbeat: --lock-timeout)")
        return clock() - began

    def _beat(self, path: str) -> None:
        self.holder = replace(self.holder, beat=self.holder.beat + 1, time=time.time())
        _overwrite(path, self.holder)

    def beat_once(self) -> None:
        """One heartbeat in every directory; a directory another job took over is this job's end."""
        for directory, what in self.directories:
            path = self._path(directory)
            seen = read(path)
            if isinstance(seen, Holder) and seen.job != self.holder.job and not seen.ended:
                self.lost = (f"the {what} was taken over by {seen.describe()} after this job's heartbeat stopped for "
                             f"more than {self.timeout:g}s (--lock-timeout): this job stops rather than overwrite its files")
                return
            try:
                if seen is None:
                    _create(path, self.holder)
                else:
                    self._beat(path)
            except OSError:
                pass  # a full or briefly unreachable volume: the next beat tries again (the timeout allows 2 misses)

    def start(self) -> None:
        """The heartbeat thread, every timeout / 3 s, for the life of this process (it becomes the agent)."""

        def run() -> None:
            while not self._stop.wait(self.timeout / BEATS_PER_TIMEOUT):
                self.beat_once()
                if self.lost:
                    self._say(f"error: {self.lost}")
                    os.kill(os.getpid(), signal.SIGTERM)  # the agent stops the ranks as for any SIGTERM
                    return

        self._thread = threading.Thread(target=run, name="trainpod-dirlock", daemon=True)
        self._thread.start()

    def release(self, ended: bool) -> None:
        """Stop the heartbeat; `ended`: the job is over (not about to be restarted), and the next job may take
        the directories at once."""
        self._stop.set()
        if not ended or self.lost:
            return
        self.holder = replace(self.holder, ended=True)
        for directory, _ in self.directories:
            path = self._path(directory)
            seen = read(path)
            if isinstance(seen, Holder) and seen.job == self.holder.job:
                with contextlib.suppress(OSError):  # then the next job waits for the heartbeat to expire
                    self._beat(path)


def hold(directories: Sequence[tuple[str | None, str]], key: str, node: str, timeout: float, say: Say) -> Hold | None:
    """acquire() the directories that are set (None: a command's, unknown) for job `key`; None with
    the lock off (timeout 0) or nothing to hold."""
    paths: list[tuple[str, str]] = []
    for directory, what in directories:
        if not directory:
            continue
        absolute = os.path.realpath(directory)  # two spellings of one directory are one lock
        try:
            os.makedirs(absolute, exist_ok=True)  # (an elastic job's ranks would make it later; hold it first)
        except OSError:
            continue  # where the ranks never write it (another node's checkpoints); else preflight said why
        if absolute not in (p for p, _ in paths):
            paths.append((absolute, what.format(path=absolute)))
    if timeout <= 0 or not paths:
        return None
    held = Hold(paths, Holder(job=key, host=socket.gethostname(), pid=os.getpid(), node=node, time=time.time()),
                timeout, say)
    try:
        held.acquire()
    except OSError as error:
        raise ConfigError(f"the lock file in {paths[0][0]}: {error.strerror or error}") from None
    return held
