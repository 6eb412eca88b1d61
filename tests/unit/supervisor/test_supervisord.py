"""trainpod.supervisor.supervisord: supervisord whose main loop wakes at its signals, not only once a second."""

import inspect
import os
import signal
import subprocess
import sys
import threading
import time
from importlib.metadata import version
from types import SimpleNamespace

import pytest
import supervisor.poller
import supervisor.supervisord

from trainpod.supervisor import supervisord as waking

# The wake-up relies on how supervisord's loop waits; recheck Supervisor.runforever() and run() before adding a version.
CHECKED_WITH = ("4.3.0",)


def test_the_supervisor_in_use_is_one_the_wake_up_was_checked_against():
    assert version("supervisor") in CHECKED_WITH, "recheck trainpod.supervisor.supervisord against this supervisor's runforever()"


def test_the_loop_still_waits_in_the_options_poller_with_a_one_second_timeout():
    loop = inspect.getsource(supervisor.supervisord.Supervisor.runforever)
    assert "timeout = 1" in loop and "self.options.poller.poll(timeout)" in loop
    assert "self.options.setsignals()" in inspect.getsource(waking._run)  # the handlers that write to the pipe


@pytest.fixture
def poller(monkeypatch):
    """A real poll(2) poller, with a wake-up pipe of its own; the process's signal state as it was afterwards."""
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGCHLD, signal.SIGUSR1)}
    monkeypatch.setattr(waking, "_waited", True)  # past the first turn
    monkeypatch.setattr(waking, "_wake", None)
    poll = supervisor.poller.Poller(SimpleNamespace(logger=SimpleNamespace(blather=lambda *a, **k: None)))
    yield poll
    signal.set_wakeup_fd(-1)
    for sig, handler in before.items():
        signal.signal(sig, handler)
    for fd in waking._wake or ():
        os.close(fd)


def test_the_first_wait_is_none_and_every_later_one_the_whole_timeout(monkeypatch):
    asked = []
    monkeypatch.setattr(waking, "_poll", lambda poller, timeout: asked.append(timeout) or ([], []))
    monkeypatch.setattr(waking, "_waited", False)
    monkeypatch.setattr(waking, "_wake", None)
    poller = supervisor.poller.Poller.__new__(supervisor.poller.Poller)
    assert poller.poll(1) == ([], [])  # the first turn: the autostart programs are spawned after it
    assert poller.poll(1) == ([], [])
    assert asked == [0.0, 1]


def test_an_idle_loop_waits_its_whole_timeout(poller):
    waking.wake_at_signals()
    started = time.monotonic()
    assert poller.poll(0.3) == ([], [])
    assert time.monotonic() - started >= 0.25


@pytest.mark.parametrize("how", ["a child's exit", "a signal sent to it"])
def test_a_handled_signal_ends_the_wait_at_once_and_the_pipe_is_not_shown_to_supervisord(poller, how):
    got = []
    signal.signal(signal.SIGCHLD, lambda sig, frame: got.append(sig))  # supervisord's handlers record the signal
    signal.signal(signal.SIGUSR1, lambda sig, frame: got.append(sig))
    read = waking.wake_at_signals()
    if how == "a child's exit":
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.2)"])
    else:
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGUSR1)).start()
    started = time.monotonic()
    assert poller.poll(30) == ([], [])  # woken, and nothing of supervisord's to read
    assert time.monotonic() - started < 10
    assert got and read in poller.readables
    if how == "a child's exit":
        child.wait()
    started = time.monotonic()
    assert poller.poll(0.2) == ([], [])  # the pipe was drained: the next turn waits again
    assert time.monotonic() - started >= 0.15


def test_each_run_makes_its_own_pipe_as_a_reload_closes_descriptors(monkeypatch):
    """A reload (SIGHUP) makes a new Supervisor whose main() closes descriptors from 5 up, then run()s again."""
    made = []
    monkeypatch.setattr(waking, "wake_at_signals", lambda: made.append(1))
    monkeypatch.setattr(waking, "_run", lambda supervisord: "ran")
    assert supervisor.supervisord.Supervisor.run(object()) == "ran"
    assert supervisor.supervisord.Supervisor.run(object()) == "ran"
    assert made == [1, 1]
