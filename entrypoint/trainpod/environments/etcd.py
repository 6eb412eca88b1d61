"""Nodes that meet in etcd: no node rank and no master in the environment, the rendezvous assigns them.

An elastic job over etcd (`--rdzv-backend etcd|etcd-v3 --rdzv-endpoint [https://]HOST:PORT[,...] --nnodes MIN:MAX`)
needs nothing from the cluster: every node starts the same command, and torch's rendezvous numbers
the nodes of each round (a node's rank may change when nodes leave or join). Detected from
TRAINPOD_RDZV_BACKEND; the flags pick it too where no cluster source detects (trainpod.resolve).
The endpoint's first host stands in for the master only to choose the interface (the route to it).
"""

from __future__ import annotations

from collections.abc import Mapping

from trainpod.environments.base import ClusterEnvironment, Discovery
from trainpod.errors import error_for
from trainpod.rendezvous.etcd_http import named, parse_endpoints, split_scheme
from trainpod.settings import RDZV_BACKEND, RDZV_ENDPOINT, resolve

ETCD_BACKENDS = ("etcd", "etcd-v3")


def split_endpoint(endpoint: str, origin: str) -> tuple[str, int]:
    """(host, port) of the first of etcd's endpoints; a one-line error naming `origin` if malformed."""
    try:
        first = parse_endpoints(endpoint)[0]
    except ValueError as bad:  # (never showing a password the text may hold)
        raise error_for(origin)(f"{named(origin, endpoint)}: {bad}") from None
    host, _, port = split_scheme(first)[1].rpartition(":")
    return host.strip("[]"), int(port)


class EtcdEnvironment(ClusterEnvironment):
    name = "etcd"
    description = "nodes that meet in etcd (--rdzv-backend etcd or etcd-v3): the rendezvous assigns the node ranks"

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        return env.get(RDZV_BACKEND.var or "", "").strip() in ETCD_BACKENDS

    @staticmethod
    def present(env: Mapping[str, str]) -> list[str]:
        return [RDZV_BACKEND.var] if EtcdEnvironment.detect(env) else []

    def discover(self) -> Discovery:
        given = resolve((RDZV_ENDPOINT,), self._flags, self.env)
        missing = {"nnodes": "an etcd rendezvous needs the node count: pass --nnodes MIN:MAX (or N)"}
        if not given.rdzv_endpoint:
            missing["master_addr"] = ("an etcd rendezvous needs etcd's address: pass --rdzv-endpoint HOST:PORT[,HOST:PORT...] "
                                      "(or set TRAINPOD_RDZV_ENDPOINT)")
            return Discovery(missing=missing)
        origin = given.origins["rdzv_endpoint"]
        host, port = split_endpoint(given.rdzv_endpoint, origin)
        route = f"{origin} (etcd: the route to it picks the interface)"
        return Discovery(master_addr=host, master_port=port, origins={"master_addr": route, "master_port": route},
                         missing=missing)
