"""RunSpec -> LaunchPlan: the torchrun argv and the environment the agent and the ranks need. Pure."""

from __future__ import annotations

import math
import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from trainpod import log
from trainpod.agent import hang
from trainpod.contract import NODE_RANK_VAR
from trainpod.runspec import RunSpec, Target  # noqa: F401 (Target: what callers build a plan for)
from trainpod.topology import Topology

SHUTDOWN_MARGIN_S = 5


@dataclass(frozen=True)
class LaunchPlan:
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)  # only what trainpod adds or changes

    def command_line(self) -> str:
        return shlex.join(self.argv)

    @property
    def agent_args(self) -> list[str]:
        """torchrun's arguments: argv after `python -m trainpod.agent`."""
        return self.argv[3:]


def _no_proxy(env: Mapping[str, str], master_addr: str, more: Sequence[str] = ()) -> str:
    current = env.get("NO_PROXY", env.get("no_proxy", ""))
    entries = [e.strip() for e in current.split(",") if e.strip()]
    for host in (master_addr, *more, "127.0.0.1", "localhost"):
        if host not in entries:
            entries.append(host)
    return ",".join(entries)


def available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _rdzv_conf(topology: Topology, join_timeout: float) -> str:
    """torchrun's --rdzv-conf: the rendezvous' own settings, and the join timeout in its backend's word."""
    rdzv = topology.rdzv
    conf: dict[str, str] = {}
    if rdzv.backend == "c10d" and topology.node_rank is not None:
        # Node 0 hosts the store; the flag says so, as the host name heuristic torch would use fails in
        # containers. Without a node rank (an elastic c10d job) torch matches the endpoint to its addresses.
        conf["is_host"] = "true" if topology.node_rank == 0 else "false"
    # torch's etcd backend calls the join timeout `timeout`; the dynamic ones (c10d, etcd-v3) `join_timeout`.
    conf["timeout" if rdzv.backend == "etcd" else "join_timeout"] = str(math.ceil(join_timeout))
    conf.update(rdzv.settings)
    # TLS reaches the backend as the keys torch's etcd backend reads (etcd-v3 reads the same: trainpod.rendezvous
    # .etcd_v3); the user and the password file go in the environment (build_plan), the password nowhere.
    conf.update(rdzv.access.conf())
    if rdzv.backend == "etcd" and rdzv.endpoint.startswith("https://"):
        conf["protocol"] = "https"
    return ",".join(f"{key}={value}" for key, value in conf.items())


def _hosts(endpoints: str) -> list[str]:
    return [e.rpartition("://")[2].rpartition(":")[0].strip("[]") for e in endpoints.split(",") if e.strip()]


def _torch_endpoint(topology: Topology) -> str:
    """torchrun's --rdzv-endpoint: torch's etcd backend takes host:port (https goes in protocol=https)."""
    rdzv = topology.rdzv
    return rdzv.endpoint.rpartition("://")[2] if rdzv.backend == "etcd" else rdzv.endpoint


def build_plan(spec: RunSpec, env: Mapping[str, str], *, cpus: int = 1) -> LaunchPlan:
    """The agent's command line and what its environment adds: the spec itself for the agent
    (RunSpec.to_env: the restart budget, the timers, the topology), the settings the ranks read
    (RunSpec.rank_env), and the variables torch, gloo and NCCL read. The rendezvous waits for every
    node (a restarted one included) for --connect-timeout."""
    # A dynamic rendezvous (c10d, etcd, etcd-v3), never static: after a failure every agent re-joins a
    # new round, so a restarted worker group (or a restarted node) meets the others in a fresh store
    # namespace, and an elastic job's nodes leave and join there. etcd-v3 is trainpod's own backend:
    # the agent registers it with torch (trainpod.agent).
    topology, target = spec.topology, spec.target
    rdzv = topology.rdzv
    torchrun = [
        "--nnodes", rdzv.nnodes,
        "--nproc-per-node", str(topology.nproc_per_node),
        "--rdzv-backend", rdzv.backend,
        "--rdzv-endpoint", _torch_endpoint(topology),
        f"--rdzv-id={rdzv.id}",  # one word whatever the id (a job's name may start with '-'), never a flag of its own
        "--rdzv-conf", _rdzv_conf(topology, spec.connect_timeout),
        "--max-restarts", str(spec.max_restarts),
        # torchrun SIGKILLs workers this long after its SIGTERM: the grace, and time to exit.
        "--shutdown-timeout", str(math.ceil(spec.term_grace) + SHUTDOWN_MARGIN_S),
        # tee makes torchrun prefix every worker line with the template below.
        "--tee", "3",
    ]
    if topology.local_addr:
        torchrun += ["--local-addr", topology.local_addr]  # published to peers instead of the host name
    added = {
        **spec.to_env(),  # the agent reads the run from it (trainpod.agent.policy)
        **spec.rank_env(),  # the ranks read their settings (term grace, recovery, trusted checkpoints)
        NODE_RANK_VAR: topology.node_label,  # the agent's and the ranks' log prefix
        "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": log.rank_tag_template(topology.node_label),
        "NO_PROXY": _no_proxy(env, topology.master_addr, _hosts(rdzv.endpoint)),
        **rdzv.access.env(),  # etcd's user and password file, for the agent (trainpod.rendezvous.etcd_http.EtcdAccess)
    }
    added["no_proxy"] = added["NO_PROXY"]
    added.update(hang.plan_env(env))  # the hang watch: progress files, flight recorder
    if topology.interface:
        for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            if not env.get(var):
                added[var] = topology.interface
    if not env.get("OMP_NUM_THREADS"):
        # torchrun would force 1 thread (with a banner); share the cores between the local ranks instead.
        added["OMP_NUM_THREADS"] = str(max(1, cpus // topology.nproc_per_node))
    argv = [sys.executable, "-m", "trainpod.agent", *torchrun, *target.torchrun_args()]
    return LaunchPlan(argv=argv, env=added)
