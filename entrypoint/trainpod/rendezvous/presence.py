"""A lost node leaves the rendezvous as soon as its peers see its agent go, not once its heartbeat lapses.

torch's dynamic rendezvous (c10d, trainpod's etcd-v3) knows a node is gone only when its heartbeat in the shared state
is older than keep_alive_interval x keep_alive_max_attempt (3 s by an elastic trainpod job's default, 15 s by torch's).
Until then the survivors' next round waits for it, and so does a spare: the lost node is still one of the round's
participants, so the round has no room. Most of a spare's takeover, and of a survivor's recovery at the smaller world,
was that wait (bench/spare_scale.py, bench/elastic.py).

Yet the survivors see a lost node go at once: its agent's process ends, and the kernel closes its sockets, sending a FIN
or RST to every peer, with a whole container killed too (its processes end before its network does). So each trainpod
agent listens on the job's interface (a port the kernel picks) and says its run and node on every connection it accepts;
it publishes that address in the rendezvous state as it joins a round or a list (publish()); and it holds one connection
to every other node's listener it finds there (seen(); at most WATCHED_MAX of them). A held connection that ends after
its greeting means the agent at the other end is gone: its node's heartbeat is expired at once in this process's reads
of the state (expire(), before torch's own sweep), so torch's sweep drops it and the next write (a heartbeat, a join, an
exit) tells every node; the agent's line of the next round names the nodes that left this way (seen_gone()), and no line
comes of a node that ends with the job. A connection that never got its greeting (refused, a timeout, another run's
listener, a stranger's port) says nothing: that node leaves as before, when its heartbeat lapses. So does a node whose
host froze or whose network went away (no FIN reaches anyone), and a node of bare torchrun (no listener).

A heartbeat written after the agent was seen to go is never expired: it is a node of the same descriptor (host, pid,
a process-local id) started anew, as a restarted container's agent may be, not the lost one.
"""

from __future__ import annotations

import contextlib
import json
import logging
import selectors
import socket
import threading
import time
from datetime import datetime, timedelta, timezone

from trainpod.topology import join_host_port

__all__ = ["ATTR", "Presence", "expire", "publish", "seen", "seen_gone", "start", "stop"]

ATTR = "trainpod_presence"  # on torch's _RendezvousState: {node descriptor: "host:port" of its agent's listener}
CONNECT_S = 2.0  # a connection that has no greeting by then says nothing (a host that drops packets)
RETRY_S = 5.0  # a node whose listener did not answer is tried again no sooner
# The nodes one agent watches at most: those after it in the nodes' order, as on a ring. Up to 65 nodes every node
# watches every other; beyond, each is still watched by as many, and an agent's descriptors stay bounded.
WATCHED_MAX = 64
MAX_ACCEPTED = 1024  # the listener's connections at most (a peer's each); more are closed unanswered
GONE_KEPT_S = 600.0  # how long a lost node's mark is kept (its heartbeat is expired in every read meanwhile)
_LONG_AGO = datetime(1970, 1, 1, tzinfo=timezone.utc)
logger = logging.getLogger(__name__)

_current: Presence | None = None


def start(handler, address: str, say=None) -> Presence | None:
    """This agent's listener on `address` (the job's interface), for `handler`'s node of torch's dynamic rendezvous;
    None for another rendezvous (torch's etcd backend) or an address that cannot be bound (said once)."""
    global _current
    node = getattr(handler, "_this_node", None)
    if node is None:
        return None
    try:
        _current = Presence(address, handler.get_run_id(), node)
    except OSError as error:
        (say or logger.warning)(f"warning: no presence listener on {address} ({error.strerror or error}): a lost node "
                                "leaves the rendezvous once its heartbeat lapses")
        return None
    return _current


def stop() -> None:
    """Close this process's listener and watch (tests: an agent's end closes them with its process)."""
    global _current
    if _current is not None:
        _current.close()
        _current = None


def publish(state, node) -> None:
    """Put this agent's listener in `state` beside `node`, if `node` is this agent's (joining a round or a list)."""
    if _current is not None and node == _current.node:
        state.__dict__.setdefault(ATTR, {})[node] = _current.address


def seen_gone(nodes) -> set:
    """Those of `nodes` whose agents this one saw go (empty without a listener)."""
    return _current.gone() & set(nodes) if _current is not None else set()


