"""supervisord whose main loop wakes at its signals: `python -m trainpod.supervisor.supervisord -c CONF`.

supervisord acts on a child's start or exit only when its main loop comes round, which it does when
one of its sockets or pipes has something to read, or else after poll()'s fixed 1-second timeout (a
SIGCHLD does not cut the wait short: Python retries the interrupted poll). Every launch paid for it
twice over: autostart programs are spawned after the first timeout, and a job's exit reaches the
event listener two loop turns after it happened (the reap, then the event's dispatch), each usually
a full second.

Here the loop's poll also watches a pipe that Python's C signal handler writes to (signal.set_wakeup_fd)
for every signal supervisord handles: SIGCHLD (a child exited: the reap), SIGTERM, SIGINT, SIGHUP. A
child's exit is reaped at once and its event dispatched on the next turn (the listener's pipe is
writable then), and a turn with nothing to do waits the whole second: an idle supervisord wakes once
a second instead of 20 times (a 50 ms cap on the wait did the same for the start and the exit, at a cost
that bench/idle.py shows). The first wait is not waited at all: the loop's first turn is
where autostart programs are spawned, and nothing can be ready before it, so the job starts as soon as
supervisord is up. What still waits for the second are timers that count in seconds anyway (a stop's
stopwaitsecs before SIGKILL).

The loop's timeout is a local variable of Supervisor.runforever(), so the wake-up goes on the poller
class that supervisord's options instantiate; tests/unit/supervisor/test_supervisord.py pins the supervisor
version this was checked against.
"""

from __future__ import annotations

import os
import signal

from supervisor import poller, supervisord

_poll = poller.Poller.poll  # the platform's implementation (poll(2) on Linux)
_waited = False  # whether the loop has waited once: its first turn spawns the autostart programs
_wake: tuple[int, int] | None = None  # (read end, write end) of the pipe the signal handler writes to


def wake_at_signals() -> int:
    """Make every handled signal wake the loop's poll, through a new pipe; its read end. Main thread only."""
    global _wake
    read, write = os.pipe()  # not inherited (PEP 446): a spawned program does not see it
    os.set_blocking(read, False)
    os.set_blocking(write, False)
    signal.set_wakeup_fd(write, warn_on_full_buffer=False)  # a full pipe already wakes the loop
    _wake = (read, write)
    return read


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 512):
            pass
    except BlockingIOError:
        pass


def _poll_until_a_signal(self, timeout):
    global _waited
    wait, _waited = (timeout if _waited else 0.0), True
    if _wake is None:
        return _poll(self, wait)
    if _wake[0] not in self.readables:
        self.register_readable(_wake[0])
    readable, writable = _poll(self, wait)
    if _wake[0] in readable:  # supervisord's own handlers ran already; its loop acts on what they recorded
        _drain(_wake[0])
        readable = [fd for fd in readable if fd != _wake[0]]
    return readable, writable


_run = supervisord.Supervisor.run


def _run_waking_at_signals(self):
    # A new pipe for each run: a reload (SIGHUP) closes the descriptors from 5 up before its run, and a number of
    # the last run's pipe may name another file by now.
    wake_at_signals()
    return _run(self)


poller.Poller.poll = _poll_until_a_signal
supervisord.Supervisor.run = _run_waking_at_signals

if __name__ == "__main__":
    supervisord.main()
