"""etcd's v3 API over plain HTTP (its JSON gateway), with the standard library only; no torch.

    client = EtcdClient("10.0.0.1:2379,10.0.0.2:2379", timeout=5)
    client.get(b"/k")                        # (value, mod_revision) or None
    client.cas(b"/k", b"v", mod_revision=0)  # put only if the key is absent (0) or unchanged
    info = probe("10.0.0.1:2379", timeout=5) # EtcdInfo(version, cluster_version, v2_enabled, endpoint)

Every etcd from 3.4 on serves `/v3/...` on its client port with no extra flag (3.3 called it
`/v3beta`). Keys and values travel base64-encoded in JSON, numbers (revisions, lease ids) as
decimal strings, and proto3 leaves out fields that hold their zero value ("succeeded": false,
a lease's "TTL": 0).

Endpoints are `host:port[,host:port...]` (an `http://` in front is accepted, the port defaults to
2379, IPv6 as `[::1]:2379`). A request goes to the endpoint that answered last and, when that one
cannot be reached (refused, timed out, reset, or answers 5xx as a member without quorum does),
on to the next, as etcd's own clients do; when none answers it raises EtcdUnreachableError, one
line naming every endpoint and what went wrong with it. Each attempt is bounded by `timeout`
seconds, so a call returns or raises within len(endpoints) * timeout. A request that timed out
may still have been applied: the compare-and-set below is safe to repeat (a repeated one fails
its compare and returns the current value), a plain put is idempotent.

TLS and etcd's authentication are not supported: an `https://` endpoint is refused in one line.
"""

from __future__ import annotations

import base64
import json
import socket
import threading
import urllib.error
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

from trainpod.errors import ConfigError, UnreachableError

__all__ = ["DEFAULT_PORT", "EtcdClient", "EtcdInfo", "EtcdResponseError", "EtcdUnreachableError", "parse_endpoints", "probe"]

DEFAULT_PORT = 2379


class EtcdUnreachableError(UnreachableError):
    """No endpoint answered (exit 69: try again later)."""


class EtcdResponseError(ConfigError):
    """An endpoint answered, but not as etcd's v3 API does (exit 78: not etcd, or etcd older than 3.4)."""


@dataclass(frozen=True)
class EtcdInfo:
    version: str  # the server's version, "3.4.23"
    cluster_version: str  # the cluster's, "3.4.0"
    v2_enabled: bool  # GET /v2/keys/ answered: torch's `etcd` and `etcd-v2` rendezvous can work
    endpoint: str  # the endpoint that answered


def parse_endpoints(endpoints: Union[str, Sequence[str]]) -> list[str]:
    """`host:port[,host:port...]` (or a list of them) as a list of `host:port`; ValueError, one line, if malformed."""
    items = endpoints.split(",") if isinstance(endpoints, str) else list(endpoints)
    parsed = []
    for item in (i.strip() for i in items):
        if not item:
            continue
        scheme, _, rest = item.rpartition("://")
        if scheme not in ("", "http"):
            raise ValueError(f"etcd endpoint {item!r}: only http:// is supported (no TLS)")
        try:
            split = urllib.parse.urlsplit("http://" + rest)
            host, port = split.hostname, split.port or DEFAULT_PORT
        except ValueError:
            host = None
        if not host or split.path or split.query:
            raise ValueError(f"etcd endpoint {item!r}: expected host:port")
        parsed.append(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    if not parsed:
        raise ValueError(f"etcd endpoints {endpoints!r}: expected host:port[,host:port...]")
    return parsed


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


class _Unavailable(Exception):
    """This endpoint did not answer; the next one may."""


def _reason(exc: BaseException, timeout: float) -> str:
    if isinstance(exc, urllib.error.URLError) and not isinstance(exc, urllib.error.HTTPError):
        exc = exc.reason if isinstance(exc.reason, BaseException) else exc
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return f"timed out after {timeout:g} s"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, socket.gaierror):
        return "unknown host"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower()
    return str(exc) or type(exc).__name__


def _message(body: bytes) -> str:
    try:
        payload = json.loads(body)
        return str(payload.get("message") or payload.get("error") or payload)
    except (ValueError, AttributeError):
        return body.decode("utf-8", "replace").strip().splitlines()[0][:200] if body.strip() else "empty body"


