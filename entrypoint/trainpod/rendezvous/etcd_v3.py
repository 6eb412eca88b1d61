"""`etcd-v3`: torch's dynamic rendezvous with its state in etcd, over etcd's v3 API.

torch's own etcd rendezvous backends (`etcd`, `etcd-v2`) speak only etcd's v2 API, which etcd 3.4
and 3.5 serve only with --enable-v2 and 3.6 removed (pytorch issues #158326, #170707). This one
needs nothing but the v3 API, which every etcd from 3.4 on serves over HTTP or HTTPS (etcd_http.py).

Use. torchrun looks backends up in torch's rendezvous handler registry, which knows `etcd-v3` only
once register() ran in the agent's process, before torchrun creates the handler:

    from trainpod.rendezvous import etcd_v3
    etcd_v3.register()                       # idempotent
    torch.distributed.run.main(["--rdzv-backend", "etcd-v3", "--rdzv-endpoint", "etcd1:2379,etcd2:2379",
                                "--rdzv-id", RUN_ID, "--nnodes", "1:4", ...])

`python -m trainpod.rendezvous.torchrun ARGS` does exactly that. Options (torchrun's --rdzv-conf):
`read_timeout` (seconds each etcd request may take, and an agent may wait for a key of the
store, default 60, as torch's c10d backend uses it for its TCPStore), `ttl` (the lease, below;
default 7200) and those of torch's dynamic rendezvous (join_timeout, last_call_timeout,
close_timeout, heartbeat_timeout, keep_alive_interval, keep_alive_max_attempt); with TLS
(`--rdzv-endpoint https://...`), `cacert`, `cert` and `key`, the names torch's etcd backend reads;
an etcd user and its password come from TRAINPOD_ETCD_USER and TRAINPOD_ETCD_PASSWORD_FILE or
TRAINPOD_ETCD_PASSWORD (etcd_http.EtcdAccess), never from the command line.

The state. torch's DynamicRendezvousHandler keeps the whole rendezvous (participants, wait list,
heartbeats, round, closed) in one opaque byte string and asks its backend only to read it and to
replace it if nobody else did in between. Here it is the value of one etcd key,
`/trainpod/rdzv/<run_id>/state`; the fencing token is the key's mod_revision, and set_state is one
transaction: "if mod_revision is still the token (0: the key does not exist) put the new state,
else read the current one" (etcd_http.EtcdClient.cas). A set reports success only if its own
transaction put the state. (torch's c10d backend also counts a failed set that finds the very bytes
it meant to write as done; that loses one of two identical concurrent updates, and torch does not
need it: after a failed set it re-reads and re-applies its operation to what it got back.)

The store. The handler also hands the agents a c10d Store, for what they exchange before the
workers start (rank 0's address, the worker ranks, the exit barrier): EtcdV3Store, keys under
`/trainpod/rdzv/<run_id>/store/`, polled with a short back-off while an agent waits for one. The
workers themselves use the TCPStore that the round's rank-0 agent hosts (torch's default), so no
training traffic goes through etcd.

Lease (TTL). torch's etcd backend writes its state with a TTL of two hours, so what an abandoned
run leaves behind goes away. The same here with a v3 lease: each process grants one lease of
`ttl` seconds and attaches every key it writes to it; a write more than ttl/2 after the lease was
granted or renewed renews it first (one keep-alive request). A key belongs to the lease of its
last writer, so it expires between ttl/2 and ttl after the last write, unless that writer goes on
writing. A live rendezvous never gets near that: every agent rewrites the state on each
keep-alive heartbeat (5 s by default). No background thread keeps leases alive: that would keep a
dead run's keys only as long as the agent's process lived, and the renewal on use costs one request
per ttl/2. A ttl shorter than the longest quiet spell of a run (an agent waiting in the exit
barrier or in a join writes nothing for up to that long) could delete keys in use: keep it at
minutes or more.
"""

from __future__ import annotations

import binascii
import pickle
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Optional, Union

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousParameters,
    RendezvousStateError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, Token
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler as create_dynamic_handler

from trainpod.rendezvous.etcd_http import EtcdAccess, EtcdClient, EtcdResponseError, EtcdUnreachableError

__all__ = ["NAME", "EtcdV3Backend", "EtcdV3Store", "Lease", "create_backend", "create_handler", "register", "store_prefix"]

