"""Children die with their parent (PR_SET_PDEATHSIG), also across exec, also after a SIGKILL of the parent."""

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fixtures.processes import alive, gone_within
from trainpod.supervisor import orphans

ENTRYPOINT = str(Path(__file__).resolve().parents[3] / "entrypoint")
ENV = {**os.environ, "PYTHONPATH": ENTRYPOINT}

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")

# A parent that starts `sleep 300` wrapped (orphans.wrap: `python -I -S -c ... KILL <its pid> -- sleep 300`),
# prints the child's pid, and waits.
PARENT = textwrap.dedent("""
    import os, subprocess, sys, time
    from trainpod.supervisor import orphans
    entrypoint, args = orphans.wrap("sleep", ("300",), os.getpid())
    child = subprocess.Popen([entrypoint, *args], start_new_session=True)  # its own session, as torch starts a rank
    time.sleep(1.0)  # the child asked and exec'd sleep
    print(child.pid, flush=True)
    time.sleep(300)
""")


def test_a_rank_dies_with_its_agent_even_after_a_sigkill_of_the_agent():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True, env=ENV)
    child = int(parent.stdout.readline())
    try:
        assert alive(child)
        assert Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")[:2] == [b"sleep", b"300"]  # exec'd: its own command
        parent.kill()
        parent.wait()
        assert gone_within(child, 5), "the child outlived its parent"
    finally:
        if alive(child):
            os.kill(child, signal.SIGKILL)


def test_a_parent_that_died_before_the_child_asked_is_noticed():
    # The pid given is not this process's parent: as if the parent had died before prctl.
    result = subprocess.run([sys.executable, "-m", "trainpod.supervisor.orphans", "TERM", "1", "--", "echo", "ran"],
                            env=ENV, capture_output=True, text=True, timeout=30)
    assert result.returncode == -signal.SIGTERM and result.stdout == ""


def test_usage_and_a_missing_command():
    run = lambda *argv: subprocess.run([sys.executable, "-m", "trainpod.supervisor.orphans", *argv], env=ENV,  # noqa: E731
                                       capture_output=True, text=True, timeout=30)
    assert run("KILL").returncode == 64
    missing = run("KILL", str(os.getpid()), "--", "no-such-command-x")
    assert missing.returncode == 127
    assert missing.stderr.strip() == "trainpod: error: cannot run 'no-such-command-x': No such file or directory"


def test_wrap_keeps_the_command_after_the_separator():
    entrypoint, args = orphans.wrap("python", ("-u", "-m", "mod", "--x"), 42)
    assert entrypoint == sys.executable
    assert args[:3] == ("-I", "-S", "-c")
    assert args[4:] == ("SIGKILL", "42", "--", "python", "-u", "-m", "mod", "--x")


def test_the_wrapper_finds_this_package_without_site_packages_or_the_environment():
    entrypoint, args = orphans.wrap("echo", ("ran",), os.getpid())
    result = subprocess.run([entrypoint, *args], env={"PATH": os.environ["PATH"]}, capture_output=True, text=True, timeout=30)
    assert (result.returncode, result.stdout, result.stderr) == (0, "ran\n", "")
