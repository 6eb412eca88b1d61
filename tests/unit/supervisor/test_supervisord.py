"""trainpod.supervisor.supervisord: supervisord whose main loop waits at most TICK_S, not 1 s."""

import inspect
from importlib.metadata import version

import supervisor.poller
import supervisor.supervisord

from trainpod.supervisor import supervisord as fast

# The cap relies on how supervisord's loop waits; recheck Supervisor.runforever() before adding a version.
CHECKED_WITH = ("4.3.0",)


def test_the_supervisor_in_use_is_one_the_cap_was_checked_against():
    assert version("supervisor") in CHECKED_WITH, "recheck trainpod.supervisor.supervisord against this supervisor's runforever()"


def test_the_loop_still_waits_in_the_options_poller_with_a_one_second_timeout():
    loop = inspect.getsource(supervisor.supervisord.Supervisor.runforever)
    assert "timeout = 1" in loop and "self.options.poller.poll(timeout)" in loop


def test_the_first_wait_is_none_and_every_later_one_is_capped_at_a_tick(monkeypatch):
    asked = []
    monkeypatch.setattr(fast, "_poll", lambda poller, timeout: asked.append(timeout) or ([], []))
    monkeypatch.setattr(fast, "_waited", False)
    poller = supervisor.poller.Poller.__new__(supervisor.poller.Poller)
    assert poller.poll(1) == ([], [])  # the first turn: the autostart programs are spawned after it
    assert poller.poll(1) == ([], [])
    assert poller.poll(0.01) == ([], [])
    assert asked == [0.0, fast.TICK_S, 0.01]
