"""SSH to a host list: `trainpod run` on every host, the first host the master (the seed's PaddlePaddle
launcher, with asyncssh instead of fabric).

Printed, it is the command each host runs. With --submit trainpod:
1. connects to every host (concurrently, bounded) and checks that docker (or, with --no-docker,
   trainpod) is there; an unreachable host, a failed authentication, an unknown host key or a missing
   command is one line naming the host, and nothing has started anywhere;
2. starts the command on every host: `docker run --net=host ... trainpod run ...` (or `trainpod run`)
   with MASTER_ADDR (the first host), MASTER_PORT, NNODES and NODE_RANK, which trainpod's torchrun
   source reads; every output line streams with its host's prefix and goes to <log dir>/<host>.log;
3. when a host fails, stops the others (a DDP job cannot go on without it); on SIGINT or SIGTERM
   stops every host: SIGTERM to each remote trainpod (or `docker stop`), which checkpoints and stops
   within --term-grace, then SIGKILL to whatever is left after --term-grace + 30 s;
4. exits with the job's code: 0, or the first failing host's.
"""

from __future__ import annotations

import importlib.util
import shlex
from dataclasses import replace
from pathlib import Path

from trainpod.environments.base import DEFAULT_MASTER_PORT
from trainpod.errors import ConfigError, UsageError, error_for
from trainpod.jobs.base import MASTER_PORT_VAR, Scheduler, comment
from trainpod.jobs.ssh_hosts import PID_TAG, HostList, Target, parse_target
from trainpod.jobs.values import read_text
from trainpod.settings import Host, Integer, Invalid, Number, Setting, Switch

HOSTS = Setting("hosts", "the hosts, comma-separated [user@]host[:port]; the first is the master", HostList(),
                var="TRAINPOD_JOB_HOSTS", metavar="H1,H2")
HOSTS_FILE = Setting("hosts_file", "a file of hosts (UTF-8), one [user@]host[:port] a line (# comments), instead of --hosts",
                     var="TRAINPOD_JOB_HOSTS_FILE", metavar="FILE")


