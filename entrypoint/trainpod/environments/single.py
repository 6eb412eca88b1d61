"""A single node with nothing set: the job runs here alone, master on loopback."""

from __future__ import annotations

from collections.abc import Mapping

from trainpod.environments.base import DEFAULT_MASTER_PORT, ClusterEnvironment, Discovery


class SingleNodeEnvironment(ClusterEnvironment):
    name = "single"
    description = "one node, nothing set; master 127.0.0.1"

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        return True

    def discover(self) -> Discovery:
        origin = "single-node default"
        return Discovery(
            nnodes=1,
            node_rank=0,
            master_addr="127.0.0.1",
            master_port=DEFAULT_MASTER_PORT,
            origins=dict.fromkeys(("nnodes", "node_rank", "master_addr", "master_port"), origin),
        )
