"""Warm starts (trainpod.agent.warm): which commands start warm, and a rank forked from a real forkserver
runs its script as `python` would (argv, __main__, sys.path, exit codes, tracebacks) and dies with
its agent."""

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from fixtures.processes import alive, gone_within
from trainpod.agent import warm

ENTRYPOINT = str(Path(__file__).resolve().parents[3] / "entrypoint")
ENV = {**os.environ, "PYTHONPATH": ENTRYPOINT}
EXAMPLE = "trainpod.examples.cifar10"

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the forkserver, /proc and PR_SET_PDEATHSIG are Linux's")


def test_a_bundled_example_as_torchrun_builds_it_starts_warm_by_default():
    target = warm.python_target([sys.executable, "-u", "-m", EXAMPLE, "--epochs", "1"])
    assert target == ("-m", EXAMPLE, ("--epochs", "1"))
    assert warm.wanted("auto", target) and warm.wanted("on", target) and not warm.wanted("off", target)
    assert warm.preload(target)[-1] == EXAMPLE  # the server imports the example too
    # The same in any spelling CPython reads alike (trainpod.python_command)
    for spelled in ([sys.executable, "-uB", "-m", EXAMPLE, "--epochs", "1"], [sys.executable, "-um", EXAMPLE, "--epochs", "1"],
                    [sys.executable, "-u", f"-m{EXAMPLE}", "--epochs", "1"]):
        assert warm.python_target(spelled) == target


def test_a_users_python_command_starts_warm_only_when_asked():
    script = warm.python_target([sys.executable, "train.py", "--lr", "0.1"])
    module = warm.python_target([os.path.join(os.path.dirname(sys.executable), "python"), "-m", "mytrain"])
    assert script == ("script", "train.py", ("--lr", "0.1")) and module == ("-m", "mytrain", ())
    for target in (script, module):
        assert warm.wanted("on", target) and not warm.wanted("auto", target)
        assert "mytrain" not in warm.preload(target) and "train.py" not in warm.preload(target)  # never a user's import


@pytest.mark.parametrize("command", [
    ["bash", "train.sh"],
    [sys.executable, "-c", "print(1)"],  # no script or module: runs as a command
    [sys.executable, "-W", "error", "-m", EXAMPLE],  # an option a forked rank would not have: runs as a command
    [sys.executable, "-Xfrozen_modules=off", "-m", EXAMPLE],
    [sys.executable, "-O", "-m", EXAMPLE],
    [sys.executable],
    ["/nonexistent/venv/bin/python3", "train.py"],  # another Python: its packages are not this one's
    [],
])
def test_what_is_not_this_pythons_script_or_module_is_never_warm(command):
    assert warm.python_target(command) is None
    assert not warm.wanted("on", warm.python_target(command))


def test_only_the_server_is_changed_by_its_preload_not_who_imports_trainpod():
    # trainpod.agent.warm_server's import makes its process leave its session and ignore SIGTERM: the CLI and the
    # agent must never import it
    check = ("import os, signal; sid = os.getsid(0); import trainpod.launcher.cli, trainpod.agent.agent, trainpod.agent.warm; "
             "print(os.getsid(0) == sid, signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)")
    result = subprocess.run([sys.executable, "-c", check], env=ENV, capture_output=True, text=True, timeout=60,
                            start_new_session=True)  # a session leader, as a container's first process is
    assert result.stdout.split() == ["True", "True"], result.stderr


# Starts the forkserver as the agent does, runs one warm rank of `kind name argv`, prints its pid, then its exit code.
# The rank runs as soon as it is started: its output and the pid line reach the same pipe in either order (the pid
# line came second, and with PYTHONUNBUFFERED print's text and newline are two writes, so the rank's line once landed
# between them). So the pid line is one write, whole wherever it lands, and run_warm() takes it out.
# With TP_TEST_ZYGOTE set, the server is the driver's copy of itself (trainpod.agent.zygote), as in a job's process.
DRIVER = textwrap.dedent("""
    import multiprocessing, os, sys
    from trainpod.agent import warm, zygote
    if os.environ.get("TP_TEST_ZYGOTE"):
        assert zygote.fork() is not None
    warm.start_server([warm.PRELOAD[0], "json"])
    rank = multiprocessing.get_context(warm.START_METHOD).Process(target=warm.run_rank, args=tuple(sys.argv[1:]))
    rank.start()
    sys.stdout.write(f"pid {rank.pid}\\n")
    sys.stdout.flush()
    rank.join()
    print(f"exit {rank.exitcode}", flush=True)
""")
PID_LINE = re.compile(r"pid \d+\n")
SERVERS = {"a new interpreter": {}, "a copy of the agent": {"TP_TEST_ZYGOTE": "1"}}


@pytest.fixture(params=list(SERVERS))
def server(request):
    """The fork server's environment for the driver: each test runs against both kinds of server."""
    return SERVERS[request.param]


