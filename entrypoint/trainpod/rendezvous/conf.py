"""--rdzv-conf, checked against what each rendezvous backend reads, before anything starts. No torch.

torchrun hands every KEY=VALUE of --rdzv-conf to the backend, which reads the keys it knows when the
agent creates its handler and ignores the others: a typo (`keep_alive_intreval=2`) silently does
nothing, and a bad value (`keep_alive_interval=abc`) is a ValueError inside the agent, a traceback
and a restart. So `explain` and `run` check each key and value here, by the backend's own rules,
read in torch 2.13's handlers (and trainpod's etcd_v3.py); a bad one is one line naming the key,
64 for --rdzv-conf, 78 for TRAINPOD_RDZV_CONF.

    c10d     torch's dynamic rendezvous (dynamic_rendezvous.create_handler): join_timeout,
             last_call_timeout, close_timeout, heartbeat_timeout (seconds, positive: torch's
             RendezvousTimeout), keep_alive_interval (seconds), keep_alive_max_attempt; and its
             store (c10d_rendezvous_backend): is_host (torch's booleans), read_timeout (positive),
             store_type (tcp only: trainpod's fixed-size c10d jobs share that store, trainpod.agent.control)
    etcd-v3  the dynamic rendezvous' keys; read_timeout and ttl (trainpod.rendezvous.etcd_v3)
    etcd     torch's etcd rendezvous (etcd_rendezvous.create_rdzv_handler): timeout (the join),
             last_call_timeout, etcd_prefix; keep_alive_ttl, trainpod's own (trainpod.agent)

The TLS keys torch's etcd backend reads (protocol, cacert, cert, key) are trainpod's to set, from
--rdzv-endpoint https://... and --etcd-cacert/--etcd-cert/--etcd-key, which also reach trainpod's
own etcd requests (the preflight, the generation): given here they are refused with that hint.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Callable

from trainpod.errors import error_for
from trainpod.settings import Choice, Integer, Invalid

MAX_SECONDS = 10_000_000  # about 115 days: any real timeout; a typo's extra digits are refused
KEEP_ALIVE_TTL = "keep_alive_ttl"  # trainpod's key for torch's etcd backend's keep-alive TTL (trainpod.agent)
KEEP_ALIVE_TTL_RANGE = (2, 3600)
TLS_KEYS = {"protocol": "--rdzv-endpoint https://...", "cacert": "--etcd-cacert (TRAINPOD_ETCD_CACERT)",
            "cert": "--etcd-cert (TRAINPOD_ETCD_CERT)", "key": "--etcd-key (TRAINPOD_ETCD_KEY)"}


class TorchBoolean:
    """What torch's RendezvousParameters.get_as_bool() takes."""

    def expected(self) -> str:
        return "one of 1, true, t, yes, y, 0, false, f, no, n"

    TRUE = ("1", "true", "t", "yes", "y")

    def __call__(self, value: Any) -> str:
        if str(value).strip().lower() not in (*self.TRUE, "0", "false", "f", "no", "n"):
            raise Invalid(self.expected())
        return str(value)


class KeyPrefix:
    """An etcd v2 key prefix: it goes into python-etcd's URLs unquoted."""

    def expected(self) -> str:
        return "an etcd key path such as /torchelastic/p2p (letters, digits, . _ ~ - and /, starting with /)"

    def __call__(self, value: Any) -> str:
        if not re.fullmatch(r"/[A-Za-z0-9._~/-]*", str(value).strip()) or "//" in str(value):
            raise Invalid(self.expected())
        return str(value)


def _seconds(minimum: int = 1) -> Integer:
    return Integer(minimum, MAX_SECONDS)


# key -> (kind, what it is); every kind raises settings.Invalid with what was expected.
Kind = Callable[[Any], Any]
DYNAMIC: dict[str, tuple[Kind, str]] = {
    "join_timeout": (_seconds(), "seconds for every node to join (trainpod sets it from --connect-timeout)"),
    "last_call_timeout": (_seconds(), "seconds to wait for more nodes once the minimum joined"),
    "close_timeout": (_seconds(), "seconds for the rendezvous to close"),
    "heartbeat_timeout": (_seconds(), "seconds a keep-alive heartbeat may take"),
    "keep_alive_interval": (_seconds(), "seconds between a node's heartbeats"),
    "keep_alive_max_attempt": (Integer(1, 1000), "heartbeats a node may miss before it counts as gone"),
}
KEYS: dict[str, dict[str, tuple[Kind, str]]] = {
    "c10d": {
        **DYNAMIC,
        "is_host": (TorchBoolean(), "whether this node's agent hosts the store (trainpod sets it when it knows)"),
        "read_timeout": (Integer(1, 86400), "seconds a store request may take"),
        "store_type": (Choice(("tcp",)), "the store: trainpod's c10d jobs share the TCP store (trainpod.agent.control)"),
    },
    "etcd-v3": {
        **DYNAMIC,
        "read_timeout": (Integer(1, 86400), "seconds an etcd request may take, and an agent may wait for a store key"),
        "ttl": (_seconds(), "seconds the run's keys outlive their last write (an etcd lease)"),
    },
    "etcd": {
        "timeout": (_seconds(), "seconds for every node to join (trainpod sets it from --connect-timeout)"),
        "last_call_timeout": (Integer(0, MAX_SECONDS), "seconds to wait for more nodes once the minimum joined"),
        "etcd_prefix": (KeyPrefix(), "where torch keeps its keys in etcd's v2 key space (default /torchelastic/p2p)"),
        KEEP_ALIVE_TTL: (Integer(*KEEP_ALIVE_TTL_RANGE), "seconds a lost node stays in the rendezvous (trainpod's key)"),
    },
}


def check(backend: str, conf: Mapping[str, str], origin: str) -> dict[str, str]:
    """`conf` if the `backend` reads every key and takes every value; else one line naming `origin`
    and the key (64 for a flag, 78 for a variable). Values are never echoed for an unknown key."""
    known = KEYS.get(backend, {})
    for key, value in conf.items():
        if key in TLS_KEYS and backend != "c10d":
            raise error_for(origin)(f"{origin} {key}: trainpod sets it for the {backend} rendezvous from {TLS_KEYS[key]}, "
                                    "which its own etcd requests use too; give that instead")
        if key not in known:
            hint = " (torch's etcd backend calls it timeout)" if key == "join_timeout" else (
                " (the dynamic rendezvous calls it join_timeout)" if key == "timeout" else "")
            raise error_for(origin)(f"{origin}: the {backend} rendezvous reads no key {key!r}{hint}: expected one of "
                                    f"{', '.join(sorted(known))}")
        kind, what = known[key]
        try:
            kind(value)
        except Invalid as bad:
            raise error_for(origin)(f"{origin} {key}={value!r}: expected {bad} ({what})") from None
    return dict(conf)