def expire(state) -> None:
    """Make the heartbeat of every node this agent saw go old in `state`, so that torch's sweep drops it now."""
    if _current is not None:
        _current.expire(state.last_heartbeats)


def seen(state) -> None:
    """After torch's sweep of `state`: forget the listeners of nodes no longer in it, and watch the others'."""
    listeners = state.__dict__.get(ATTR)
    if listeners is None:
        return
    alive = state.last_heartbeats
    if any(node not in alive for node in listeners):
        state.__dict__[ATTR] = listeners = {node: at for node, at in listeners.items() if node in alive}
    if _current is not None:
        _current.watch(listeners)


def _greeting(run_id: str, node) -> bytes:
    return json.dumps({"trainpod-presence": 1, "run": run_id, "node": repr(node)}).encode() + b"\n"


def _split(address: str) -> tuple[str, int] | None:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


class _Watch:
    """One held connection to another node's listener."""

    def __init__(self, node, sock: socket.socket, expected: bytes):
        self.node, self.sock, self.expected = node, sock, expected
        self.received = b""
        self.greeted = False
        self.deadline = time.monotonic() + CONNECT_S


class Presence:
    """This agent's listener and its watch on the other nodes' (the module docstring). One thread, which only waits."""

    def __init__(self, address: str, run_id: str, node):
        self.node, self.run_id = node, run_id
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._listener.bind((address, 0))
            self._listener.listen(64)
        except OSError:
            self._listener.close()
            raise
        self._listener.setblocking(False)
        self.address = join_host_port(address, self._listener.getsockname()[1])
        self._hello = _greeting(run_id, node)
        self._lock = threading.Lock()
        self._listed: dict = {}  # node -> listener address, as the state last listed them
        self._wanted: dict = {}  # ... those of them this agent watches
        self._listen_again = 0.0  # when to accept again after the process ran out of descriptors (0: accepting)
        self._watches: dict = {}  # node -> _Watch: connecting, or held
        self._tried: dict = {}  # node -> when a connection to it last said nothing
        self._gone: dict = {}  # node -> when its held connection ended (UTC)
        self._accepted = 0
        self._closing = False
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)  # a full buffer has wakes enough: the rendezvous' thread never waits on the loop
        self._selector.register(self._listener, selectors.EVENT_READ, "listener")
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread = threading.Thread(target=self._loop, name="trainpod-presence", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """End the loop and close every socket: the peers watching this node see it go."""
        self._closing = True
        self._wake()
        self._thread.join(5)

    # --- the rendezvous' side (its thread, or torch's heartbeat thread) ---

    def watch(self, listeners: dict) -> None:
        """Hold a connection to each of these nodes' listeners (not this node's), and none to a node not among them."""
        with self._lock:
            if listeners == self._listed:  # the usual case: a poll of an unchanged state
                return
            self._listed = dict(listeners)
        others = sorted((node for node in listeners if node != self.node), key=repr)
        if len(others) > WATCHED_MAX:
            mine = repr(self.node)
            others = ([node for node in others if repr(node) > mine] + [node for node in others if repr(node) < mine])
        with self._lock:
            self._wanted = {node: listeners[node] for node in others[:WATCHED_MAX]}
        self._wake()

    def expire(self, heartbeats: dict) -> None:
        with self._lock:
            if not self._gone:
                return
            cutoff = datetime.now(timezone.utc) - timedelta(seconds=GONE_KEPT_S)
            for node, at in list(self._gone.items()):
                if at < cutoff:
                    del self._gone[node]
                elif node in heartbeats and heartbeats[node] <= at:  # not a node of that descriptor started anew
                    heartbeats[node] = _LONG_AGO

    def gone(self) -> set:
        """The nodes whose agents this one saw go (in the last GONE_KEPT_S)."""
        with self._lock:
            return set(self._gone)

    def watching(self) -> set:
        """The nodes whose listeners greeted this one, their connections held (tests)."""
        with self._lock:
            return {node for node, watch in self._watches.items() if watch.greeted}

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    # --- the loop ---

    def _loop(self) -> None:
        while not self._closing:
            with self._lock:
                due = [w.deadline for w in self._watches.values() if not w.greeted]
                due += [self._tried[node] + RETRY_S for node in self._wanted
                        if node in self._tried and node not in self._watches and node not in self._gone]
            if self._listen_again:
                due.append(self._listen_again)
            timeout = max(0.0, min(due) - time.monotonic()) if due else None
            for key, _ in self._selector.select(timeout):
                try:
                    self._event(key)
                except Exception:  # a peer's bytes never end this thread: its watch would end with it
                    logger.debug("presence: an event of %r failed", key.data, exc_info=True)
            if self._listen_again and time.monotonic() >= self._listen_again:
                self._listen_again = 0.0
                self._selector.register(self._listener, selectors.EVENT_READ, "listener")
            self._timeouts()
            self._follow_wanted()
        for key in list(self._selector.get_map().values()):
            key.fileobj.close()
        self._listener.close()  # also when it was out of the loop
        self._selector.close()
        self._wake_w.close()

    def _event(self, key) -> None:
        if key.data == "listener":
            self._accept()
        elif key.data == "wake":
            with contextlib.suppress(BlockingIOError):
                self._wake_r.recv(4096)
        elif key.data == "peer":  # a peer's watch on this node: held until it closes it
            if not self._receive(key.fileobj):
                self._selector.unregister(key.fileobj)
                key.fileobj.close()
                self._accepted -= 1
        else:
            self._watched(key.data)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # out of descriptors: a peer's connect waits in the backlog, or ends with no greeting (nothing
                # said); the listener stays out of the loop for a while, where its readiness would wake it at once, again
                self._selector.unregister(self._listener)
                self._listen_again = time.monotonic() + RETRY_S
                return
            if self._accepted >= MAX_ACCEPTED:
                sock.close()
                continue
            sock.setblocking(False)
            try:
                sock.send(self._hello)  # a few dozen bytes into an empty buffer
            except OSError:
                sock.close()
                continue
            self._accepted += 1
            self._selector.register(sock, selectors.EVENT_READ, "peer")

    @staticmethod
    def _receive(sock: socket.socket) -> bytes | None:
        """What a readable socket had (discarded by callers that expect nothing); None once it ended."""
        try:
            data = sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return b""
        except OSError:  # ECONNRESET: the other end ended with data unread, or its host reset it
            return None
        return data or None

    def _watched(self, watch: _Watch) -> None:
        data = self._receive(watch.sock)
        if data is None:
            self._close(watch, gone=watch.greeted)
            return
        if watch.greeted:
            return
        watch.received += data
        if b"\n" not in watch.received:
            if len(watch.received) > 4096:
                self._close(watch, gone=False)
            return
        if watch.received.split(b"\n", 1)[0] + b"\n" != watch.expected:
            self._close(watch, gone=False)  # another run's listener, or a stranger's port
            return
        with self._lock:
            watch.greeted = True

    def _close(self, watch: _Watch, gone: bool) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(watch.sock)
        watch.sock.close()
        with self._lock:
            if self._watches.get(watch.node) is watch:
                del self._watches[watch.node]
            if gone:
                self._gone[watch.node] = datetime.now(timezone.utc)
            else:
                self._tried[watch.node] = time.monotonic()
        if gone:  # said where it changes something: the agent's line of the next round (trainpod.agent.policy)
            logger.debug("the agent of node %r ended: its connection to this node's closed", watch.node)

    def _timeouts(self) -> None:
        now = time.monotonic()
        with self._lock:
            late = [w for w in self._watches.values() if not w.greeted and w.deadline <= now]
        for watch in late:
            self._close(watch, gone=False)

    def _follow_wanted(self) -> None:
        now = time.monotonic()
        with self._lock:
            wanted = dict(self._wanted)
            dropped = [w for node, w in self._watches.items() if node not in wanted]
            new = [(node, at) for node, at in wanted.items()
                   if node not in self._watches and node not in self._gone and now - self._tried.get(node, -RETRY_S) >= RETRY_S]
        for watch in dropped:  # left the state: no longer this node's to watch
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(watch.sock)
            watch.sock.close()
            with self._lock:
                self._watches.pop(watch.node, None)
        for node, at in new:
            self._connect(node, at)

    def _connect(self, node, at: str) -> None:
        where = _split(at) if isinstance(at, str) else None
        if where is None:
            with self._lock:
                self._tried[node] = time.monotonic()
            return
        sock = socket.socket(socket.AF_INET6 if ":" in where[0] else socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            sock.connect_ex(where)
        except OSError:
            sock.close()
            with self._lock:
                self._tried[node] = time.monotonic()
            return
        watch = _Watch(node, sock, _greeting(self.run_id, node))
        with self._lock:
            self._watches[node] = watch
        self._selector.register(sock, selectors.EVENT_READ, watch)
