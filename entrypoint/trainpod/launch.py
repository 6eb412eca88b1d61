"""Topology + what to run -> LaunchPlan: the torchrun argv and the environment it needs. Pure."""

from __future__ import annotations

import math
import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from trainpod import hang, log
from trainpod.errors import UsageError
from trainpod.examples import EXAMPLES
from trainpod.settings import HANG_TIMEOUT, PROGRESS_WINDOW, RECOVERY, REJOIN_TIMEOUT, TERM_GRACE, TRUST_CHECKPOINTS, WARM_START
from trainpod.topology import Topology

SHUTDOWN_MARGIN_S = 5


@dataclass(frozen=True)
class Target:
    """What the workers run: a bundled example's module, or the user's own command."""

    module: str | None = None
    command: tuple[str, ...] = ()
    args: tuple[str, ...] = ()
    needs: tuple[str, ...] = ()  # what the ranks import besides torch: preflight imports it first
    shm_mib: int | None = None  # the /dev/shm it needs (DataLoader workers); 0: none; None: unknown (a command)
    output_dir: str | None = None  # where an example writes its metrics (None: a command, unknown)
    checkpoint_dir: str | None = None  # where an example checkpoints (None: nowhere, or a command)

    @staticmethod
    def for_example(name: str, extra_args: Sequence[str] = (), env: Mapping[str, str] | None = None) -> Target:
        if name not in EXAMPLES:
            raise UsageError(f"--example={name!r}: expected one of {', '.join(EXAMPLES)}")
        example = EXAMPLES[name]
        args = example.args + tuple(extra_args)
        env = os.environ if env is None else env
        shm = example.shm_mib if example.uses_loader_workers(args, env) else 0
        output_dir, checkpoint_dir = example.directories(args, env)
        return Target(module=example.module, args=args, needs=example.needs, shm_mib=shm, output_dir=output_dir,
                      checkpoint_dir=checkpoint_dir)

    @staticmethod
    def from_dict(data: Mapping) -> Target:
        return Target(module=data["module"], command=tuple(data["command"]), args=tuple(data["args"]),
                      needs=tuple(data.get("needs", ())), shm_mib=data.get("shm_mib"), output_dir=data.get("output_dir"),
                      checkpoint_dir=data.get("checkpoint_dir"))

    def directories(self) -> list[tuple[str | None, str]]:
        """(directory, what: its name, flag and variable, with {path}) of the output and checkpoint directories;
        a command's come from the variables alone (it has no such flags)."""
        def named(kind: str, flag: str, var: str) -> str:
            return f"{kind} directory {{path}} ({flag + ', ' if self.module else ''}{var})"

        return [(self.output_dir, named("output", "--output-dir", "TRAINPOD_OUTPUT_DIR")),
                (self.checkpoint_dir, named("checkpoint", "--checkpoint-dir", "TRAINPOD_CHECKPOINT_DIR"))]

    def torchrun_args(self) -> list[str]:
        if self.module:
            return ["-m", self.module, *self.args]
        # --no-python runs the command as given (`python train.py`, a shell script, a binary),
        # so what the user typed is exactly what each rank runs.
        return ["--no-python", *self.command, *self.args]


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


