"""The job's newest committed checkpoint, one view for every node: each agent publishes its node's in a store they share.

A node's restart budget counts a newer committed checkpoint as progress (trainpod.supervisor.restarts). But a
node learns of a commit from its own ranks' progress files, and only the node of global rank 0 writes
checkpoints: the others' ranks report one when they resume from it. So the nodes disagreed about whether a failure
came after progress: in an elastic job whose one node's ranks crash at step 6 every time, the saving node saw
"the same failure twice" one failure before the crashing node, which took its second crash for progress (it had
just resumed from step 4) and stayed in the round that ended the job (CI).

Shared: every agent publishes its node's newest committed step under COMMITTED_KEY where it is newer than what
the key holds, once a second (a thread) and again at each failure, and reads the job's from there. The store is
the one the nodes already share: the raw c10d store in a fixed-size job (trainpod.agent.control's JobControl
polls this with its stop key), the run's rendezvous store in an elastic one (trainpod.rendezvous.exclusions
.job_store: c10d's, etcd-v3's keys, torch etcd's run directory). Steps only grow, and the writer is the node of
rank 0 (another node's ranks report only a step they loaded): a write that races another and loses leaves the
key at most one checkpoint behind until the next poll.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

COMMITTED_KEY = "trainpod/committed"
POLL_S = 1.0
FRESH_WAIT_S = 3.0  # at a failure: how long to wait for a fresh look at the store


def own_client(store):
    """A client of `store` for a thread that polls it (torch's Store.clone(): a connection of its own). Requests on
    one client wait for each other, and the agent's main thread waits on the job's store for as long as the slowest
    node takes (torch's rank assignment after a round, its exit barrier): a poll on its client waited as long,
    and saw a stop, or the master's liveness, only then. Where there is none (a store of Python's, like etcd-v3's,
    which waits by polling and holds nothing; a store that went away a moment ago), the same store."""
    try:
        return store.clone()
    except Exception:
        return store


class SharedCommitted:
    """This node's newest committed step, published; the job's, read (the module docstring)."""

    def __init__(self, store, local: Callable[[], int]):
        self.store = store
        self._local = local  # this node's newest committed step (-1: none), from its ranks' progress files
        self.job = -1  # the newest committed step known to the job
        self._lock = threading.Lock()  # one exchange at a time: the thread's, or a fresh one at a failure
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    def publish(self) -> int:
        """Publish this node's step where it is newer than the job's; the job's newest. Raises the store's errors."""
        with self._lock:
            mine, stored = self._local(), self._read()
            if mine > stored:
                self.store.set(COMMITTED_KEY, str(mine))
            self.job = max(self.job, stored, mine)
            return self.job

    def fresh(self, wait: float = FRESH_WAIT_S) -> int:
        """publish() now, on a thread the caller waits for at most `wait` (a store on a silent network must not hold
        the agent); the newest known either way, this node's own step included."""
        asked = threading.Thread(target=self._quietly, name="trainpod-committed-fresh", daemon=True)
        asked.start()
        asked.join(wait)
        return max(self.job, self._local())

    def start(self, poll_s: float = POLL_S) -> SharedCommitted:
        """Publish and read once every `poll_s` on a thread, until close()."""
        def run() -> None:
            while not self._closed.is_set():
                self._quietly()
                self._closed.wait(poll_s)

        self._thread = threading.Thread(target=run, name="trainpod-committed", daemon=True)
        self._thread.start()
        return self

    def close(self, wait: float = 2 * POLL_S) -> None:
        """Stop the thread, and wait (bounded) for an exchange in flight: a thread inside a request to torch's
        store when the interpreter exits can abort the process (docs/shutdown.md)."""
        self._closed.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(wait)

    def _quietly(self) -> None:
        with contextlib.suppress(Exception):  # a store gone or failing: the job's view stays where it was
            self.publish()

    def _read(self) -> int:
        if not self.store.check([COMMITTED_KEY]):
            return -1
        try:
            return int(self.store.get(COMMITTED_KEY))
        except ValueError:
            return -1
