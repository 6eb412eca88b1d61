"""etcd's v3 API over HTTP or HTTPS (its JSON gateway), with the standard library only; no torch.

    client = EtcdClient("10.0.0.1:2379,10.0.0.2:2379", timeout=5)
    client.get(b"/k")                        # (value, mod_revision) or None
    client.cas(b"/k", b"v", mod_revision=0)  # put only if the key is absent (0) or unchanged
    info = probe("10.0.0.1:2379", timeout=5) # EtcdInfo(version, cluster_version, v2_enabled, endpoint)
    EtcdClient("https://etcd1:2379", 5, EtcdAccess(cacert="ca.pem", cert="node.pem", key="node-key.pem",
                                                    user="trainer", password_file="/run/secrets/etcd"))

Every etcd from 3.4 on serves `/v3/...` on its client port with no extra flag (3.3 called it
`/v3beta`). Keys and values travel base64-encoded in JSON, numbers (revisions, lease ids) as
decimal strings, and proto3 leaves out fields that hold their zero value ("succeeded": false,
a lease's "TTL": 0).

Endpoints are `[http://|https://]host:port[,...]`, one scheme for all (the port defaults to 2379,
IPv6 as `[::1]:2379`); parse_endpoints() gives plain `host:port` for http and `https://host:port`
for https. A user name or password in the URL (`http://root:pw@etcd:2379`) is refused: a secret
on a command line shows in `ps` and in job files; EtcdAccess takes the user, and the password
from a file or a variable. A request goes to the endpoint that answered last and, when that one
cannot be reached (refused, timed out, reset, or answers 5xx as a member without quorum does),
on to the next, as etcd's own clients do; when none answers it raises EtcdUnreachableError, one
line naming every endpoint and what went wrong with it. Each attempt is bounded by `timeout`
seconds, so a call returns or raises within len(endpoints) * timeout. A request that timed out
may still have been applied: the compare-and-set below is safe to repeat (a repeated one fails
its compare and returns the current value), a plain put is idempotent.

TLS and authentication (EtcdAccess, etcd as production runs it). https:// verifies etcd's
certificate against `cacert` (else the system's CAs) and the host name, and presents `cert`/`key`
to an etcd started with --client-cert-auth. With a `user`, the client authenticates once
(POST /v3/auth/authenticate) and sends the token with every v3 request, authenticating again when
etcd no longer knows it (tokens expire: --auth-token-ttl, a restart); v2 requests (the probe for
torch's etcd backend) carry the user and password as HTTP basic auth, as python-etcd sends them.
What can only be a configuration mistake is an EtcdAccessError (78) at once, never retried as
"unreachable" (69): plain http to a TLS server (etcd closes the connection, or answers 400) or
https to a plain one, a certificate that does not verify, a client certificate missing or
refused, a wrong user or password, authentication on and no user given, no permission.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import socket
import threading
import urllib.error
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

from trainpod.errors import ConfigError, UnreachableError
from trainpod.settings import ETCD_PASSWORD, ETCD_PASSWORD_FILE, ETCD_USER

__all__ = ["DEFAULT_PORT", "EtcdAccess", "EtcdAccessError", "EtcdClient", "EtcdInfo", "EtcdResponseError",
           "EtcdUnreachableError", "has_userinfo", "named", "parse_endpoints", "probe", "redact"]

DEFAULT_PORT = 2379
PASSWORD_VAR = ETCD_PASSWORD.var
USERINFO = ("a user name or password in the endpoint URL is refused (a secret on a command line shows in `ps` and "
            "in job files): give --etcd-user (TRAINPOD_ETCD_USER) and the password in a file (--etcd-password-file, "
            "TRAINPOD_ETCD_PASSWORD_FILE) or in TRAINPOD_ETCD_PASSWORD")
GRANT = "grant it readwrite on the prefix /trainpod/ (etcdctl role grant-permission ROLE --prefix=true readwrite /trainpod/)"


class EtcdUnreachableError(UnreachableError):
    """No endpoint answered (exit 69: try again later)."""


class EtcdResponseError(ConfigError):
    """An endpoint answered, but not as etcd's v3 API does (exit 78: not etcd, or etcd older than 3.4)."""


class EtcdAccessError(EtcdResponseError):
    """etcd answered, and this client may not use it as configured: TLS, user, password or permission (78)."""


@dataclass(frozen=True)
class EtcdInfo:
    version: str  # the server's version, "3.4.23"
    cluster_version: str  # the cluster's, "3.4.0"
    v2_enabled: bool  # GET /v2/keys/ answered: torch's `etcd` and `etcd-v2` rendezvous can work
    endpoint: str  # the endpoint that answered


