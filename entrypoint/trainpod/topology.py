"""The resolved answer to "who am I and where is the master": one frozen dataclass."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any


@dataclass(frozen=True)
class Topology:
    source: str  # which cluster environment answered: "pai", "torchrun", "single"
    nnodes: int
    node_rank: int
    nproc_per_node: int
    master_addr: str
    master_port: int
    backend: str  # "gloo" or "nccl"
    interface: str | None  # for GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME; None: not yet known
    interface_reason: str = ""
    rendezvous: str = "c10d"  # torchrun's rendezvous, hosted by node 0's agent on master_port
    local_addr: str | None = None  # this node's address towards the master; None: not yet known
    origins: Mapping[str, str] = field(default_factory=dict)  # field -> variable or flag it came from
    warnings: tuple[str, ...] = ()

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def is_master(self) -> bool:
        return self.node_rank == 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "nnodes": self.nnodes,
            "node_rank": self.node_rank,
            "nproc_per_node": self.nproc_per_node,
            "world_size": self.world_size,
            "master_addr": self.master_addr,
            "master_port": self.master_port,
            "backend": self.backend,
            "interface": self.interface,
            "interface_reason": self.interface_reason,
            "rendezvous": self.rendezvous,
            "local_addr": self.local_addr,
            "origins": dict(self.origins),
            "warnings": list(self.warnings),
        }

    @staticmethod
    def from_dict(data: Mapping[str, Any]) -> Topology:
        """The inverse of to_dict() (which adds world_size): how the supervised job receives it."""
        known = {f.name for f in fields(Topology)}
        values = {k: v for k, v in data.items() if k in known}
        values["warnings"] = tuple(values.get("warnings", ()))
        return Topology(**values)