def build_plan(
    topology: Topology,
    target: Target,
    env: Mapping[str, str],
    *,
    cpus: int = 1,
    max_restarts: int = 0,
    term_grace: float = TERM_GRACE.default,
    join_timeout: float = 300.0,
    progress_window: float = PROGRESS_WINDOW.default,
    rejoin_timeout: float = REJOIN_TIMEOUT.default,
    hang_timeout: float = HANG_TIMEOUT.default,
    warm_start: str = WARM_START.default,
    recovery: str = RECOVERY.default,
    trust_checkpoints: bool = TRUST_CHECKPOINTS.default,
) -> LaunchPlan:
    """`max_restarts`: the restart budget (restarts without progress: trainpod.restarts, which the
    agent applies); `term_grace`: seconds the ranks get after SIGTERM to finish the step and
    checkpoint; `join_timeout`: how long the rendezvous waits for every node (a restarted node
    included); `progress_window`, `rejoin_timeout`: for the agent (trainpod.agent_policy);
    `hang_timeout`: for the agent's hang watch (trainpod.hang; 0: off); `warm_start`: whether the agent
    forks the ranks from a process that imported torch (trainpod.warm); `recovery`: whether a killed rank
    is replaced in-process (trainpod.keeper); `trust_checkpoints`: whether the ranks' checkpoints may be
    unpickled in full (trainpod.checkpoint)."""
    # A dynamic rendezvous (c10d, etcd, etcd-v3), never static: after a failure every agent re-joins a
    # new round, so a restarted worker group (or a restarted node) meets the others in a fresh store
    # namespace, and an elastic job's nodes leave and join there. etcd-v3 is trainpod's own backend:
    # the agent registers it with torch (trainpod.agent).
    rdzv = topology.rdzv
    torchrun = [
        "--nnodes", rdzv.nnodes,
        "--nproc-per-node", str(topology.nproc_per_node),
        "--rdzv-backend", rdzv.backend,
        "--rdzv-endpoint", _torch_endpoint(topology),
        "--rdzv-id", rdzv.id,
        "--rdzv-conf", _rdzv_conf(topology, join_timeout),
        "--max-restarts", str(max_restarts),
        # torchrun SIGKILLs workers this long after its SIGTERM: the grace, and time to exit.
        "--shutdown-timeout", str(math.ceil(term_grace) + SHUTDOWN_MARGIN_S),
        # tee makes torchrun prefix every worker line with the template below.
        "--tee", "3",
    ]
    if topology.local_addr:
        torchrun += ["--local-addr", topology.local_addr]  # published to peers instead of the host name
    added = {
        log.NODE_RANK_VAR: topology.node_label,  # the agent's log prefix
        "TRAINPOD_NNODES": str(topology.nnodes),
        "TRAINPOD_MIN_NODES": str(rdzv.min_nodes),  # read by the agent: below nnodes, an elastic job
        "TRAINPOD_BACKEND": topology.backend,
        TERM_GRACE.var: f"{term_grace:g}",  # read by trainpod.preemption in the ranks
        PROGRESS_WINDOW.var: f"{progress_window:g}",  # read by the agent's restart budget
        REJOIN_TIMEOUT.var: f"{rejoin_timeout:g}",  # read by the agent: how long a lost master may take
        WARM_START.var: warm_start,  # read by the agent: function entrypoints forked from a preloaded server
        RECOVERY.var: recovery,  # read by the warm ranks: each runs under a keeper (trainpod.keeper)
        # Read by the ranks' Checkpointer; set either way, so that the flag wins over a variable the job inherited.
        TRUST_CHECKPOINTS.var: "1" if trust_checkpoints else "0",
        "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": log.rank_tag_template(topology.node_label),
        "NO_PROXY": _no_proxy(env, topology.master_addr, _hosts(rdzv.endpoint)),
        **rdzv.access.env(),  # etcd's user and password file, for the agent (trainpod.rendezvous.etcd_http.EtcdAccess)
    }
    added["no_proxy"] = added["NO_PROXY"]
    added.update(hang.plan_env(env, hang_timeout))  # the hang watch: progress files, flight recorder
    if topology.interface:
        for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            if not env.get(var):
                added[var] = topology.interface
    if not env.get("OMP_NUM_THREADS"):
        # torchrun would force 1 thread (with a banner); share the cores between the local ranks instead.
        added["OMP_NUM_THREADS"] = str(max(1, cpus // topology.nproc_per_node))
    argv = [sys.executable, "-m", "trainpod.agent", *torchrun, *target.torchrun_args()]
    return LaunchPlan(argv=argv, env=added)