class SSHJob(Scheduler):
    name = "ssh"
    description = "trainpod run on every host of a list over SSH (asyncssh): docker run --net=host, or trainpod itself"
    submits = "runs it on every host, streams their output, stops them all on Ctrl-C"
    no_spares = ("a host that fails stops the others (a job of a fixed host list), so no job is left for a spare to join: "
                 "use openpai or kubeflow for a job with spares")
    settings = (
        HOSTS,
        HOSTS_FILE,
        Setting("no_docker", "run `trainpod run` on the hosts themselves (trainpod installed there) instead of docker run",
                Switch(), var="TRAINPOD_JOB_NO_DOCKER", default=False),
        Setting("master_addr", "the address the hosts reach the master at (default: the first host as listed)", Host(),
                var="TRAINPOD_JOB_MASTER_ADDR", metavar="HOST"),
        Setting("master_port", f"the master's port (default {DEFAULT_MASTER_PORT})", Integer(1, 65535),
                var=MASTER_PORT_VAR, default=DEFAULT_MASTER_PORT, metavar="PORT"),
        Setting("log_dir", "where each host's output goes, <host>.log (default trainpod-logs/<name>)", var="TRAINPOD_JOB_LOG_DIR",
                metavar="DIR"),
        Setting("identity", "the SSH private key (default: ssh-agent, ~/.ssh/config and ~/.ssh/id_*)",
                var="TRAINPOD_JOB_SSH_IDENTITY", metavar="FILE"),
        Setting("known_hosts", "the known_hosts file the hosts' keys are checked against (default ~/.ssh/known_hosts)",
                var="TRAINPOD_JOB_SSH_KNOWN_HOSTS", metavar="FILE"),
        Setting("ssh_timeout", "seconds to connect to a host before it counts as unreachable", Number(above=0),
                var="TRAINPOD_JOB_SSH_TIMEOUT", default=15.0),
    )

    def check(self) -> None:
        o = self.options
        if o.hosts and o.hosts_file:
            raise UsageError(f"{o.origins['hosts']} and {o.origins['hosts_file']}: give the hosts one way")
        if o.hosts:
            self.targets, origin = o.hosts, o.origins["hosts"]
        elif o.hosts_file:
            self.targets, origin = self._read_hosts_file(o.hosts_file, o.origins["hosts_file"]), o.origins["hosts_file"]
        else:
            raise UsageError("trainpod job ssh: give the hosts: --hosts h1,h2 or --hosts-file FILE")
        r = self.request
        count = len(self.targets)
        if r.origins.get("nodes", "default") != "default" and r.nodes != count:
            raise error_for(r.origins["nodes"])(f"{r.origins['nodes']}={r.nodes} but {origin} names {count} host(s)")
        if r.example.max_nodes and count > r.example.max_nodes:
            raise error_for(origin)(f"{origin}: {count} hosts, but the example {r.example.name} trains on at most "
                                    f"{r.example.max_nodes} node(s); across nodes use cifar10-ddp")
        self.request = replace(r, nodes=count)
        self.master_addr = o.master_addr or self.targets[0].host

    @staticmethod
    def _read_hosts_file(path: str, origin: str) -> tuple[Target, ...]:
        text = read_text(path, origin, "a host list, one [user@]host[:port] a line")
        lines = [line.split("#", 1)[0].strip() for line in text.splitlines()]
        lines = [line for line in lines if line]
        try:
            return HostList()(",".join(lines)) if lines else HostList()("")
        except Invalid as bad:
            raise error_for(origin)(f"{origin}={path!r}: expected {bad}") from None

    # --- the commands ---------------------------------------------------------------------------

    def container_name(self, rank: int) -> str:
        return f"{self.request.name}-node{rank}"

    def node_argv(self, rank: int) -> list[str]:
        """What host `rank` runs: docker run ... trainpod run ..., or trainpod run ... with the variables."""
        r, o = self.request, self.options
        variables = {"MASTER_ADDR": self.master_addr, "MASTER_PORT": str(o.master_port), "NNODES": str(r.nodes),
                     "NODE_RANK": str(rank)}
        if o.no_docker:
            # An SSH session's output is a pipe: unbuffered, every rank's line streams as it is written
            # (the image sets this for docker run). Nothing limits what the host's trainpod sees: --gpus N
            # is its processes per node, as the other schedulers' N GPUs give it.
            gpus = ["--nproc-per-node", str(r.gpus)] if r.gpus and not r.nproc_per_node and not r.example.nproc_per_node else []
            return ["env", "PYTHONUNBUFFERED=1", *(f"{k}={v}" for k, v in variables.items()), *r.run_argv(*gpus)]
        docker = ["docker", "run", "--rm", "--name", self.container_name(rank), "--net=host", f"--shm-size={r.shm_mb}m",
                  f"--stop-timeout={r.stop_grace_s}"]
        if r.gpus:
            docker.append(f"--gpus={r.gpus}")  # that many of the host's GPUs, as Kubernetes' and OpenPAI's N GPUs
        # CPUs and memory bound the container where they were asked for (a default would throttle a bigger host).
        if r.origins.get("cpus", "default") != "default":
            docker.append(f"--cpus={r.cpus}")
        if r.origins.get("memory_mb", "default") != "default":
            docker.append(f"--memory={r.memory_mb}m")
        for key, value in variables.items():
            docker += ["-e", f"{key}={value}"]
        return [*docker, r.image, *r.run_argv()]

    def remote_command(self, rank: int) -> str:
        """The command line sent to the host: prints its PID first (the stop signals it), then becomes the job."""
        script = f'echo "{PID_TAG} $$"; exec "$@"'
        return shlex.join(["sh", "-c", script, "sh", *self.node_argv(rank)])

    def render(self) -> str:
        r = self.request
        lines = [comment([
            f"trainpod job ssh for trainpod's example {r.summary()}.",
            f"Generated by `{r.generated_by()}`.",
            "Each host runs its line over SSH; --submit does it: streams every host's output, stops all on Ctrl-C.",
        ])]
        for rank, target in enumerate(self.targets):
            lines.append(f"{target}: {shlex.join(self.node_argv(rank))}\n")
        return "".join(lines)

    # --- --submit -------------------------------------------------------------------------------

    def submit(self) -> int:
        if importlib.util.find_spec("asyncssh") is None:
            raise ConfigError("trainpod job ssh --submit needs asyncssh: pip install 'trainpod[ssh]'")
        import asyncio

        from trainpod.jobs.ssh_keys import client_options  # asyncssh's first import: its warnings filtered there
        from trainpod.jobs.ssh_launch import Launch  # asyncio's and asyncssh's world: only for --submit

        keys = client_options(self.options, self.env)  # a bad key or known_hosts file: 64/78 before any host is tried
        log_dir = Path(self.options.log_dir or Path("trainpod-logs") / self.request.name)
        return asyncio.run(Launch(self, log_dir, keys).run())


__all__ = ["HostList", "SSHJob", "Target", "parse_target"]
