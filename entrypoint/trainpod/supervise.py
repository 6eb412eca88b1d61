"""Run the job under supervisord, adding the restart policy it lacks and the exit code it loses.

supervisord restarts a RUNNING program forever (no cap, no backoff), cannot exit when a program
gives up, and always exits 0 itself. So it runs the job with autorestart=false, and an event
listener (listen(), in the same supervisord) decides: on each exit it reads the exit status over
XML-RPC (the event does not carry it), restarts with exponential backoff while the budget lasts
and the code is worth retrying, and otherwise writes the final code to a file and shuts
supervisord down. run_supervised(), the container's main process under tini, starts supervisord,
forwards signals to it, and exits with the code from that file.

    tini -> trainpod run (run_supervised) -> supervisord -> job: trainpod run (TRAINPOD_SUPERVISED=1)
                                                          -> policy: python -m trainpod.supervise
"""

from __future__ import annotations

import json
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

from trainpod.errors import EXIT_CONFIG, EXIT_OK, EXIT_USAGE

PROGRAM = "job"
NEVER_RESTARTED = (EXIT_OK, EXIT_USAGE, EXIT_CONFIG)  # done, or retrying cannot help
KILLED_BY_SIGNAL = -1  # supervisord's exit status for a signal; it does not keep which one
# torchrun needs up to 30 s to stop its workers; supervisord's default wait is 10 s.
STOP_WAIT_S = 60


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


def render_config(job: Sequence[str], listener: Sequence[str], workdir: Path) -> str:
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
stopwaitsecs={STOP_WAIT_S}
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


def run_supervised(job: Sequence[str], env: dict[str, str], policy: Policy, log_prefix: str) -> int:
    """Run `job` under supervisord with `policy`; the job's final exit code (128+N after signal N)."""
    workdir = Path(tempfile.mkdtemp(prefix="trainpod-supervisor-"))
    outcome = workdir / "outcome.json"
    listener = [sys.executable, "-m", "trainpod.supervise", str(workdir / "supervisor.sock"), str(outcome),
                json.dumps(asdict(policy)), log_prefix]
    config = workdir / "supervisord.conf"
    config.write_text(render_config(job, listener, workdir))
    supervisord = subprocess.Popen([sys.executable, "-m", "supervisor.supervisord", "-c", str(config)], env=env)

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
        print(f"{log_prefix}: supervisord exited ({supervisord.returncode}) before the job finished", file=sys.stderr)
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


def listen(socket_path: str, outcome: str, policy: Policy, log_prefix: str) -> None:
    import xmlrpc.client

    from supervisor.xmlrpc import SupervisorTransport  # only inside the image's supervisord

    rpc = xmlrpc.client.ServerProxy("http://localhost", transport=SupervisorTransport(None, None, f"unix://{socket_path}"))
    restarts = 0

    def log(message: str) -> None:
        print(f"{log_prefix}: {message}", file=sys.stderr, flush=True)

    for name, fields in _events(sys.stdin, sys.stdout):
        if name != "PROCESS_STATE_EXITED" or fields.get("processname") != PROGRAM:
            continue
        if rpc.supervisor.getState()["statename"] != "RUNNING":
            continue  # supervisord is shutting down (a signal): run_supervised reports it
        code = rpc.supervisor.getProcessInfo(PROGRAM)["exitstatus"]
        if code == KILLED_BY_SIGNAL:
            code = 128 + signal.SIGKILL  # supervisord does not say which signal; the usual one is the OOM killer's
        if policy.restarts(code, restarts):
            restarts += 1
            delay = policy.delay(restarts)
            log(f"the job exited with {code}: restart {restarts} of {policy.max_restarts} in {delay:g}s")
            time.sleep(delay)
            rpc.supervisor.startProcess(PROGRAM, False)
            continue
        attempts = restarts + 1
        if code in (EXIT_USAGE, EXIT_CONFIG):
            log(f"the job exited with {code} (a usage or configuration error): not restarted")
        elif code != EXIT_OK:
            log(f"the job exited with {code} after {attempts} attempt(s) (--max-restarts {policy.max_restarts}): giving up")
        Path(outcome).write_text(json.dumps({"code": code, "attempts": attempts}))
        rpc.supervisor.shutdown()


if __name__ == "__main__":
    socket_path, outcome_path, policy_json, prefix = sys.argv[1:5]
    listen(socket_path, outcome_path, Policy(**json.loads(policy_json)), prefix)
