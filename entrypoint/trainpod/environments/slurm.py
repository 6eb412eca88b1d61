"""SLURM: the variables sbatch and srun set in a job step (one `trainpod run` per node, started by srun).

From SLURM's sbatch and srun manuals (OUTPUT ENVIRONMENT VARIABLES):
- SLURM_JOB_ID; the job's nodes SLURM_JOB_NODELIST (older SLURM_NODELIST) and SLURM_NNODES
  (SLURM_JOB_NUM_NODES); a step's own SLURM_STEP_NODELIST and SLURM_STEP_NUM_NODES, which srun
  sets and which win here (a step may run on part of the allocation);
- SLURM_NODEID: the node's relative index (0 on the step's first node);
- SLURM_GPUS_ON_NODE: GPUs allocated on this node; SLURM_NTASKS_PER_NODE: --ntasks-per-node,
  only when it was given;
- SLURM_STEP_TASKS_PER_NODE: the tasks srun started on each node of the step ('2(x3),1'), and
  SLURM_LOCALID: this task's index on its node. trainpod starts a node's ranks itself, so a step must
  run one task per node: with more (`#SBATCH --ntasks-per-node=4` and a bare `srun`, as one-task-per-GPU
  launchers want), each task would be a whole node's agent claiming the same node rank and master port.
  That is refused on every node, before anything starts (a batch script's own task has SLURM_LOCALID=0
  and no SLURM_STEP_* variable: running trainpod there, on the first node only, is left alone).

A node list is SLURM's hostlist expression (`node[01-03,07],gpu-a[1-2]`), expanded here in
Python, without `scontrol show hostnames` (which needs SLURM's client and its configuration). The
master is the first host of the list, as SLURM orders it (node 0). Its port is MASTER_PORT when the
job exported one, else derived from the job id, so that two jobs sharing a node do not collide.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Mapping

from trainpod.environments.base import MAX_NODES, MAX_NPROC, ClusterEnvironment, Discovery, parse_int, parse_port
from trainpod.errors import ConfigError

JOB_ID_VARS = ("SLURM_JOB_ID", "SLURM_JOBID")
NODELIST_VARS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
# Each node list's own count: a step's list goes with the step's count.
NNODES_VARS = {"SLURM_STEP_NODELIST": ("SLURM_STEP_NUM_NODES",),
               "SLURM_JOB_NODELIST": ("SLURM_NNODES", "SLURM_JOB_NUM_NODES"),
               "SLURM_NODELIST": ("SLURM_NNODES", "SLURM_JOB_NUM_NODES")}
# The derived master port: PORT_BASE + job id mod PORT_SPAN, below Linux's ephemeral range (32768-).
PORT_BASE = 15000
PORT_SPAN = 15000


def expand_hostlist(expression: str) -> list[str]:
    """SLURM's hostlist expression -> host names, in order: 'node[01-03,07],gpu-a[1-2]' ->
    node01 node02 node03 node07 gpu-a1 gpu-a2. Zero padding follows the range's first number; several
    bracket groups in one name ('rack[1-2]-n[1-2]') multiply. Raises ValueError when malformed."""
    hosts: list[str] = []
    for item in _split_top_level(expression):
        parts = re.split(r"(\[[^\]]*\])", item)
        choices: list[list[str]] = []
        for part in parts:
            if part.startswith("["):
                choices.append(_expand_ranges(part[1:-1]))
            elif "[" in part or "]" in part:
                raise ValueError(f"unbalanced brackets in {item!r}")
            elif part:
                choices.append([part])
        if not choices:
            raise ValueError(f"an empty host name in {expression!r}")
        # Counted before it is expanded: 'a[1-60000]b[1-60000]' would be 3.6e9 names.
        if len(hosts) + math.prod(len(choice) for choice in choices) > MAX_NODES:
            raise ValueError(f"more than {MAX_NODES} hosts")
        hosts.extend("".join(combination) for combination in itertools.product(*choices))
    if not hosts:
        raise ValueError("no hosts")
    return hosts


def _split_top_level(expression: str) -> list[str]:
    items, depth, current = [], 0, ""
    for char in expression.strip():
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced brackets in {expression!r}")
        if char == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += char
    if depth:
        raise ValueError(f"unbalanced brackets in {expression!r}")
    items.append(current)
    if any(not item.strip() or " " in item.strip() for item in items):
        raise ValueError(f"an empty or blank host name in {expression!r}")
    return [item.strip() for item in items]


def _expand_ranges(body: str) -> list[str]:
    values: list[str] = []
    for piece in body.split(","):
        match = re.fullmatch(r"([0-9]{1,9})(?:-([0-9]{1,9}))?", piece.strip())  # (int() of 5000 digits is an error too)
        if not match:
            raise ValueError(f"{piece!r} is not a number or a range")
        low, high = match[1], match[2] if match[2] is not None else match[1]
        if int(high) < int(low):
            raise ValueError(f"the range {piece!r} runs backwards")
        if int(high) - int(low) + len(values) >= MAX_NODES:
            raise ValueError(f"the ranges {body!r} name more than {MAX_NODES} nodes")
        width = len(low)
        values.extend(str(n).zfill(width) for n in range(int(low), int(high) + 1))
    return values


def expand_counts(expression: str) -> list[int]:
    """SLURM's compressed per-node counts -> one count per node: '2(x3),1' -> [2, 2, 2, 1].
    Raises ValueError when malformed."""
    counts: list[int] = []
    for item in expression.split(","):
        match = re.fullmatch(r"\s*([0-9]{1,6})(?:\(x([0-9]{1,6})\))?\s*", item)
        if not match:
            raise ValueError(f"{item!r} is not a count or COUNT(xNODES)")
        repeat = int(match[2]) if match[2] is not None else 1
        if repeat < 1 or len(counts) + repeat > MAX_NODES:
            raise ValueError(f"{item!r} names {'no' if repeat < 1 else 'more than ' + str(MAX_NODES)} nodes")
        counts.extend([int(match[1])] * repeat)
    return counts


def _one_task_per_node(env: Mapping[str, str]) -> None:
    """Refuse a step that runs several tasks on a node (each would be a trainpod starting the node's ranks)."""
    # Checked on compose/slurm: inside `#SBATCH --ntasks-per-node=2`, `srun --ntasks-per-node=1` alone is ignored
    # (srun warns and keeps the job's task count); with --ntasks too, it runs one task per node.
    fix = ("start one per node: `srun --ntasks=$SLURM_NNODES --ntasks-per-node=1 trainpod run ...` (srun ignores a bare "
           "--ntasks-per-node=1 where the job asked for more tasks), with the ranks per node in --nproc-per-node")
    text = env.get("SLURM_STEP_TASKS_PER_NODE", "").strip()
    if text:
        try:
            counts = expand_counts(text)
        except ValueError as bad:
            raise ConfigError(f"SLURM_STEP_TASKS_PER_NODE={text!r}: expected srun's tasks per node such as 1(x3): {bad}") from None
        if max(counts) > 1:
            raise ConfigError(f"SLURM_STEP_TASKS_PER_NODE={text!r}: srun started {max(counts)} tasks on a node, each a "
                              f"trainpod that would start all of the node's ranks; {fix}")
    local = env.get("SLURM_LOCALID", "").strip()
    if local and parse_int(local, "SLURM_LOCALID", maximum=MAX_NPROC * 64) > 0:
        raise ConfigError(f"SLURM_LOCALID={local}: srun started more than one task on this node, each a trainpod "
                          f"that would start all of the node's ranks; {fix}")


def derived_port(job_id: int) -> int:
    return PORT_BASE + job_id % PORT_SPAN


def _first(env: Mapping[str, str], names: tuple[str, ...]) -> tuple[str | None, str | None]:
    for name in names:
        if env.get(name, "").strip():
            return env[name].strip(), name
    return None, None


class SlurmEnvironment(ClusterEnvironment):
    name = "slurm"
    description = "SLURM job step variables (SLURM_JOB_ID, SLURM_JOB_NODELIST, SLURM_NNODES, SLURM_NODEID)"

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        return any(env.get(v, "").strip() for v in JOB_ID_VARS) and any(env.get(v, "").strip() for v in NODELIST_VARS)

    def discover(self) -> Discovery:
        env = self.env
        job_text, job_var = _first(env, JOB_ID_VARS)
        if job_text is None:
            raise ConfigError("SLURM_JOB_ID is not set: the source 'slurm' reads the variables of a SLURM job step; "
                              "run trainpod with srun inside a job, or choose another --source")
        job_id = parse_int(job_text, job_var)
        _one_task_per_node(env)
        list_text, list_var = _first(env, NODELIST_VARS)
        if list_text is None:
            raise ConfigError("SLURM_JOB_NODELIST is not set: expected the job's node list (run trainpod with srun)")
        try:
            hosts = expand_hostlist(list_text)
        except ValueError as bad:
            raise ConfigError(f"{list_var}={list_text!r}: expected a SLURM host list such as node[01-03,07]: {bad}") from None
        if len(hosts) > MAX_NODES:
            raise ConfigError(f"{list_var}={list_text!r}: {len(hosts)} hosts, more than {MAX_NODES}")
        if len(set(hosts)) != len(hosts):
            raise ConfigError(f"{list_var}={list_text!r}: names a host twice")
        origins: dict[str, str] = {"master_addr": f"{list_var} (first host)"}

        count_text, count_var = _first(env, NNODES_VARS[list_var])
        nnodes, origins["nnodes"] = len(hosts), f"{list_var} ({len(hosts)} hosts)"
        if count_text is not None:
            nnodes = parse_int(count_text, count_var, minimum=1, maximum=MAX_NODES)
            origins["nnodes"] = count_var
            if nnodes != len(hosts):
                raise ConfigError(f"{count_var}={count_text} but {list_var}={list_text!r} names {len(hosts)} host(s)")

        missing: dict[str, str] = {}
        node_rank = None
        rank_text, rank_var = _first(env, ("SLURM_NODEID",))
        if rank_text is not None:
            node_rank = parse_int(rank_text, rank_var, maximum=MAX_NODES - 1)
            origins["node_rank"] = rank_var
        else:
            missing["node_rank"] = ("SLURM_NODEID is not set: start one trainpod per node with srun "
                                    "(srun --ntasks-per-node=1 trainpod run ...), or pass --node-rank")

        port_text, port_var = _first(env, ("MASTER_PORT",))
        if port_text is not None:
            master_port, origins["master_port"] = parse_port(port_text, port_var), port_var
        else:
            master_port = derived_port(job_id)
            origins["master_port"] = f"{job_var} ({PORT_BASE} + {job_id} mod {PORT_SPAN})"

        nproc = None
        gpus_text, gpus_var = _first(env, ("SLURM_GPUS_ON_NODE",))
        tasks_text, tasks_var = _first(env, ("SLURM_NTASKS_PER_NODE",))
        if gpus_text is not None and parse_int(gpus_text, gpus_var, maximum=MAX_NPROC) > 0:
            nproc, origins["nproc_per_node"] = parse_int(gpus_text, gpus_var, maximum=MAX_NPROC), gpus_var
        elif tasks_text is not None and "(" not in tasks_text:
            tasks = parse_int(tasks_text, tasks_var, minimum=1, maximum=MAX_NPROC)
            # 1 is srun's "one trainpod per node", not a request for one process: the node decides then.
            if tasks > 1:
                nproc, origins["nproc_per_node"] = tasks, tasks_var

        job_id = env_job = self.env.get("SLURM_JOB_ID", "").strip()
        if job_id:
            # One step of one job (srun), and a requeued job's next run: each a rendezvous of its own.
            parts = [("SLURM_STEP_ID", "s"), ("SLURM_RESTART_COUNT", "r")]
            used = [(var, tag) for var, tag in parts if self.env.get(var, "").strip()]
            job_id = "slurm-" + env_job + "".join(f"-{tag}{self.env[var].strip()}" for var, tag in used)
            origins["job_id"] = " + ".join(["SLURM_JOB_ID", *(var for var, _ in used)])
        return Discovery(
            job_id=job_id or None,
            nnodes=nnodes,
            node_rank=node_rank,
            master_addr=hosts[0],
            master_port=master_port,
            nproc_per_node=nproc,
            origins=origins,
            missing=missing,
        )