NAME = "etcd-v3"
KEY_PREFIX = "/trainpod/rdzv/"
DEFAULT_READ_TIMEOUT = 60  # seconds, as torch's c10d and etcd backends
DEFAULT_TTL = 7200  # seconds, as torch's etcd backend
POLL_FIRST, POLL_MAX = 0.01, 0.25  # seconds between reads of a key an agent waits for


class _Errors:
    """Turns the client's errors into torch's rendezvous errors, one line naming the endpoint."""

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if isinstance(exc, (EtcdUnreachableError, EtcdResponseError)):
            raise RendezvousConnectionError(f"{NAME} rendezvous: {exc}") from None
        if isinstance(exc, binascii.Error):
            raise RendezvousStateError(f"{NAME} rendezvous: a value in etcd is not base64 ({exc})") from None
        if isinstance(exc, (KeyError, IndexError, TypeError, ValueError)):
            raise RendezvousStateError(f"{NAME} rendezvous: an answer etcd would not give ({type(exc).__name__}: {exc})") from None
        return False


class Lease:
    """One lease of `ttl` seconds, granted on first use and renewed on use after ttl/2."""

    def __init__(self, client: EtcdClient, ttl: int):
        if ttl <= 0:
            raise ValueError(f"the lease TTL must be a positive number of seconds, got {ttl!r}")
        self.client, self.ttl = client, ttl
        self._id, self._renewed = 0, 0.0
        self._lock = threading.Lock()

    def id(self) -> int:
        with self._lock:
            age = time.monotonic() - self._renewed
            if self._id and age > self.ttl / 2 and self.client.keepalive(self._id) <= 0:
                self._id = 0  # expired (or revoked) meanwhile: a new one
            elif self._id and age > self.ttl / 2:
                self._renewed = time.monotonic()
            if not self._id:
                self._renewed = time.monotonic()
                self._id = self.client.grant(self.ttl)
            return self._id

    def forget(self) -> None:
        with self._lock:
            self._id = 0


def _with_lease(lease: Lease, write):
    """write(lease_id), once more with a new lease if etcd no longer knows the one we had."""
    try:
        return write(lease.id())
    except EtcdResponseError as exc:
        if "lease not found" not in str(exc):
            raise
        lease.forget()
        return write(lease.id())


class EtcdV3Backend(RendezvousBackend):
    """torch's RendezvousBackend on one etcd key, compare-and-set on its mod_revision."""

    def __init__(self, client: EtcdClient, run_id: str, lease: Lease):
        if not run_id:
            raise ValueError("The run id must be a non-empty string.")
        self.client, self.lease = client, lease
        self.key = f"{KEY_PREFIX}{run_id}/state".encode()

    @property
    def name(self) -> str:
        return NAME

    def get_state(self) -> Optional[tuple[bytes, Token]]:
        with _Errors():
            return self.client.get(self.key)

    def set_state(self, state: bytes, token: Optional[Token] = None) -> Optional[tuple[bytes, Token, bool]]:
        if token is not None and not isinstance(token, int):
            current = self.get_state()  # not a token of ours: it cannot match
            return None if current is None else (*current, False)
        with _Errors():
            done, current = _with_lease(self.lease, lambda lease: self.client.cas(self.key, state, token or 0, lease))
        if current is None:
            return None
        return (*current, done)


def closed(client: EtcdClient, run_id: str) -> Optional[bool]:
    """Whether the run's rendezvous is closed, by its state in etcd (torch's pickled _RendezvousState, as
    its state holder writes it); None when etcd holds none (it expired with the last node's lease)."""
    with _Errors():
        found = client.get(f"{KEY_PREFIX}{run_id}/state".encode())
    if found is None:
        return None
    return bool(getattr(pickle.loads(found[0]), "closed", False))


def _bytes(value: Union[str, bytes]) -> bytes:
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if isinstance(value, list):  # what c10d hands over for a std::vector<uint8_t>
        return bytes(value)
    raise TypeError(f"a store key or value must be str or bytes, got {type(value).__name__}")