@dataclass(frozen=True)
class EtcdAccess:
    """How to reach a TLS etcd and who to be there. Holds no secret: the password is read when needed
    (password()) from `password_file`, else the variable `password_var`; repr() and explain show paths only.

    The agent rebuilds it (from_env()): the TLS paths reach it in --rdzv-conf (cacert, cert, key: the keys
    torch's etcd backend reads), the user and the password file in TRAINPOD_ETCD_USER and
    TRAINPOD_ETCD_PASSWORD_FILE, the password variable as the job inherited it.
    """

    cacert: str = ""
    cert: str = ""
    key: str = ""
    user: str = ""
    password_file: str = ""
    password_var: str = ""

    @property
    def tls(self) -> bool:
        return bool(self.cacert or self.cert or self.key)

    def password_source(self) -> str:
        return f"the file {self.password_file}" if self.password_file else self.password_var or "no password"

    def password(self, env: Optional[Mapping[str, str]] = None) -> str:
        """The user's password, read now; a ConfigError (78) naming the file or variable, never showing it."""
        if self.password_file:
            try:
                with open(self.password_file, "rb") as handle:
                    raw = handle.read(65536)
                text = raw.decode("utf-8")
            except OSError as exc:
                raise ConfigError(f"etcd password file {self.password_file}: {exc.strerror or exc}") from None
            except UnicodeDecodeError:
                raise ConfigError(f"etcd password file {self.password_file}: expected UTF-8 text") from None
            source = f"etcd password file {self.password_file}"
            text = text[:-2] if text.endswith("\r\n") else text[:-1] if text.endswith("\n") else text
        else:
            env = os.environ if env is None else env
            text = env.get(self.password_var, "") if self.password_var else ""
            source = self.password_var or PASSWORD_VAR
        if not text:
            raise ConfigError(f"{source}: expected the password of etcd user {self.user!r}, found it empty")
        if any(ord(c) < 32 or ord(c) == 127 for c in text):
            raise ConfigError(f"{source}: expected a password without control characters (one trailing newline in a "
                              "file is ignored; the value is not shown)")
        return text

    def ssl_context(self):
        """The client's TLS context: etcd's certificate verified against `cacert` (else the system's CAs),
        and `cert`/`key` presented. ConfigError naming the file that cannot be used."""
        import ssl

        try:
            context = ssl.create_default_context(cafile=self.cacert or None)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"etcd CA certificate {self.cacert} (--etcd-cacert, TRAINPOD_ETCD_CACERT): "
                              f"{_file_problem(exc, 'a PEM certificate')}") from None
        if self.cert:
            try:
                context.load_cert_chain(self.cert, self.key or None)
            except (OSError, ssl.SSLError) as exc:
                raise ConfigError(f"etcd client certificate {self.cert} with key {self.key or '(in the same file)'} "
                                  "(--etcd-cert, --etcd-key; TRAINPOD_ETCD_CERT, TRAINPOD_ETCD_KEY): "
                                  f"{_file_problem(exc, 'a PEM certificate and its private key, unencrypted')}") from None
        return context

    def describe(self) -> str:
        """What explain shows: files and the user, never a password."""
        parts = []
        if self.cacert:
            parts.append(f"CA {self.cacert}")
        if self.cert:
            parts.append(f"client certificate {self.cert}, key {self.key}")
        if self.user:
            parts.append(f"user {self.user} (password from {self.password_source()})")
        return "; ".join(parts)

    def conf(self) -> dict[str, str]:
        """The --rdzv-conf keys that carry the TLS files to the agent (the names torch's etcd backend reads)."""
        return {k: v for k, v in (("cacert", self.cacert), ("cert", self.cert), ("key", self.key)) if v}

    def env(self) -> dict[str, str]:
        """The variables that carry the user and the password file to the agent (never the password)."""
        if not self.user:
            return {}
        return {ETCD_USER.var: self.user, **({ETCD_PASSWORD_FILE.var: self.password_file}
                                                    if self.password_file else {})}

    @staticmethod
    def from_env(conf: Mapping[str, Any], env: Optional[Mapping[str, str]] = None) -> EtcdAccess:
        """The agent's: TLS files from its rendezvous configuration, the user and password source from `env`."""
        env = os.environ if env is None else env
        user = env.get(ETCD_USER.var, "").strip()
        password_file = env.get(ETCD_PASSWORD_FILE.var, "").strip() if user else ""
        return EtcdAccess(cacert=str(conf.get("cacert") or ""), cert=str(conf.get("cert") or ""),
                          key=str(conf.get("key") or ""), user=user, password_file=password_file,
                          password_var="" if password_file or not user else PASSWORD_VAR)


