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

import asyncio
import contextlib
import re
import shlex
import signal
import socket
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from trainpod.environments.base import DEFAULT_MASTER_PORT
from trainpod.errors import EXIT_CONFIG, EXIT_UNAVAILABLE, ConfigError, TrainpodError, UsageError, error_for
from trainpod.jobs.base import Scheduler, comment
from trainpod.settings import Host, Integer, Invalid, Number, Setting, Switch

PID_TAG = "trainpod-ssh-pid"  # the first line every remote command prints: its PID, for the stop


@dataclass(frozen=True)
class Target:
    """One host of the list: [user@]host[:port]."""

    host: str
    user: str | None = None
    port: int = 22

    @property
    def label(self) -> str:
        return self.host

    def __str__(self) -> str:
        user = f"{self.user}@" if self.user else ""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{user}{host}:{self.port}"


_TARGET = re.compile(r"(?:(?P<user>[^@\s:]+)@)?(?P<host>\[[^\]]+\]|[^:\s@\[\]]+)(?::(?P<port>[0-9]+))?")


def parse_target(text: str) -> Target:
    """'alice@gpu1:2222' -> Target('gpu1', 'alice', 2222); ValueError when malformed."""
    match = _TARGET.fullmatch(text.strip())
    if not match:
        raise ValueError(f"{text!r} is not [user@]host[:port]")
    try:
        host = Host()(match["host"])
    except Invalid as bad:
        raise ValueError(f"{text!r}: {bad}") from None
    port = int(match["port"]) if match["port"] else 22
    if not 1 <= port <= 65535:
        raise ValueError(f"{text!r}: the port must be from 1 to 65535")
    return Target(host=host, user=match["user"], port=port)


class HostList:
    """Comma-separated [user@]host[:port]; checked as a setting kind."""

    def expected(self) -> str:
        return "comma-separated [user@]host[:port], each host once"

    def __call__(self, value: Any) -> tuple[Target, ...]:
        items = [item.strip() for item in str(value).split(",")]
        if not items or any(not item for item in items):
            raise Invalid(self.expected())
        try:
            targets = tuple(parse_target(item) for item in items)
        except ValueError as bad:
            raise Invalid(f"{self.expected()}: {bad}") from None
        if len({(t.host, t.port) for t in targets}) != len(targets):
            raise Invalid(f"{self.expected()}: a host is listed twice")
        return targets


HOSTS = Setting("hosts", "the hosts, comma-separated [user@]host[:port]; the first is the master", HostList(),
                var="TRAINPOD_JOB_HOSTS", metavar="H1,H2")
HOSTS_FILE = Setting("hosts_file", "a file of hosts, one [user@]host[:port] a line (# comments), instead of --hosts",
                     var="TRAINPOD_JOB_HOSTS_FILE", metavar="FILE")


