"""torchrun's and Kubeflow's variables: PET_* first, then the plain MASTER_ADDR/NNODES family.

Kubeflow's training operators set torchrun's own PET_* variables; older operators (one process
per pod) set only WORLD_SIZE/RANK, which then count nodes, not processes.

What torchrun sets in each worker it starts (TORCHELASTIC_RUN_ID, LOCAL_RANK, RANK) is not a cluster's:
trainpod started there (`torchrun --nproc-per-node 4 -m trainpod run ...`) would be one launcher per rank,
each a job of its own on the node's master port, training alone at world 1. That is refused (refuse_in_a_worker).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from trainpod.environments.base import (
    DEFAULT_MASTER_PORT,
    MAX_NODES,
    MAX_NPROC,
    ClusterEnvironment,
    Discovery,
    parse_int,
    parse_port,
)
from trainpod.errors import ConfigError, TrainpodError
from trainpod.settings import NNODES, RDZV_BACKEND

NNODES_VARS = ("PET_NNODES", "NNODES")
NODE_RANK_VARS = ("PET_NODE_RANK", "NODE_RANK")
MASTER_ADDR_VARS = ("PET_MASTER_ADDR", "MASTER_ADDR")
MASTER_PORT_VARS = ("PET_MASTER_PORT", "MASTER_PORT")
# torchrun's own twins of its --rdzv-* and --max-restarts flags (Kubeflow's elastic PyTorchJob sets them).
RDZV_VARS = ("PET_RDZV_BACKEND", "PET_RDZV_ENDPOINT", "PET_RDZV_ID", "PET_MAX_RESTARTS")
DETECT_VARS = NNODES_VARS + NODE_RANK_VARS + MASTER_ADDR_VARS + MASTER_PORT_VARS + RDZV_VARS[:2]


# Kubernetes' service links: a Service named master gives every pod MASTER_PORT=tcp://10.96.0.12:29500.
_SERVICE_LINK = re.compile(r"(?:tcp|udp|sctp)://[^\s/]+:[0-9]+")
WORKER_VAR = "TORCHELASTIC_RUN_ID"  # torchrun's agent sets it in each worker, and no cluster sets it for a node


def refuse_in_a_worker(env: Mapping[str, str]) -> None:
    """A one-line error where this process is a worker of another torchrun (or torch.distributed.launch)."""
    if WORKER_VAR in env:
        where = ", ".join(f"{name}={env[name]!r}" for name in (WORKER_VAR, "LOCAL_RANK") if name in env)
        raise ConfigError(f"{where}: this trainpod runs as a rank that torchrun started, and would start a job of its own "
                          "per rank; run `trainpod run` in place of torchrun, once per node (it starts the node's ranks)")


def _first(env: Mapping[str, str], names: tuple[str, ...]) -> tuple[str | None, str | None]:
    for name in names:
        if env.get(name, "").strip():
            return env[name], name
    return None, None


def _parse_nnodes(value: str, origin: str) -> tuple[int, int]:
    """torchrun's node count: N, or an elastic range MIN:MAX (Kubeflow's elastic PyTorchJob sets one)."""
    return NNODES.parse(value, origin)


def _parse_nproc(value: str, origin: str) -> int | None:
    # torchrun also takes "auto" and "gpu" (Kubeflow sets "auto"): one process per visible GPU,
    # which resolve works out (None here).
    if value.strip() in ("auto", "gpu"):
        return None
    return parse_int(value, origin, minimum=1, maximum=MAX_NPROC)


def _disagreements(env: Mapping[str, str]) -> tuple[str, ...]:
    """One warning when a PET_* variable and its plain twin are both set and differ (PET_* wins)."""
    pairs = [(pet, plain) for pet, plain in zip(NNODES_VARS[:1] + NODE_RANK_VARS[:1] + MASTER_ADDR_VARS[:1] + MASTER_PORT_VARS[:1],
                                                NNODES_VARS[1:] + NODE_RANK_VARS[1:] + MASTER_ADDR_VARS[1:] + MASTER_PORT_VARS[1:])]
    differ = [(pet, plain) for pet, plain in pairs
              if env.get(pet, "").strip() and env.get(plain, "").strip() and env[pet].strip() != env[plain].strip()]
    if not differ:
        return ()
    used = ", ".join(f"{pet}={env[pet].strip()!r}" for pet, _ in differ)
    ignored = ", ".join(f"{plain}={env[plain].strip()!r}" for _, plain in differ)
    return (f"PET_* and plain variables disagree: using torchrun's {used}; ignoring {ignored}",)


class TorchrunEnvironment(ClusterEnvironment):
    name = "torchrun"
    description = "torchrun/Kubeflow variables (PET_*, MASTER_ADDR, NNODES, NODE_RANK, WORLD_SIZE/RANK)"

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        if any(env.get(name, "").strip() and not _SERVICE_LINK.fullmatch(env[name].strip()) for name in DETECT_VARS):
            return True
        return "WORLD_SIZE" in env and "RANK" in env and "LOCAL_RANK" not in env

    @staticmethod
    def present(env: Mapping[str, str]) -> list[str]:
        names = [name for name in DETECT_VARS if env.get(name, "").strip()]
        if not names and TorchrunEnvironment.detect(env):
            names = ["WORLD_SIZE", "RANK"]
        return names

    def _parsed(self, name: str, parse, text: str | None, var: str | None, default: Any = None) -> Any:
        """`text` of `var` parsed, or `default` where it is not set; where a flag gives the value (flags override
        variables), a malformed variable is passed over instead of refused."""
        if text is None:
            return default
        try:
            return parse(text, var)
        except TrainpodError:
            if self._flags.get(name) is None:
                raise
            return default

    def discover(self) -> Discovery:
        env = self.env
        origins: dict[str, str] = {}
        warnings: list[str] = []

        nnodes_text, nnodes_var = _first(env, NNODES_VARS)
        rank_text, rank_var = _first(env, NODE_RANK_VARS)
        if nnodes_text is None and "LOCAL_RANK" not in env:
            nnodes_text, nnodes_var = _first(env, ("WORLD_SIZE",))
            if rank_text is None:
                rank_text, rank_var = _first(env, ("RANK",))

        min_nodes, nnodes = self._parsed("nnodes", _parse_nnodes, nnodes_text, nnodes_var, (1, 1))
        origins["nnodes"] = nnodes_var or "default (no node count set)"
        rdzv = {var: env[var].strip() for var in RDZV_VARS if env.get(var, "").strip()}
        for var in rdzv:
            origins[var.removeprefix("PET_").lower()] = var
        backend = self._parsed("rdzv_backend", RDZV_BACKEND.parse, rdzv.get("PET_RDZV_BACKEND"), "PET_RDZV_BACKEND")
        max_restarts = self._parsed("max_restarts", lambda text, var: parse_int(text, var, maximum=10000),
                                    rdzv.get("PET_MAX_RESTARTS"), "PET_MAX_RESTARTS")

        missing: dict[str, str] = {}
        node_rank: int | None = None
        if rank_text is not None and (node_rank := self._parsed(
                "node_rank", lambda text, var: parse_int(text, var, maximum=MAX_NODES - 1), rank_text, rank_var)) is not None:
            origins["node_rank"] = rank_var
        elif nnodes > 1:
            missing["node_rank"] = (
                f"{nnodes_var}={nnodes_text!r} but no node rank is set: "
                "set PET_NODE_RANK or NODE_RANK (or pass --node-rank)"
            )
        else:
            node_rank = 0
            origins["node_rank"] = "default"

        master_addr, addr_var = _first(env, MASTER_ADDR_VARS)
        if master_addr is None:
            if nnodes > 1:
                missing["master_addr"] = (
                    f"{nnodes_var}={nnodes_text!r} but no master address is set: "
                    "set PET_MASTER_ADDR or MASTER_ADDR (or pass --master-addr)"
                )
            else:
                master_addr, addr_var = "127.0.0.1", "default (single node)"
        if master_addr is not None:
            origins["master_addr"] = addr_var

        port_text, port_var = _first(env, MASTER_PORT_VARS)
        if port_text is not None and _SERVICE_LINK.fullmatch(port_text.strip()):
            # What Kubernetes sets in every pod for a Service named master (its service links), not a port.
            warnings.append(f"{port_var}={port_text.strip()!r} is Kubernetes' link to a Service named master, not a "
                            f"port: ignored (set {port_var} to the port, or enableServiceLinks: false)")
            port_text = None
        master_port = self._parsed("master_port", parse_port, port_text, port_var)
        if master_port is None:
            master_port, port_var = DEFAULT_MASTER_PORT, "default"
        origins["master_port"] = port_var

        nproc_text, nproc_var = _first(env, ("PET_NPROC_PER_NODE",))
        nproc = self._parsed("nproc_per_node", _parse_nproc, nproc_text, nproc_var)
        if nproc is not None:
            origins["nproc_per_node"] = nproc_var

        return Discovery(
            warnings=(*_disagreements(env), *warnings),
            nnodes=nnodes,
            min_nodes=min_nodes if min_nodes < nnodes else None,
            rdzv_backend=backend,
            rdzv_endpoint=rdzv.get("PET_RDZV_ENDPOINT"),
            rdzv_id=rdzv.get("PET_RDZV_ID"),
            max_restarts=max_restarts,
            nproc_per_node=nproc,
            node_rank=node_rank,
            master_addr=master_addr.strip() if master_addr else None,
            master_port=master_port,
            origins=origins,
            missing=missing,
        )
