"""What `ps` and /proc show of a process that was forked, not started: its name and its command line.

A forked process (a warm rank, its keeper, the node's fork server) has the command line of the process
it was forked from. Linux shows /proc/PID/cmdline from the memory that held the process's argv when it
was started, so a process can write a new command line there, as setproctitle does, but no longer than
that memory is. The job's process is started with room to spare for that (trainpod.contract.job_command).
Best effort, Linux only: elsewhere, or where /proc cannot be read, nothing changes.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence


def set_name(name: str) -> None:
    """/proc/PID/comm (`pgrep -x NAME`, `top`): at most 15 bytes are kept."""
    try:
        with open(f"/proc/{os.getpid()}/comm", "w") as comm:
            comm.write(name[:15])
    except OSError:
        pass


def room() -> int:
    """The bytes this process's command line can hold (0 where it cannot be read)."""
    area = _argv_area()
    return area[1] - area[0] if area else 0


def set_command_line(argv: Sequence[str]) -> None:
    """/proc/PID/cmdline (`ps`, `pgrep -f`, psutil): `argv`, cut to room(); the rest of the area zeroed."""
    area = _argv_area()
    if not area:
        return
    start, end = area
    text = b"\0".join(os.fsencode(arg) for arg in argv)[: end - start - 1]
    ctypes.memmove(start, text.ljust(end - start, b"\0"), end - start)


def _argv_area() -> tuple[int, int] | None:
    try:
        with open(f"/proc/{os.getpid()}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])  # arg_start and arg_end: stat's fields 48 and 49
    except (OSError, IndexError, ValueError):
        return None
    return (start, end) if start and end > start else None
