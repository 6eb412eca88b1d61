"""Run the job under supervisord, adding the restart policy it lacks and the exit code it loses.

supervisord restarts a RUNNING program forever (no cap, no backoff), cannot exit when a program
gives up, and always exits 0 itself. So it runs the job with autorestart=false, and an event
listener (listen(), in the same supervisord) decides: on each exit it reads the exit status over
XML-RPC (the event does not carry it), restarts with exponential backoff while the budget lasts
and the code is worth retrying, and otherwise writes the final code to a file and shuts
supervisord down. run_supervised(), the container's main process under tini, starts supervisord,
forwards signals to it, and exits with the code from that file.

    tini -> trainpod run (run_supervised) -> supervisord -> job: python -m trainpod.job
                                                          -> policy: python -m trainpod.supervise

One budget of --max-restarts covers both layers. A failed rank is restarted inside the agent by
torchrun (fast: the worker group re-forms without a new agent); the agent writes how many such
restarts it made into the supervisor's directory, and each job start reads what is left of the
budget from there. supervisord restarts the agent itself (master unreachable, a crashed agent).
"""

from __future__ import annotations

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
from trainpod.errors import EXIT_CONFIG, EXIT_OK, EXIT_USAGE

PROGRAM = "job"
NEVER_RESTARTED = (EXIT_OK, EXIT_USAGE, EXIT_CONFIG)  # done, or retrying cannot help
KILLED_BY_SIGNAL = -1  # supervisord's exit status for a signal; it does not keep which one
BUDGET_DIR = "TRAINPOD_SUPERVISOR_DIR"  # set for the job: where the restart budget is kept
RESTARTS_USED = "restarts_used"  # written by the listener: restarts spent so far, both layers
WORKER_RESTARTS = "worker_restarts"  # written by the agent: restarts torchrun made in that run
OUTCOME = "outcome.json"  # written by the listener at the end: the code run_supervised exits with


def stop_wait_s(term_grace_s: float) -> int:
    """supervisord's wait before SIGKILL: the ranks' grace, torchrun's margin, the agent's exit.
    Its default of 10 s is shorter than torchrun's own 30 s shutdown."""
    return max(60, math.ceil(term_grace_s) + 30)


def _read_int(path: Path) -> int:
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return 0


def restarts_left(max_restarts: int) -> int:
    """What the job may still restart: all of it, unless a supervisor has spent some already."""
    directory = os.environ.get(BUDGET_DIR)
    used = _read_int(Path(directory, RESTARTS_USED)) if directory else 0
    return max(0, max_restarts - used)


def record_worker_restarts(count: int) -> None:
    directory = os.environ.get(BUDGET_DIR)
    if directory:
        Path(directory, WORKER_RESTARTS).write_text(str(count))


@dataclass(frozen=True)
class Policy:
    max_restarts: int = 3
    backoff_s: float = 1.0  # the first delay; it doubles with each restart
    backoff_max_s: float = 60.0

    def restarts(self, code: int, restarts_done: int) -> bool:
        return code not in NEVER_RESTARTED and restarts_done < self.max_restarts

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
pidfile={workdir}/supervisord.pid
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
    outcome = workdir / OUTCOME
    listener = [sys.executable, "-m", "trainpod.supervise", str(workdir), json.dumps(asdict(policy)), str(node_rank)]
    config = workdir / "supervisord.conf"
    config.write_text(render_config(job, listener, workdir, stop_wait))
    supervisord = subprocess.Popen([sys.executable, "-m", "supervisor.supervisord", "-c", str(config)],
                                   env={**env, BUDGET_DIR: str(workdir)})

    received: list[int] = []

    def forward(signum, frame):
        received.append(signum)
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


def listen(workdir: Path, policy: Policy, node_rank: str) -> None:
    import xmlrpc.client

    from supervisor.xmlrpc import SupervisorTransport  # only inside the image's supervisord

    socket_url = f"unix://{workdir / 'supervisor.sock'}"
    rpc = xmlrpc.client.ServerProxy("http://localhost", transport=SupervisorTransport(None, None, socket_url))
    restarts = attempts = 0

    say = log.writer(node_rank)
    for name, fields in _events(sys.stdin, sys.stdout):
        if name != "PROCESS_STATE_EXITED" or fields.get("processname") != PROGRAM:
            continue
        if rpc.supervisor.getState()["statename"] != "RUNNING":
            continue  # supervisord is shutting down (a signal): run_supervised reports it
        code = rpc.supervisor.getProcessInfo(PROGRAM)["exitstatus"]
        if code == KILLED_BY_SIGNAL:
            code = 128 + signal.SIGKILL  # supervisord does not say which signal; the usual one is the OOM killer's
        worker_restarts = _read_int(workdir / WORKER_RESTARTS)  # torchrun's own, in the run that just ended
        (workdir / WORKER_RESTARTS).unlink(missing_ok=True)
        restarts += worker_restarts
        attempts += worker_restarts + 1
        if policy.restarts(code, restarts):
            restarts += 1
            (workdir / RESTARTS_USED).write_text(str(restarts))
            delay = policy.delay(restarts)
            say(f"the job exited with {code}: restart {restarts} of {policy.max_restarts} in {delay:g}s")
            time.sleep(delay)
            rpc.supervisor.startProcess(PROGRAM, False)
            continue
        if code in (EXIT_USAGE, EXIT_CONFIG):
            say(f"the job exited with {code} (a usage or configuration error): not restarted")
        elif code != EXIT_OK:
            say(f"the job exited with {code} after {attempts} attempt(s) (--max-restarts {policy.max_restarts}): giving up")
        (workdir / OUTCOME).write_text(json.dumps({"code": code, "attempts": attempts}))
        rpc.supervisor.shutdown()


if __name__ == "__main__":
    directory, policy_json, node = sys.argv[1:4]
    listen(Path(directory), Policy(**json.loads(policy_json)), node)
