"""Run the job under supervisord, adding the restart policy it lacks and the exit code it loses.

supervisord restarts a RUNNING program forever (no cap, no backoff), cannot exit when a program
gives up, and always exits 0 itself. So it runs the job with autorestart=false, and an event
listener (listen(), in the same supervisord) decides: on each exit it reads the exit status over
XML-RPC (the event does not carry it), restarts with exponential backoff while the budget lasts
and the code is worth retrying, and otherwise writes the final code to a file and shuts
supervisord down. run_supervised(), the container's main process under tini, starts supervisord,
forwards signals to it, and exits with the code from that file.

    tini -> trainpod run (run_supervised) -> supervisord -> job: python -m trainpod.supervisor.job
                                              (trainpod.supervisor.supervisord: its loop wakes at a SIGCHLD, not 1 s later)
                                                          -> policy: python -m trainpod.supervisor.supervise

One budget of --max-restarts, restarts *without progress* (trainpod.supervisor.restarts), covers both
layers. A failed rank is restarted inside the agent by torchrun (fast: the worker group re-forms
without a new agent); supervisord restarts the agent itself (master unreachable, a crashed agent).
Both ask trainpod.supervisor.restarts.Budget, kept in budget.json in the supervisor's directory; when the agent
(or the job's preflight) decided that the job is over, the listener only records the code.

Orphans: supervisord dies with this process (PR_SET_PDEATHSIG, SIGTERM: it then stops the job as
on `docker stop`); the job, its agent and the listener die with supervisord (trainpod.supervisor.orphans).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from trainpod import log
from trainpod.contract import OUTCOME_FILE, PROGRESS_DIR, STOP_SIGNAL_FILE, SUPERVISOR_DIR_VAR, SUPERVISORD_PIDFILE
from trainpod.supervisor import oom, orphans, restarts
from trainpod.supervisor.restarts import NEVER_RESTARTED  # noqa: F401 (where it used to live)

PROGRAM = "job"
KILLED_BY_SIGNAL = -1  # supervisord's exit status for a signal; it does not keep which one


def stop_wait_s(term_grace_s: float) -> int:
    """supervisord's wait before SIGKILL: the ranks' grace, torchrun's margin, the agent's exit.
    Its default of 10 s is shorter than torchrun's own 30 s shutdown."""
    return max(60, math.ceil(term_grace_s) + 30)


def supervisor_pid(env=os.environ) -> int | None:
    """supervisord's pid, for the job's check that its parent is still alive (trainpod.supervisor.orphans)."""
    directory = env.get(SUPERVISOR_DIR_VAR)
    try:
        return int(Path(directory, SUPERVISORD_PIDFILE).read_text()) if directory else None
    except (OSError, ValueError):
        return None


@dataclass(frozen=True)
class Policy:
    max_restarts: int = 3
    backoff_s: float = 1.0  # the first delay; it doubles with each restart without progress
    backoff_max_s: float = 60.0
    progress_window: float = 600.0  # trainpod.supervisor.restarts: a job without checkpoints made progress after this long

    def budget(self, directory: str | os.PathLike | None) -> restarts.Budget:
        return restarts.Budget(self.max_restarts, self.progress_window, directory)

    def delay(self, restart: int) -> float:
        return min(self.backoff_max_s, self.backoff_s * 2 ** (restart - 1))


def _quote(argv: Sequence[str]) -> str:
    return shlex.join(argv).replace("%", "%%")  # supervisord expands %(name)s in its values


def render_config(job: Sequence[str], listener: Sequence[str], workdir: Path, stop_wait: int = 60) -> str:
    """supervisord's configuration: the job, the policy listener, everything in workdir."""
    out = "stdout_logfile=/dev/stdout\nstdout_logfile_maxbytes=0\nstderr_logfile=/dev/stderr\nstderr_logfile_maxbytes=0\n"
    return f"""\
[supervisord]
nodaemon=true
silent=true
logfile={workdir}/supervisord.log
pidfile={workdir}/{SUPERVISORD_PIDFILE}
childlogdir={workdir}

[unix_http_server]
file={workdir}/supervisor.sock
chmod=0700

[rpcinterface:supervisor]
supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface

[program:{PROGRAM}]
command={_quote(job)}
autostart=true
autorestart=false
startsecs=0
startretries=0
stopsignal=TERM
stopwaitsecs={stop_wait}
stopasgroup=true
killasgroup=true
{out}
[eventlistener:policy]
command={_quote(listener)}
events=PROCESS_STATE_EXITED
autorestart=true
startsecs=0
stderr_logfile=/dev/stderr
stderr_logfile_maxbytes=0
"""


