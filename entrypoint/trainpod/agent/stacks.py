"""Reading a rank's Python stack from outside it: py-spy, or the rank's own faulthandler.

py-spy (`py-spy dump --nonblocking`, a child of the agent) reads the rank's memory with
process_vm_readv and never stops it, so it also reads a rank that is stopped (SIGSTOP). That needs
ptrace access to the rank, which Linux grants a process of the same uid without any capability
(the ranks run as the agent's user, are dumpable, and hold no capability the agent lacks), and
which Docker's default seccomp profile allows (ptrace and process_vm_readv, kernel 4.8 or later).
Yama (`/proc/sys/kernel/yama/ptrace_scope`) can forbid it: at 1 only an ancestor, or a process the
rank named with prctl(PR_SET_PTRACER), may read it; at 2 only CAP_SYS_PTRACE; at 3 nobody. A rank
that uses trainpod.train.progress names the agent (trainpod.train.progress does it when it sees Yama at 1).

Without ptrace, a rank that uses trainpod.train.progress answers a request on a FIFO in the progress
directory: a thread of its own writes faulthandler's dump of every thread, and torch's flight
recorder, into the files the request names (trainpod.train.progress serves it; request() asks).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from trainpod.agent.hang import Frame

PYSPY_TIMEOUT_S = 10
REFUSED = ("Permission denied", "Operation not permitted", "os error 1)", "os error 13)")


@dataclass(frozen=True)
class Thread:
    ident: str  # OS thread id (py-spy) or Python's thread ident in hex (faulthandler)
    name: str
    frames: tuple[Frame, ...]  # innermost first
    main: bool


@dataclass(frozen=True)
class Stack:
    threads: tuple[Thread, ...] = ()
    source: str = ""  # "py-spy" or "faulthandler"
    error: str = ""  # why there is none
    refused: bool = False  # ptrace was refused (Yama, a missing capability): try the rank's own dump

    @property
    def main(self) -> tuple[Frame, ...] | None:
        for thread in self.threads:
            if thread.main:
                return thread.frames
        return None

    def render(self) -> str:
        if not self.threads:
            return f"(no stack: {self.error})\n"
        lines = []
        for thread in sorted(self.threads, key=lambda t: not t.main):  # the main thread first
            lines.append(f'Thread {thread.ident} "{thread.name}"{" (main)" if thread.main else ""}:')
            lines += [f"    {f.function} ({f.file}:{f.line})" for f in thread.frames]
        return "\n".join(lines) + "\n"


def pyspy_path() -> str | None:
    """py-spy beside this Python (the image's venv), else on PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


def parse_pyspy(text: str, pid: int) -> Stack:
    threads = []
    for thread in json.loads(text):
        frames = tuple(Frame(f.get("name", "?"), f.get("filename") or f.get("short_filename") or "?", int(f.get("line") or 0))
                       for f in thread.get("frames", []))
        name = thread.get("thread_name") or ""
        main = thread.get("os_thread_id") == pid or name == "MainThread"
        threads.append(Thread(str(thread.get("os_thread_id") or thread.get("thread_id")), name, frames, main))
    if threads and not any(t.main for t in threads):
        threads[0] = Thread(threads[0].ident, threads[0].name, threads[0].frames, True)
    return Stack(tuple(threads), source="py-spy")


def pyspy(pid: int, executable: str | None, attempts: int = 3) -> Stack:
    """The stack of every thread of `pid`, read without stopping it. Reading a running process's
    memory can meet it mid-change (py-spy: "Bad address"): tried again, up to `attempts` times."""
    stack = _pyspy(pid, executable)
    for _ in range(attempts - 1):
        if stack.threads or stack.refused or not executable or "No such process" in stack.error:
            break
        time.sleep(0.05)
        stack = _pyspy(pid, executable)
    return stack


def _pyspy(pid: int, executable: str | None) -> Stack:
    if not executable:
        return Stack(error="py-spy is not installed")
    try:
        done = subprocess.run([executable, "dump", "--nonblocking", "--json", "--pid", str(pid)],
                              capture_output=True, text=True, timeout=PYSPY_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Stack(error=f"py-spy: {exc}")
    if done.returncode != 0 or not done.stdout.strip().startswith("["):
        message = " ".join((done.stderr or done.stdout).split())[:200] or f"exit {done.returncode}"
        return Stack(error=f"py-spy: {message}", refused=any(word in message for word in REFUSED))
    try:
        return parse_pyspy(done.stdout, pid)
    except (ValueError, TypeError, AttributeError) as exc:
        return Stack(error=f"py-spy: unreadable output ({exc})")


_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+) \(most recent call first\):$")
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')


def parse_faulthandler(text: str) -> Stack:
    """faulthandler's dump, after a first line 'main thread 0x...' written by trainpod.train.progress."""
    lines = text.splitlines()
    main = lines[0].split()[-1] if lines and lines[0].startswith("main thread ") else ""
    threads: list[Thread] = []
    ident, frames = None, []
    for line in lines:
        head = _THREAD.match(line)
        if head:
            if ident is not None:
                threads.append(Thread(ident, "", tuple(frames), int(ident, 16) == int(main or "0", 16)))
            ident, frames = head.group(2), []
            continue
        frame = _FRAME.match(line)
        if frame and ident is not None:
            frames.append(Frame(frame.group(3), frame.group(1), int(frame.group(2))))
    if ident is not None:
        threads.append(Thread(ident, "", tuple(frames), int(ident, 16) == int(main or "0", 16)))
    return Stack(tuple(threads), source="faulthandler", error="" if threads else "empty faulthandler dump")


def dump_fifo(progress_dir: str | os.PathLike, local_rank: int) -> Path:
    """The FIFO on which a rank that uses trainpod.train.progress takes dump requests."""
    return Path(progress_dir) / f"rank{local_rank}.dump"


def request(progress_dir: str | os.PathLike, local_rank: int, **what) -> bool:
    """Ask the rank's own thread for a dump (keys: stack=PATH, flight_recorder=PATH); False when it
    has no such thread (it does not use trainpod.train.progress, is gone, or is busy serving another)."""
    try:
        fd = os.open(dump_fifo(progress_dir, local_rank), os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        return False  # no FIFO, or no reader on it (ENXIO)
    try:
        os.write(fd, json.dumps({k: str(v) for k, v in what.items()}).encode())
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def own_dump(progress_dir: str | os.PathLike, local_rank: int, path: Path, timeout: float = 2.0) -> Stack:
    """The rank's stack by its own faulthandler (no ptrace needed), through its dump thread."""
    path.unlink(missing_ok=True)
    if not request(progress_dir, local_rank, stack=path):
        return Stack(error="no ptrace access, and the rank serves no dump requests (it does not use trainpod.train.progress)")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return parse_faulthandler(path.read_text(errors="replace"))
        time.sleep(0.02)
    return Stack(error=f"the rank wrote no stack within {timeout:g}s")