class SSHJob(Scheduler):
    name = "ssh"
    description = "trainpod run on every host of a list over SSH (asyncssh): docker run --net=host, or trainpod itself"
    submits = "runs it on every host, streams their output, stops them all on Ctrl-C"
    settings = (
        HOSTS,
        HOSTS_FILE,
        Setting("no_docker", "run `trainpod run` on the hosts themselves (trainpod installed there) instead of docker run",
                Switch(), var="TRAINPOD_JOB_NO_DOCKER", default=False),
        Setting("master_addr", "the address the hosts reach the master at (default: the first host as listed)", Host(),
                var="TRAINPOD_JOB_MASTER_ADDR", metavar="HOST"),
        Setting("master_port", f"the master's port (default {DEFAULT_MASTER_PORT})", Integer(1, 65535),
                var="TRAINPOD_JOB_MASTER_PORT", default=DEFAULT_MASTER_PORT, metavar="PORT"),
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
        try:
            text = Path(path).read_text()
        except OSError as error:
            raise error_for(origin)(f"{origin}={path!r}: {error.strerror or error}") from None
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
            # (the image sets this for docker run).
            return ["env", "PYTHONUNBUFFERED=1", *(f"{k}={v}" for k, v in variables.items()), *r.run_argv()]
        docker = ["docker", "run", "--rm", "--name", self.container_name(rank), "--net=host", f"--shm-size={r.shm_mb}m",
                  f"--stop-timeout={r.stop_grace_s}"]
        if r.gpus:
            docker.append("--gpus=all")
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
        try:
            import asyncssh  # noqa: F401
        except ImportError:
            raise ConfigError("trainpod job ssh --submit needs asyncssh: pip install 'trainpod[ssh]'") from None
        log_dir = Path(self.options.log_dir or Path("trainpod-logs") / self.request.name)
        return asyncio.run(Launch(self, log_dir).run())


class HostError(TrainpodError):
    """A host that cannot take the job: one line naming it."""

    def __init__(self, target: Target, message: str, code: int):
        super().__init__(f"host {target}: {message}")
        self.exit_code = code


class Launch:
    """One --submit: connect to all, start all, stream, stop all, the job's exit code."""

    def __init__(self, job: SSHJob, log_dir: Path):
        self.job = job
        self.log_dir = log_dir
        self.connections: list[Any] = []
        self.processes: list[Any] = []
        self.pids: dict[int, str] = {}
        self.codes: dict[int, int] = {}
        self.first_failure: int | None = None
        self.stopping = asyncio.Event()
        self.stop_reason = ""

    def say(self, message: str) -> None:
        print(f"trainpod: {message}", file=sys.stderr, flush=True)

    async def connect(self, target: Target) -> Any:
        import asyncssh

        o = self.job.options
        options: dict[str, Any] = {"port": target.port, "connect_timeout": o.ssh_timeout}
        if target.user:
            options["username"] = target.user
        if o.identity:
            options["client_keys"] = [o.identity]
        if o.known_hosts:
            options["known_hosts"] = o.known_hosts
        try:
            return await asyncssh.connect(target.host, **options)
        except socket.gaierror as error:
            origin = o.origins["hosts"] if o.hosts else o.origins["hosts_file"]
            raise HostError(target, f"the name does not resolve ({error.strerror}); check {origin}",
                            error_for(origin).exit_code) from None
        except asyncssh.PermissionDenied:
            raise HostError(target, "authentication failed (no key the host accepts: --identity, ssh-agent, ~/.ssh)",
                            EXIT_CONFIG) from None
        except asyncssh.HostKeyNotVerifiable as error:
            raise HostError(target, f"its host key is not known or does not match ({error.reason}; --known-hosts)",
                            EXIT_CONFIG) from None
        except (asyncio.TimeoutError, TimeoutError):
            raise HostError(target, f"no answer within {o.ssh_timeout:g} s (--ssh-timeout)", EXIT_UNAVAILABLE) from None
        except (OSError, asyncssh.Error) as error:
            reason = getattr(error, "strerror", None) or getattr(error, "reason", None) or str(error) or type(error).__name__
            raise HostError(target, f"unreachable: {reason}", EXIT_UNAVAILABLE) from None

    async def check_host(self, target: Target, connection: Any) -> None:
        tool = "trainpod" if self.job.options.no_docker else "docker"
        result = await connection.run(f"command -v {tool}", check=False)
        if result.exit_status != 0:
            where = "on the PATH of a non-interactive SSH session" if tool == "trainpod" else "installed"
            raise HostError(target, f"{tool} is not {where}" + ("" if tool == "trainpod" else " (or run --no-docker)"),
                            EXIT_CONFIG)

    async def open_all(self) -> None:
        targets = self.job.targets
        results = await asyncio.gather(*(self.connect(t) for t in targets), return_exceptions=True)
        self.connections = [r for r in results if not isinstance(r, BaseException)]
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            raise failures[0] if isinstance(failures[0], TrainpodError) else failures[0]
        checks = await asyncio.gather(*(self.check_host(t, c) for t, c in zip(targets, self.connections)), return_exceptions=True)
        for check in checks:
            if isinstance(check, BaseException):
                raise check

    async def stream(self, rank: int, process: Any) -> None:
        target = self.job.targets[rank]
        prefix = f"[{target.label}] "
        with open(self.log_dir / f"{target.label}.log", "a", encoding="utf-8") as log:
            async for line in process.stdout:
                if rank not in self.pids and line.startswith(PID_TAG):
                    self.pids[rank] = line.split()[1]
                    continue
                log.write(line)
                log.flush()
                sys.stdout.write(prefix + line if line.endswith("\n") else prefix + line + "\n")
                sys.stdout.flush()

    async def watch(self, rank: int, process: Any) -> None:
        await self.stream(rank, process)
        await process.wait_closed()
        code = process.exit_status
        if code is None or code < 0:
            signame = process.exit_signal[0] if process.exit_signal else None
            number = getattr(signal, f"SIG{signame}", None) if signame else None
            code = 128 + int(number) if number else 255
        self.codes[rank] = code
        if code != 0 and self.first_failure is None:
            self.first_failure = rank
            if not self.stopping.is_set():
                self.say(f"host {self.job.targets[rank]} (node {rank}) exited with {code}: stopping the others")
                self.request_stop(f"node {rank} failed")

    def request_stop(self, reason: str) -> None:
        if not self.stopping.is_set():
            self.stop_reason = reason
            self.stopping.set()

    async def signal_all(self, hard: bool) -> None:
        """SIGTERM to every remote job that still runs (docker stop in docker mode); SIGKILL of the tree if hard."""
        o = self.job.options
        commands = []
        for rank, connection in enumerate(self.connections):
            if rank in self.codes:
                continue
            pid = self.pids.get(rank)
            if not o.no_docker:
                name = shlex.quote(self.job.container_name(rank))
                command = f"docker kill {name}" if hard else f"docker stop --time {self.job.request.stop_grace_s} {name}"
                commands.append(connection.run(command + " >/dev/null 2>&1 || true", check=False))
            elif pid:
                if hard:  # the remote job's whole process tree, deepest first
                    tree = ('kill_tree() { for child in $(ps -o pid= --ppid "$1"); do kill_tree "$child"; done; '
                            f'kill -KILL "$1" 2>/dev/null || true; }}; kill_tree {int(pid)}')
                    commands.append(connection.run(tree, check=False))
                else:
                    commands.append(connection.run(f"kill -TERM {int(pid)} 2>/dev/null || true", check=False))
        # docker stop waits for the container; it runs beside the watchers, which see the exit.
        await asyncio.gather(*commands, return_exceptions=True)

    async def stopper(self, watchers: list[asyncio.Task]) -> None:
        await self.stopping.wait()
        self.say(f"stopping the job on every host ({self.stop_reason})")
        grace = self.job.request.stop_grace_s
        soft = asyncio.ensure_future(self.signal_all(hard=False))
        _, pending = await asyncio.wait(watchers, timeout=grace + 15)
        if pending:
            self.say(f"{len(pending)} host(s) still running after {grace + 15} s: SIGKILL")
            await self.signal_all(hard=True)
            await asyncio.wait(pending, timeout=30)
        soft.cancel()

    async def run(self) -> int:
        job = self.job
        started = time.monotonic()
        await self.open_all()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.say(f"{len(job.targets)} host(s) reachable in {time.monotonic() - started:.1f} s; master {job.master_addr}:"
                 f"{job.options.master_port}; logs in {self.log_dir}/")
        loop = asyncio.get_running_loop()
        for signum, name in ((signal.SIGINT, "SIGINT"), (signal.SIGTERM, "SIGTERM")):
            loop.add_signal_handler(signum, self.request_stop, f"{name} received")
        try:
            import asyncssh

            for rank, connection in enumerate(self.connections):
                self.processes.append(await connection.create_process(job.remote_command(rank), stderr=asyncssh.STDOUT,
                                                                      encoding="utf-8", errors="replace"))
            watchers = [asyncio.ensure_future(self.watch(rank, process)) for rank, process in enumerate(self.processes)]
            stopper = asyncio.ensure_future(self.stopper(watchers))
            await asyncio.wait(watchers)
            if not self.stopping.is_set():
                stopper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await stopper
        finally:
            for signum in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(signum)
            for connection in self.connections:
                connection.close()
            await asyncio.gather(*(c.wait_closed() for c in self.connections), return_exceptions=True)
        if self.first_failure is not None:
            return self.codes[self.first_failure]
        failed = [code for code in self.codes.values() if code != 0]
        if failed:
            return failed[0]
        self.say(f"the job finished on every host in {time.monotonic() - started:.1f} s")
        return 0


__all__ = ["HostList", "SSHJob", "Target", "parse_target"]
