"""`trainpod job ssh --submit`: connect to every host, start the job on each, stream its lines, stop
them all when one fails or on a signal, and exit with the job's code (trainpod.jobs.ssh says what
each step does). Kept apart from the job's rendering so that `trainpod run`, which imports the
scheduler registry, does not import asyncio and ssl.
"""

from __future__ import annotations

import asyncio
import contextlib
import shlex
import signal
import socket
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainpod.errors import EXIT_CONFIG, EXIT_UNAVAILABLE, TrainpodError, error_for
from trainpod.jobs.ssh_hosts import PID_TAG, Target
from trainpod.jobs.values import printable

if TYPE_CHECKING:  # the job that submits: ssh.py imports this module when it runs --submit
    from trainpod.jobs.ssh import SSHJob


class HostError(TrainpodError):
    """A host that cannot take the job: one line naming it."""

    def __init__(self, target: Target, message: str, code: int):
        super().__init__(f"host {target}: {message}")
        self.exit_code = code


class Launch:
    """One --submit: connect to all, start all, stream, stop all, the job's exit code."""

    def __init__(self, job: SSHJob, log_dir: Path, keys: dict[str, Any] | None = None):
        self.job = job
        self.log_dir = log_dir
        self.keys = keys or {}  # --identity and --known-hosts, already read (trainpod.jobs.ssh_keys)
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
        options.update(self.keys)
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
        except ValueError as error:
            # asyncssh read one of SSH's default files (~/.ssh/config, known_hosts, id_*) and could not parse it.
            raise HostError(target, f"SSH's own files could not be read ({printable(str(error))}): check ~/.ssh, or give "
                            "--identity and --known-hosts", EXIT_CONFIG) from None
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

