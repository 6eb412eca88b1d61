"""The resolved answer to "who am I, where do the nodes meet": frozen dataclasses."""

from __future__ import annotations

import socket
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from trainpod.rendezvous.etcd_http import EtcdAccess

C10D_ID = "trainpod"  # c10d's store is this job's own (its host's agent): no other job to keep apart

# What `explain` says of each backend: where its state lives, so where its single point of failure is.
RDZV_NOTES = {
    "c10d": "node 0's agent hosts the store on the master port: a single point of failure (losing that node ends "
            "the job); use etcd or etcd-v3 for jobs that must survive any node",
    "etcd": "torch's etcd rendezvous on etcd's v2 API (etcd 3.4/3.5 started with --enable-v2); survives any node",
    "etcd-v3": "trainpod's etcd rendezvous on etcd's v3 API (any etcd from 3.4 on); survives any node",
}


@dataclass(frozen=True)
class Rendezvous:
    """How the nodes' agents meet (torchrun's --rdzv-* and --nnodes).

    `endpoint` is etcd's host:port[,host:port...] (https://host:port[,...] with TLS) or c10d's host:port;
    '' for c10d means the master's address and port. `id` is the same on every node of the job, the
    job's identity escaped one-to-one (trainpod.rendezvous.ids); with etcd, trainpod.rendezvous.generation
    adds a generation at run time, so a run never meets a rendezvous an earlier run closed. `min_nodes` <
    `max_nodes`: an elastic job. 0 for either: the topology's node count. `settings`: torchrun's
    --rdzv-conf beyond what trainpod sets itself (join_timeout, is_host), checked per backend
    (trainpod.rendezvous.conf). `access`: etcd's TLS files and user (EtcdAccess: no secret).
    """

    backend: str = "c10d"
    endpoint: str = ""
    id: str = C10D_ID
    min_nodes: int = 0
    max_nodes: int = 0
    settings: Mapping[str, str] = field(default_factory=dict)
    id_origin: str = "default"
    access: EtcdAccess = EtcdAccess()
    spares: int = 0  # nodes beyond max_nodes that wait on the redundancy list (--spares)

    @property
    def elastic(self) -> bool:
        return self.min_nodes < self.max_nodes

    @property
    def uses_etcd(self) -> bool:
        return self.backend in ("etcd", "etcd-v3")

    @property
    def nnodes(self) -> str:
        """torchrun's --nnodes: 'N' or 'MIN:MAX'."""
        return str(self.max_nodes) if not self.elastic else f"{self.min_nodes}:{self.max_nodes}"

    def to_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "endpoint": self.endpoint, "id": self.id, "id_origin": self.id_origin,
                "min_nodes": self.min_nodes, "max_nodes": self.max_nodes, "elastic": self.elastic, "spares": self.spares,
                "settings": dict(self.settings), "note": RDZV_NOTES.get(self.backend, ""),
                "access": {k: v for k, v in asdict(self.access).items() if v}}

    @staticmethod
    def from_dict(data: Mapping[str, Any]) -> Rendezvous:
        known = {f.name for f in fields(Rendezvous)}
        values = {k: v for k, v in data.items() if k in known}
        values["access"] = EtcdAccess(**values.get("access") or {})
        return Rendezvous(**values)


def join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(frozen=True)
class Topology:
    source: str  # which cluster environment answered: "pai", "torchrun", "slurm", "etcd", "single"
    nnodes: int  # the most nodes the job has (an elastic job's MAX)
    node_rank: int | None  # None: assigned by the rendezvous (etcd, an elastic job), not known before it
    nproc_per_node: int
    master_addr: str  # c10d: the store's host; etcd: the first endpoint's host (the route picks the interface)
    master_port: int
    backend: str  # "gloo" or "nccl"
    interface: str | None  # for GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME; None: not yet known
    interface_reason: str = ""
    rendezvous: Rendezvous | None = None  # None: c10d on the master, fixed size; filled in on construction
    local_addr: str | None = None  # this node's address towards the master; None: not yet known
    max_restarts: int | None = None  # a restart budget the cluster set (PET_MAX_RESTARTS); None: not set
    origins: Mapping[str, str] = field(default_factory=dict)  # field -> variable or flag it came from
    warnings: tuple[str, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "rendezvous", self._filled())

    @property
    def rdzv(self) -> Rendezvous:
        """The rendezvous, every default filled in."""
        assert self.rendezvous is not None
        return self.rendezvous

    def _filled(self) -> Rendezvous:
        """The rendezvous with every default filled in (c10d on the master, nnodes fixed)."""
        rdzv = self.rendezvous or Rendezvous()
        if rdzv.backend == "c10d" and not rdzv.endpoint:
            rdzv = replace(rdzv, endpoint=join_host_port(self.master_addr, self.master_port))
        if not rdzv.max_nodes:
            rdzv = replace(rdzv, max_nodes=self.nnodes)
        if not rdzv.min_nodes:
            rdzv = replace(rdzv, min_nodes=rdzv.max_nodes)
        return rdzv

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def global_ranks(self) -> range | None:
        """The global ranks this node hosts at every start and restart (trainpod.rendezvous.node_order), or None
        where the rendezvous numbers the nodes (an elastic job; torch's etcd backend, which has an order of its own)."""
        if self.node_rank is None or self.rdzv.elastic or self.rdzv.backend == "etcd":
            return None
        return range(self.node_rank * self.nproc_per_node, (self.node_rank + 1) * self.nproc_per_node)

    @property
    def is_master(self) -> bool:
        """This node hosts the c10d store (node 0 of a job whose node ranks are known)."""
        return self.node_rank == 0 and self.rdzv.backend == "c10d"

    @property
    def node_label(self) -> str:
        """What `[nodeN]` says: the node rank, or '@' and the host's name where the rendezvous assigns
        the rank (etcd, elastic c10d): it may change at every membership change, the host does not."""
        return f"@{socket.gethostname().split('.')[0]}" if self.node_rank is None else str(self.node_rank)

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "nnodes": self.nnodes,
            "min_nodes": self.rdzv.min_nodes,
            "max_nodes": self.rdzv.max_nodes,
            "node_rank": self.node_rank,
            "nproc_per_node": self.nproc_per_node,
            "world_size": self.world_size,
            "global_ranks": None if self.global_ranks is None else [self.global_ranks.start, self.global_ranks.stop - 1],
            "master_addr": self.master_addr,
            "master_port": self.master_port,
            "backend": self.backend,
            "interface": self.interface,
            "interface_reason": self.interface_reason,
            "rendezvous": self.rdzv.to_dict(),
            "local_addr": self.local_addr,
            "max_restarts": self.max_restarts,
            "origins": dict(self.origins),
            "warnings": list(self.warnings),
        }

    @staticmethod
    def from_dict(data: Mapping[str, Any]) -> Topology:
        """The inverse of to_dict() (which adds world_size): how the supervised job receives it."""
        known = {f.name for f in fields(Topology)}
        values = {k: v for k, v in data.items() if k in known}
        values["warnings"] = tuple(values.get("warnings", ()))
        if isinstance(values.get("rendezvous"), Mapping):
            values["rendezvous"] = Rendezvous.from_dict(values["rendezvous"])
        elif "rendezvous" in values:
            values["rendezvous"] = None  # an older spec's "c10d"
        return Topology(**values)
