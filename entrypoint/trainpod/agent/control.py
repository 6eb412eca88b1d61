"""One node stops, the job stops: a stop key in the c10d rendezvous store that every agent polls.

torchrun's agents share nothing but the rendezvous, and torch's agent offers no way for one node to
end the job on the others: a node that was stopped (SIGTERM: `docker stop`, pre-emption) or that
gave up (its restart budget, the same failure twice) simply goes away, and the other nodes take that
as a failure to restart from; when the node that went away was node 0, whose agent hosts the store,
they waited --connect-timeout on every attempt. So every agent of a multi-node job runs a small
thread (JobControl) that, once a second, on the store the agents already share (node 0's, on the
master port; the raw store, not a rendezvous round's; through a connection of its own, committed.own_client):

- reads `trainpod/stop`: set by a node that ends the job on purpose, to {"code", "node", "why"};
  seen, the agent adds 1 to `trainpod/stop/seen` and stops its ranks (SIGTERM: they get
  --term-grace, as on `docker stop`), exits with that code (143 after a SIGTERM), and neither it
  nor supervisord restarts anything. The node that stops sets the key *before* it signals its own
  ranks, so a peer whose ranks fail because of that stop already finds the key; node 0, whose
  process holds the store, waits (at most SEEN_WAIT_S after its ranks stopped) until every other
  node counted itself in `trainpod/stop/seen` before it exits and the store goes away.
- publishes the newest checkpoint committed on this node (`trainpod/committed`) and reads the job's:
  only rank 0's node writes checkpoints, and every node's restart budget counts them as progress
  (trainpod.agent.committed).
- notices when the store stops answering: the master's agent is gone (killed, its host lost), not
  stopped (that would have set the key). After the job started, a node then waits at most
  --rejoin-timeout for the master's port to answer again, and ends with 69 and one line if it does
  not; if it does (an orchestrator restarted node 0), the agent exits 69 and supervisord starts a
  new one, which joins the new master.

Why the store and not something of torch's: the rendezvous' own state can be closed (torch's
`shutdown()` marks it closed), but a closed rendezvous raises RendezvousClosedError only at the
next rendezvous, i.e. after the other nodes' ranks failed and were restarted into it, and it says
nothing about the code. The store is already there, reachable from every agent, and costs two
small requests a second.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import dataclass

from trainpod import log
from trainpod.agent.committed import SharedCommitted, own_client

STOP_KEY = "trainpod/stop"
SEEN_KEY = "trainpod/stop/seen"
POLL_S = 1.0
SEEN_WAIT_S = 5.0  # node 0, after its ranks stopped: how long it keeps the store up for the others
PROBE_WAIT_S = 3.0  # after a failure: how long to wait for a fresh answer from the store


@dataclass(frozen=True)
class Stop:
    code: int
    node: int | str
    why: str


class JobControl:
    """The stop key, the job's committed step and the master's liveness, for one agent (module docstring)."""

    def __init__(self, store, *, node_rank: int, nnodes: int, is_host: bool, master: tuple[str, int],
                 committed=lambda: -1, say: log.Log | None = None):
        self.store = own_client(store)  # not the agent's: its waits would hold this thread's polls
        self._host = store  # ... which on node 0 is the store's server too: it serves while this control lives
        self.node_rank, self.nnodes, self.is_host, self.master = node_rank, nnodes, is_host, master
        self.committed = SharedCommitted(self.store, committed)  # published on this thread's polls
        self._say = say or log.writer(node_rank)
        self.stop: Stop | None = None  # the first stop this node saw or announced
        self.announced = False
        self._acked = False
        self._last_ok = time.monotonic()
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._polling = threading.Lock()  # one poll at a time: the thread's, or a fresh one after a failure
        self._thread = threading.Thread(target=self._run, name="trainpod-job-control", daemon=True)
        self._thread.start()

    # --- the thread ---

    def _run(self) -> None:
        while not self._closed.is_set():
            self._poll()
            self._closed.wait(POLL_S)

    def _poll(self) -> None:
        with self._polling:
            self._poll_once()

    def _poll_once(self) -> None:
        try:
            if self.stop is None and self.store.check([STOP_KEY]):
                stop = _parse(self.store.get(STOP_KEY))
                with self._lock:
                    if self.stop is None:
                        self.stop = stop
                if not self.announced and not self._acked:
                    self._acked = True
                    self.store.add(SEEN_KEY, 1)
            self.committed.publish()
            self._last_ok = time.monotonic()
        except Exception:  # the store is gone (its host died) or failing: unreachable_s() grows
            pass

    # --- what the agent asks ---

    @property
    def job_committed(self) -> int:
        """The job's newest committed checkpoint, as of the last poll (-1: none)."""
        return self.committed.job

    def unreachable_s(self) -> float:
        """Seconds since the store last answered (0 while it answers, and on node 0, which holds it)."""
        if self.is_host:
            return 0.0
        silent = time.monotonic() - self._last_ok
        return silent if silent > 2.5 * POLL_S else 0.0

    def reachable_now(self) -> bool:
        """Poll the store now (the stop key too: a peer may have set it a moment ago, after the thread's
        last poll), at most PROBE_WAIT_S; False when the master's agent is gone (its connection reset,
        or silent). Always True on node 0, which holds the store."""
        asked = time.monotonic()
        poll = threading.Thread(target=self._poll, name="trainpod-job-control-probe", daemon=True)
        poll.start()
        poll.join(PROBE_WAIT_S)  # a request hanging on a silent network cannot hold the agent longer
        return self.is_host or self._last_ok >= asked

    def announce(self, code: int, why: str) -> Stop:
        """End the job on every node with `code`: set the stop key unless another node set it first."""
        stop = Stop(code, self.node_rank, why)
        with self._lock:
            if self.stop is not None:
                return self.stop
            self.stop, self.announced = stop, True
        try:
            current = self.store.compare_set(STOP_KEY, "", json.dumps(stop.__dict__))
            decoded = current.decode() if isinstance(current, bytes) else str(current)
            if decoded and _parse(decoded) != stop:
                return _parse(decoded)  # another node was first; ours is moot
        except Exception as exc:  # no store: the others find out by themselves
            self._say(f"warning: could not tell the other nodes to stop ({type(exc).__name__}: {exc})")
        return stop

    def wait_seen(self, timeout: float = SEEN_WAIT_S) -> None:
        """On node 0 after a stop: keep the store up until every other node saw the stop (bounded)."""
        if not self.is_host or self.stop is None or self.nnodes < 2:
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if self.store.add(SEEN_KEY, 0) >= self.nnodes - 1:
                    return
            except Exception:
                return
            time.sleep(0.1)

    def close(self, wait: float = 2 * POLL_S) -> None:
        """Stop polling, and wait (bounded) for a poll in flight: a thread still inside a request to the
        store when the interpreter exits can abort the process (std::terminate in torch's store)."""
        self._closed.set()
        if self._thread is not threading.current_thread():
            self._thread.join(wait)


def _parse(value) -> Stop:
    text = value.decode() if isinstance(value, bytes) else str(value)
    try:
        data = json.loads(text)
        return Stop(int(data["code"]), data.get("node", "?"), str(data.get("why", "")))
    except (ValueError, KeyError, TypeError):
        return Stop(143, "?", text)


def wait_for_port(address: tuple[str, int], timeout: float) -> bool:
    """Whether `address` accepts a TCP connection within `timeout` seconds (asked about once a second)."""
    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        try:
            with socket.create_connection(address, timeout=max(0.2, min(2.0, remaining))):
                return True
        except OSError:
            pass
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
