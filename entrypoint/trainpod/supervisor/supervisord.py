"""supervisord with a 50 ms main-loop tick: `python -m trainpod.supervisor.supervisord -c CONF`.

supervisord acts on a child's start or exit only when its main loop comes round, which it does when
one of its sockets or pipes has something to read, or else after poll()'s fixed 1-second timeout (a
SIGCHLD does not cut the wait short: Python retries the interrupted poll). Every launch paid for it
twice over: autostart programs are spawned after the first timeout, and a job's exit reaches the
event listener two loop turns after it happened (the reap, then the event's dispatch), each usually
a full second. Capping the timeout at TICK_S makes both take tens of milliseconds; each extra turn
costs supervisord a waitpid and a few checks (well under 1 % of a core at 20 turns a second). The
first wait is not waited at all: the loop's first turn is where autostart programs are spawned, and
nothing can be ready before it, so the job starts as soon as supervisord is up.

The loop's timeout is a local variable of Supervisor.runforever(), so the cap goes on the poller
class that supervisord's options instantiate; tests/unit/supervisor/test_supervisord.py pins the supervisor
version this was checked against.
"""

from __future__ import annotations

from supervisor import poller, supervisord

TICK_S = 0.05
_poll = poller.Poller.poll  # the platform's implementation (poll(2) on Linux)
_waited = False  # whether the loop has waited once: its first turn spawns the autostart programs


def _poll_at_most_a_tick(self, timeout):
    global _waited
    cap, _waited = (TICK_S if _waited else 0.0), True
    return _poll(self, min(timeout, cap))


poller.Poller.poll = _poll_at_most_a_tick

if __name__ == "__main__":
    supervisord.main()