class EtcdClient:
    """The few v3 calls a rendezvous needs, against one or more endpoints; thread-safe."""

    def __init__(self, endpoints: Union[str, Sequence[str]], timeout: float):
        if not timeout > 0:
            raise ValueError(f"etcd timeout must be positive, got {timeout!r}")
        self.endpoints = parse_endpoints(endpoints)
        self.timeout = float(timeout)
        self._current = 0  # the endpoint that answered last
        self._lock = threading.Lock()

    @property
    def endpoint(self) -> str:
        return self.endpoints[self._current]

    def _once(self, endpoint: str, path: str, body: Optional[dict]) -> tuple[int, bytes]:
        # Imported here: http.client, email and ssl are a third of `trainpod run`'s own start-up, and the
        # outer run imports this module (for parse_endpoints) whether or not the job uses etcd.
        import http.client
        import urllib.request

        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"http://{endpoint}{path}", data=data, method="GET" if body is None else "POST",
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as exc:
            content = exc.read()
            if exc.code >= 500:  # a member without a leader or quorum: another one may have them
                raise _Unavailable(f"HTTP {exc.code}: {_message(content)}") from None
            return exc.code, content
        except (urllib.error.URLError, http.client.HTTPException, OSError) as exc:
            raise _Unavailable(_reason(exc, self.timeout)) from None

    def request(self, path: str, body: Optional[dict] = None) -> tuple[int, bytes]:
        """(status, body) from the first endpoint that answers, starting with the last one that did."""
        with self._lock:
            first = self._current
        failures = []
        for i in range(len(self.endpoints)):
            index = (first + i) % len(self.endpoints)
            try:
                answer = self._once(self.endpoints[index], path, body)
            except _Unavailable as exc:
                failures.append(f"{self.endpoints[index]}: {exc}")
                continue
            with self._lock:
                self._current = index
            return answer
        raise EtcdUnreachableError(f"etcd unreachable ({'; '.join(failures)})")

    def call(self, path: str, body: dict) -> dict:
        """POST a v3 request; its JSON answer. EtcdResponseError for anything but a JSON 200."""
        status, content = self.request(path, body)
        if status != 200:
            raise EtcdResponseError(f"etcd at {self.endpoint}: POST {path}: HTTP {status}: {_message(content)}")
        try:
            payload = json.loads(content)
        except ValueError:
            payload = None
        if not isinstance(payload, dict):
            raise EtcdResponseError(f"etcd at {self.endpoint}: POST {path}: not a JSON object: {_message(content)}")
        return payload

    # --- keys ---

    @staticmethod
    def _kv(kv: dict) -> tuple[bytes, int]:
        return base64.b64decode(kv.get("value", ""), validate=True), int(kv["mod_revision"])

    def get(self, key: bytes) -> Optional[tuple[bytes, int]]:
        """(value, mod_revision) of `key`, or None when it does not exist."""
        kvs = self.call("/v3/kv/range", {"key": b64(key)}).get("kvs")
        return self._kv(kvs[0]) if kvs else None

    def put(self, key: bytes, value: bytes, lease: int = 0) -> int:
        """Set `key` (attached to `lease` unless 0); the new revision."""
        body: dict[str, Any] = {"key": b64(key), "value": b64(value)}
        if lease:
            body["lease"] = str(lease)
        return int(self.call("/v3/kv/put", body)["header"]["revision"])

    def cas(self, key: bytes, value: bytes, mod_revision: int, lease: int = 0) -> tuple[bool, Optional[tuple[bytes, int]]]:
        """Put `value` only if `key`'s mod_revision is `mod_revision` (0: only if the key does not exist).

        One transaction: (True, (value, new mod_revision)) if it was put, else (False, the key's
        current (value, mod_revision), or None if it does not exist).
        """
        put: dict[str, Any] = {"key": b64(key), "value": b64(value)}
        if lease:
            put["lease"] = str(lease)
        answer = self.call("/v3/kv/txn", {
            "compare": [{"key": b64(key), "target": "MOD", "result": "EQUAL", "mod_revision": str(mod_revision)}],
            "success": [{"request_put": put}],
            "failure": [{"request_range": {"key": b64(key)}}],
        })  # fmt: skip
        if answer.get("succeeded"):
            return True, (value, int(answer["header"]["revision"]))  # the txn's one put made this revision
        kvs = answer["responses"][0]["response_range"].get("kvs")
        return False, self._kv(kvs[0]) if kvs else None

    # --- leases ---

    def grant(self, ttl: int) -> int:
        """A new lease of `ttl` seconds; its id."""
        return int(self.call("/v3/lease/grant", {"TTL": str(ttl)})["ID"])

    def keepalive(self, lease: int) -> int:
        """Renew `lease` to its full TTL; the TTL, or 0 when the lease no longer exists."""
        return int(self.call("/v3/lease/keepalive", {"ID": str(lease)}).get("result", {}).get("TTL", 0))


def probe(endpoints: Union[str, Sequence[str]], timeout: float) -> EtcdInfo:
    """What the first etcd endpoint that answers says about itself: GET /version and GET /v2/keys/.

    Raises EtcdUnreachableError (exit 69) when no endpoint answers (each attempt bounded by
    `timeout`), EtcdResponseError (exit 78) when one answers but is not etcd, and ValueError for
    malformed endpoints. etcd 3.4/3.5 answer /v2/keys/ only when started with --enable-v2; 3.6 never.
    """
    client = EtcdClient(endpoints, timeout)
    status, content = client.request("/version")
    try:
        version = json.loads(content) if status == 200 else None
    except ValueError:
        version = None
    if not isinstance(version, dict) or "etcdserver" not in version:
        raise EtcdResponseError(f"{client.endpoint} answered GET /version with HTTP {status} ({_message(content)}): is it etcd?")
    status, _ = client.request("/v2/keys/")
    return EtcdInfo(endpoint=client.endpoint, version=str(version["etcdserver"]),
                    cluster_version=str(version.get("etcdcluster", "")), v2_enabled=status == 200)