def _file_problem(exc: BaseException, expected: str) -> str:
    import ssl

    if isinstance(exc, ssl.SSLError):
        return f"expected {expected} ({exc.reason or exc})"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc)


_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


def has_userinfo(endpoints: str) -> bool:
    """Whether endpoint text may hold a user and password (an '@'): then no message shows it as it is."""
    return "@" in endpoints


def named(origin: str, endpoint: str) -> str:
    """`origin='endpoint'` for an error line, or just `origin` when the text may hold a password."""
    return origin if has_userinfo(endpoint) else f"{origin}={endpoint!r}"


def redact(endpoints: str) -> str:
    """`endpoints` with any user:password@ taken out: 'http://root:s3cret@etcd1:2379' -> 'http://***@etcd1:2379'.
    Everything from the first scheme to the last '@' goes (a password may hold ',' or '/')."""
    if not has_userinfo(endpoints):
        return endpoints
    scheme = _SCHEME.match(endpoints)
    return (scheme.group(0) if scheme else "") + "***@" + endpoints.rpartition("@")[2]


def parse_endpoints(endpoints: Union[str, Sequence[str]]) -> list[str]:
    """`[http://|https://]host:port[,...]` (or a list of them) as a list: `host:port` for http,
    `https://host:port` for https; ValueError, one line, if malformed (never showing a password)."""
    items = endpoints.split(",") if isinstance(endpoints, str) else list(endpoints)
    if any(has_userinfo(item) for item in items):
        raise ValueError(USERINFO)
    parsed, schemes = [], set()
    for item in (i.strip() for i in items):
        if not item:
            continue
        scheme, _, rest = item.rpartition("://")
        if scheme not in ("", "http", "https"):
            raise ValueError(f"etcd endpoint {item!r}: expected http:// or https://, got {scheme}://")
        schemes.add(scheme or "http")
        try:
            split = urllib.parse.urlsplit("http://" + rest)
            host, port = split.hostname, split.port
        except ValueError:
            raise ValueError(f"etcd endpoint {item!r}: expected host:port with a port from 1 to 65535") from None
        if not host or split.path or split.query or split.fragment:
            raise ValueError(f"etcd endpoint {item!r}: expected host:port")
        if port is None:
            if rest.rstrip().endswith(":"):
                raise ValueError(f"etcd endpoint {item!r}: expected host:port with a port from 1 to 65535")
            port = DEFAULT_PORT
        if not 1 <= port <= 65535:
            raise ValueError(f"etcd endpoint {item!r}: expected a port from 1 to 65535, got {port}")
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        parsed.append(address if scheme != "https" else f"https://{address}")
    if not parsed:
        raise ValueError(f"etcd endpoints {endpoints!r}: expected host:port[,host:port...]")
    if len(schemes) > 1:
        raise ValueError("etcd endpoints: expected one scheme for all of them, got both http:// and https://")
    return parsed


def split_scheme(endpoint: str) -> tuple[str, str]:
    """('https', 'host:port') for 'https://host:port', ('http', 'host:port') for 'host:port'."""
    scheme, _, rest = endpoint.rpartition("://")
    return scheme or "http", rest


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


def _ssl_error(exc: BaseException):
    """The ssl.SSLError behind `exc` (urllib wraps it in a URLError, a read raises it bare), or None."""
    import ssl

    inner = exc.reason if isinstance(exc, urllib.error.URLError) and isinstance(exc.reason, BaseException) else exc
    return inner if isinstance(inner, ssl.SSLError) else None


# What etcd's v3 gateway answers when authentication or permissions stop a request (the gRPC message).
_NO_USER = "user name is empty"
_BAD_LOGIN = "authentication failed"
_DENIED = "permission denied"
_BAD_TOKEN = "invalid auth token"
_AUTH_OFF = "authentication is not enabled"
_HTTPS_ONLY = "http request to an https server"  # Go's answer to plain HTTP on a TLS port (etcd 3.5 on)