def run_warm(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """The driver's run: stdout is the rank's output, then `exit N` (the pid line taken out)."""
    result = subprocess.run([sys.executable, "-c", DRIVER, *args], env={**ENV, **(env or {})}, capture_output=True,
                            text=True, timeout=60)
    assert len(PID_LINE.findall(result.stdout)) == 1, result.stdout
    result.stdout = PID_LINE.sub("", result.stdout)
    return result


def script(tmp_path: Path, body: str) -> str:
    (tmp_path / "helper.py").write_text("VALUE = 'from the script directory'\n")
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


@pytest.mark.slow
def test_a_warm_rank_runs_its_script_as_main_with_its_argv_and_directory(server, tmp_path):
    path = script(tmp_path, """
        import multiprocessing, os, signal, sys, helper
        print(__name__, sys.argv, helper.VALUE, os.environ["PYTHONUNBUFFERED"], multiprocessing.get_start_method(),
              [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)])
        # What ps shows: the rank's name, and the command it would have run (not its fork server's)
        print(open("/proc/self/comm").read().strip(), open("/proc/self/cmdline", "rb").read().rstrip(b"\\0").split(b"\\0"))
    """)
    result = run_warm("script", path, "--lr", "0.1", env={"RANK": "3", **server})
    # a new interpreter's start method (a DataLoader's workers are not the fork server's): fork, or 3.14's forkserver
    default = subprocess.run([sys.executable, "-c", "import multiprocessing as m; print(m.get_start_method())"],
                             capture_output=True, text=True).stdout.strip()
    assert result.stdout.splitlines() == [
        f"__main__ {[path, '--lr', '0.1']} from the script directory 1 {default} {[signal.SIG_DFL] * 3}",
        f"rank3 {[os.fsencode(arg) for arg in (sys.executable, '-u', path, '--lr', '0.1')]}",
        "exit 0"]
    assert result.stderr == ""


def test_what_the_server_imported_is_out_of_a_warm_ranks_collections(server, tmp_path):
    # A collection in the rank (in-process recovery's after a failed step, or Python's own) looks only at what the
    # rank made: torch's objects, imported by the server, are frozen (gc.freeze) and stay collected by none.
    path = script(tmp_path, """
        import gc, json
        print(gc.get_freeze_count() > 1000, any(type(o).__name__ == "JSONDecoder" for o in gc.get_objects()))
    """)
    result = run_warm("script", path, env=server)
    assert result.stdout.splitlines() == ["True False", "exit 0"], result.stderr


@pytest.mark.slow
@pytest.mark.parametrize(("body", "code"), [
    ("import sys; sys.exit()", 0),
    ("import sys; sys.exit(0)", 0),
    ("import sys; sys.exit(78)", 78),
    ("import atexit, sys; atexit.register(print, 'atexit ran'); sys.exit(3)", 3),
])
def test_a_warm_ranks_exit_code_is_the_scripts(server, tmp_path, body, code):
    result = run_warm("script", script(tmp_path, body), env=server)
    assert result.stdout.splitlines()[-1] == f"exit {code}"
    assert ("atexit ran" in result.stdout) == ("atexit" in body)  # the interpreter's exit handlers run, as they would


def test_a_warm_ranks_uncaught_exception_is_its_own_traceback_and_exit_1(server, tmp_path):
    result = run_warm("script", script(tmp_path, "def train():\n    raise ValueError('bad batch')\ntrain()\n"), env=server)
    assert result.stdout.splitlines()[-1] == "exit 1"
    assert "Traceback" in result.stderr and "in train" in result.stderr
    assert result.stderr.strip().splitlines()[-1] == "ValueError: bad batch"


def test_a_warm_module_runs_afresh_as_main_even_when_the_server_imported_it(server, tmp_path):
    (tmp_path / "mytrain.py").write_text("import sys\nprint(__name__, sys.argv[1:])\n")
    result = run_warm("-m", "mytrain", "x", env={"PYTHONPATH": f"{ENTRYPOINT}{os.pathsep}{tmp_path}", **server})
    assert result.stdout.splitlines() == ["__main__ ['x']", "exit 0"]
    assert "RuntimeWarning" not in result.stderr


@pytest.mark.slow
def test_a_warm_rank_dies_with_its_agent_even_after_a_sigkill_of_the_agent(server, tmp_path):
    agent = subprocess.Popen([sys.executable, "-c", DRIVER, "script", script(tmp_path, "import time; time.sleep(300)")],
                             env={**ENV, **server}, stdout=subprocess.PIPE, text=True)
    rank = int(agent.stdout.readline().split()[1])
    try:
        time.sleep(0.5)
        assert alive(rank)
        # Out of the agent's session and process group, as torch's own ranks: a SIGTERM to the agent's group
        # (supervisord stopping the job) reaches the agent, which gives the ranks their grace; not the server.
        assert os.getsid(rank) != os.getsid(agent.pid) and os.getpgid(rank) != os.getpgid(agent.pid)
        # and it outlives the signals that stop a job (scancel sends SIGTERM to every process of the step):
        # the ranks then checkpoint within their grace, which its death would cut short
        server_pid = int(Path(f"/proc/{rank}/stat").read_text().rsplit(")", 1)[1].split()[1])
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
            os.kill(server_pid, sig)
        time.sleep(0.5)
        assert alive(server_pid) and alive(rank)
        agent.kill()  # the server gets SIGKILL with its agent (trainpod.agent.warm_server), and the rank with the server
        agent.wait()
        assert gone_within(rank, 10), "the warm rank outlived its agent"
    finally:
        if alive(rank):
            os.kill(rank, signal.SIGKILL)


def test_the_fork_servers_death_is_seen_without_reaping_it(monkeypatch):
    # Issue 24: the OOM killer's SIGKILL of the server (a real child of this process here) is named, and
    # multiprocessing can still reap it when it starts the next server.
    from multiprocessing import forkserver

    child = subprocess.Popen(["sleep", "60"])
    monkeypatch.setattr(forkserver._forkserver, "_forkserver_pid", child.pid)
    try:
        assert warm.server_death() is None
        child.kill()
        assert warm.server_death(wait_s=10) == (child.pid, 128 + signal.SIGKILL)
        assert warm.server_death() == (child.pid, 128 + signal.SIGKILL)  # still there to be seen
    finally:
        child.kill()
        assert child.wait(timeout=10) == -signal.SIGKILL  # and to be reaped
    monkeypatch.setattr(forkserver._forkserver, "_forkserver_pid", None)
    assert warm.server_death() is None  # no server started