class EtcdV3Store(dist.Store):
    """A c10d Store on etcd keys under `prefix`: set, get, add, check and wait, what torch's agents use.

    get() and wait() poll until every key exists or the store's timeout passes, then raise
    DistStoreError as TCPStore does.
    """

    def __init__(self, client: EtcdClient, prefix: str, lease: Lease, timeout: timedelta = timedelta(seconds=300)):
        super().__init__()  # the pybind trampoline needs it
        self.client, self.lease = client, lease
        self.prefix = prefix.encode()
        self.set_timeout(timeout)

    def _key(self, key: Union[str, bytes]) -> bytes:
        return self.prefix + _bytes(key)

    def set(self, key, value) -> None:
        key, value = self._key(key), _bytes(value)
        with _Errors():
            _with_lease(self.lease, lambda lease: self.client.put(key, value, lease))

    def get(self, key) -> bytes:
        return self._wait([key], self.timeout)[0]

    def add(self, key, num: int) -> int:
        key = self._key(key)
        while True:
            with _Errors():
                current = self.client.get(key)
            value = (int(current[0]) if current else 0) + num  # c10d's counters are decimal strings
            with _Errors():
                done, _ = _with_lease(self.lease, lambda lease, current=current, value=value: self.client.cas(
                    key, str(value).encode(), current[1] if current else 0, lease))
            if done:
                return value

    def check(self, keys) -> bool:
        keys = [self._key(k) for k in keys]
        with _Errors():
            return all(self.client.get(k) is not None for k in keys)

    def wait(self, keys, override_timeout: Optional[timedelta] = None) -> None:
        self._wait(keys, override_timeout or self.timeout)

    def _wait(self, keys: Sequence, timeout: timedelta) -> list[bytes]:
        deadline = time.monotonic() + timeout.total_seconds()
        wanted = [self._key(k) for k in keys]
        found: dict[bytes, bytes] = {}
        pause = POLL_FIRST
        while True:
            for key in wanted:
                if key not in found:
                    with _Errors():
                        current = self.client.get(key)
                    if current is not None:
                        found[key] = current[0]
            if len(found) == len(set(wanted)):
                return [found[k] for k in wanted]
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [k for k, w in zip(keys, wanted) if w not in found]
                raise dist.DistStoreError(f"{NAME} store: timed out after {timeout.total_seconds():g} s "
                                          f"waiting for {missing} at {self.client.endpoint}")
            time.sleep(min(pause, left))
            pause = min(pause * 2, POLL_MAX)


def _client(params: RendezvousParameters) -> EtcdClient:
    read_timeout = params.get_as_int("read_timeout", DEFAULT_READ_TIMEOUT)
    if read_timeout is None or read_timeout <= 0:
        raise ValueError(f"{NAME} rendezvous: read_timeout must be a positive number of seconds, got {read_timeout!r}")
    if not params.endpoint:
        raise ValueError(f"{NAME} rendezvous: an endpoint is needed (--rdzv-endpoint host:port[,host:port...])")
    # TLS files from the rendezvous configuration, the user from TRAINPOD_ETCD_* (the launch plan puts them there).
    return EtcdClient(params.endpoint, read_timeout, EtcdAccess.from_env(params.config))


def store_prefix(run_id: str) -> str:
    """Where the agents' store of run `run_id` keeps its keys."""
    return f"{KEY_PREFIX}{run_id}/store/"


def create_backend(params: RendezvousParameters) -> tuple[EtcdV3Backend, EtcdV3Store]:
    """The backend and the agents' store for `params` (endpoint, run_id, read_timeout, ttl)."""
    client = _client(params)
    lease = Lease(client, params.get_as_int("ttl", DEFAULT_TTL) or DEFAULT_TTL)
    backend = EtcdV3Backend(client, params.run_id, lease)
    store = EtcdV3Store(client, store_prefix(params.run_id), lease, timedelta(seconds=client.timeout))
    return backend, store


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    """torch's DynamicRendezvousHandler on the etcd-v3 backend: the creator register() registers."""
    backend, store = create_backend(params)
    return create_dynamic_handler(store, backend, params)


def torchrun_handler():
    """For a `torchrun.handlers` entry point (`etcd-v3 = "trainpod.rendezvous.etcd_v3:torchrun_handler"`):
    torch's registry calls it and registers what it returns."""
    return create_handler


def register() -> None:
    """Make `etcd-v3` known to torch's rendezvous registry, so torchrun's --rdzv-backend takes it.

    Call it in the agent's process before torchrun creates its rendezvous handler (before
    torch.distributed.run.main / elastic_launch). Calling it again does nothing.
    """
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(NAME, create_handler)