class EtcdClient:
    """The few v3 calls a rendezvous needs, against one or more endpoints; thread-safe.

    `access`: TLS files and the user (EtcdAccess); the endpoints' scheme (https://) turns TLS on.
    """

    def __init__(self, endpoints: Union[str, Sequence[str]], timeout: float, access: Optional[EtcdAccess] = None):
        if not timeout > 0:
            raise ValueError(f"etcd timeout must be positive, got {timeout!r}")
        self.endpoints = parse_endpoints(endpoints)
        self.timeout = float(timeout)
        self.access = access or EtcdAccess()
        self.scheme = split_scheme(self.endpoints[0])[0]
        if self.access.tls and self.scheme != "https":
            raise ValueError("etcd's TLS files (--etcd-cacert, --etcd-cert, --etcd-key) need https:// endpoints")
        self._context = self.access.ssl_context() if self.scheme == "https" else None
        self._current = 0  # the endpoint that answered last
        self._lock = threading.Lock()
        self._token: Optional[str] = None  # None: not authenticated yet; "": etcd's authentication is off
        self._auth_lock = threading.Lock()

    @property
    def endpoint(self) -> str:
        return self.endpoints[self._current]

    def _url(self, endpoint: str, path: str) -> str:
        scheme, address = split_scheme(endpoint)
        return f"{scheme}://{address}{path}"

    def _once(self, endpoint: str, path: str, body: Optional[dict], headers: Mapping[str, str]) -> tuple[int, bytes]:
        # Imported here: http.client, email and ssl are a third of `trainpod run`'s own start-up, and the
        # outer run imports this module (for parse_endpoints) whether or not the job uses etcd.
        import http.client
        import urllib.request

        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self._url(endpoint, path), data=data, method="GET" if body is None else "POST",
                                         headers={"Content-Type": "application/json", **headers})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout, context=self._context) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as exc:
            content = exc.read()
            if exc.code >= 500:  # a member without a leader or quorum: another one may have them
                raise _Unavailable(f"HTTP {exc.code}: {_message(content)}") from None
            return exc.code, content
        except (urllib.error.URLError, http.client.HTTPException, OSError) as exc:
            self._tls_mistake(endpoint, exc)  # raises EtcdAccessError where it is one
            raise _Unavailable(_reason(exc, self.timeout)) from None

    def _tls_mistake(self, endpoint: str, exc: BaseException) -> None:
        """Raise EtcdAccessError (78) when `exc` comes from TLS configured wrong on either side, which no
        retry mends; return where it may be transient (refused, timed out, reset by a dying member)."""
        import http.client
        import ssl

        _, address = split_scheme(endpoint)
        ssl_error = _ssl_error(exc)
        inner = exc.reason if isinstance(exc, urllib.error.URLError) and isinstance(exc.reason, BaseException) else exc
        if self.scheme == "http":
            # etcd 3.4 closes a plain-HTTP connection to its TLS port without a word (3.5 on answer 400).
            if isinstance(inner, (http.client.RemoteDisconnected, http.client.BadStatusLine, ConnectionResetError)) \
                    and _speaks_tls(address, self.timeout):
                raise EtcdAccessError(f"etcd at {address} speaks TLS and this request was plain http: use https://{address} "
                                      "in the endpoint (with --etcd-cacert, and --etcd-cert/--etcd-key if etcd asks "
                                      "for a client certificate)")
            return
        if isinstance(ssl_error, ssl.SSLCertVerificationError):
            against = f"the CA in {self.access.cacert} (--etcd-cacert)" if self.access.cacert else "the system's CAs (no --etcd-cacert)"
            raise EtcdAccessError(f"etcd at https://{address}: its certificate does not verify against {against}: "
                                  f"{ssl_error.verify_message or ssl_error.reason}; give the CA that signed it "
                                  "(--etcd-cacert, TRAINPOD_ETCD_CACERT) and the name it was issued for")
        if ssl_error is not None and "ALERT" in str(ssl_error.reason or ssl_error).upper():
            if not self.access.cert:
                raise EtcdAccessError(f"etcd at https://{address} asks for a client certificate (it runs with "
                                      f"--client-cert-auth) and none was given ({ssl_error.reason}): give --etcd-cert and "
                                      "--etcd-key (TRAINPOD_ETCD_CERT, TRAINPOD_ETCD_KEY)")
            raise EtcdAccessError(f"etcd at https://{address} refused the client certificate {self.access.cert} "
                                  f"({ssl_error.reason}): it must be signed by a CA in etcd's --trusted-ca-file")
        if (ssl_error is not None or isinstance(inner, (ConnectionResetError, http.client.RemoteDisconnected))) \
                and _speaks_http(address, self.timeout):
            raise EtcdAccessError(f"etcd at {address} answers plain http, not TLS: use http://{address} (or start etcd "
                                  "with --cert-file and --key-file)")

    def request(self, path: str, body: Optional[dict] = None, headers: Optional[Mapping[str, str]] = None) -> tuple[int, bytes]:
        """(status, body) from the first endpoint that answers, starting with the last one that did."""
        with self._lock:
            first = self._current
        failures = []
        for i in range(len(self.endpoints)):
            index = (first + i) % len(self.endpoints)
            try:
                answer = self._once(self.endpoints[index], path, body, headers or {})
            except _Unavailable as exc:
                failures.append(f"{self.endpoints[index]}: {exc}")
                continue
            with self._lock:
                self._current = index
            return answer
        raise EtcdUnreachableError(f"etcd unreachable ({'; '.join(failures)})")

    # --- authentication ---

    def _authenticate(self, stale: Optional[str] = None) -> str:
        """The token to send ('' where etcd's authentication is off); a new one when `stale` is the current."""
        with self._auth_lock:
            if self._token is not None and self._token != stale:
                return self._token
            status, content = self.request("/v3/auth/authenticate",
                                           {"name": self.access.user, "password": self.access.password()})
            message = _message(content)
            if status == 200:
                token = json.loads(content).get("token", "")
            elif _AUTH_OFF in message:
                token = ""  # (a user for the v2 API only: torch's etcd backend)
            elif _BAD_LOGIN in message:
                raise EtcdAccessError(f"etcd at {self.endpoint} refused user {self.access.user!r} (--etcd-user, "
                                      f"TRAINPOD_ETCD_USER): wrong user name or password (from "
                                      f"{self.access.password_source()}): {message}")
            else:
                raise EtcdResponseError(f"etcd at {self.endpoint}: POST /v3/auth/authenticate: HTTP {status}: {message}")
            self._token = token
            return token

    def _headers(self) -> dict[str, str]:
        if not self.access.user:
            return {}
        token = self._authenticate()
        return {"Authorization": token} if token else {}

    def basic_auth(self) -> dict[str, str]:
        """The HTTP basic auth header of etcd's v2 API (python-etcd's way), where a user is given."""
        if not self.access.user:
            return {}
        pair = f"{self.access.user}:{self.access.password()}".encode()
        return {"Authorization": "Basic " + base64.b64encode(pair).decode("ascii")}

    def _refused(self, path: str, body: dict, message: str) -> EtcdAccessError:
        if _NO_USER in message:
            return EtcdAccessError(f"etcd at {self.endpoint} has authentication on, and no user was given: set --etcd-user "
                                   "(TRAINPOD_ETCD_USER) and its password (--etcd-password-file, "
                                   "TRAINPOD_ETCD_PASSWORD_FILE, or TRAINPOD_ETCD_PASSWORD)")
        key = ""
        with contextlib.suppress(ValueError, TypeError):
            key = base64.b64decode(body.get("key") or (body.get("compare") or [{}])[0].get("key", "")).decode()
        what = {"/v3/kv/range": "read", "/v3/kv/put": "write", "/v3/kv/txn": "read and write"}.get(path, path)
        return EtcdAccessError(f"etcd at {self.endpoint}: user {self.access.user!r} may not {what} {key or 'keys'} "
                               f"({message}): {GRANT}")

    def call(self, path: str, body: dict) -> dict:
        """POST a v3 request; its JSON answer. EtcdAccessError (78) where etcd's TLS, authentication or
        permissions stop it; EtcdResponseError (78) for anything else but a JSON 200."""
        headers = self._headers()
        status, content = self.request(path, body, headers)
        if status == 401 and _BAD_TOKEN in _message(content) and self.access.user:
            # The token expired (etcd's --auth-token-ttl) or etcd restarted: once more with a new one.
            headers = {"Authorization": self._authenticate(stale=headers.get("Authorization"))}
            status, content = self.request(path, body, headers)
        if status != 200:
            message = _message(content)
            if _NO_USER in message or _DENIED in message or _BAD_TOKEN in message:
                raise self._refused(path, body, message)
            if _HTTPS_ONLY in message.lower():
                address = split_scheme(self.endpoint)[1]
                raise EtcdAccessError(f"etcd at {address} speaks TLS and this request was plain http: use https://{address}")
            raise EtcdResponseError(f"etcd at {self.endpoint}: POST {path}: HTTP {status}: {message}")
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

    def check_writable(self, key: bytes) -> None:
        """EtcdAccessError unless this client may read and write `key`; writes nothing. (etcd checks the
        permissions of every operation of a transaction before it evaluates the compare, and this compare,
        a version below 0, never holds.)"""
        self.call("/v3/kv/txn", {
            "compare": [{"key": b64(key), "target": "VERSION", "result": "LESS", "version": "0"}],
            "success": [{"request_put": {"key": b64(key), "value": ""}}],
        })  # fmt: skip

    # --- leases ---

    def grant(self, ttl: int) -> int:
        """A new lease of `ttl` seconds; its id."""
        return int(self.call("/v3/lease/grant", {"TTL": str(ttl)})["ID"])

    def keepalive(self, lease: int) -> int:
        """Renew `lease` to its full TTL; the TTL, or 0 when the lease no longer exists."""
        return int(self.call("/v3/lease/keepalive", {"ID": str(lease)}).get("result", {}).get("TTL", 0))

    # --- etcd's v2 API (torch's etcd backend) ---

    def check_v2_readable(self, prefix: str) -> None:
        """EtcdAccessError unless etcd's v2 API lets this client (its user, as HTTP basic auth) read `prefix`.
        etcd 3.4's v2 API has an authentication of its own, with users apart from v3's."""
        status, content = self.request("/v2/keys" + prefix, None, self.basic_auth())
        if status in (200, 404):  # (404: the key does not exist yet, and reading it was allowed)
            return
        message = _message(content)
        if status in (401, 403):
            who = f"user {self.access.user!r} (--etcd-user)" if self.access.user else "a client without a user (no --etcd-user)"
            raise EtcdAccessError(f"etcd at {self.endpoint} refused {who} on its v2 API, which torch's etcd rendezvous uses "
                                  f"({message}): a wrong password (from {self.access.password_source()}), or no read and "
                                  f"write permission on {prefix}/*; etcd 3.4's v2 users and roles are apart from v3's "
                                  "(etcdctl --api=2 user/role ...)")
        raise EtcdResponseError(f"etcd at {self.endpoint}: GET /v2/keys{prefix}: HTTP {status}: {message}")