def run_supervised(job: Sequence[str], env: dict[str, str], policy: Policy, node_rank: int, stop_wait: int = 60) -> int:
    """Run `job` under supervisord with `policy`; the job's final exit code (128+N after signal N)."""
    workdir = Path(tempfile.mkdtemp(prefix="trainpod-supervisor-"))
    outcome = workdir / OUTCOME_FILE
    listener = [sys.executable, "-m", "trainpod.supervisor.supervise", str(workdir), json.dumps(asdict(policy)), str(node_rank)]
    config = workdir / "supervisord.conf"
    config.write_text(render_config(job, listener, workdir, stop_wait))
    outer = os.getpid()
    # No thread runs here, so the pre-exec function is safe: supervisord gets SIGTERM if this process
    # dies, even of SIGKILL, and stops the job as on `docker stop`.
    supervisord = subprocess.Popen([sys.executable, "-m", "trainpod.supervisor.supervisord", "-c", str(config)],
                                   env={**env, SUPERVISOR_DIR_VAR: str(workdir)},
                                   preexec_fn=lambda: orphans.die_with_parent(orphans.PARENT_SIGNAL, outer))

    received: list[int] = []

    def forward(signum, frame):
        received.append(signum)
        # first: supervisord stops the job with SIGTERM whatever came, and the agent names this one
        with contextlib.suppress(OSError):
            (workdir / STOP_SIGNAL_FILE).write_text(signal.Signals(received[0]).name)
        supervisord.send_signal(signum)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, forward)
    try:
        supervisord.wait()
    finally:
        code = json.loads(outcome.read_text())["code"] if outcome.exists() else None
        shutil.rmtree(workdir, ignore_errors=True)
    if received:
        return 128 + received[0]
    if code is None:
        print(f"{log.prefix(node_rank)}: supervisord exited ({supervisord.returncode}) before the job finished", file=sys.stderr)
        return 70  # EX_SOFTWARE
    return code


def stop_signal(env=os.environ) -> str | None:
    """The name of the signal `trainpod run` was given and passed on to supervisord ('SIGINT' after Ctrl-C),
    which stops the job with SIGTERM whatever it was; None if none came (or the job is not supervised)."""
    directory = env.get(SUPERVISOR_DIR_VAR)
    try:
        return Path(directory, STOP_SIGNAL_FILE).read_text().strip() or None if directory else None
    except OSError:
        return None


# --- the event listener (runs inside supervisord) ---------------------------------------------------

def _events(stdin, stdout):
    """supervisord's event listener protocol: READY, a header line, a payload; then a result."""
    while True:
        stdout.write("READY\n")
        stdout.flush()
        header = dict(field.split(":", 1) for field in stdin.readline().split())
        payload = stdin.read(int(header["len"]))
        yield header["eventname"], dict(field.split(":", 1) for field in payload.split())
        stdout.write("RESULT 2\nOK")
        stdout.flush()


def _rpc(workdir: Path):
    """supervisord's XML-RPC interface, over its socket in `workdir`."""
    import xmlrpc.client

    from supervisor.xmlrpc import SupervisorTransport  # only inside the image's supervisord

    socket_url = f"unix://{workdir / 'supervisor.sock'}"
    return xmlrpc.client.ServerProxy("http://localhost", transport=SupervisorTransport(None, None, socket_url))


def listen(workdir: Path, policy: Policy, node_rank: str) -> None:
    budget = policy.budget(workdir)
    say = log.writer(node_rank)
    memory = oom.Watch()  # the cgroup's OOM kills: one more when the agent died of a signal names the OOM killer
    rpc = None  # made at the job's first exit: its imports would compete with the job's launch for the CPU
    for name, fields in _events(sys.stdin, sys.stdout):
        if name != "PROCESS_STATE_EXITED" or fields.get("processname") != PROGRAM:
            continue
        rpc = rpc or _rpc(workdir)
        if rpc.supervisor.getState()["statename"] != "RUNNING":
            continue  # supervisord is shutting down (a signal): run_supervised reports it
        info = rpc.supervisor.getProcessInfo(PROGRAM)
        code = info["exitstatus"]
        killed = memory.killed()  # at every exit: the agent's own lines named the kills it saw
        cause = where = ""
        if code == KILLED_BY_SIGNAL:
            code = 128 + signal.SIGKILL  # supervisord does not say which signal; the usual one is the OOM killer's
            if killed is not None:
                cause = (f"the job's agent was killed by the kernel's OOM killer ({oom.describe(killed)}: give the job more "
                         "memory or make it use less)")
                where = oom.WHERE
        if budget.final() is None:  # else the agent (or the job's preflight) decided, and said so
            committed, step = restarts.reported(workdir / PROGRESS_DIR)
            ran_s = max(0.0, float(info.get("stop", 0)) - float(info.get("start", 0)))
            decision = budget.decide(restarts.Failure(code=code, committed=committed, step=step, ran_s=ran_s, who="the job",
                                                      cause=cause, where=where))
            if decision.restart:
                delay = policy.delay(decision.used)
                say(f"{decision.line}; starting it again in {delay:g}s")
                time.sleep(delay)
                rpc.supervisor.startProcess(PROGRAM, False)
                continue
            if decision.line:
                say(decision.line)
        (workdir / OUTCOME_FILE).write_text(json.dumps({"code": code, "attempts": budget.load().attempts}))
        rpc.supervisor.shutdown()


if __name__ == "__main__":
    orphans.die_with_parent(orphans.PARENT_SIGNAL)  # supervisord's child: gone with it
    directory, policy_json, node = sys.argv[1:4]
    listen(Path(directory), Policy(**json.loads(policy_json)), node)
