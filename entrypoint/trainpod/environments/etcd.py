"""Nodes that meet in etcd: no node rank and no master in the environment, the rendezvous assigns them.

An elastic job over etcd (`--rdzv-backend etcd|etcd-v3 --rdzv-endpoint [https://]HOST:PORT[,...] --nnodes MIN:MAX`)
needs nothing from the cluster: every node starts the same command, and torch's rendezvous numbers
the nodes of each round (a node's rank may change when nodes leave or join). Detected from
TRAINPOD_RDZV_BACKEND; the flags pick it too where no cluster source detects (trainpod.launcher.resolve).
The endpoint's first host stands in for the master only to choose the interface (the route to it:
trainpod.launcher.resolve derives it, for this source as for any other whose job meets in etcd).
"""

from __future__ import annotations

from collections.abc import Mapping

from trainpod.environments.base import ClusterEnvironment, Discovery
from trainpod.settings import RDZV_BACKEND

ETCD_BACKENDS = ("etcd", "etcd-v3")


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
        # No master: the nodes meet in etcd, and the route to its first member picks the interface
        # (trainpod.launcher.resolve, which reads the endpoint for every source).
        return Discovery(missing={"nnodes": "an etcd rendezvous needs the node count: pass --nnodes MIN:MAX (or N)"})