def _speaks_tls(address: str, timeout: float) -> bool:
    """Whether `address` (host:port) completes a TLS handshake, or answers it with a TLS alert."""
    import ssl

    host, port = _host_port(address)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE  # only: is it TLS at all?
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock, context.wrap_socket(sock):
            return True
    except ssl.SSLError as exc:
        return "ALERT" in str(exc.reason or "").upper()
    except OSError:
        return False


def _speaks_http(address: str, timeout: float) -> bool:
    """Whether `address` answers plain HTTP (GET /version) with any HTTP status."""
    import http.client

    host, port = _host_port(address)
    connection = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        connection.request("GET", "/version")
        return connection.getresponse().status > 0
    except (OSError, http.client.HTTPException):
        return False
    finally:
        connection.close()


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def probe(endpoints: Union[str, Sequence[str]], timeout: float, access: Optional[EtcdAccess] = None) -> EtcdInfo:
    """What the first etcd endpoint that answers says about itself: GET /version and GET /v2/keys/.

    Raises EtcdUnreachableError (exit 69) when no endpoint answers (each attempt bounded by
    `timeout`), EtcdAccessError (78) where TLS is configured wrong on either side (or the user or
    password is wrong: with a user, it authenticates), EtcdResponseError (exit 78) when one answers
    but is not etcd, and ValueError for malformed endpoints. etcd 3.4/3.5 answer /v2/keys/ only
    when started with --enable-v2 (401 where the v2 API's own authentication is on); 3.6 never.
    """
    client = EtcdClient(endpoints, timeout, access)
    status, content = client.request("/version")
    try:
        version = json.loads(content) if status == 200 else None
    except ValueError:
        version = None
    if not isinstance(version, dict) or "etcdserver" not in version:
        if _HTTPS_ONLY in _message(content).lower():
            address = split_scheme(client.endpoint)[1]
            raise EtcdAccessError(f"etcd at {address} speaks TLS and this request was plain http: use https://{address}")
        raise EtcdResponseError(f"{client.endpoint} answered GET /version with HTTP {status} ({_message(content)}): is it etcd?")
    if client.access.user:
        client._authenticate()  # a wrong user or password: 78 now, not in the agent
    status, _ = client.request("/v2/keys/", None, client.basic_auth())
    return EtcdInfo(endpoint=client.endpoint, version=str(version["etcdserver"]),
                    cluster_version=str(version.get("etcdcluster", "")), v2_enabled=status in (200, 401, 403))
